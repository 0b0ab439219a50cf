"""Stopping on a signal without Slurm: checkpoint, exit 75 and resume; signals before the handler or before the
workers exist; the batch script; one rank signalled stops every rank at the same step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from rl_training.base.exit_codes import STOPPED_EXIT_CODE
from rl_training.ckpt.store import list_checkpoints
from rl_training.cluster.launch import exit_status
from rl_training.runners import rl_runner
from rl_training.runtime.stopping import StopOnSignal
from tests.helpers import REPO, RL_RUNNER, TESTCFG, read_steps, torchrun_cmd, trainer_state, training_started

SBATCH = REPO / "scripts" / "slurm" / "rl_train.sbatch"


# --------------------------------------------------------------------------- stop logic, no Slurm
def test_stop_signal_checkpoints_exits_75_and_resume_finishes(run_overrides, tmp_path, monkeypatch, capsys):
    real_step = rl_runner.rl_step

    def signal_during_step_2(run, step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM's --signal would, in the middle of a step
        return real_step(run, step)

    monkeypatch.setattr(rl_runner, "rl_step", signal_during_step_2)
    base = [*run_overrides, "train.total_steps=5", "ckpt.every=0"]
    assert rl_runner.main(["--cfg", TESTCFG, *base]) == STOPPED_EXIT_CODE
    assert "stop: SIGUSR1 received; checkpoint at step 2 of 5" in capsys.readouterr().out
    run_dir = tmp_path / "runs" / "testconfig"
    assert read_steps(run_dir) == [1, 2]  # step 2 finished, then the stop at the top of step 3
    assert [s for s, _ in list_checkpoints(run_dir)] == [2]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler is removed again

    monkeypatch.setattr(rl_runner, "rl_step", real_step)
    assert rl_runner.main(["--cfg", TESTCFG, *base, "ckpt.resume=latest"]) == 0
    assert read_steps(run_dir) == [1, 2, 3, 4, 5]
    assert [s for s, _ in list_checkpoints(run_dir)][-1] == 5


def test_a_signal_that_arrived_before_the_handler_is_not_lost():
    """Under SLURM the workers start with SIGUSR1 blocked (slurm_launch): a signal sent while a worker is still
    importing stays pending and counts as soon as the handler is installed."""
    main = threading.main_thread().ident
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        signal.pthread_kill(main, signal.SIGUSR1)  # to this thread only: other threads do not block it
        assert signal.SIGUSR1 in signal.sigpending()
        with StopOnSignal("SIGUSR1") as stop:
            assert stop.received
        assert signal.SIGUSR1 in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # blocked again afterwards
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_a_signal_before_the_workers_exist_reaches_them_through_the_stop_file(tmp_path, monkeypatch):
    """A stop signal that reaches the node while torchrun has not yet started the workers finds only the
    launcher: its watcher thread turns it into RL_STOP_FILE, which a worker's StopOnSignal counts."""
    stop_file = tmp_path / "stop_requested"
    child = (
        "import os, signal, threading, sys\n"
        "from pathlib import Path\n"
        "from rl_training.cluster.launch import watch_stop_signal\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})  # as main() does first\n"
        "os.kill(os.getpid(), signal.SIGUSR1)  # before the watcher exists: pending, not lost\n"
        "done = threading.Event()\n"
        "t = threading.Thread(target=watch_stop_signal, args=(Path(sys.argv[1]), done))\n"
        "t.start(); t.join(10)\n"
        "sys.exit(0 if not t.is_alive() else 3)\n"
    )
    res = subprocess.run([sys.executable, "-c", child, str(stop_file)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert stop_file.is_file()

    monkeypatch.setenv("RL_STOP_FILE", str(tmp_path / "absent"))
    with StopOnSignal("SIGUSR1") as stop:
        assert not stop.agreed(torch.device("cpu"))
    monkeypatch.setenv("RL_STOP_FILE", str(stop_file))
    with StopOnSignal("SIGUSR1") as stop:
        assert stop.agreed(torch.device("cpu")) and stop.received


def test_batch_script_survives_a_stop_signal_before_the_job_step(tmp_path):
    """The batch shell's trap is installed first thing: a signal during the head-node lookup (stub scontrol,
    which waits until the test has sent it) is counted, not fatal, and the job stops with 75 before srun."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    stub = {
        # n1, n2 and then more than a pipe buffer (64 KiB) of names: a reader that exits after the first
        # line (head -n1) would SIGPIPE this writer and, under pipefail, end the script with 141 (CI, 2026-11-27)
        "scontrol": f"touch {tmp_path}/ready; while [ ! -e {tmp_path}/go ]; do sleep 0.05; done; echo n1; echo n2; "
        "seq 3 20000 | sed 's/^/n/'",
        "srun": f"touch {tmp_path}/srun-called",
        "scancel": f"touch {tmp_path}/scancel-called",
    }
    for name, body in stub.items():
        (stubs / name).write_text(f"#!/bin/sh\n{body}\n")
        (stubs / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURMD_NODENAME": "n1",
        "RL_PYTHON": sys.executable,
        "RL_RDZV_ADDR": "10.0.0.1",
    }
    proc = subprocess.Popen(["bash", str(SBATCH), "--cfg", TESTCFG], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the script did not reach scontrol"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # as --signal=B:USR1 would, while scontrol runs
        (tmp_path / "go").touch()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == STOPPED_EXIT_CODE, out  # before the fix: -SIGUSR1, the shell killed by it
    assert "rl_train.sbatch[7]: SIGUSR1 received before the job step started" in out
    assert "stopped before training started; a job chained with --dependency=afterany:7 resumes it" in out
    assert not (tmp_path / "srun-called").exists() and not (tmp_path / "scancel-called").exists()


def worker_pids(parent: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers that are children of `parent` (their RANK is in their environ)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            env = dict(
                kv.split("=", 1) for kv in (stat.parent / "environ").read_bytes().decode().split("\0") if "=" in kv
            )
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(stat.parent.name)
    return out


def test_signal_to_one_rank_stops_every_rank_at_the_same_step(run_overrides, tmp_path):
    """Only rank 1 gets the signal; the all-reduce makes rank 0 stop at the same step (no collective hang)."""
    cmd = torchrun_cmd(2, RL_RUNNER, "--cfg", TESTCFG, *run_overrides, "train.total_steps=40", "ckpt.every=0")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "runs" / "testconfig"
    try:
        deadline = time.monotonic() + 300
        while not training_started(run_dir):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.2)
        os.kill(worker_pids(proc.pid)[1], signal.SIGUSR1)  # rank 1 only
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Plain torchrun reports any non-zero worker as a failure; the SLURM launcher maps this back to 75.
    assert proc.returncode == 1
    codes = sorted({int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", err)})
    assert exit_status(codes) == STOPPED_EXIT_CODE, err[-3000:]
    m = re.search(r"stop: SIGUSR1 received; checkpoint at step (\d+) of 40", out)  # printed by rank 0
    assert m, out[-2000:] + err[-3000:]
    k = int(m.group(1))
    assert 1 <= k < 40 and read_steps(run_dir) == list(range(1, k + 1))
    ((step, ck),) = list_checkpoints(run_dir)
    assert step == k and trainer_state(ck)["world_size"] == 2 and (ck / "rng_rank1.pt").exists()

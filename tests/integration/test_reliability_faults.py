"""Runs killed with SIGKILL, then resumed with ckpt.resume=latest, log exactly what an uninterrupted run logs.

Kills come two ways: named kill points (RL_FAULT_KILL, rl_training/base/faults.py) inside the windows a crash can
hurt (mid-way through a metrics line, between a line and the checkpoint that covers it, inside a checkpoint
save), and kill -9 at random moments of the torchrun agent (the launcher: its workers must die with it,
rl_training/runtime/lifeline.py) or of one worker. The random seed is printed; RL_FAULT_SEED replays a sequence.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_training.ckpt.store import list_checkpoints
from tests.helpers import REPO, TESTCFG, torchrun_cmd, wait_until

pytestmark = pytest.mark.slow

RUNNER = str(REPO / "rl_training" / "runners" / "rl_runner.py")
VLLM = ["rollout.backend=vllm", "vllm.kv_cache_gb=0.1"]
# Measurements of this process's own work (seconds, memory) differ by design; everything else, the engine's
# weight version included (it counts from the resumed step), must be identical.
VOLATILE = ("perf/", "mem/")


def launch(args: list[str], cwd: Path, nproc: int = 0, fault: str | None = None) -> subprocess.Popen:
    """The runner as `python -m` (nproc=0, a world of one) or under torchrun with nproc workers."""
    if nproc:
        cmd = torchrun_cmd(nproc, RUNNER)
    else:
        cmd = [sys.executable, "-m", "rl_training.runners.rl_runner"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("RL_FAULT_KILL", None)
    if fault:
        env["RL_FAULT_KILL"] = fault
    n = len(list(cwd.glob("launch*.log")))
    log = open(cwd / f"launch{n}.log", "w")  # handed to the child, closed with it
    return subprocess.Popen([*cmd, *args], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 900) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def log_text(cwd: Path, n: int) -> str:
    return (cwd / f"launch{n}.log").read_text()


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logged_steps(run_dir: Path) -> int:
    """Whole lines in metrics.jsonl (0 before it exists)."""
    try:
        return (run_dir / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_for_lines(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 600) -> bool:
    """Until metrics.jsonl has n lines; False when the run ended first."""
    t0 = time.monotonic()
    while logged_steps(run_dir) < n:
        if proc.poll() is not None:
            return False
        assert time.monotonic() - t0 < timeout, "the run made no progress"
        time.sleep(0.05)
    return True


def assert_same_history(straight: list[dict], resumed: list[dict]) -> None:
    """Every step once, in order, with every non-volatile metric bit-identical."""
    assert [m["step"] for m in resumed] == [m["step"] for m in straight]
    for a, b in zip(straight, resumed, strict=True):
        keys = {k for k in a if not k.startswith(VOLATILE)}
        assert keys == {k for k in b if not k.startswith(VOLATILE)}, a["step"]
        for k in keys:
            assert a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]), (a["step"], k, a[k], b[k])  # NaN == NaN


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def children(pid: int) -> list[int]:
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [c for c in pids if (_stat(c) or ("", 0))[1] == pid]


def alive(pid: int) -> bool:
    """A zombie is dead: in a container no init may reap a re-parented worker."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def working_in(directory: str) -> list[int]:
    """Live processes whose working directory is `directory`: a run's, orphans re-parented elsewhere included."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and os.readlink(p / "cwd") == directory and alive(int(p.name)):
                found.append(int(p.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def kill_agent_and_check_workers_die(agent: subprocess.Popen, run_dir: Path) -> None:
    """kill -9 the torchrun agent: every worker gone within 5 s, and nothing in the run directory changes."""
    workers = children(agent.pid)
    assert workers, "torchrun started no workers"
    home = os.readlink(f"/proc/{agent.pid}/cwd")  # every process of the run works there (launch's cwd)
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    t0 = time.monotonic()
    while any(alive(w) for w in workers) and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers), f"workers {workers} outlived their launcher by 5 s"
    print(f"workers gone {time.monotonic() - t0:.2f} s after the agent's kill -9")
    before = tree_state(run_dir)
    # whatever the workers had started
    wait_until(lambda: not working_in(home), "no process of the run outlives its workers", 30)
    assert tree_state(run_dir) == before  # no orphan wrote metrics or checkpoints: none is left that could


# ------------------------------------------------------------------------------------ named kill points
# Each launch resumes the previous one's run and dies at the next point (total 6 steps, a checkpoint every 2):
CHAIN = [
    "metrics.torn_line@3",  # steps 1-2 logged, checkpoint 2; dies half-way through step 3's line
    "ckpt.before_rename@1",  # resumes at 2, drops the torn line; step 4's save dies after its marker
    "ckpt.after_rename@1",  # resumes at 2 again; checkpoint 4 in place, dies before pruning
    "loop.after_log@1",  # resumes at 4; step 5 logged, no checkpoint covers it yet
    "ckpt.files_written@1",  # resumes at 4; the final save dies before its marker
    None,  # resumes at 4 and finishes
]


def test_kill_points_then_resume_reproduce_the_uninterrupted_run(run_overrides, tmp_path):
    base = ["--cfg", TESTCFG, *run_overrides, "train.total_steps=6", "ckpt.every=2", "ckpt.keep_last=5"]
    assert finish(launch([*base, "run.name=straight"], tmp_path)) == 0
    straight = metric_lines(tmp_path / "runs" / "straight")
    run_dir = tmp_path / "runs" / "killed"
    for i, fault in enumerate(CHAIN):
        resume = ["ckpt.resume=latest"] if i else []
        status = finish(launch([*base, "run.name=killed", *resume], tmp_path, fault=fault))
        assert status == (0 if fault is None else -signal.SIGKILL), log_text(tmp_path, i + 1)[-3000:]
    assert "dropped 1 torn line" in log_text(tmp_path, 2)
    assert_same_history(straight, metric_lines(run_dir))
    assert [s for s, _ in list_checkpoints(run_dir)] == [2, 4, 6]
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))  # the killed saves' temp dirs were cleared


def test_colocated_vllm_two_ranks_resume_logs_every_metric_as_the_uninterrupted_run(run_overrides, tmp_path):
    # Issue 30 item 5: rollout/weight_version restarted after a resume (2, 3, 4 where the uninterrupted run
    # logged 4, 5, 6). Killed right after step 3 is logged; the resume from checkpoint 2 re-logs steps 3-4.
    base = ["--cfg", TESTCFG, *run_overrides, *VLLM, "train.total_steps=4", "ckpt.every=2", "ckpt.keep_last=5"]
    assert finish(launch([*base, "run.name=straight"], tmp_path, nproc=2)) == 0
    straight_dir = tmp_path / "runs" / "straight"
    straight = metric_lines(straight_dir)
    # The two-rank colocated run itself: every step, the canary at float noise on both ranks' engines, a world of 2
    # in the checkpoint with each rank's RNG, a clean engine and process-group teardown.
    assert [m["step"] for m in straight] == [1, 2, 3, 4]
    assert all(m["rollout/logp_diff_mean"] < 1e-3 for m in straight), straight
    ck = straight_dir / "checkpoints" / "step_000004"
    assert json.loads((ck / "trainer_state.json").read_text())["world_size"] == 2
    assert (ck / "rng_rank0.pt").exists() and (ck / "rng_rank1.pt").exists()
    assert "backend: vllm" in (straight_dir / "config.yaml").read_text()
    assert "Traceback" not in (tmp_path / "launch0.log").read_text()
    # build sync + one per step: step s logs s + 1 + 1
    assert [m["rollout/weight_version"] for m in straight] == [2.0, 3.0, 4.0, 5.0]
    killed = launch([*base, "run.name=killed"], tmp_path, nproc=2, fault="loop.after_log@3:0")
    assert finish(killed) != 0
    run_dir = tmp_path / "runs" / "killed"
    assert [s for s, _ in list_checkpoints(run_dir)] == [2]
    assert finish(launch([*base, "run.name=killed", "ckpt.resume=latest"], tmp_path, nproc=2)) == 0
    assert_same_history(straight, metric_lines(run_dir))


# ---------------------------------------------------------------------------------- random-time kills
def random_kill_run(base: list[str], cwd: Path, run_dir: Path, nproc: int, rng: random.Random) -> None:
    """Kill -9 the agent once and one worker once, each at a random moment after a random number of logged
    steps, resuming after each; then resume to the end."""
    for i, target in enumerate(("agent", "worker")):
        resume = ["ckpt.resume=latest"] if i else []
        proc = launch([*base, *resume], cwd, nproc=nproc)
        while not children(proc.pid) and proc.poll() is None:  # the agent's workers exist: its own start-up
            time.sleep(0.05)  # is not what is tested (a kill then orphans nothing)
        saved = max((s for s, _ in list_checkpoints(run_dir)), default=0)  # where this launch starts
        if wait_for_lines(run_dir, saved + rng.randint(0, 2), proc):  # 0: during setup
            time.sleep(rng.uniform(0, 1.5))
            if proc.poll() is None and target == "agent":
                kill_agent_and_check_workers_die(proc, run_dir)
            elif proc.poll() is None:
                os.kill(rng.choice(children(proc.pid)), signal.SIGKILL)
        finish(proc)
    assert finish(launch([*base, "ckpt.resume=latest"], cwd, nproc=nproc)) == 0


@pytest.mark.parametrize("backend, nproc", [("hf", 2), ("vllm", 1)])
def test_random_kills_of_launcher_and_workers_then_resume(run_overrides, tmp_path, backend, nproc):
    seed = int(os.environ.get("RL_FAULT_SEED") or random.SystemRandom().randrange(2**31))  # fixtures seed `random`
    print(f"RL_FAULT_SEED={seed}")
    extra = VLLM if backend == "vllm" else ["rollout.backend=hf"]
    base = ["--cfg", TESTCFG, *run_overrides, *extra, "rollout.prompts_per_step=4", "train.micro_batch_groups=1"]
    base += ["train.total_steps=6", "ckpt.every=1", "ckpt.keep_last=3"]
    assert finish(launch([*base, "run.name=straight"], tmp_path, nproc=nproc)) == 0
    run_dir = tmp_path / "runs" / "killed"
    random_kill_run([*base, "run.name=killed"], tmp_path, run_dir, nproc, random.Random(seed))
    assert_same_history(metric_lines(tmp_path / "runs" / "straight"), metric_lines(run_dir))


def test_workers_die_with_their_launcher(run_overrides, tmp_path):
    """The issue's reproduction: kill -9 of the torchrun agent during a 2-rank run."""
    args = ["--cfg", TESTCFG, *run_overrides, "rollout.prompts_per_step=4", "train.micro_batch_groups=1"]
    agent = launch([*args, "train.total_steps=200", "ckpt.every=1"], tmp_path, nproc=2)
    run_dir = tmp_path / "runs" / "testconfig"
    workers: list[int] = []
    try:
        assert wait_for_lines(run_dir, 2, agent), log_text(tmp_path, 0)[-3000:]
        workers = children(agent.pid)
        kill_agent_and_check_workers_die(agent, run_dir)
    finally:
        agent.kill()
        for w in workers:  # a failed assertion must leave no trainer behind
            if alive(w):
                os.kill(w, signal.SIGKILL)
    # and the next run takes the directory over at once (the kernel dropped the dead holder's lock)
    assert finish(launch([*args, "train.total_steps=3", "ckpt.resume=latest"], tmp_path, nproc=2)) == 0

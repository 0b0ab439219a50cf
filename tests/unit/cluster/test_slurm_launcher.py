"""The SLURM launcher (rl_training/cluster/launch.py) at unit level: worker environment, node-local dirs, proxy
bypass, log redaction, torchrun arguments, the node's exit status, the workers' OpenMP threads."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from rl_training.cluster import launch as slurm_launch
from rl_training.cluster.launch import (
    add_no_proxy,
    exit_status,
    node_local_env,
    nproc_per_node,
    torchrun_args,
    worker_env,
    worker_threads,
)


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


def launch_in(tmp_path, args: list[str], **extra: str) -> int:
    """slurm_launch.main on node 0 (n1) of a 2-node job, in a minimal SLURM environment plus `extra`. main()
    replaces the environment with the workers' and blocks the stop signals: both are undone after."""
    env = {
        "PATH": os.environ["PATH"],
        "SLURM_JOB_ID": "9",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "0",
        "SLURMD_NODENAME": "n1",
        "RL_RDZV_ENDPOINT": "127.0.0.1:20009",
        "RL_NODE_LOCAL_ROOT": str(tmp_path),
        **extra,
    }
    saved_env, saved_mask = dict(os.environ), signal.pthread_sigmask(signal.SIG_BLOCK, set())
    try:
        os.environ.clear()
        os.environ.update(env)
        return slurm_launch.main(["--", *args])
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        signal.pthread_sigmask(signal.SIG_SETMASK, saved_mask)


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
    assert launch_in(tmp_path, args) == 0
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
    # the weight-state guard's 70 is kept the same way; mixed with a 75 it is no clean stop of either kind
    assert exit_status([70]) == 70 and exit_status([-15, 70]) == 70
    assert exit_status([70, 75]) == 1 and exit_status([1, 70]) == 1


def test_trainer_gpus_are_set_inside_the_task(tmp_path, monkeypatch):
    """Issue 41, item 4: srun gives the trainers' task every GPU of the step (CUDA_VISIBLE_DEVICES=0,1,2,3 and
    SLURM_GPUS_ON_NODE=4), past what rl_train.sbatch exported; with RL_TRAINER_GPUS=0 (3 vLLM servers on GPUs 1-3)
    torchrun must start one worker that sees GPU 0 only."""
    seen = {}

    def fake_torchrun(argv):
        seen.update(argv=argv, cvd=os.environ.get("CUDA_VISIBLE_DEVICES"))
        return 0

    monkeypatch.setattr(slurm_launch, "run_torchrun", fake_torchrun)
    srun = {"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # the task's, from srun
    assert launch_in(tmp_path, ["--cfg", "c.yaml"], **srun, RL_TRAINER_GPUS="0") == 0
    assert "--nproc-per-node=1" in seen["argv"] and seen["cvd"] == "0"
    assert nproc_per_node({"RL_TRAINER_GPUS": "2,3", "SLURM_GPUS_ON_NODE": "4"}) == 2


def test_each_worker_gets_its_share_of_the_cpus_whatever_omp_num_threads_it_inherited(tmp_path, monkeypatch):
    """Issue 50, item 6: an OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK exported by the job (288 on a GH200 node) passed
    the allow-list to every worker, so 4 workers ran 288 OpenMP threads each. Each gets SLURM_CPUS_PER_TASK // nproc
    now (288 // 4 = 72), unless the user names OMP_NUM_THREADS in RL_WORKER_ENV: then the value is theirs."""
    seen = {}

    def fake_torchrun(argv):
        seen["omp"] = os.environ.get("OMP_NUM_THREADS")
        return 0

    monkeypatch.setattr(slurm_launch, "run_torchrun", fake_torchrun)
    task = {"SLURM_CPUS_PER_TASK": "288", "SLURM_GPUS_ON_NODE": "4", "OMP_NUM_THREADS": "288"}
    assert launch_in(tmp_path, ["--cfg", "c.yaml"], **task) == 0
    assert seen["omp"] == "72"
    assert launch_in(tmp_path, ["--cfg", "c.yaml"], **task, RL_WORKER_ENV="SITE_*, OMP_NUM_THREADS") == 0
    assert seen["omp"] == "288"  # named: passed as the user set it
    assert worker_threads({"SLURM_CPUS_PER_TASK": "3"}, 4) == {"OMP_NUM_THREADS": "1"}  # at least one
    assert worker_threads({}, 2) == {"OMP_NUM_THREADS": "1"}  # no --cpus-per-task: one CPU per task
    assert worker_threads({"SLURM_CPUS_PER_TASK": "72", "RL_WORKER_ENV": "OMP_NUM_THREADS"}, 1) == {
        "OMP_NUM_THREADS": "72"
    }  # named but unset: nothing of the user's to keep

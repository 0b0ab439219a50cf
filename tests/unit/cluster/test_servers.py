"""The batch script's server facts (rl_training/cluster/servers.py): CPUs per server task and vLLM's dev mode for
the weight syncs that need it (issue 29, N2 and N3), vllm_server.sh passing the dev mode on to the server, and each
server bound to its own GPU's NUMA node (issue 50)."""

from __future__ import annotations

import os
import subprocess

import pytest

from rl_training.cluster.servers import cpu_list, main, needs_dev_mode, numa_cpus, server_cpus
from tests.helpers import REPO, TESTCFG, fake_nvidia_smi


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


def fake_sysfs(root, pci: str, node: int, cpulist: str):
    """/sys/bus/pci/devices/<pci>/numa_node and /sys/devices/system/node/node<node>/cpulist."""
    dev = root / "bus" / "pci" / "devices" / pci
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(f"{node}\n")
    cpus = root / "devices" / "system" / "node" / f"node{node}"
    cpus.mkdir(parents=True)
    (cpus / "cpulist").write_text(cpulist + "\n")
    return root


def test_a_server_binds_to_its_gpus_numa_node(tmp_path):
    """Issue 50, item 6: on a GH200 node GPU k hangs off Grace k (NUMA node k, CPUs 72k..72k+71); the server of GPU
    2 runs on CPUs 144-215, within what its task may use. nvidia-smi writes an 8-digit PCI domain, sysfs 4."""
    sysfs = fake_sysfs(tmp_path, "0019:01:00.0", 2, "144-215")
    node = set(range(288))
    assert numa_cpus("00000019:01:00.0", node, sysfs) == set(range(144, 216))
    assert numa_cpus("0019:01:00.0", set(range(150, 300)), sysfs) == set(range(150, 216))  # the task's part only
    assert numa_cpus("00000019:01:00.0", set(range(72)), sysfs) == set()  # none of them allowed: unbound
    assert numa_cpus("00000009:01:00.0", node, sysfs) == set()  # no NUMA information for this device
    assert cpu_list(set(range(144, 216))) == "144-215"
    assert cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


def test_cpus_prints_the_taskset_list_of_the_servers_gpu(tmp_path, capsys, monkeypatch):
    mine = sorted(os.sched_getaffinity(0))
    sysfs = fake_sysfs(tmp_path / "sys", "0009:01:00.0", 1, f"{mine[0]}-{mine[0] + 200}")
    fake_nvidia_smi(tmp_path / "bin", ["00000009:01:00.0"])  # --query-gpu=pci.bus_id -i 1
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert main(["cpus", "--gpu", "1", "--sysfs", str(sysfs)]) == 0
    expected = cpu_list({c for c in mine if c <= mine[0] + 200})
    assert capsys.readouterr().out == expected + "\n"
    fake_nvidia_smi(tmp_path / "bin", ["No devices were found"], status=6)  # an unknown GPU: unbound, one line
    assert main(["cpus", "--gpu", "7", "--sysfs", str(sysfs)]) == 0
    out = capsys.readouterr()
    assert out.out == "\n" and "nvidia-smi names no PCI bus id for GPU 7" in out.err and "not bound" in out.err


def test_vllm_server_sh_runs_the_server_on_its_gpus_cpus(tmp_path):
    """vllm_server.sh asks `servers cpus` for its GPU's CPUs and execs the server under taskset: a fake python answers
    the question with this process's first CPU, then records the CPUs the server ran on."""
    cpu = min(os.sched_getaffinity(0))
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/bash\n"
        f'if [[ "$2" == rl_training.cluster.servers ]]; then echo "$*" > {tmp_path}/asked.txt; echo {cpu}; exit 0; fi\n'
        f"grep Cpus_allowed_list /proc/self/status > {tmp_path}/cpus.txt\n"
        f'echo "$CUDA_VISIBLE_DEVICES" > {tmp_path}/gpu.txt\n'
    )
    fake.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "RL_PYTHON": str(fake), "RL_SERVER_PORT": "31000", "SLURM_PROCID": "4"}
    env |= {"SLURM_LOCALID": "1", "SLURMD_NODENAME": "n2", "RL_SERVER_ARGS": "--model m", "RL_SERVER_GPUS": "1,2,3"}
    r = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "vllm_server.sh")], env=env, capture_output=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "asked.txt").read_text() == "-m rl_training.cluster.servers cpus --gpu 2\n"  # local task 1
    assert (tmp_path / "gpu.txt").read_text() == "2\n"
    assert (tmp_path / "cpus.txt").read_text().split() == ["Cpus_allowed_list:", str(cpu)]
    assert f"gpus 2 cpus {cpu}" in r.stdout.decode()
    (tmp_path / "asked.txt").unlink()
    script = ["bash", str(REPO / "scripts" / "slurm" / "vllm_server.sh")]
    r = subprocess.run(script, env={**env, "RL_NUMA_BIND": "0"}, capture_output=True)
    assert r.returncode == 0 and not (tmp_path / "asked.txt").exists() and "cpus unbound" in r.stdout.decode()


def test_the_server_step_leaves_the_binding_to_each_server():
    script = (REPO / "scripts" / "slurm" / "rl_train.sbatch").read_text()
    server_step = script.split('srun --nodes="$n_server_nodes"')[1].split("vllm_server.sh")[0]
    assert "--cpu-bind=none" in server_step

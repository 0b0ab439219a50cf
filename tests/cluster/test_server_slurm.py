"""The SLURM wrapper's inference-server layout (rl_training/cluster/servers.py, scripts/slurm/vllm_server.sh):
where the servers and trainers go, then a real 2-node job on the local Slurm: a CPU vLLM server as its own
job step on the second node, the trainer on the first against it with K=1, the server stopped at exit.
Run the cluster test under `flock /tmp/slurm.lock`."""

from __future__ import annotations

import json
import re

import pytest
import requests

from rl_training.cluster.servers import server_layout, server_urls
from tests.helpers import SBATCH, TEST_RESOURCES, TESTCFG, job_env, sbatch, wait_job


def test_dedicated_and_shared_layouts():
    nodes = ["gh1", "gh2", "gh3", "gh4"]
    # 1 server node with 4 engines: tasks 0-3 on gh4, trainers on gh1-gh3
    hosts, trainers = server_layout(nodes, 1, 4)
    assert hosts == ["gh4"] * 4 and trainers == ["gh1", "gh2", "gh3"]
    assert server_urls(hosts, 8000) == [f"http://gh4:{8000 + p}" for p in range(4)]
    # GH200: 3 engines beside the learner on every node; task p = node p // 3, port 8000 + p
    hosts, trainers = server_layout(nodes[:2], 0, 3)
    assert trainers == ["gh1", "gh2"]
    assert server_urls(hosts, 8000) == [
        "http://gh1:8000",
        "http://gh1:8001",
        "http://gh1:8002",
        "http://gh2:8003",
        "http://gh2:8004",
        "http://gh2:8005",
    ]
    with pytest.raises(ValueError, match="leaves none of the job's 2 nodes"):
        server_layout(nodes[:2], 2, 1)


def refused(url: str) -> bool:
    s = requests.Session()
    s.trust_env = False
    try:
        s.get(url + "/health", timeout=2)
    except requests.ConnectionError:
        return True
    return False


@pytest.mark.slow
def test_two_node_job_with_a_dedicated_server_node(slurm_cluster, run_overrides, warm_model, tmp_path):
    server_args = (
        f"--model {warm_model} --served-model-name base --dtype float32 --enforce-eager --max-model-len 256 "
        "--enable-lora --max-lora-rank 8 --max-loras 3 --logprobs-mode processed_logprobs "
        "--generation-config vllm --seed 0"
    )
    env = job_env(
        RL_SERVER_ARGS=server_args,
        RL_SERVER_NODES="1",
        RL_RDZV_IFACE="lo",
        VLLM_CPU_KVCACHE_SPACE="1",
        RL_SERVER_DEADLINE_S="600",
    )
    args = [*run_overrides, "train.total_steps=3", "ckpt.every=0", "rollout.max_async_level=1", "loss.tis_cap=2"]
    job = sbatch([*TEST_RESOURCES, str(SBATCH), "--cfg", TESTCFG, *args], tmp_path, env)
    rc = wait_job(job, 1200)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert rc == 0, log[-4000:] + (tmp_path / f"vllm-servers-{job}.log").read_text()[-3000:]
    (url,) = re.findall(r"vLLM servers on n2 \(1 per node\): (http://n2:\d+)", log)
    assert f"slurm_servers: {url} healthy" in log
    assert re.search(r"slurm_launch\[n1 0/1\]", log)  # the trainer step: n1 only, a world of one node
    assert "slurm_launch[n2" not in log
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "testconfig" / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/policy_version_max"] for m in metrics] == [0.0, 0.0, 1.0]  # K=1 against the server
    assert "task 0 on n2" in (tmp_path / f"vllm-servers-{job}.log").read_text()
    assert refused(url.replace("n2", "127.0.0.1"))  # stopped when the batch script exited

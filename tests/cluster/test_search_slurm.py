"""The SLURM launcher's retrieval server (search tasks): started per node on 127.0.0.1, health-checked with a
deadline before torchrun, NO_PROXY with its exact host, the runner pointed at it, stopped at exit; a given URL
used as is. Unit level with real server processes, then a 2-node job on the local Slurm (run it under
`flock /tmp/slurm.lock`)."""

from __future__ import annotations

import json
import re
import socket

import pytest
import requests

from rl_training.cluster.launch import RetrieverError, RetrieverServer, start_retriever
from rl_training.retrieval.client import HttpRetriever
from tests.helpers import REPO, SBATCH, TEST_RESOURCES, TESTCFG, job_env, sbatch, step_environments, wait_job


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.jsonl"
    p.write_text("".join(json.dumps({"id": str(i), "contents": f"k{i}\nk{i} code {i}"}) + "\n" for i in range(5)))
    return p


def refused(url: str) -> bool:
    try:
        requests.Session().get(url.replace("/retrieve", "/health"), timeout=2)
    except requests.ConnectionError:
        return True
    return False


def test_no_retriever_knob_is_a_null_object(tmp_path):
    server = start_retriever({}, {}, tmp_path, tmp_path / "log")
    assert server == RetrieverServer() and server.overrides == []
    server.stop()


def test_server_per_node_started_checked_and_stopped(tmp_path, corpus):
    wenv = {"PYTHONPATH": str(REPO), "NO_PROXY": "n1"}
    log = tmp_path / "retriever.log"
    server = start_retriever({"RL_RETRIEVER_ARGS": f"--corpus {corpus} --topk 1"}, wenv, tmp_path, log)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/retrieve", server.url)
        assert server.overrides == ["search.retriever=http", f"search.url={server.url}"]
        assert wenv["NO_PROXY"] == wenv["no_proxy"] == "n1,127.0.0.1"  # the exact host, added to what was there
        hits = HttpRetriever(server.url, retries=0).retrieve(["k3"], 1).passages
        assert [p.id for p in hits[0]] == ["3"]  # --topk 1 reached the server
    finally:
        server.stop()
    assert server.proc.returncode is not None and refused(server.url)


def test_server_that_dies_or_never_answers_fails_the_node(tmp_path):
    log = tmp_path / "retriever.log"
    env = {"RL_RETRIEVER_ARGS": f"--corpus {tmp_path / 'missing.jsonl'}"}
    with pytest.raises(RetrieverError, match=r"retrieval server exited with status 1; see .*retriever.log"):
        start_retriever(env, {"PYTHONPATH": str(REPO)}, tmp_path, log)
    assert "corpus file not found" in log.read_text()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {"RL_RETRIEVER_URL": f"http://127.0.0.1:{port}/retrieve", "RL_RETRIEVER_DEADLINE_S": "1"}
    with pytest.raises(RetrieverError, match="was not healthy by RL_RETRIEVER_DEADLINE_S"):
        start_retriever(env, {}, tmp_path, log)
    with pytest.raises(RetrieverError, match="not both"):
        start_retriever({**env, "RL_RETRIEVER_ARGS": "--corpus x"}, {}, tmp_path, log)


@pytest.mark.slow
def test_two_node_job_runs_one_retriever_per_node(slurm_cluster, run_overrides, corpus, tmp_path):
    env = job_env(RL_RETRIEVER_ARGS=f"--corpus {corpus}", RL_RDZV_IFACE="lo")
    args = [*run_overrides, "train.total_steps=1", "ckpt.every=0"]
    job = sbatch([*TEST_RESOURCES, str(SBATCH), "--cfg", TESTCFG, *args], tmp_path, env)
    envs = step_environments(job)
    assert wait_job(job, 600) == 0, (tmp_path / f"slurm-{job}.out").read_text()[-4000:]
    log = (tmp_path / f"slurm-{job}.out").read_text()
    urls = re.findall(r"slurm_launch: retriever (http://127\.0\.0\.1:\d+/retrieve) healthy: (\{.*\})", log)
    assert len(urls) == 2 and len({u for u, _ in urls}) == 2, log[-4000:]  # one server per node, own port each
    assert all("'passages': 5" in h for _, h in urls)
    for node, (url, _) in zip(("n1", "n2"), sorted(urls)):
        assert (tmp_path / f"retriever-{job}-{node}.log").exists()
        assert refused(url)  # stopped at exit
    for node in ("n1", "n2"):
        worker = envs[node].get("worker")
        assert worker and "127.0.0.1" in worker["NO_PROXY"].split(","), envs
    # the runner got the per-node url: its resolved config (printed by rank 0) names one of them
    assert re.search(r"url: http://127\.0\.0\.1:\d+/retrieve", log) and "retriever: http" in log

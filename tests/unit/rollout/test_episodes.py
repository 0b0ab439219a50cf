"""The multi-turn episode engine (rollout/episodes.py) with the search environment (tasks/search/task.py): exact
tokens and masks of scripted episodes, budgets, one batched retrieval per turn, and the real HF backend running
episodes turn by turn."""

from __future__ import annotations

import pytest

from rl_training.config.schema import SearchCfg
from rl_training.data.sources import Example
from rl_training.policy.tiny_model import build_tokenizer
from rl_training.retrieval.retriever import Passage, RetrievalResult, information_block
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.episodes import EpisodeSpec, TurnSample, turn_end
from rl_training.rollout.episodes import run_episodes as engine
from rl_training.tasks.search.task import INVALID_ACTION, SearchTask, parse_action

TOK = build_tokenizer()  # byte-level: one token per ASCII character
EOS = TOK.eos_token_id


def enc(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids


class ScriptedGen:
    """A TurnGenerator that answers call c, context i with script[c][i] (text or token ids), log-prob -0.5 per
    token, cut at the context's cap; it records every call's contexts, caps and seeds."""

    def __init__(self, script):
        self.script, self.calls, self.stop_ids = script, [], {EOS}

    def generate_turn(self, contexts, max_tokens, seeds, spec, stop):
        self.calls.append((contexts, max_tokens, seeds))
        outs = []
        for i, cap in enumerate(max_tokens):
            s = self.script[len(self.calls) - 1][i]
            ids = (enc(s) if isinstance(s, str) else s)[:cap]
            outs.append(TurnSample(ids, [-0.5] * len(ids)))
        return outs


class KeyRetriever:
    """Returns one passage per query ('<query> code 417'), or an error for the query 'dead'; records calls."""

    def __init__(self):
        self.calls = []

    def retrieve(self, queries, topk):
        self.calls.append(list(queries))
        ok = [q != "dead" for q in queries]
        return RetrievalResult(
            [[Passage("0", f"{q}\n{q} code 417")] if k else [] for q, k in zip(queries, ok, strict=True)],
            [None if k else "connection refused" for k in ok],
        )

    def close(self):
        pass


SPEC = SamplingSpec(n=1, max_new_tokens=0, seed=7)
STOP = ("</search>", "</answer>")


def search_env(retriever) -> SearchTask:
    """The search environment with `retriever` in place of the one start() would build from search.*."""
    env = SearchTask(SearchCfg(topk=3))
    env.retriever = retriever
    return env


def run_episodes(gen, retriever, tok, prompts, spec, es):
    """The engine on the search environment; the problems do not matter to it (it resets no state from them)."""
    return engine(gen, search_env(retriever), tok, prompts, [Example("q")] * len(prompts), spec, es)


def test_scripted_episode_exact_tokens_masks_and_contexts():
    prompt = enc("code of bazo?\n")
    gen = ScriptedGen(
        [
            ["<search>bazo</search>", "hello"],  # turn 1: a search; an action-less turn (stopped at the cap of 5)
            ["<answer>417</answer>", [EOS]],  # turn 2: the answer; EOS
        ]
    )
    ret = KeyRetriever()
    es = EpisodeSpec(max_turns=4, max_tokens_per_turn=5 + 20, max_response_tokens=1000, max_obs_tokens=400, stop=STOP)
    gen.script[0][1] = "hello" + "x" * 20  # 25 tokens: exactly the per-turn cap, no action -> invalid
    ro = run_episodes(gen, ret, TOK, [prompt, prompt], SamplingSpec(n=1, max_new_tokens=0, seed=7), es)
    s1, obs1 = enc("<search>bazo</search>"), enc(information_block([Passage("0", "bazo\nbazo code 417")]))
    a1 = enc("<answer>417</answer>")
    # Episode 0: search, the observation (Search-R1's text, tokenized on its own), the answer.
    assert ro.completion_ids[0] == s1 + obs1 + a1
    assert ro.loss_mask[0] == [1] * len(s1) + [0] * len(obs1) + [1] * len(a1)
    assert ro.turn_index[0] == [1] * len(s1) + [0] * len(obs1) + [2] * len(a1)
    assert ro.logprobs[0] == [-0.5] * len(s1) + [0.0] * len(obs1) + [-0.5] * len(a1)
    assert ro.texts[0] == "<search>bazo</search><answer>417</answer>"  # sampled text only: the reward's input
    assert ro.episodes[0] == {
        "turns": 2, "searches": 1, "invalid": 0, "answered": True, "obs_tokens": len(obs1), "obs_capped": 0,
        "truncated": "", "error": "",
    }  # fmt: skip
    # Episode 1: an invalid action gets Search-R1's text, then EOS ends the episode without an answer.
    h = enc("hello" + "x" * 20)
    assert ro.completion_ids[1] == h + enc(INVALID_ACTION) + [EOS]
    assert ro.loss_mask[1] == [1] * 25 + [0] * len(enc(INVALID_ACTION)) + [1]
    assert ro.episodes[1]["invalid"] == 1 and not ro.episodes[1]["answered"] and not ro.truncated[1]
    # Each turn's context is exactly the previous context + the previous turn's tokens (+ its observation).
    (c1, _, seeds1), (c2, _, seeds2) = gen.calls
    assert c1 == [prompt, prompt]
    assert c2 == [prompt + s1 + obs1, prompt + h + enc(INVALID_ACTION)]
    assert ro.completion_ids[0] == (c2[0] + a1)[len(prompt) :]
    # One batched retrieval per turn, only for the episodes that searched.
    assert ret.calls == [["bazo"]]
    # Per-episode, per-turn seeds: distinct, and an episode's do not depend on which others are still live
    # (here the second episode ends at once, so turn 2 batches the first one alone).
    assert len({*seeds1, *seeds2}) == 4
    other = ScriptedGen([["<search>bazo</search>", [EOS]], ["<answer>417</answer>"]])
    run_episodes(other, KeyRetriever(), TOK, [prompt, prompt], SamplingSpec(n=1, max_new_tokens=0, seed=7), es)
    assert other.calls[0][2] == seeds1 and other.calls[1][2] == [seeds2[0]]


def test_budgets_end_episodes_truncated_without_cutting_context():
    prompt = enc("q?\n")
    s = "<search>bazo</search>"  # 21 tokens
    obs = enc(information_block([Passage("0", "bazo\nbazo code 417")]))
    # max_turns=1: a search on the last turn ends the episode flagged "turns", its observation not appended.
    ro = run_episodes(ScriptedGen([[s]]), KeyRetriever(), TOK, [prompt], SPEC, EpisodeSpec(1, 30, 1000, 400))
    assert ro.completion_ids[0] == enc(s) and ro.truncated == [True]
    assert ro.episodes[0]["truncated"] == "turns"
    # A response budget that the observation would fill: the episode ends "tokens" after the search.
    es = EpisodeSpec(4, 30, 21 + len(obs), 400)
    ro = run_episodes(ScriptedGen([[s]]), KeyRetriever(), TOK, [prompt], SPEC, es)
    assert ro.completion_ids[0] == enc(s) and ro.episodes[0]["truncated"] == "tokens"
    # One token more: the observation fits, the next turn gets a cap of exactly 1 token and is cut there.
    gen = ScriptedGen([[s], ["<answer>417</answer>"]])
    ro = run_episodes(gen, KeyRetriever(), TOK, [prompt], SPEC, EpisodeSpec(4, 30, 21 + len(obs) + 1, 400))
    assert gen.calls[1][1] == [1]
    assert ro.completion_ids[0] == enc(s) + obs + enc("<")
    assert ro.episodes[0]["truncated"] == "tokens" and len(ro.completion_ids[0]) == 21 + len(obs) + 1
    # The observation cap cuts the observation (counted), never the context before it.
    gen = ScriptedGen([[s], ["<answer>417</answer>"]])
    ro = run_episodes(gen, KeyRetriever(), TOK, [prompt], SPEC, EpisodeSpec(4, 30, 1000, 10))
    assert ro.completion_ids[0] == enc(s) + obs[:10] + enc("<answer>417</answer>")
    assert ro.episodes[0]["obs_capped"] == 1 and ro.episodes[0]["answered"]


def test_failed_retrieval_is_an_observation_and_a_count():
    gen = ScriptedGen([["<search>dead</search>", "<search>bazo</search>"], ["<answer>x</answer>"] * 2])
    ro = run_episodes(gen, KeyRetriever(), TOK, [enc("q\n")] * 2, SPEC, EpisodeSpec(4, 30, 1000, 400))
    assert TOK.decode(ro.completion_ids[0]).count("<information>Search failed: connection refused</information>") == 1
    assert ro.env_stats.queries == 2 and ro.env_stats.failed == 1
    assert ro.episodes[0]["answered"] and ro.episodes[1]["answered"]


def test_turn_end_and_parse_action():
    # vLLM's rule: through the token that completes a stop string; EOS; else the cap.
    ids = enc("ab</search>xyz")
    assert turn_end(ids, TOK, ("</search>", "</answer>"), {EOS}, 100) == len("ab</search>")
    assert turn_end([*enc("ab"), EOS, *enc("c")], TOK, ("</search>",), {EOS}, 100) == 3
    assert turn_end(ids, TOK, ("</answer>",), {EOS}, 4) == 4
    assert parse_action("think <search> who </search>") == ("search", "who")
    assert parse_action("<answer>417</answer>") == ("answer", "417")
    assert parse_action("<search>open") == ("invalid", "")


def test_max_trainable_tokens():
    assert EpisodeSpec(4, 500, 2048, 512).max_trainable_tokens == 2000  # 4 turns x 500 < 2048
    assert EpisodeSpec(4, 500, 1024, 512).max_trainable_tokens == 1024  # the budget binds first


def test_hf_backend_runs_episodes(tiny_model):
    """The HF backend's turn-level generate on the real tiny model: stop strings cut where vLLM cuts, contexts
    chain, and the log-probs are the sampler's."""
    import torch

    from rl_training.config.schema import ModelCfg
    from rl_training.policy.models import load_base_model, load_tokenizer
    from rl_training.rollout.hf import HFBackend

    tok = load_tokenizer(str(tiny_model))
    model = load_base_model(ModelCfg(name_or_path=str(tiny_model), dtype="float32"), torch.device("cpu"))
    backend = HFBackend(model, tok)
    # A random model rarely writes a stop string: the stop set holds single characters to force it.
    es = EpisodeSpec(3, 12, 200, 50, ("a", "e"))
    ro = run_episodes(backend, KeyRetriever(), tok, [enc("code of bazo?\n")] * 2, SamplingSpec(2, 0, seed=3), es)
    assert len(ro) == 4
    for i in range(4):
        sampled = [t for t, m in zip(ro.completion_ids[i], ro.loss_mask[i], strict=True) if m]
        assert "<information>" not in tok.decode(sampled)
        turns = sorted({t for t in ro.turn_index[i] if t})
        assert turns == list(range(1, ro.episodes[i]["turns"] + 1))
        for t in turns:  # each turn ends at its first stop character, its cap, or EOS
            ids = [x for x, k in zip(ro.completion_ids[i], ro.turn_index[i], strict=True) if k == t]
            text = tok.decode(ids, skip_special_tokens=True)
            stops = [j for j, ch in enumerate(text) if ch in "ae"]
            assert not stops or stops[0] == len(text) - 1
            assert len(ids) <= 12


def test_episode_metrics_values():
    """Two episodes: (2 turns, 1 search, answered, 30 observation tokens) and (3 turns, 1 invalid, truncated by
    turns, 10 observation tokens). turns 5, valid 5 - 1 = 4 -> 0.8. (The per-turn canary is the update's.)"""
    from rl_training.base.meter import Meter
    from rl_training.metrics.episode import measure_episodes
    from rl_training.retrieval.retriever import RetrievalStats
    from rl_training.rollout.base import Rollouts

    e1 = {"turns": 2, "searches": 1, "invalid": 0, "answered": True, "obs_tokens": 30, "obs_capped": 0}
    e2 = {"turns": 3, "searches": 0, "invalid": 1, "answered": False, "obs_tokens": 10, "obs_capped": 1}
    stats = RetrievalStats(queries=1, failed=0, retries=0, latencies_s=[0.002])
    ro = Rollouts(
        [[1], [1]], [[5] * 6, [5] * 4], [[0.0] * 6, [0.0] * 4], [False, True], ["", ""],
        loss_mask=[[1, 1, 0, 0, 1, 1], [1, 0, 1, 1]], turn_index=[[1, 1, 0, 0, 2, 2], [1, 0, 2, 2]],
        episodes=[{**e1, "truncated": "", "error": ""}, {**e2, "truncated": "turns", "error": ""}], env_stats=stats,
    )  # fmt: skip
    env = SearchTask(SearchCfg())
    meter = Meter()
    measure_episodes(meter, ro, env)
    m = meter.reduce(torch_device())
    assert m["rollout/turns_mean"] == 2.5 and m["rollout/searches_mean"] == 0.5
    assert m["rollout/valid_action_rate"] == 0.8 and m["rollout/answer_rate"] == 0.5
    assert m["rollout/truncated_turns_rate"] == 0.5 and m["rollout/truncated_tokens_rate"] == 0.0
    assert m["rollout/obs_tokens_mean"] == 20.0 and m["rollout/obs_capped"] == 1.0
    assert m["rollout/trainable_tokens_mean"] == 3.5  # (4 + 3) / 2
    assert m["rollout/env_errors"] == 0.0 and m["rollout/env_invalid"] == 0.0
    assert m["retrieval/queries"] == 1.0 and m["retrieval/latency_p50_ms"] == pytest.approx(2.0)
    single, meter = Rollouts([[1]], [[5]], [[0.0]], [False], [""]), Meter()
    measure_episodes(meter, single, env)
    assert meter.reduce(torch_device()) == {}  # single-turn: nothing metered


def torch_device():
    import torch

    return torch.device("cpu")

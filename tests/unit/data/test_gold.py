"""Gold episodes for SFT (rl_training/data/gold.py): the token ids and loss mask, and the episodes RL's engine could
not produce refused with one line. The tiny model's tokenizer is byte-level: an ASCII string of n characters is n
tokens, so every count below is a string's length."""

from __future__ import annotations

import json

import pytest

from rl_training.config.load import load_config
from rl_training.data.gold import encode_gold_episodes
from rl_training.data.sources import DataError
from rl_training.policy.models import load_tokenizer
from rl_training.tasks.base import Environment, Task

CALL, OBS, ANSWER = "<search>ab</search>", "<information>x</information>", "<answer>7</answer>"  # 19, 28, 18 tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model), False)


def episode(question: str = "q1", *segments: tuple[str, bool]) -> dict:
    segments = segments or ((CALL, True), (OBS, False), (ANSWER, True))
    return {"question": question, "segments": [{"text": t, "trainable": k} for t, k in segments]}


def write(tmp_path, rows) -> str:
    path = tmp_path / "gold.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def encode(tmp_path, tokenizer, rows, *overrides: str, task=None):
    cfg = load_config(None, ["data.prompt_template={question}=", *overrides])
    env = task or Environment()
    limits = cfg.multiturn if isinstance(env, Environment) else None
    return encode_gold_episodes(write(tmp_path, rows), cfg.data, tokenizer, env, 0, limits)


def test_ids_are_prompt_then_segments_and_only_sampled_segments_are_trained(tmp_path, tokenizer):
    ((ids, mask),) = encode(tmp_path, tokenizer, [episode()])
    assert tokenizer.decode(ids) == "q1=" + CALL + OBS + ANSWER
    # the prompt "q1=" (3) and the observation (28) are masked; the two sampled turns (19 + 18) are trained
    assert mask == [0] * 3 + [1] * 19 + [0] * 28 + [1] * 18


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        # limits each one token below the episode's: prompt 3, turns 19 and 18, observation 28, response 65, 2 turns
        ("data.max_prompt_tokens=2", "prompt of 3 tokens > data.max_prompt_tokens=2"),
        ("multiturn.max_turns=1", "2 turns > multiturn.max_turns=1"),
        ("multiturn.max_tokens_per_turn=18", "a turn of 19 tokens > multiturn.max_tokens_per_turn=18"),
        ("multiturn.max_obs_tokens=27", "an observation of 28 tokens > multiturn.max_obs_tokens=27"),
        (
            "multiturn.max_response_tokens=64 multiturn.max_tokens_per_turn=64",
            "65 response tokens > multiturn.max_response_tokens=64",
        ),
    ],
)
def test_an_episode_past_an_rl_limit_is_one_line_naming_the_first_and_the_count(
    tmp_path, tokenizer, override, expected
):
    short = episode("q2", (ANSWER, True))  # 3 + 18 tokens: within every limit above but max_prompt_tokens
    rows = [short, episode(), short, episode()]
    if override.startswith("data."):
        rows = [episode("q", (ANSWER, True)), episode(), short, episode()]  # "q=" is 2 tokens: only q1, q2 over
    with pytest.raises(DataError) as e:
        encode(tmp_path, tokenizer, rows, *override.split())
    assert str(e.value) == (
        f"{tmp_path / 'gold.jsonl'}: {3 if override.startswith('data.') else 2} of 4 gold episodes go past the limits "
        f"RL's episodes have (first, line 2: {expected}); raise the limit in the config or shorten the episodes"
    )
    encode(tmp_path, tokenizer, rows)  # the default limits hold them all


def test_consecutive_segments_of_one_kind_are_one_turn_or_one_observation(tmp_path, tokenizer):
    rows = [episode("q", ("<think>", True), (CALL, True), (OBS, False), (OBS, False), (ANSWER, True))]
    encode(tmp_path, tokenizer, rows, "multiturn.max_turns=2", "multiturn.max_tokens_per_turn=26")  # 7 + 19 = 26
    with pytest.raises(DataError, match="a turn of 26 tokens > multiturn.max_tokens_per_turn=25"):
        encode(tmp_path, tokenizer, rows, "multiturn.max_tokens_per_turn=25")
    with pytest.raises(DataError, match="an observation of 56 tokens > multiturn.max_obs_tokens=55"):
        encode(tmp_path, tokenizer, rows, "multiturn.max_obs_tokens=55")


def test_a_single_turn_task_checks_the_prompt_only(tmp_path, tokenizer):
    rows = [episode()]  # 2 turns: past max_turns=1, but a Task (not an Environment) has no episode limits
    assert len(encode(tmp_path, tokenizer, rows, "multiturn.max_turns=1", task=Task())) == 1
    with pytest.raises(DataError, match="prompt of 3 tokens > data.max_prompt_tokens=2"):
        encode(tmp_path, tokenizer, rows, "data.max_prompt_tokens=2", task=Task())


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{not json", "invalid JSON"),
        ({"question": "q"}, "a gold episode needs 'question' and 'segments'"),
        ({"question": "q", "segments": "abc"}, "'segments' must be a list"),
        ({"question": "q", "segments": [{"text": "a"}]}, "each segment must be {'text': string, 'trainable'"),
        ({"question": "q", "segments": [{"text": 3, "trainable": True}]}, "each segment must be"),
        ({"question": "q", "segments": [{"text": "a", "trainable": "yes"}]}, "each segment must be"),
    ],
)
def test_a_malformed_row_is_one_line_naming_its_line(tmp_path, tokenizer, row, message):
    with pytest.raises(DataError) as e:
        encode(tmp_path, tokenizer, [episode(), row])
    assert str(e.value).startswith(f"{tmp_path / 'gold.jsonl'}:2: ") and message in str(e.value)
    assert "\n" not in str(e.value)

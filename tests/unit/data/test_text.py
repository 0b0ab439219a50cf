"""Text made safe to tokenize (rl_training/data/text.py) against Qwen2.5's added tokens (tests/hostile.py): for any
text a policy or a tool writes, clean_text is valid UTF-8, encode_plain never matches an added token and reads only
a prefix for a budget, and result_text renders any value a tool returns. The tool turn built from them:
tests/unit/tasks/test_tool_boundary.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rl_training.data.text import clean_text, encode_plain, result_text
from tests.hostile import HOSTILE_TEXT, RETURN_VALUES, qwen25_tokenizer

Q = qwen25_tokenizer()
ADDED = frozenset(Q.added_tokens_encoder.values())


@given(HOSTILE_TEXT)
def test_clean_text_is_valid_utf8_and_keeps_valid_text(text):
    out = clean_text(text)
    out.encode("utf-8")
    assert len(out) == len(text) and (out == text) == all(not 0xD800 <= ord(c) <= 0xDFFF for c in text)


@given(HOSTILE_TEXT)
def test_encode_plain_never_matches_an_added_token_and_spells_the_text(text):
    ids = encode_plain(Q, text)
    assert ADDED.isdisjoint(ids)
    assert Q.decode(ids) == clean_text(text)


@given(HOSTILE_TEXT, st.integers(min_value=0, max_value=600))
def test_encode_plain_with_a_budget_is_a_prefix_that_holds_it(text, budget):
    """The budgeted encoding reads a prefix of the text: its ids decode to a prefix of the text, and there are at
    least `budget` of them wherever the whole text has that many."""
    whole, cut = encode_plain(Q, text), encode_plain(Q, text, max_tokens=budget)
    assert clean_text(text).startswith(Q.decode(cut)) or Q.decode(cut).endswith("\ufffd")
    assert len(cut) >= min(budget, len(whole))


@given(RETURN_VALUES)
def test_result_text_renders_any_value_as_valid_utf8(value):
    out = result_text(value)
    assert isinstance(out, str)
    out.encode("utf-8")

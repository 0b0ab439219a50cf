"""What a policy under RL writes, as Hypothesis strategies, and a tokenizer with Qwen2.5's added tokens and its real
chat template: the inputs of every property-based test of a function that reads model-written text or a tool's
output (issue 38). Not a test module: the tests of several tiers import it (tests/helpers.py's rule: no test module
imports another).

The tokenizer is the tiny byte-level one (rl_training/policy/tiny_model.py) with Qwen2.5-Instruct's 22 added tokens
appended in Qwen's order and with Qwen's flags (14 special, such as <|im_end|>; 8 not, such as <tool_call>, which a
tokenizer matches even in plain text), and Qwen2.5-Instruct's chat template (tests/fixtures/, as published with
the model's tokenizer_config.json). Every byte is a token of its own, so ids are easy to reason about, while the
added tokens and the template are the real model's.
"""

from __future__ import annotations

import functools
import json
import sys

from hypothesis import strategies as st

from tests.helpers import FIXTURES
from tests.tool_fns import Unprintable, nested_list

# Qwen2.5-Instruct's added tokens (tokenizer_config.json's added_tokens_decoder, ids 151643-151664), in order,
# with their `special` flag.
QWEN25_ADDED: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
QWEN25_TEMPLATE = (FIXTURES / "qwen2.5_chat_template.jinja").read_text()


@functools.lru_cache(maxsize=1)
def qwen25_tokenizer():
    """The byte-level tokenizer with Qwen2.5's added tokens (their flags) and chat template; EOS <|im_end|>."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from rl_training.policy.tiny_model import build_tokenizer

    base = build_tokenizer(chat=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, pad_token="<|pad|>", model_max_length=1 << 20
    )
    for text, special in QWEN25_ADDED:
        if text in tok.get_vocab():
            continue
        tok.add_tokens([AddedToken(text, special=special, normalized=False)], special_tokens=special)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN25_TEMPLATE
    return tok


# ----------------------------------------------------------------------------------------------- strategies
CONTROL = [t for t, _ in QWEN25_ADDED] + [
    "<|im_start|>assistant\n",
    "<|im_start|>user\n",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
    "<|pad|>",
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "<information>",
    "</information>",
    "\\boxed{",
    "####",
    "```python\n",
    "```",
]
SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)  # lone halves: not encodable as UTF-8
# Any code point, lone surrogates, controls and the NUL byte included.
ANY_CHAR = st.characters(codec=None, exclude_categories=())


def huge_int_text(digits: int) -> str:
    return "9" * digits


def _nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "list" else '{"a":' * depth + "1" + "}" * depth


# Pieces a policy strings together: control-token look-alikes, tags, JSON fragments and bombs, numbers past
# Python's int-to-str limit, lone surrogates as raw characters and as JSON escapes, whitespace and plain text.
PIECES = st.one_of(
    st.sampled_from(CONTROL),
    st.text(ANY_CHAR, max_size=12),
    SURROGATES,
    st.sampled_from(['"\\ud800"', '"\\udfff"', '"\\ud83d\\ude00"', "\\u0000", '"', "\\", "{", "}", "[", "]", ":", ","]),
    st.sampled_from(["\n", " ", "\t", "\r\n", "\x00", "\x1b[2J", "\u202e", "\ufeff", "\ufffd"]),
    st.integers(min_value=4000, max_value=6000).map(huge_int_text),
    st.tuples(st.integers(min_value=50, max_value=3000), st.sampled_from(["list", "dict"])).map(lambda a: _nested(*a)),
    st.builds(lambda n, s: s * n, st.integers(min_value=1, max_value=300), st.sampled_from(CONTROL)),
)
HOSTILE_TEXT = st.lists(PIECES, max_size=12).map("".join)


def call_block(body: str, closed: bool = True) -> str:
    return f"<tool_call>{body}</tool_call>" if closed else f"<tool_call>{body}"


JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(ANY_CHAR, max_size=20),
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(ANY_CHAR, max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _call_json(name: str, args) -> str:
    return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


DEPTHS, DIGITS = st.integers(1, 5000), st.integers(4000, 9000)  # nesting past the recursion limit, ints past 4300
# A turn: prose and tool-call blocks, well formed, malformed, unclosed, nested, or carrying hostile arguments.
TOOL_CALL_BLOCKS = st.one_of(
    st.builds(call_block, st.builds(_call_json, st.sampled_from(["echo", "calculator", "nope", ""]), JSON_VALUES)),
    st.builds(call_block, HOSTILE_TEXT, st.booleans()),
    st.builds(
        lambda n: call_block('{"name": "echo", "arguments": {"text": ' + _nested(n, "list") + "}}"),
        st.integers(1, 5000),
    ),
    st.builds(
        lambda d: call_block('{"name": "calculator", "arguments": {"a": ' + "9" * d + ', "b": 1}}'),
        st.integers(4000, 9000),
    ),
    st.just(call_block('{"name": "echo", "arguments": {"text": "a</tool_call>b"}}')),
    st.just(call_block('{"name": "echo", "arguments": {"text": "\\ud800"}}')),
    st.just(call_block(call_block('{"name": "echo", "arguments": {}}'))),
)
TURN_TEXT = st.lists(st.one_of(TOOL_CALL_BLOCKS, HOSTILE_TEXT), max_size=6).map("".join)


# Values a tool may return: whatever Python can hold, the shapes that break rendering included.
RETURN_VALUES = st.one_of(
    JSON_VALUES,
    st.binary(max_size=64),
    st.text(ANY_CHAR, max_size=64),
    st.integers(min_value=10**4400, max_value=10**4500),
    st.integers(min_value=sys.getrecursionlimit(), max_value=4 * sys.getrecursionlimit()).map(nested_list),
    st.just(float("nan")),
    st.just(Unprintable()),
    st.just(object()),
    st.just({1: {2, 3}, (4, 5): b"\xff"}),
)

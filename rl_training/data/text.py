"""Text that came from a policy, a tool or an environment, made safe to tokenize: total functions whose cost is
bounded by the budget, not by what the writer chose to send.

- `clean_text`: any string as valid UTF-8 (a lone surrogate, which a model's JSON escape `"\\ud800"` or a tool's
  output can carry, becomes '?'; every tokenizer takes the result). `result_text`: any value a tool returns as
  such a text.
- `encode_plain`: the ids of a text as data. No added token (special, such as `<|im_end|>`, or not, such as
  Qwen2.5's `<tool_call>`) is ever matched, so a tool's output cannot forge a role boundary. Special tokens are
  not parsed (`split_special_tokens`); where a non-special added token still matched, the text is split at every
  added token's string, each is spelled as its first character and the rest, and the pieces are tokenized in one
  batch call: one pass, linear in the text, whatever number of look-alikes it holds. With `max_tokens`, only a
  prefix of the text long enough for that many tokens is tokenized (`encode_prefix`): a 10 MiB observation costs
  what its first few thousand characters cost.
"""

from __future__ import annotations

import json
import re
from typing import Any

_MARGIN = 8  # tokens past the cut: a prefix's last tokens may differ from the whole text's (a merge cut in two)


def clean_text(text: Any) -> str:
    """`text` as a str of valid UTF-8: lone surrogates replaced by '?'; a str subclass as a plain str; anything
    else (never expected) by its type name."""
    if not isinstance(text, str):
        return f"<{type_name(text)}>"
    text = str.__str__(text)
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="replace").decode("utf-8")


def type_name(x: Any) -> str:
    """The name of x's type for a message; total (a metaclass may make even the name raise)."""
    try:
        name = type(x).__name__
        return name if isinstance(name, str) else "object"
    except Exception:  # noqa: BLE001 -- a metaclass may make even the type's name raise
        return "object"


def result_text(out: Any) -> str:
    """A tool's return value as the text the model reads, for any value: a string as is, bytes decoded (invalid
    UTF-8 replaced), anything else as JSON, else str(); what neither can show (an int past Python's 4,300-digit
    str limit, a container nested past the recursion limit, an object whose __str__ raises) is named by its type.
    Always valid UTF-8 (clean_text)."""
    try:
        if isinstance(out, bytes | bytearray | memoryview):
            return clean_text(bytes(out).decode("utf-8", errors="replace"))
        if isinstance(out, str):
            return clean_text(out)
        try:
            return clean_text(json.dumps(out, ensure_ascii=False))
        except (TypeError, ValueError, RecursionError):
            return clean_text(str(out))
    except Exception:  # noqa: BLE001 -- any value a tool returns must render, or be named: never raise
        return _unshowable(out)


def _unshowable(out: Any) -> str:
    if isinstance(out, int) and not isinstance(out, bool):
        return f"<int of {out.bit_length()} bits, too large to print>"
    return f"<{clean_text(type_name(out))} that cannot be shown as text>"


class _Added:
    """What encode_plain needs of a tokenizer's added tokens, computed once per tokenizer."""

    def __init__(self, tokenizer):
        added = getattr(tokenizer, "added_tokens_encoder", {}) or {}
        self.ids = frozenset(added.values())
        texts = sorted((t for t in added if t), key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, texts))) if texts else None


_ADDED: dict[int, tuple[Any, int, _Added]] = {}


def _added(tokenizer) -> _Added:
    """The tokenizer's _Added, rebuilt when its vocabulary grew (len() is cheap; added_tokens_encoder builds a
    dict on every read, which would cost each encoding)."""
    key, size = id(tokenizer), len(tokenizer)
    hit = _ADDED.get(key)
    if hit is None or hit[0] is not tokenizer or hit[1] != size:
        hit = (tokenizer, size, _Added(tokenizer))
        _ADDED[key] = hit
    return hit[2]


def _batch(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True).input_ids


def encode_plain(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """Ids of `text` as plain text (module docstring); with `max_tokens`, of a prefix that holds more than that
    many tokens where the text does (encode_prefix; the caller cuts). Total: any str, of any length or content."""
    if max_tokens is None:
        return _plain(tokenizer, clean_text(text))
    return encode_prefix(tokenizer, text, max_tokens)[0]


def encode_prefix(tokenizer, text: str, max_tokens: int) -> tuple[list[int], bool]:
    """(plain ids of a prefix of `text`, whether that prefix is the whole text). The prefix tried first is 4
    characters a token, doubled while it encodes to no more than max_tokens + a margin: O(budget) for ordinary
    text and for runs of look-alikes (counted as the plain tokens they become), O(text) at worst, never more;
    the rest of the text is never read."""
    text = text if isinstance(text, str) else clean_text(text)
    n = max(int(max_tokens), 0) * 4 + 64
    while n < len(text):
        ids = _plain(tokenizer, clean_text(text[:n]))
        if len(ids) > max_tokens + _MARGIN:
            return ids, False
        n *= 2
    return _plain(tokenizer, clean_text(text)), True


def _plain(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    (ids,) = _batch(tokenizer, [text])
    added = _added(tokenizer)
    if added.pattern is None or added.ids.isdisjoint(ids):
        return ids
    pieces, pos = [], 0
    for m in added.pattern.finditer(text):
        tok = m.group()
        pieces += [text[pos : m.start()], tok[:1], tok[1:]]
        pos = m.end()
    pieces.append(text[pos:])
    distinct = list(dict.fromkeys(p for p in pieces if p))
    encoded = dict(zip(distinct, _batch(tokenizer, distinct), strict=True))
    for piece, piece_ids in encoded.items():
        if not added.ids.isdisjoint(piece_ids):  # matched anyway (normalisation, overlapping tokens): per character
            encoded[piece] = [i for ch_ids in _batch(tokenizer, list(piece)) for i in ch_ids]
    return [i for p in pieces if p for i in encoded[p]]


def encode_observation(tokenizer, text: str, max_tokens: int) -> tuple[list[int], bool]:
    """(ids, cut): a text observation as plain ids, at most max_tokens of them, and whether it was longer."""
    ids, _ = encode_prefix(tokenizer, text, max_tokens)
    return ids[:max_tokens], len(ids) > max_tokens


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """The content of the last complete <tag>...</tag>, stripped; None without one. Exactly the last pair
    re.finditer(rf"<{tag}>(.*?)</{tag}>", text, re.S) finds, in one pass: that pattern rescans the rest of the
    text from every unclosed <tag> (quadratic: 0.5 s on 2,500 of them, 8 s on 10,000)."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    found, pos = None, 0
    while (start := text.find(opening, pos)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:  # no later opening tag is closed either
            break
        found, pos = text[start + len(opening) : end], end + len(closing)
    return None if found is None else found.strip()

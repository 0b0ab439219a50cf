"""The chat template's token layout: the turn an environment appends after a sampled turn, as the tokenizer's chat
template writes it, token-exact (the tool turn of a ToolEnvironment, the user turn of a verifiers Env). Beside
encode_plain (text.py), which tokenizes the text runs between the template's structure tokens.

How the appended turn stays exact: the template renders a probe conversation with sentinels in place of the
assistant's text and of the appended messages; the text after the assistant sentinel is the appended turn. It is
split at the tokenizer's added tokens (the template's own structure: `<|im_end|>`, `<|im_start|>`, which keep their
ids) and the runs between them, the messages included, are tokenized as plain text (`encode_plain`), which is how
the tokenizer itself splits a full rendering, so for an ordinary message the ids equal the template's tokenization
of the whole conversation, while a message's look-alike of a control token stays plain text. The sampled ids are
never re-encoded: when the turn ended with the token the template closes an assistant turn with (`<|im_end|>`),
that token is not appended again. A tokenizer without a chat template, or one whose renderings are not prefixes of
each other (a template that rewrites earlier turns), is refused in one line (ChatTemplateError).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rl_training.base.errors import UserError, one_line
from rl_training.data.text import encode_plain, encode_prefix

TRUNCATED = "\n[truncated]"  # the marker after a message cut to its share of multiturn.max_obs_tokens
_SENT_A = "@@rlt-assistant@@"  # sentinels of the probe conversations
_SENT_R = "@@rlt-result-{}@@"


class ChatTemplateError(UserError, ValueError):
    """The tokenizer cannot serve a chat environment (no chat template, no prefix property)."""


class ChatTurnFormat:
    """The tokenizer's chat template around the messages of one `role` appended after a sampled turn."""

    role = "user"
    what = "a user turn"  # what the error messages call the appended turn
    error: type[ChatTemplateError] = ChatTemplateError
    schemas: list[dict] | None = None  # the tools the template renders (ToolEnvironment's)

    def __init__(self, tokenizer, head: str):
        self.tok, self.head = tokenizer, head
        self._layouts: dict[int, list[tuple[str, Any]]] = {}
        self.check()

    def render(self, messages: list[dict], generation_prompt: bool, tools: bool = True) -> str:
        return self.tok.apply_chat_template(
            messages, tools=self.schemas if tools else None, add_generation_prompt=generation_prompt, tokenize=False
        )

    def message(self, content: str) -> dict:
        return {"role": self.role, "content": content}

    def check_prompt(self, user: list[dict], prompt: str) -> None:
        """What else the template's prompt must show (ChatToolFormat: the tools)."""

    def check(self) -> None:
        """`error` (one line) unless the template renders the appended turn, and the rendering of a conversation
        is the rendering of its beginning plus what was added (the prefix property the token-in token-out episode
        relies on)."""
        head = self.head
        if not getattr(self.tok, "chat_template", None):
            raise self.error(f"{head} has no chat template")
        user = [{"role": "user", "content": "Q"}]
        try:
            prompt = self.render(user, True)
            self.check_prompt(user, prompt)
            one = [*user, {"role": "assistant", "content": _SENT_A}, self.message(_SENT_R.format(0))]
            two = [*one, {"role": "assistant", "content": "B"}, self.message(_SENT_R.format(1))]
            first, second = self.render(one, True), self.render(two, True)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 -- whatever a template raises (TemplateError, a role it refuses)
            raise self.error(f"{head} cannot render {self.what}: {one_line(e)}") from None
        if not first.startswith(prompt + _SENT_A) or not second.startswith(first + "B"):
            raise self.error(
                f"{head} renders a conversation that is not its prompt + the assistant's text + {self.what}"
            )
        self._layout(1)  # the sentinels survive the template (it does not rewrite a message's content)

    def _layout(self, k: int) -> list[tuple[str, Any]]:
        """The appended turn of k messages after an assistant turn: ('id', structure token id) | ('text', structure
        text) | ('slot', message index), in order, from the closing of the assistant turn through the next
        generation prompt."""
        if k in self._layouts:
            return self._layouts[k]
        sents = [_SENT_R.format(i) for i in range(k)]
        conv = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _SENT_A}]
        full = self.render([*conv, *map(self.message, sents)], True)
        if full.count(_SENT_A) != 1 or any(full.count(s) != 1 for s in sents):
            raise self.error(f"{self.head} has a chat template that rewrites a {self.role}'s content")
        tail = full[full.index(_SENT_A) + len(_SENT_A) :]
        added = sorted(self.tok.added_tokens_encoder, key=len, reverse=True)
        split = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        parts: list[tuple[str, Any]] = []
        for i, s in enumerate([*sents, None]):
            piece, tail = tail.split(s, 1) if s else (tail, "")
            for j, chunk in enumerate(split.split(piece) if split else [piece]):
                if j % 2:  # a captured added token: the template's own structure keeps its id
                    parts.append(("id", self.tok.added_tokens_encoder[chunk]))
                elif chunk:
                    parts.append(("text", chunk))
            if s:
                parts.append(("slot", i))
        self._layouts[k] = parts
        return parts

    def turn_ids(self, texts: Sequence[str], sampled: Sequence[int]) -> list[int]:
        """Ids of the turn carrying `texts`, after a turn that sampled `sampled`: structure tokens keep their ids,
        each text run (the messages inside) is plain text; the assistant's closing token is left out when the turn
        sampled it."""
        parts = self._layout(len(texts))
        if parts and parts[0][0] == "id" and sampled and sampled[-1] == parts[0][1]:
            parts = parts[1:]
        ids: list[int] = []
        run = ""
        for kind, v in parts:
            if kind == "id":
                ids += [*encode_plain(self.tok, run), v]
                run = ""
            else:
                run += v if kind == "text" else texts[v]
        return ids + encode_plain(self.tok, run)

    def truncate(self, text: str, cap: int) -> tuple[str, bool]:
        """`text` cut to at most `cap` plain tokens, ending with the TRUNCATED marker where the cap holds it (an
        empty text where it does not), or as is. Only a prefix of a long text is tokenized (encode_plain's
        max_tokens), so the cost follows the cap, not the text."""
        ids, whole = encode_prefix(self.tok, text, cap)
        if whole and len(ids) <= cap:
            return text, False
        marker = len(encode_plain(self.tok, TRUNCATED))
        if cap < marker:
            return "", True
        keep = cap - marker
        head = self.tok.decode(ids[:keep], clean_up_tokenization_spaces=False)
        for _ in range(16):  # a character cut in two decodes as U+FFFD, which may take more tokens: shorten
            over = len(encode_plain(self.tok, head)) - keep
            if over <= 0:
                return head + TRUNCATED, True
            head = head[: -max(over // 2, 1)]  # a character is at least one token: never cuts more than needed
        return TRUNCATED, True

    def fitted(self, texts: Sequence[str], sampled: Sequence[int], limit: int) -> tuple[list[int], int]:
        """(ids, how many texts were cut): the turn's ids within `limit` wherever its structure alone fits, each
        text cut to an equal share of what the structure leaves (a text run can tokenize a few ids longer than its
        parts: the share shrinks until it fits), at worst every text empty."""
        fixed = len(self.turn_ids([""] * len(texts), sampled))
        cap = max((limit - fixed) // len(texts), 0)
        while True:  # the cap falls every round; at 0 every text is empty
            cut = [self.truncate(t, cap) for t in texts]
            ids = self.turn_ids([t for t, _ in cut], sampled)
            if len(ids) <= limit or cap == 0:
                return ids, sum(c for _, c in cut)
            cap = max(min(cap - 1, cap - (len(ids) - limit + len(texts) - 1) // len(texts)), 0)

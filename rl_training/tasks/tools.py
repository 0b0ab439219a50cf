"""Chat-template tool calling as an Environment: tools are Python functions, declared to the model through the
tokenizer's own chat template, called with Hermes/Qwen `<tool_call>` blocks, answered with the template's tool
turn (docs/tools.md has the protocol, the metrics and the limits).

    def calculator(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: The first addend.
            b: The second addend.
        '''
        return a + b

    class AddWithTool(ToolEnvironment):
        tools = (calculator,)
        def reward(self, completion, example):
            return float(final_text(completion).strip() == example.reference)

One episode: the prompt is `apply_chat_template([system?, user], tools=<schemas>, add_generation_prompt=True)`;
each sampled turn's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (one or several) are run
in order and their results appended as the template's tool turn, up to and including the next generation
prompt; a turn without a tool call ends the episode. Bad tool use (class in brackets: malformed JSON [json], an
unknown tool [unknown_tool], wrong or missing arguments [arguments], a tool that raises [raised] or runs past
`tool_timeout_s` [timeout], a call past `max_tool_calls` per episode [too_many]) is answered with an error
message as that call's result and counted; it never stops the run.

How the tool turn stays exact (ChatToolFormat): the template renders a probe conversation with sentinels in
place of the assistant's text and the results; the text after the assistant sentinel is the tool turn. It is
split at the tokenizer's added tokens (the template's own structure: `<|im_end|>`, `<|im_start|>`, which keep
their ids) and the runs between them, results included, are tokenized as plain text (`encode_plain`), which is
how the tokenizer itself splits a full rendering, so for an ordinary result the ids equal the template's
tokenization of the whole conversation, while a result's look-alike of a control token stays plain text. The
sampled ids are never re-encoded: when the turn ended with the token the template closes an assistant turn with
(`<|im_end|>`), that token is not appended again. Startup refuses a tokenizer without a chat template, one whose
template ignores `tools=`, and one whose renderings are not prefixes of each other (ToolTemplateError).
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_training.base.errors import UserError, one_line
from rl_training.data.sources import Example
from rl_training.tasks.base import Environment, RewardTimeout, Step, TaskContext, Turn, time_limit

ERROR_CLASSES = ("json", "unknown_tool", "arguments", "raised", "timeout", "too_many")
TRUNCATED = "\n[truncated]"  # the marker after a result cut to its share of multiturn.max_obs_tokens
MAX_OBS_TOKENS = 512  # multiturn.max_obs_tokens's default, used outside a run
_SENT_A = "@@rlt-assistant@@"  # sentinels of the probe conversations (ChatToolFormat)
_SENT_R = "@@rlt-result-{}@@"
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


class ToolFailed(Exception):
    """Raised by a tool (or ToolEnvironment.invoke) for a failure whose `text` is the whole result, counted under
    `cls` (one of the environment's error_classes)."""

    def __init__(self, cls: str, text: str):
        super().__init__(text)
        self.cls, self.text = cls, text


class ToolTemplateError(UserError, ValueError):
    """The tokenizer cannot serve a ToolEnvironment (no chat template, no tool support, no prefix property)."""


# ------------------------------------------------------------------------------------------------ tokenizing
def encode_plain(tokenizer, text: str) -> list[int]:
    """Ids of `text` as data: no added token (special, such as <|im_end|>, or not, such as Qwen2.5's <tool_call>)
    is ever matched, so a tool's output cannot forge a role boundary. Special tokens are not parsed
    (split_special_tokens); where a non-special added token still matched, its text is encoded in two pieces
    (its first character, then the rest), which spells the same text in plain tokens."""
    if not text:
        return []
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
    added = tokenizer.added_tokens_encoder
    if len(text) == 1 or set(added.values()).isdisjoint(ids):
        return ids
    m = re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True)))).search(text)
    if m is None:  # matched through normalisation: nothing better to do than the tokenizer's own answer
        return ids
    tok = m.group()
    return (
        encode_plain(tokenizer, text[: m.start()])
        + encode_plain(tokenizer, tok[:1])
        + encode_plain(tokenizer, tok[1:])
        + encode_plain(tokenizer, text[m.end() :])
    )


def result_text(out: Any) -> str:
    """A tool's return value as the text the model reads: a string as is, bytes decoded (invalid UTF-8 replaced),
    anything else as JSON (str() when it is not JSON). Lone surrogates become '?': every tokenizer can take it."""
    if isinstance(out, bytes | bytearray):
        text = bytes(out).decode("utf-8", errors="replace")
    elif isinstance(out, str):
        text = out
    else:
        try:
            text = json.dumps(out, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(out)
    return text.encode("utf-8", errors="replace").decode("utf-8")


# ----------------------------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str = ""  # why the block is not a call (class json); then name/arguments are empty


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call> block of a turn, in order: {"name": str, "arguments": object (or a JSON string of
    one; absent = {})}. A block that is not that (bad JSON, unclosed at the end of the turn) is a ToolCall with
    its `error`."""
    calls = []
    for m in _CALL.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            calls.append(ToolCall("", {}, "malformed tool call: <tool_call> without </tool_call>"))
            continue
        try:
            obj = json.loads(body)
            args = obj.get("arguments", {}) if isinstance(obj, dict) else None
            if isinstance(args, str):
                args = json.loads(args)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"malformed tool call JSON ({e.msg} at char {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            calls.append(ToolCall("", {}, 'malformed tool call: expected {"name": string, "arguments": object}'))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


def final_text(completion: str) -> str:
    """What an episode's sampled text says after its last tool call (its answer)."""
    return completion.rsplit("</tool_call>", 1)[-1]


# ---------------------------------------------------------------------------------------------- running
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def argument_problem(fn: Callable, schema: dict, arguments: dict) -> str:
    """Why `arguments` do not fit the tool ('' when they do): the signature (missing, unexpected) and the JSON
    types and enums of its schema's parameters."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return str(e)
    props = schema["function"].get("parameters", {}).get("properties", {})
    for k, v in arguments.items():
        spec = props.get(k, {})
        types = spec.get("type")
        types = [types] if isinstance(types, str) else types or []
        if types and not any(_JSON_TYPES.get(t, lambda _: True)(v) for t in types):
            return f"argument {k!r} must be {' or '.join(types)}, got {type(v).__name__} {json.dumps(v)[:40]}"
        if "enum" in spec and v not in spec["enum"]:
            return f"argument {k!r} must be one of {spec['enum']}, got {json.dumps(v)[:40]}"
    return ""


def run_limited(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn() under a time limit (RewardTimeout past it): SIGALRM in the main thread (base.time_limit); elsewhere
    a daemon thread that is abandoned, still running, when it is late."""
    if threading.current_thread() is threading.main_thread():
        with time_limit(timeout_s):
            return fn()
    box: dict[str, Any] = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread as is
            box["err"] = e

    t = threading.Thread(target=target, name="tool-call", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RewardTimeout
    if "err" in box:
        raise box["err"]
    return box["out"]


# ------------------------------------------------------------------------------------------ the template
class ChatToolFormat:
    """The tokenizer's chat template with tools: the prompt text, and a tool turn's ids (module docstring)."""

    def __init__(self, tokenizer, schemas: list[dict]):
        self.tok, self.schemas = tokenizer, schemas
        self._layouts: dict[int, list[tuple[str, Any]]] = {}
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        self.head = f"a ToolEnvironment needs a chat template with tool support (docs/tools.md): tokenizer {name!r}"
        self.check()

    def render(self, messages: list[dict], generation_prompt: bool, tools: bool = True) -> str:
        return self.tok.apply_chat_template(
            messages, tools=self.schemas if tools else None, add_generation_prompt=generation_prompt, tokenize=False
        )

    def check(self) -> None:
        """ToolTemplateError (one line) unless the template renders tools and a tool turn, and the rendering of
        a conversation is the rendering of its beginning plus what was added (the prefix property the token-in
        token-out episode relies on)."""
        head = self.head
        if not getattr(self.tok, "chat_template", None):
            raise ToolTemplateError(f"{head} has no chat template")
        user = [{"role": "user", "content": "Q"}]
        try:
            prompt = self.render(user, True)
            if prompt == self.render(user, True, tools=False):
                raise ToolTemplateError(f"{head} has a chat template that ignores tools= (same prompt without them)")
            one = [*user, {"role": "assistant", "content": _SENT_A}, _tool_message(_SENT_R.format(0))]
            two = [*one, {"role": "assistant", "content": "B"}, _tool_message(_SENT_R.format(1))]
            first, second = self.render(one, True), self.render(two, True)
        except ToolTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 -- whatever a template raises (TemplateError, a role it refuses)
            raise ToolTemplateError(f"{head} cannot render a tool turn: {one_line(e)}") from None
        if not first.startswith(prompt + _SENT_A) or not second.startswith(first + "B"):
            raise ToolTemplateError(
                f"{head} renders a conversation that is not its prompt + the assistant's text + the tool turn"
            )
        self._layout(1)  # the sentinels survive the template (it does not rewrite a tool's content)

    def _layout(self, k: int) -> list[tuple[str, Any]]:
        """The tool turn of k results after an assistant turn: ('id', structure token id) | ('text', structure
        text) | ('slot', result index), in order, from the closing of the assistant turn through the next
        generation prompt."""
        if k in self._layouts:
            return self._layouts[k]
        sents = [_SENT_R.format(i) for i in range(k)]
        conv = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _SENT_A}]
        full = self.render([*conv, *map(_tool_message, sents)], True)
        if full.count(_SENT_A) != 1 or any(full.count(s) != 1 for s in sents):
            raise ToolTemplateError(f"{self.head} has a chat template that rewrites a tool's content")
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

    def tool_turn(self, results: Sequence[str], sampled: Sequence[int]) -> list[int]:
        """Ids of the tool turn carrying `results`, after a turn that sampled `sampled`: structure tokens keep
        their ids, each text run (results inside) is plain text; the assistant's closing token is left out
        when the turn sampled it."""
        parts = self._layout(len(results))
        if parts and parts[0][0] == "id" and sampled and sampled[-1] == parts[0][1]:
            parts = parts[1:]
        ids: list[int] = []
        run = ""
        for kind, v in parts:
            if kind == "id":
                ids += [*encode_plain(self.tok, run), v]
                run = ""
            else:
                run += v if kind == "text" else results[v]
        return ids + encode_plain(self.tok, run)

    def truncate(self, text: str, cap: int) -> tuple[str, bool]:
        """`text` cut to at most `cap` plain tokens with the TRUNCATED marker (inside the cap), or as is. A huge
        text is first cut by characters (16 per token allowed), so its tokenization stays cheap."""
        pre = text[: cap * 16 + 64]
        ids = encode_plain(self.tok, pre)
        if len(ids) <= cap and len(pre) == len(text):
            return text, False
        keep = max(cap - len(encode_plain(self.tok, TRUNCATED)), 0)
        head = self.tok.decode(ids[:keep], clean_up_tokenization_spaces=False)
        while head and len(encode_plain(self.tok, head)) > keep:  # a character cut in two decodes as U+FFFD
            head = head[:-1]
        return head + TRUNCATED, True


def _tool_message(content: str) -> dict:
    return {"role": "tool", "content": content}


# -------------------------------------------------------------------------------------------- metrics
@dataclass
class ToolStats:
    """One generate call's tool counters (Environment.call_stats), summed across ranks: tool/calls (every
    <tool_call> block), tool/errors_<class>, tool/timeouts (= errors_timeout), tool/obs_tokens (tool-turn
    tokens appended) and tool/truncated (results cut to their share of multiturn.max_obs_tokens)."""

    calls: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_CLASSES, 0))
    obs_tokens: int = 0
    truncated: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "tool/calls": float(self.calls),
            **{f"tool/errors_{k}": float(v) for k, v in self.errors.items()},
            "tool/timeouts": float(self.errors["timeout"]),
            "tool/obs_tokens": float(self.obs_tokens),
            "tool/truncated": float(self.truncated),
        }


@dataclass
class ToolEpisode:
    """A ToolEnvironment episode's state."""

    example: Example
    calls: int = 0  # <tool_call> blocks so far, the malformed ones included


# ------------------------------------------------------------------------------------------- environment
class ToolEnvironment(Environment):
    """An Environment whose actions are tool calls. Set `tools` (functions with type hints and a Google-style
    docstring: transformers.utils.get_json_schema makes their schemas) and grade with `reward` as any task does
    (`completion` is the sampled text, tool calls included; `final_text` is what follows the last one)."""

    tools: tuple[Callable, ...] = ()
    episode_counts = ("tool_calls", "tool_errors", "used_tools")
    error_classes: tuple[str, ...] = ERROR_CLASSES  # a subclass may add its own (ToolFailed), never drop one

    def __init__(
        self,
        max_tool_calls: int = 4,
        tool_timeout_s: float = 5.0,
        max_obs_tokens: int | None = None,
        tools: Sequence[Callable] | None = None,
        empty_results: bool = False,
    ):
        from transformers.utils import get_json_schema

        if tools is not None:
            self.tools = tuple(tools)
        if not self.tools:
            raise ValueError(f"{type(self).__name__} declares no tools")
        if max_tool_calls < 1 or tool_timeout_s <= 0:
            raise ValueError(
                f"max_tool_calls must be >= 1 and tool_timeout_s > 0, got {max_tool_calls}, {tool_timeout_s}"
            )
        self.max_tool_calls, self.tool_timeout_s = max_tool_calls, tool_timeout_s
        self.max_obs_tokens = max_obs_tokens  # None: multiturn.max_obs_tokens of the run (start)
        # The ablation "does the tool's output matter?": a well-formed call is answered with an empty result and
        # the tool never runs (bad calls are still errors, counted as usual).
        self.empty_results = bool(empty_results)
        self.schemas, self.by_name = [], {}
        for fn in self.tools:
            try:
                schema = get_json_schema(fn)
            except Exception as e:  # noqa: BLE001 -- transformers' TypeError / DocstringParsingException
                raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: {one_line(e)}") from None
            name = schema["function"]["name"]
            if name in self.by_name:
                raise ValueError(f"two tools are named {name!r}")
            self.schemas.append(schema)
            self.by_name[name] = (fn, schema)
        self.fmt: ChatToolFormat | None = None

    # ------------------------------------------------------------------------------------------- startup
    def start(self, ctx: TaskContext | None = None) -> None:
        """Check the tokenizer's template (ToolTemplateError) and take multiturn.max_obs_tokens."""
        if ctx is not None and ctx.tokenizer is not None:
            self.format_for(ctx.tokenizer)
        if self.max_obs_tokens is None:
            multiturn = getattr(getattr(ctx, "cfg", None), "multiturn", None)
            self.max_obs_tokens = getattr(multiturn, "max_obs_tokens", MAX_OBS_TOKENS)
        if self.fmt is not None:  # a cap below the tool turn's own tokens would cut the template's structure
            from rl_training.config.schema import ConfigError

            fixed = len(self.fmt.tool_turn([""], []))
            if self.max_obs_tokens <= fixed:
                raise ConfigError(
                    f"max_obs_tokens={self.max_obs_tokens} cannot hold this template's tool turn ({fixed} tokens "
                    f"around the result): raise multiturn.max_obs_tokens (or task.args.max_obs_tokens) to at least "
                    f"{fixed + 1}, better {fixed + 64}"
                )

    def format_for(self, tokenizer) -> ChatToolFormat:
        if self.fmt is None or self.fmt.tok is not tokenizer:
            self.fmt = ChatToolFormat(tokenizer, self.schemas)
        return self.fmt

    def render_prompt(self, example: Example, tokenizer, data) -> str:
        """data.prompt_template around the question as the user turn (after data.system_prompt's system turn),
        rendered by the chat template with the tools (data.use_chat_template is implied)."""
        text = data.prompt_template.replace("{question}", example.question)
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        return self.format_for(tokenizer).render([*messages, {"role": "user", "content": text}], True)

    # ------------------------------------------------------------------------------------------ episodes
    def reset(self, example: Example) -> ToolEpisode:
        return ToolEpisode(example)

    def call_stats(self) -> ToolStats:
        return ToolStats(errors=dict.fromkeys(self.error_classes, 0))

    def step_batch(self, states: list, turns: list[Turn], stats: ToolStats) -> list[Step]:
        return [self.tool_step(s, t, stats) for s, t in zip(states, turns, strict=True)]

    def tool_step(self, ep: ToolEpisode, turn: Turn, stats: ToolStats) -> Step:
        """A turn without a tool call ends the episode; else every call is answered in one tool turn."""
        calls = parse_tool_calls(turn.text)
        if not calls:
            return Step(done=True)
        if turn.exhausted:  # no room to sample after it: the engine ends the episode truncated
            return Step()
        if self.fmt is None:
            raise RuntimeError(f"{type(self).__name__}.step_batch before start() or render_prompt(): no tokenizer")
        first, results, errors = ep.calls == 0, [], 0
        for call in calls:
            ep.calls += 1
            text, err = self.call(call, ep.calls, ep)
            stats.calls += 1
            if err:
                stats.errors[err] += 1
                errors += 1
            results.append(text)
        ids, cut = self._observation(results, turn.ids)
        stats.obs_tokens += len(ids)
        stats.truncated += cut
        return Step(ids, counts={"tool_calls": len(calls), "tool_errors": errors, "used_tools": float(first)})

    def call(self, call: ToolCall, nth: int, ep: ToolEpisode | None = None) -> tuple[str, str]:
        """(result text, error class or '') of the episode's nth call."""
        if nth > self.max_tool_calls:
            return f"error: more than max_tool_calls={self.max_tool_calls} tool calls in this episode", "too_many"
        if call.error:
            return f"error: {call.error}", "json"
        if call.name not in self.by_name:
            return f"error: unknown tool {call.name[:60]!r} (tools: {', '.join(self.by_name)})", "unknown_tool"
        fn, schema = self.by_name[call.name]
        problem = argument_problem(fn, schema, call.arguments)
        if problem:
            return f"error: {call.name}: {problem}", "arguments"
        if self.empty_results:
            return "", ""
        try:
            out = self.invoke(ep, fn, call.arguments)
        except ToolFailed as e:
            return e.text, e.cls
        except RewardTimeout:
            return f"error: {call.name} timed out after {self.tool_timeout_s:g} s", "timeout"
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- a user's tool may raise anything: an observation
            return f"error: {call.name} raised {one_line(e)}", "raised"
        return result_text(out), ""

    def invoke(self, ep: ToolEpisode | None, fn: Callable, arguments: dict) -> Any:
        """One checked call's return value: fn under tool_timeout_s. A tool with per-episode state or a time limit
        of its own (the python tool's sandbox deadline) overrides it."""
        return run_limited(lambda: fn(**arguments), self.tool_timeout_s)

    def _observation(self, results: list[str], sampled: list[int]) -> tuple[list[int], int]:
        """The tool turn's ids within max_obs_tokens: each result cut to an equal share of what the structure
        leaves (a text run can tokenize a few ids longer than its parts: the share shrinks until it fits)."""
        fmt, limit = self.fmt, self.max_obs_tokens or MAX_OBS_TOKENS
        fixed = len(fmt.tool_turn([""] * len(results), sampled))
        cap = max((limit - fixed) // len(results), 0)
        for _ in range(4):
            cut = [fmt.truncate(r, cap) for r in results]
            ids = fmt.tool_turn([t for t, _ in cut], sampled)
            if len(ids) <= limit or cap == 0:
                break
            cap = max(cap - (len(ids) - limit + len(results) - 1) // len(results), 0)
        return ids, sum(c for _, c in cut)

    def episode_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["n"], 1.0)
        return {
            "rollout/tool_calls_mean": sums["tool_calls"] / n,
            "rollout/tool_errors_mean": sums["tool_errors"] / n,
            "rollout/tool_use_rate": sums["used_tools"] / n,
        }

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

How the tool turn stays exact is data/chat_turns.py's (ChatTurnFormat: the template's structure tokens keep their ids,
results are plain text, the sampled ids are never re-encoded). Startup refuses a tokenizer without a chat
template, one whose template ignores `tools=`, and one whose renderings are not prefixes of each other
(ToolTemplateError).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_training.base.errors import one_line
from rl_training.data.chat_turns import ChatTemplateError, ChatTurnFormat
from rl_training.data.sources import Example
from rl_training.data.text import clean_text, result_text
from rl_training.sandbox.tool_process import ToolFailed, ToolProcess
from rl_training.tasks.base import Environment, RewardTimeout, Step, TaskContext, Turn

ERROR_CLASSES = ("json", "unknown_tool", "arguments", "raised", "timeout", "too_many", "crash")
MAX_OBS_TOKENS = 512  # multiturn.max_obs_tokens's default, used outside a run
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder()
_CLOSE_AFTER = re.compile(r"\s*</tool_call>")
_SPACE = re.compile(r"\s*")


class ToolTemplateError(ChatTemplateError):
    """The tokenizer cannot serve a ToolEnvironment (no chat template, no tool support, no prefix property)."""


# ------------------------------------------------------------------------------------------------ rendering
def preview(value: Any, n: int = 40) -> str:
    """The first n characters of a JSON value's text, for an error message: total (huge ints, deep nesting)."""
    try:
        return clean_text(json.dumps(value, ensure_ascii=False))[:n]
    except (TypeError, ValueError, RecursionError):
        return result_text(value)[:n]


# ----------------------------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str = ""  # why the block is not a call (class json); then name/arguments are empty


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call> block of a turn, in order (scan_tool_calls without a limit)."""
    return scan_tool_calls(text)[0]


def scan_tool_calls(text: str, limit: int | None = None) -> tuple[list[ToolCall], int]:
    """(the first `limit` <tool_call> blocks of a turn, how many more <tool_call> openings follow them). A block
    is {"name": str, "arguments": object (or a JSON string of one; absent = {})} closed by </tool_call>; the JSON
    is read as JSON, so a "</tool_call>" inside one of its strings does not end it. A block that is not that (bad
    JSON, text after the object, unclosed at the end of the turn) is a ToolCall with its `error`. Linear in the
    text per block read; total for any text."""
    calls: list[ToolCall] = []
    pos = 0
    while (i := text.find(_OPEN, pos)) >= 0:
        if limit is not None and len(calls) >= limit:
            return calls, text.count(_OPEN, i)
        call, pos = _read_block(text, i + len(_OPEN))
        calls.append(call)
    return calls, 0


def _read_block(text: str, start: int) -> tuple[ToolCall, int]:
    """The call whose body starts at `start`, and where the text after its block starts."""
    body = _SPACE.match(text, start).end()
    problem = ""
    try:
        obj, end = _JSON.raw_decode(text, body)
    except ValueError as e:  # JSONDecodeError, or an int past the str-conversion limit
        msg = getattr(e, "msg", None) or "invalid number"
        problem = f"malformed tool call JSON ({clean_text(msg)} at char {getattr(e, 'pos', body) - start})"
    except RecursionError:
        problem = "malformed tool call JSON (nested too deep)"
    else:
        close = _CLOSE_AFTER.match(text, end)
        if close is not None:
            return _as_call(obj), close.end()
        problem = "malformed tool call: text after the JSON object before </tool_call>"
    close_at = text.find(_CLOSE, start)
    if close_at < 0:
        return ToolCall("", {}, "malformed tool call: <tool_call> without </tool_call>"), len(text)
    return ToolCall("", {}, problem), close_at + len(_CLOSE)


def _as_call(obj: Any) -> ToolCall:
    args = obj.get("arguments", {}) if isinstance(obj, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return ToolCall("", {}, "malformed tool call: its arguments string is not JSON")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
        return ToolCall("", {}, 'malformed tool call: expected {"name": string, "arguments": object}')
    return ToolCall(obj["name"], args)


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
            return f"argument {k!r} must be {' or '.join(types)}, got {type(v).__name__} {preview(v)}"
        if "enum" in spec and v not in spec["enum"]:
            return f"argument {k!r} must be one of {spec['enum']}, got {preview(v)}"
    return ""


# ------------------------------------------------------------------------------------------ the template
class ChatToolFormat(ChatTurnFormat):
    """The tokenizer's chat template with tools: the prompt text, and a tool turn's ids (data/chat_turns.py)."""

    role, what, error = "tool", "a tool turn", ToolTemplateError

    def __init__(self, tokenizer, schemas: list[dict]):
        self.schemas = schemas
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        super().__init__(
            tokenizer, f"a ToolEnvironment needs a chat template with tool support (docs/tools.md): tokenizer {name!r}"
        )

    def check_prompt(self, user: list[dict], prompt: str) -> None:
        if prompt == self.render(user, True, tools=False):
            raise ToolTemplateError(f"{self.head} has a chat template that ignores tools= (same prompt without them)")

    def tool_turn(self, results: Sequence[str], sampled: Sequence[int]) -> list[int]:
        """Ids of the tool turn carrying `results`, after a turn that sampled `sampled` (turn_ids)."""
        return self.turn_ids(results, sampled)


# -------------------------------------------------------------------------------------------- metrics
@dataclass
class ToolStats:
    """One generate call's tool counters (Environment.call_stats), summed across ranks: tool/calls (every
    <tool_call> block), tool/errors_<class>, tool/timeouts (= errors_timeout) and tool/truncated (results cut to
    their share of multiturn.max_obs_tokens). tool/obs_tokens, the tool-turn tokens the engine appended, comes
    from the episodes (ToolEnvironment.episode_metrics)."""

    calls: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_CLASSES, 0))
    truncated: int = 0

    def measure(self, meter) -> None:
        """Into the step's meter (base/meter.py)."""
        meter.add("tool/calls", self.calls)
        for k, v in self.errors.items():
            meter.add(f"tool/errors_{k}", v)
        meter.add("tool/timeouts", self.errors["timeout"])
        meter.add("tool/truncated", self.truncated)


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
        self.process: ToolProcess | None = None  # the tools' own process (invoke), started by start()

    # ------------------------------------------------------------------------------------------- startup
    def start(self, ctx: TaskContext | None = None) -> None:
        """Check the tokenizer's template (ToolTemplateError) and settle the one observation budget: a tool turn is
        never cut by the episode engine, so task.args.max_obs_tokens, where given, must be multiturn's, and the
        budget must hold the largest tool turn's own tokens (ConfigError, one line, before any model loads)."""
        from rl_training.config.schema import ConfigError

        if ctx is not None and ctx.tokenizer is not None:
            self.format_for(ctx.tokenizer)
        engine = getattr(getattr(getattr(ctx, "cfg", None), "multiturn", None), "max_obs_tokens", None)
        if self.max_obs_tokens is None:
            self.max_obs_tokens = engine or MAX_OBS_TOKENS
        elif engine is not None and self.max_obs_tokens != engine:
            raise ConfigError(
                f"task.args.max_obs_tokens={self.max_obs_tokens} and multiturn.max_obs_tokens={engine} disagree: the "
                "episode engine cuts every observation at multiturn's, inside the tool turn's structure; set one "
                "budget, multiturn.max_obs_tokens"
            )
        if self.fmt is not None:
            k = self.max_results_per_turn
            fixed = len(self.fmt.tool_turn([""] * k, []))
            if self.max_obs_tokens < fixed:
                raise ConfigError(
                    f"max_obs_tokens={self.max_obs_tokens} cannot hold this template's largest tool turn ({fixed} "
                    f"tokens around {k} results: max_tool_calls={self.max_tool_calls} calls and the error past "
                    f"them): raise multiturn.max_obs_tokens to at least {fixed}, better {fixed + 64}, or lower "
                    "task.args.max_tool_calls"
                )
        if self.runs_tools_in_process and self.process is None:
            self.process = self._tool_process(start=True)  # a tool it cannot import: ConfigError now

    def _tool_process(self, start: bool = False) -> ToolProcess:
        from rl_training.config.schema import ConfigError

        try:
            process = ToolProcess([fn for fn, _ in self.by_name.values()], self.tool_timeout_s)
            if start:
                process.start()
            return process
        except ValueError as e:
            raise ConfigError(f"{type(self).__name__}: {e}") from None

    @property
    def runs_tools_in_process(self) -> bool:
        """The default invoke runs the tools in their own process; an environment that overrides invoke (the
        python tool's sandbox) or answers every call with nothing (empty_results) needs none."""
        return type(self).invoke is ToolEnvironment.invoke and not self.empty_results

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None

    @property
    def max_results_per_turn(self) -> int:
        """The most results one tool turn carries: the episode's max_tool_calls calls and one too_many error that
        counts every block past them (tool_step)."""
        return self.max_tool_calls + 1

    def format_for(self, tokenizer) -> ChatToolFormat:
        if self.fmt is None or self.fmt.tok is not tokenizer:
            self.fmt = ChatToolFormat(tokenizer, self.schemas)
        return self.fmt

    def render_prompt(self, example: Example, tokenizer, data) -> str:
        """data.prompt_template around the question as the user turn (after data.system_prompt's system turn),
        rendered by the chat template with the tools (data.use_chat_template is implied)."""
        text = self.template(data).replace("{question}", example.question)
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
        """A turn without a tool call ends the episode; else its calls are answered in one tool turn: each within
        the episode's max_tool_calls is run, and the first past them is answered with a too_many error that also
        counts the rest (which get no result of their own), so a turn holds at most max_results_per_turn."""
        calls, more = scan_tool_calls(turn.text, self.turn_limit(ep))
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
            if err == "too_many" and more:
                text += f" ({more} more <tool_call> blocks in this turn were not run)"
            stats.calls += 1
            if err:
                stats.errors[err] += 1
                errors += 1
            results.append(text)
        ep.calls += more
        stats.calls += more
        stats.errors["too_many"] += more
        ids, cut = self._observation(results, turn.ids)
        stats.truncated += cut
        n = len(calls) + more
        return Step(ids, counts={"tool_calls": n, "tool_errors": errors + more, "used_tools": float(first)})

    def turn_limit(self, ep: ToolEpisode) -> int:
        """The blocks of this episode's next turn that get a result of their own (tool_step)."""
        return max(self.max_tool_calls - ep.calls, 0) + 1

    def call(self, call: ToolCall, nth: int, ep: ToolEpisode | None = None) -> tuple[str, str]:
        """(result text, error class or '') of the episode's nth call; the text is valid UTF-8 on every path."""
        text, err = self._call(call, nth, ep)
        return clean_text(text), err

    def _call(self, call: ToolCall, nth: int, ep: ToolEpisode | None) -> tuple[str, str]:
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
            return result_text(e.text), e.cls if e.cls in self.error_classes else "raised"
        except RewardTimeout:
            return f"error: {call.name} timed out after {self.tool_timeout_s:g} s", "timeout"
        except (Exception, SystemExit) as e:  # noqa: BLE001 -- a user's tool may raise anything: an observation
            return f"error: {call.name} raised {one_line(e)}", "raised"
        return result_text(out), ""

    def invoke(self, ep: ToolEpisode | None, fn: Callable, arguments: dict) -> Any:
        """One checked call's result: fn(**arguments) in the tools' own process (sandbox/tool_process.py), rendered
        there; past tool_timeout_s that process is killed with everything it started, whatever the tool catches, and
        the call is a timeout. Failures come back as ToolFailed. A tool with per-episode state or a limit of its own
        (the python tool's sandbox) overrides it."""
        if self.process is None:  # used without start() (a script, a test): started on first use
            self.process = self._tool_process()
        text, err = self.process.call(fn.__name__, arguments)
        if err:
            raise ToolFailed(err, text)
        return text

    def _observation(self, results: list[str], sampled: list[int]) -> tuple[list[int], int]:
        """The tool turn's ids within max_obs_tokens, always (ChatTurnFormat.fitted: at worst every result empty,
        which start() made sure fits)."""
        return self.fmt.fitted(results, sampled, self.max_obs_tokens or MAX_OBS_TOKENS)

    def episode_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["n"], 1.0)
        return {
            "rollout/tool_calls_mean": sums["tool_calls"] / n,
            "rollout/tool_errors_mean": sums["tool_errors"] / n,
            "rollout/tool_use_rate": sums["used_tools"] / n,
            "tool/obs_tokens": sums["obs_tokens"],  # what the engine appended (every observation is a tool turn)
        }

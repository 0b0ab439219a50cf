"""An Env subclass's `run(task, agents)` played turn by turn by the episode engine: VerifiersEnvironment.

The run goes on an event loop of the sampling thread; its one seat's `interaction.turn(...)` suspends it until the
engine has sampled that turn (_Episode.advance / replied), and the user messages it passes are the next
observation, the chat template's user turn (data/chat_turns.py). Each episode's trace is filed under its sampled text
(_Traces), which is what `grade` is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from typing import Any

from rl_training.data.chat_turns import ChatTurnFormat
from rl_training.data.sources import Example
from rl_training.tasks.base import Environment, Step, TaskContext, Turn
from rl_training.tasks.verifiers_env import FAMILY, NotRunnable
from rl_training.tasks.verifiers_env.task import VerifiersTask, add_messages, new_trace, prompt_messages

MAX_TRACES = 8192  # episodes' traces kept for grading (oldest dropped): several generate calls' worth
MAX_OBS_TOKENS = 512  # multiturn.max_obs_tokens's default, used outside a run


class _Traces:
    """Episodes' traces by (problem, sampled text): what `grade` finds for the text it is given (the same text
    the engine's Rollouts carry: all sampled ids decoded). Identical texts of one problem queue in order."""

    def __init__(self):
        self._by_key: OrderedDict[tuple, list] = OrderedDict()
        self._lock = threading.Lock()  # the sampling thread adds while the trainer's thread grades

    def put(self, key: tuple, trace, old: tuple | None = None) -> None:
        with self._lock:
            if old in self._by_key:  # the episode's text so far: it has sampled another turn since
                self._by_key[old] = [t for t in self._by_key[old] if t is not trace]
                if not self._by_key[old]:
                    del self._by_key[old]
            self._by_key.setdefault(key, []).append(trace)
            while len(self._by_key) > MAX_TRACES:
                self._by_key.popitem(last=False)

    def take(self, key: tuple):
        with self._lock:
            queue = self._by_key.get(key)
            if not queue:
                return None
            trace = queue.pop(0)
            if not queue:
                del self._by_key[key]
            return trace


_PROMPT, _DONE = object(), object()  # the seat's first request (the task's prompt, already sampled); run() ended


class _Episode:
    """One episode of an Env's `run(task, agents)` on the sampling thread's event loop: it runs until its seat
    asks for a model turn (the engine samples it: `replied`) or it ends (`advance`)."""

    def __init__(self, owner: VerifiersEnvironment, loop, example: Example):
        self.owner, self.loop, self.example = owner, loop, example
        self.vtask = owner.task_of(example)
        self.trace = new_trace(self.vtask, owner.seat, owner.seat_name)
        add_messages(self.trace, prompt_messages(example.meta["chat"]))
        self.ids: list[int] = []  # every sampled id so far
        self.pending: list = []  # the user messages of the last observation, committed once a turn follows them
        self.key: tuple | None = None  # its place in the owner's _Traces
        self.opened = self.over = self.stopped = False
        self.asked = loop.create_future()  # the seat's request: _PROMPT or a list of user messages
        self.answer: asyncio.Future | None = None  # the reply the seat awaits
        self.main = loop.create_task(self._run(owner.env, _Agents(self, owner.seat_name)))

    async def _run(self, env, agents) -> None:
        await env.setup(agents)
        if not agents.seat.trainable:
            raise NotRunnable(f"{type(env).__name__}.setup made its one seat untrainable: nothing would train")
        await env.run(self.vtask, agents)
        if not self.opened:
            raise ValueError(f"{type(env).__name__}.run() ran no agent: every episode must carry one run")

    def advance(self):
        """Run the Env until it asks for the next turn (returned) or ends (_DONE; what it raised, raised)."""
        self.loop.run_until_complete(asyncio.wait({self.main, self.asked}, return_when=asyncio.FIRST_COMPLETED))
        if self.asked.done():
            request, self.asked = self.asked.result(), self.loop.create_future()
            return request
        self.main.result()
        return _DONE

    async def ask(self, request) -> Any:
        """The seat's side: hand the request to the engine, wait for the sampled reply."""
        self.answer = self.loop.create_future()
        self.asked.set_result(request)
        return await self.answer

    def replied(self, turn: Turn, tokenizer) -> None:
        """The engine sampled `turn`: it joins the trace (after the observation it followed), the trace is filed
        under the episode's sampled text, and the seat's awaited reply is answered."""
        import verifiers.v1 as vf

        add_messages(self.trace, self.pending)
        self.pending = []
        reply = vf.AssistantMessage(content=turn.text)
        add_messages(self.trace, [reply], sampled=True, ids=turn.ids)
        self.ids += turn.ids
        key = (self.owner.problem_key(self.example), tokenizer.decode(self.ids, skip_special_tokens=True))
        self.owner.traces.put(key, self.trace, self.key)
        self.key = key
        self.answer.set_result(reply)

    async def refused(self) -> bool:
        """v1's checks before a model call past the first: the seat's max_turns, then the task's Trace @stops."""
        limit = self.owner.seat.max_turns
        if limit is not None and self.trace.num_turns >= limit:
            self.trace.stop("max_turns")
            return True
        from verifiers.v1.session import call_hook

        for stop in self.vtask.hooks("stop"):
            result = await call_hook(stop, {_trace_type(): self.trace})
            if not isinstance(result, bool):
                raise TypeError(f"@stop must return bool, got {type(result).__name__}")
            if result:
                self.trace.stop(stop.__name__)
                return True
        return False

    def cancel(self) -> None:
        if not self.main.done():
            self.main.cancel()
            self.loop.run_until_complete(asyncio.wait({self.main}))
        with contextlib.suppress(BaseException):
            self.main.exception()  # retrieved: no 'exception was never retrieved' warning


def _trace_type():
    import verifiers.v1 as vf

    return vf.Trace


class _Agents:
    """The Env's agents: its one seat, by name (v1's Agents)."""

    def __init__(self, ep: _Episode, name: str):
        self.seat, self._name = _Seat(ep), name

    def __getattr__(self, name: str):
        if name == self.__dict__.get("_name"):
            return self.__dict__["seat"]
        raise AttributeError(f"no agent {name!r}; this config declares [{self.__dict__.get('_name')!r}]")


class _Seat:
    """The seat's Agent: every model turn it asks for is the episode's next turn, sampled by the engine."""

    def __init__(self, ep: _Episode):
        self.ep, self.trainable = ep, True

    async def run(self, task, **borrowed):
        async with self.interaction(task, **borrowed) as chat:
            await chat.turn()
        return chat.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task, *, runtime=None, tools=None, on_trace=None):
        ep = self.ep
        if runtime is not None or tools:
            raise NotRunnable("a borrowed runtime or tool servers: no box or tool server runs here")
        if ep.opened:
            raise NotRunnable("a second rollout in one episode (best-of-n, a retry): one episode is one sequence")
        if (task.data.prompt, task.data.system_prompt) != (ep.vtask.data.prompt, ep.vtask.data.system_prompt):
            raise NotRunnable("the Env opened the seat on another prompt than its task's, which the engine sampled")
        ep.opened = True
        if on_trace is not None:
            on_trace(ep.trace)
        yield _Interaction(ep)
        ep.over = True


class _Interaction:
    """v1's Interaction for the seat: the caller (the Env's run) is the user; `turn` is one sampled turn."""

    def __init__(self, ep: _Episode):
        self.ep = ep

    @property
    def trace(self):
        return self.ep.trace

    async def turn(self, message=None):
        from verifiers.v1.agent import Segment
        from verifiers.v1.dialects import parse_message
        from verifiers.v1.types import UserMessage

        ep = self.ep
        if ep.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        first = not ep.ids and ep.answer is None
        if first != (message is None):
            raise ValueError(
                "the task's prompt opens this exchange: take its first reply with a bare turn()"
                if first
                else "nothing to run a turn on: this exchange takes its next user message"
            )
        if not first and await ep.refused():
            ep.over = ep.stopped = True
            return Segment(messages=[], terminated=True)
        if isinstance(message, str):
            message = [UserMessage(content=message)]
        elif message is not None:
            message = [parse_message(m) if isinstance(m, dict) else m for m in message]
            if not message or any(m.role != "user" or not isinstance(m.content, str) for m in message):
                raise NotRunnable("a turn's messages must be user messages of text (the chat template's user turn)")
        reply = await ep.ask(_PROMPT if first else message)
        return Segment(messages=[reply])

    async def send(self, message: str, **_):
        raise NotRunnable("send/steer inject a message into a running harness turn: a chat turn has no such point")

    steer = send

    async def close(self):
        self.ep.over = True
        return self.ep.trace


class VerifiersEnvironment(VerifiersTask, Environment):
    """A verifiers v1 Env subclass whose one seat plays several turns: its `run` writes the user turns."""

    episode_counts = ("stopped",)  # the seat's max_turns or a Trace @stop ended the exchange
    count_names = ("untraced",)  # completions graded without their episode's trace (one reply to the prompt)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.traces = _Traces()
        self.fmt: ChatTurnFormat | None = None
        self.tok = None
        self.max_obs_tokens = MAX_OBS_TOKENS
        self._local = threading.local()  # each sampling thread's event loop and live episodes

    def start(self, ctx: TaskContext | None = None) -> None:
        """The chat template's user turn for the run's tokenizer (ChatTemplateError without one, or one that
        rewrites earlier turns); the observation budget is multiturn.max_obs_tokens."""
        if ctx is None or ctx.tokenizer is None:
            return
        name = getattr(ctx.tokenizer, "name_or_path", "") or type(ctx.tokenizer).__name__
        head = f"a {FAMILY} Env needs a chat template for its user turns (docs/verifiers.md): tokenizer {name!r}"
        self.tok, self.fmt = ctx.tokenizer, ChatTurnFormat(ctx.tokenizer, head)
        engine = getattr(getattr(ctx.cfg, "multiturn", None), "max_obs_tokens", None)
        self.max_obs_tokens = engine or MAX_OBS_TOKENS
        fixed = len(self.fmt.turn_ids([""], []))
        if self.max_obs_tokens < fixed:
            from rl_training.config.schema import ConfigError

            raise ConfigError(
                f"multiturn.max_obs_tokens={self.max_obs_tokens} cannot hold a user turn ({fixed} tokens)"
            )

    def _loop(self):
        local = self._local
        if getattr(local, "loop", None) is None:
            local.loop, local.current = asyncio.new_event_loop(), []
        return local.loop

    def reset(self, example: Example) -> _Episode:
        if self.fmt is None:
            raise RuntimeError(f"{self.name}: start the task with the run's tokenizer first (Task.start)")
        ep = _Episode(self, self._loop(), example)
        self._local.current.append(ep)
        request = ep.advance()
        if request is not _PROMPT:
            ep.cancel()
            raise ValueError(f"{type(self.env).__name__}.run() ended before the seat's first turn")
        return ep

    def step(self, ep: _Episode, turn: Turn) -> Step:
        ep.replied(turn, self.tok)
        request = ep.advance()
        if request is _DONE:
            return Step(done=True, counts={"stopped": float(ep.stopped)})
        ep.pending = request
        ids, _ = self.fmt.fitted([m.content for m in request], turn.ids, self.max_obs_tokens)
        return Step(observation=ids)

    def call_stats(self) -> None:
        """Called once per generate call, after its resets (rollout/episodes.py): the episodes of this thread's
        call before are over (the engine may have ended them mid-exchange, at its limits), so their runs are
        cancelled."""
        local = self._local
        for ep in getattr(local, "previous", []):
            ep.cancel()
        local.previous, local.current = getattr(local, "current", []), []
        return None

    def trace_for(self, completion: str, example: Example) -> tuple[Any, bool]:
        trace = self.traces.take((self.problem_key(example), completion))
        return (trace, True) if trace is not None else (super().trace_for(completion, example)[0], False)

    def close(self) -> None:
        local = self._local
        for ep in [*getattr(local, "previous", []), *getattr(local, "current", [])]:
            ep.cancel()
        local.previous, local.current = [], []
        loop = getattr(self._local, "loop", None)
        if loop is not None:
            loop.close()
            self._local.loop = None

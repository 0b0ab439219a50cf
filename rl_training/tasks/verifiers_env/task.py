"""A verifiers v1 taskset as a Task: its tasks as Examples, their prompts, and v1's grade of a conversation's
trace (the task's @vf.reward functions, then the Env's `finalize`)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rl_training.data.prompts import chat_template_on, render_prompt
from rl_training.data.sources import DataError, Example
from rl_training.tasks.base import RewardTimeout, Scores, Task, _within, finite_reward
from rl_training.tasks.verifiers_env import FAMILY, SPLITS, NotRunnable


def chat_messages(data, where: str) -> list[dict]:
    """The task's prompt as chat messages (its system prompt first); DataError for what a text chat turn cannot
    carry: no prompt (the Env would open the exchange), images, tool calls, a reply to continue."""
    import verifiers.v1 as vf

    if data.image is not None:
        raise DataError(f"{where}: the task runs in the container image {data.image!r}: no box runs here")
    if data.prompt is None:
        raise DataError(f"{where}: the task has no prompt (its Env would open the exchange): not supported here")
    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt is not None else []
    prompt = data.prompt if not isinstance(data.prompt, str) else [vf.UserMessage(content=data.prompt)]
    for m in prompt:
        content = m.content
        if not isinstance(content, str):
            if not all(isinstance(p, vf.TextContentPart) for p in content):
                raise DataError(f"{where}: a {m.role} message has images: only text is supported here")
            content = "\n".join(p.text for p in content)
        if m.role not in ("system", "user", "assistant") or getattr(m, "tool_calls", None):
            raise DataError(f"{where}: the prompt has a {m.role} message with tool calls or results")
        out.append({"role": m.role, "content": content})
    if out[-1]["role"] != "user":
        raise DataError(f"{where}: the prompt ends with a {out[-1]['role']} message, not the user's")
    return out


def new_trace(vtask, seat_cfg, seat_name: str):
    """An empty v1 Trace of the task, as v1's Rollout opens one."""
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    return Trace(
        task=TraceTask(type=type(vtask).__name__, data=vtask.data, key=vtask.key, hash=vtask.hash),
        state=state_cls(type(vtask))(),
        agent=AgentInfo(config=seat_cfg, name=seat_name),
    )


def add_messages(trace, messages: Sequence, sampled: bool = False, ids: Sequence[int] = ()) -> None:
    """Append messages to the trace's one branch (a sampled one carries the engine's ids)."""
    from verifiers.v1.graph import MessageNode

    for m in messages:
        parent = len(trace.nodes) - 1 if trace.nodes else None
        node = MessageNode(parent=parent, message=m, sampled=sampled, token_ids=list(ids), mask=[sampled] * len(ids))
        trace.nodes.append(node)


def prompt_messages(chat: list[dict]) -> list:
    import verifiers.v1 as vf

    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    return [kinds[m["role"]](content=m["content"]) for m in chat]


def run_async(coro):
    """A coroutine to its result on a fresh event loop (graders run wherever score_completions runs)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@dataclass(frozen=True)
class Source:
    """Where the environment comes from: its Taskset class, its Env class (None: v1's SingleAgentEnv)."""

    name: str  # 'verifiers/<id>' or the file spec, for messages and the eval records
    taskset_cls: type
    env_cls: type | None
    taskset_id: str = ""  # the id of an installed package's taskset ('' for a file's)


# --------------------------------------------------------------------------------------------- the task
class VerifiersTask(Task):
    """A verifiers v1 taskset played by one seat, one reply per task (v1's SingleAgentEnv)."""

    def __init__(
        self,
        source: Source,
        taskset,
        first,
        seat: tuple[str, Any],
        env=None,
        size: int | None = None,
        heldout_size: int = 0,
        heldout: dict | None = None,
        correct_threshold: float = 1.0,
    ):
        for key, v in (("size", size), ("heldout_size", heldout_size)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{key} must be a non-negative integer, got {v!r}")
        if taskset.INFINITE and not size:
            raise NotRunnable(f"{type(taskset).__name__} is infinite (INFINITE): set task.args.size")
        self.name, self.source, self.taskset, self.env = source.name, source, taskset, env
        self.seat_name, self.seat = seat
        self.size, self.heldout_size, self.heldout = size, heldout_size, heldout
        self.correct_threshold = float(correct_threshold)
        self.task_cls, self.data_cls = type(first), type(first).data_type()
        self.part_names = tuple(dict.fromkeys(fn.__name__ for fn in first.hooks("reward")))
        self.overlap_dropped = 0
        self._splits: dict[str, list[Example]] = {}
        self._tasks: dict[str, Any] = {}  # a task's data (JSON) -> the v1 Task rebuilt around it

    # ------------------------------------------------------------------------------------------------ data
    def examples(self, split: str) -> list[Example]:
        """The taskset's tasks (data spec 'task:train' / 'task:heldout'), loaded once per process: the held-out
        split is the first heldout_size tasks (of the taskset under task.args.heldout's settings, when given)
        and the train split the next `size` (the taskset's first `size`), less any problem also held out."""
        if split not in SPLITS:
            raise DataError(f"data spec 'task:{split}': {self.name} makes the splits {', '.join(SPLITS)}")
        if split == "heldout" and not self.heldout_size:
            raise DataError(f"data spec 'task:heldout': {self.name} holds no tasks out: set task.args.heldout_size")
        if not self._splits:
            n, size = self.heldout_size, self.size
            if self.heldout is None:  # one pass over load(): the first n held out, then the train split
                stream = list(itertools.islice(iter(self.taskset), None if size is None else n + size))
                held, tasks = stream[:n], stream[n:]
            else:
                cfg = type(self.taskset.config).model_validate({**self.taskset.config.model_dump(), **self.heldout})
                held = list(itertools.islice(iter(type(self.taskset)(cfg)), n))
                tasks = list(itertools.islice(iter(self.taskset), size))
            self._splits["heldout"] = [self._example(t, "heldout") for t in held]
            keys = {self.problem_key(ex) for ex in self._splits["heldout"]}
            train = [self._example(t, "train") for t in tasks]
            self._splits["train"] = [ex for ex in train if self.problem_key(ex) not in keys]
            self.overlap_dropped = len(train) - len(self._splits["train"])
        return list(self._splits[split])

    def _example(self, vtask, split: str) -> Example:
        where = f"{self.name}@{split}:task {vtask.data.idx}"
        if not isinstance(vtask, self.task_cls):
            raise DataError(f"{where}: a {type(vtask).__name__}, not the taskset's {self.task_cls.__name__}")
        chat = chat_messages(vtask.data, where)
        answer = getattr(vtask.data, "answer", None)  # the SFT target, where the task's data has one
        solution = str(answer) if isinstance(answer, str | int | float) and not isinstance(answer, bool) else ""
        data = vtask.data.model_dump(mode="json", exclude_none=True)
        return Example(chat[-1]["content"], solution, solution, where, {"task": data, "chat": chat})

    def parse(self, record: dict, where: str) -> Example:
        raise DataError(f"{where}: a {FAMILY} taskset makes its own tasks: set data.train: task:train (task:heldout)")

    def problem_key(self, example: Example):
        """The task's content without its position in the taskset (v1's task key is a hash of both)."""
        from verifiers.v1.task import task_key

        return task_key({k: v for k, v in example.meta["task"].items() if k != "idx"})

    def task_of(self, example: Example):
        """The v1 Task of an example, rebuilt from its data (what a sample or a synthesized row carries)."""
        from verifiers.v1.task import task_key

        key = task_key(example.meta["task"])
        if key not in self._tasks:
            data = self.data_cls.model_validate(example.meta["task"])
            self._tasks[key] = self.task_cls(data, self.taskset.config.task)
        return self._tasks[key]

    def render_prompt(self, example: Example, tokenizer, data) -> str:
        """A one-message prompt as every task's (data.prompt_template around it, the chat template when
        data.use_chat_template); a system prompt or a conversation needs the chat template."""
        chat = example.meta["chat"]
        if len(chat) == 1:
            q, system = chat[0]["content"], data.system_prompt
            return render_prompt(q, self.template(data), tokenizer, data.use_chat_template, system)
        if not chat_template_on(data.use_chat_template, tokenizer):
            raise DataError(f"{example.source}: a prompt of {len(chat)} messages needs data.use_chat_template: true")
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    # ------------------------------------------------------------------------------------------- grading
    def trace_for(self, completion: str, example: Example) -> tuple[Any, bool]:
        """(the trace to grade, whether it is the episode's): here always the prompt and one reply."""
        import verifiers.v1 as vf

        vtask = self.task_of(example)
        trace = new_trace(vtask, self.seat, self.seat_name)
        add_messages(trace, prompt_messages(example.meta["chat"]))
        add_messages(trace, [vf.AssistantMessage(content=completion)], sampled=True)
        return trace, True

    def judge(self, trace, example: Example) -> tuple[float, dict[str, float]]:
        """v1's scoring of a finished trace: the task's rewards (Task.score), then the Env's `finalize`."""
        vtask = self.task_of(example)

        async def score():
            await vtask.score(trace)
            if self.env is not None and type(self.env).finalize is not _env_base().finalize:
                from verifiers.v1.episode import EnvInfo, Episode

                episode = Episode(env=EnvInfo(id=self.name), task=trace.task, traces=[trace], ok=True)
                await self.env.finalize(vtask, episode)

        run_async(score())
        unscored = [k for k, r in trace.rewards.items() if r is None]
        if unscored:
            raise ValueError(f"rewards {unscored} did not score")
        return trace.reward, {k: r.score for k, r in trace.rewards.items()}

    def grade(self, completions: Sequence[str], examples: Sequence[Example], timeout_s: float) -> Scores:
        """v1's grade of each completion's trace under the time limit; a grader that raises, times out or gives
        no finite number scores 0, counted as Task.grade counts it. Parts: each @vf.reward's score."""
        n = len(completions)
        rewards, parts = [0.0] * n, {k: [0.0] * n for k in self.part_names}
        errors = timeouts = untraced = 0
        for i, (c, ex) in enumerate(zip(completions, examples, strict=True)):
            try:
                trace, traced = self.trace_for(c, ex)
                untraced += not traced
                rewards[i], got = _within(lambda t=trace, ex=ex: self.judge(t, ex), timeout_s)
            except RewardTimeout:
                timeouts += 1
                continue
            except Exception:  # noqa: BLE001 -- an environment's reward may raise anything; it never stops the run
                errors += 1
                continue
            for k in parts.keys() & got.keys():
                parts[k][i] = finite_reward(got[k]) or 0.0
        formatted = [bool(c.strip()) for c in completions]
        correct = [r >= self.correct_threshold for r in rewards]
        counts = {"untraced": float(untraced)} if "untraced" in self.count_names else {}
        return Scores(rewards, correct, formatted, errors, timeouts, 0, parts, counts)


def _env_base():
    import verifiers.v1 as vf

    return vf.Env

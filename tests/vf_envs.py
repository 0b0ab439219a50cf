"""Small verifiers v1 environments the verifiers tests train and grade
(tests/unit/tasks/verifiers_env/test_verifiers_env.py, tests/integration/test_verifiers_run.py), written here: no hub,
no network. Not a test module (tests/helpers.py's rule: no test module imports another). Named in a config as a file,
`tests/vf_envs.py:NAME`, or, through a package that exports them (`package_dir`), by id, as an installed environment
package is.

- ReverseTaskset: single turn (v1's SingleAgentEnv): reverse a word, partial credit per position (the tiny warm
  model's task, rendered '{question}=') plus a zero-weight reward that counts the reply's letters.
- GuessEnv over GuessTaskset: multi-turn: the Env's run answers each wrong reply with a hint, for at most
  `max_turns` model turns (its seat's config); the rewards: the last reply is the reversed word, its credit, the
  answer's letters seen in any reply, and (the Env's finalize) fewer turns.
- The refused ones: each has one thing this trainer cannot run token-exactly.
"""

from __future__ import annotations

import random
from pathlib import Path

import verifiers.v1 as vf

HERE = Path(__file__).resolve()


def words(n: int, seed: int = 0) -> list[str]:
    """n distinct strings of 3 to 6 letters of a..j (the reverse task's alphabet)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        w = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
        if w not in out:
            out.append(w)
    return out


def reverse_credit(reply: str, answer: str) -> float:
    """Matching positions / the longer length (the reverse task's credit); 0 for an empty reply."""
    reply = reply.strip()
    if not reply:
        return 0.0
    return sum(a == b for a, b in zip(reply, answer, strict=False)) / max(len(reply), len(answer))


# ------------------------------------------------------------------------------------------- single turn
class WordData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[WordData]):
    @vf.reward
    async def reversed_credit(self, trace: vf.Trace) -> float:
        return reverse_credit(trace.last_reply, self.data.answer)

    @vf.reward(weight=0.0)
    async def letters(self, trace: vf.Trace) -> float:
        return float(sum(c.isalpha() for c in trace.last_reply))


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 200
    seed: int = 0


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        return [
            ReverseTask(WordData(prompt=w, answer=w[::-1]), self.config.task)
            for w in words(self.config.num_tasks, self.config.seed)
        ]


# -------------------------------------------------------------------------------------------- multi-turn
class GuessTask(vf.Task[WordData]):
    @vf.reward
    async def solved(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.5)
    async def credit(self, trace: vf.Trace) -> float:
        return reverse_credit(trace.last_reply, self.data.answer)

    @vf.reward(weight=0.25)
    async def seen(self, trace: vf.Trace) -> float:
        """The share of the answer's letters some reply has (partial credit even a random policy earns)."""
        replies = "".join(m.content or "" for m in trace.assistant_messages)
        return sum(c in replies for c in set(self.data.answer)) / len(set(self.data.answer))

    @vf.stop
    async def gave_up(self, trace: vf.Trace) -> bool:
        return trace.last_reply == "pass"


class GuessTaskset(vf.Taskset[GuessTask, ReverseConfig]):
    def load(self):
        return [
            GuessTask(WordData(prompt=w, system_prompt="Reverse the word.", answer=w[::-1]), self.config.task)
            for w in words(self.config.num_tasks, self.config.seed)
        ]


class GuessConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(max_turns=3)


def hint(reply: str, answer: str) -> str:
    return f"no: {sum(a == b for a, b in zip(reply, answer, strict=False))} of {len(answer)} letters right"


class GuessEnv(vf.Env[GuessConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            while not segment.terminated and segment.last_reply != task.data.answer:
                segment = await chat.turn(hint(segment.last_reply, task.data.answer))

    async def finalize(self, task, episode):
        for trace in episode.traces:
            trace.record_metric("turns", float(trace.num_turns))
            trace.record_reward("fewer_turns", 1.0 / trace.num_turns, weight=0.25)


# ------------------------------------------------------------------------------------------ the refused
class SearchToolset(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    async def query(self, text: str) -> str:
        """Search."""
        return text


class ToolTask(ReverseTask):
    @classmethod
    def toolsets(cls, config):
        return [SearchToolset(vf.ToolsetConfig())]


class ToolTaskset(vf.Taskset[ToolTask, ReverseConfig]):
    def load(self):
        return [ToolTask(WordData(prompt="abc", answer="cba"), self.config.task)]


class BoxTask(ReverseTask):
    NEEDS_CONTAINER = True


class BoxTaskset(vf.Taskset[BoxTask, ReverseConfig]):
    def load(self):
        return [BoxTask(WordData(prompt="abc", answer="cba"), self.config.task)]


class SetupTask(ReverseTask):
    async def setup(self, trace, runtime):
        await runtime.run(["true"], {})


class SetupTaskset(vf.Taskset[SetupTask, ReverseConfig]):
    def load(self):
        return [SetupTask(WordData(prompt="abc", answer="cba"), self.config.task)]


class RuntimeRewardTask(ReverseTask):
    @vf.reward
    async def file_written(self, trace: vf.Trace, runtime) -> float:
        return float((await runtime.run(["test", "-f", "out"], {})).exit_code == 0)


class RuntimeRewardTaskset(vf.Taskset[RuntimeRewardTask, ReverseConfig]):
    def load(self):
        return [RuntimeRewardTask(WordData(prompt="abc", answer="cba"), self.config.task)]


class InterceptTask(ReverseTask):
    @vf.intercept
    async def shout(self, response: vf.Response) -> vf.Response | None:
        return None


class InterceptTaskset(vf.Taskset[InterceptTask, ReverseConfig]):
    def load(self):
        return [InterceptTask(WordData(prompt="abc", answer="cba"), self.config.task)]


class RequestStopTask(ReverseTask):
    @vf.stop
    async def long_request(self, request: vf.Request) -> bool:
        return len(request.messages) > 4


class RequestStopTaskset(vf.Taskset[RequestStopTask, ReverseConfig]):
    def load(self):
        return [RequestStopTask(WordData(prompt="abc", answer="cba"), self.config.task)]


class ImageTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        return [ReverseTask(WordData(prompt="abc", answer="cba", image="python:3.11"), self.config.task)]


class TwoSeatConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    user: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})


class TwoSeatEnv(vf.Env[TwoSeatConfig]):
    async def run(self, task, agents):
        await agents.solver.run(task)


class BestOfTwoEnv(vf.Env[GuessConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)
        await agents.agent.run(task)


class OwnHarness(vf.Harness):
    """A package's own harness: a program of its own that calls the model."""

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        raise NotImplementedError


def package_dir(root: Path, env_id: str, names: list[str]) -> Path:
    """An environment package `env_id` under `root` exporting `names` of this module (put `root` on sys.path and
    it is installed as far as verifiers' loader can tell: `import_taskset(env_id)` imports it)."""
    pkg = root / env_id.replace("-", "_")
    pkg.mkdir(parents=True, exist_ok=True)
    body = f"from tests.vf_envs import {', '.join(names)}\n\n__all__ = {names!r}\n"
    (pkg / "__init__.py").write_text(body)
    return root

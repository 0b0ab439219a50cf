"""One builder for every entry point: the task a config names, built-in or a user's file, and its context.

    task = build_task(cfg)                    # task.name + task.args; before any model loads
    task.start(task_context(info, tokenizer, cfg))  # its resources (a sandbox pool, a retriever)

task.name is a built-in name (BUILTIN), a member of a built-in family ('reasoning-gym/<dataset>',
'verifiers/<env-id>': FAMILIES) or a user task: 'path/to/file.py:NAME' or 'package.module:NAME', read by the plugin
loader every extension point shares (rl_training/config/plugins.py), where NAME is a Task (or Environment) subclass,
a factory returning one, or an instance; task.args (a mapping) is handed to the class or factory as keyword
arguments. A bad spec is one ConfigError line naming it and the cause.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rl_training.base.errors import one_line
from rl_training.config import plugins
from rl_training.config.plugins import Kind
from rl_training.config.schema import Config, ConfigError
from rl_training.tasks.base import Environment, Task, TaskContext


def _keys(cfg: Config, args: dict) -> dict:
    """The record field names of the tabular built-in tasks: data.question_key / answer_key unless task.args
    names them."""
    return {"question_key": cfg.data.question_key, "answer_key": cfg.data.answer_key, **args}


def _math(fmt: str) -> Callable[[Config, dict], Task]:
    def make(cfg: Config, args: dict) -> Task:
        from rl_training.tasks.math import MathTask

        return MathTask(fmt, **_keys(cfg, args))

    return make


def _reverse(cfg: Config, args: dict) -> Task:
    from rl_training.tasks.reverse import ReverseTask

    return ReverseTask(**_keys(cfg, args))


def _search(match: str) -> Callable[[Config, dict], Task]:
    def make(cfg: Config, args: dict) -> Task:
        from rl_training.tasks.search.task import SearchTask

        return SearchTask(cfg.search, **{"match": match, **_keys(cfg, args)})

    return make


def _code(fmt: str) -> Callable[[Config, dict], Task]:
    def make(cfg: Config, args: dict) -> Task:
        from rl_training.tasks.code.task import CodeTask

        return CodeTask(fmt, **args)  # its pool takes sandbox.* from the config it starts with

    return make


def _python_tool(fmt: str) -> Callable[[Config, dict], Task]:
    def make(cfg: Config, args: dict) -> Task:
        from rl_training.tasks.python_tool import PythonToolEnvironment

        # task.args: max_tool_calls, tool_timeout_s, output_chars, persist, max_obs_tokens; its pool takes sandbox.*
        return PythonToolEnvironment(fmt, **_keys(cfg, args))

    return make


def _reasoning_gym(dataset: str | None) -> Callable[[Config, dict], Task]:
    def make(cfg: Config, args: dict) -> Task:
        from rl_training.tasks.reasoning_gym import UnknownDataset, reasoning_gym_task

        h = plugins.head(TASK, "reasoning-gym" if dataset is None else f"reasoning-gym/{dataset}")
        try:
            return reasoning_gym_task(dataset, args)
        except UnknownDataset as e:  # a name's error, not its arguments' (in task.args.datasets it is theirs)
            if dataset is None:
                raise
            raise ConfigError(f"{h}: {e}") from None
        except ImportError as e:  # reasoning_gym is imported on first use
            raise ConfigError(f"{h} needs the reasoning-gym package ({one_line(e)}; requirements.txt)") from None

    return make


def _verifiers(env_id: str | None) -> Callable[[Config, dict], Task]:
    def make(cfg: Config, args: dict) -> Task:
        from rl_training.tasks.verifiers_env.load import NotRunnable, verifiers_task

        h = plugins.head(TASK, "verifiers" if env_id is None else f"verifiers/{env_id}")
        try:
            return verifiers_task(env_id, args, cfg)
        except NotRunnable as e:  # what of v1 this trainer cannot run (docs/verifiers.md), or a load failure
            raise ConfigError(f"{h}: {e}") from None
        except ImportError as e:  # verifiers is an optional extra, imported on first use
            raise ConfigError(f"{h} needs the verifiers package ({one_line(e)}; requirements-extras.txt)") from None

    return make


# name -> factory(config, task.args): the families under rl_training/tasks/
BUILTIN: dict[str, Callable[[Config, dict], Task]] = {
    "gsm8k": _math("gsm8k"),
    "math": _math("math"),
    "reverse": _reverse,
    "search": _search("em"),
    "search_subem": _search("subem"),
    "humaneval": _code("humaneval"),
    "mbpp": _code("mbpp"),
    "stdio": _code("stdio"),
    "python_gsm8k": _python_tool("gsm8k"),
    "python_math": _python_tool("math"),
    "reasoning-gym": _reasoning_gym(None),  # a weighted composite: task.args.datasets (docs/extending.md)
    "verifiers": _verifiers(None),  # a verifiers Taskset or Env in a user's file: task.args.env (docs/verifiers.md)
}

# family -> factory(member): 'FAMILY/MEMBER' names one member ('reasoning-gym/spell_backward'); no ':' in it, so it
# can never be read as a user's 'file.py:NAME'.
FAMILIES: dict[str, Callable[[str], Callable[[Config, dict], Task]]] = {
    "reasoning-gym": _reasoning_gym,
    "verifiers": _verifiers,  # an installed verifiers environment package by id: 'verifiers/<env-id>'
}


TASK = Kind.of_class("task.name", "task", "task.args", Task, what="rl_training.tasks.Task")


def build_task(cfg: Config) -> Task:
    """The task of cfg.task (name and args); ConfigError (one line) for any bad spec."""
    return make_task(cfg.task.name, cfg.task.args, cfg)


def make_task(name: str, args: dict[str, Any] | None = None, cfg: Config | None = None) -> Task:
    """The task `name` with keyword arguments `args`; `cfg` gives the built-in tasks their config sections
    (search.*, sandbox.*, data.question_key/answer_key; the defaults when None)."""
    args, cfg = dict(args or {}), cfg or Config()
    family, slash, member = name.partition("/")
    if ":" not in name and slash and family in FAMILIES:
        obj, builtin = FAMILIES[family](member), True
    else:
        obj, builtin = plugins.find(TASK, name, BUILTIN)
    if builtin:
        try:
            task = obj(cfg, args)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{plugins.head(TASK, name)}: task.args={args!r} do not fit it ({one_line(e)})") from None
    else:
        task = plugins.construct(TASK, name, obj, args)
    return _checked(task, plugins.head(TASK, name))


def task_context(info=None, tokenizer=None, cfg: Config | None = None) -> TaskContext:
    """The context a task starts in: the process's DistInfo (None: a process of its own), torchrun's
    LOCAL_WORLD_SIZE (ranks on this node), its tokenizer and the run's config."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    rank, world = (info.rank, info.world_size) if info is not None else (0, 1)
    return TaskContext(rank=rank, world_size=world, local_world_size=local, tokenizer=tokenizer, cfg=cfg)


def _checked(task: Task, head: str) -> Task:
    """The declared names a task's callers rely on, checked before any model loads."""
    for attr in ("part_names", "count_names", *(("stop", "episode_counts") if isinstance(task, Environment) else ())):
        value = getattr(task, attr)
        if not isinstance(value, tuple | list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(
                f"{head}: {type(task).__name__}.{attr} must be a tuple of non-empty strings, got {value!r}"
            )
    return task

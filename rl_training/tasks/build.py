"""One builder for every entry point: the task a config names, built-in or a user's file, and its context.

    task = build_task(cfg)                    # task.name + task.args; before any model loads
    task.start(task_context(info, tokenizer, cfg))  # its resources (a sandbox pool, a retriever)

task.name is a built-in name (BUILTIN) or a user task: 'path/to/file.py:NAME' or 'package.module:NAME' (the
grammar: config.schema.split_task_spec), where NAME is a Task (or Environment) subclass, a factory returning one,
or an instance; task.args (a mapping) is handed to the class or factory as keyword arguments. Every way a spec
can be wrong (no such file or module, an exception while importing it, no such attribute, an object of the
wrong type, arguments it does not take) is one ConfigError line naming the spec and the cause.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rl_training.base.errors import one_line
from rl_training.config.schema import Config, ConfigError, split_task_spec
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
}


def build_task(cfg: Config) -> Task:
    """The task of cfg.task (name and args); ConfigError (one line) for any bad spec."""
    return make_task(cfg.task.name, cfg.task.args, cfg)


def make_task(name: str, args: dict[str, Any] | None = None, cfg: Config | None = None) -> Task:
    """The task `name` with keyword arguments `args`; `cfg` gives the built-in tasks their config sections
    (search.*, sandbox.*, data.question_key/answer_key; the defaults when None)."""
    args, cfg = dict(args or {}), cfg or Config()
    kind, where, attr = split_task_spec(name)
    head = f"task.name={name!r}"
    if kind == "builtin":
        if name not in BUILTIN:
            raise ConfigError(
                f"{head} is not a built-in task ({', '.join(BUILTIN)}) nor a user task "
                "('path/to/file.py:NAME' or 'package.module:NAME'; docs/extending.md)"
            )
        try:
            task = BUILTIN[name](cfg, args)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{head}: task.args={args!r} do not fit it ({one_line(e)})") from None
        return _checked(task, head)
    if not attr:
        raise ConfigError(f"{head}: name the object after the ':' ('{where}:NAME')")
    module = _import_file(where, head) if kind == "file" else _import_module(where, head)
    if not hasattr(module, attr):
        found = _candidates(module)
        hint = f"; it defines {', '.join(found)}" if found else "; it defines no Task subclass, factory or instance"
        raise ConfigError(f"{head}: {where} has no attribute {attr!r}{hint}")
    return _checked(_instantiate(getattr(module, attr), args, head), head)


def task_context(info=None, tokenizer=None, cfg: Config | None = None) -> TaskContext:
    """The context a task starts in: the process's DistInfo (None: a process of its own), torchrun's
    LOCAL_WORLD_SIZE (ranks on this node), its tokenizer and the run's config."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    rank, world = (info.rank, info.world_size) if info is not None else (0, 1)
    return TaskContext(rank=rank, world_size=world, local_world_size=local, tokenizer=tokenizer, cfg=cfg)


# ------------------------------------------------------------------------------------------------ user tasks
def _import_file(path: str, head: str):
    """The user's file as a module of its own, imported once per process (a second build reuses it)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{head}: no such file {p}")
    real = p.resolve()
    name = f"rl_user_task_{p.stem}_{hashlib.sha1(str(real).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        return module_from_file(name, real)
    except NotPython:
        raise ConfigError(f"{head}: {p} cannot be imported as Python") from None
    except BaseException as e:  # noqa: BLE001 -- whatever the user's file raises (SystemExit too) is one line
        raise ConfigError(f"{head}: importing {p}{_where_in(e, real)} raised {one_line(e)}") from None


class NotPython(ImportError):
    """A file that importlib cannot load as a Python module (no loader for its name)."""


def module_from_file(name: str, path: str | Path):
    """The Python file at `path` imported as the module `name` (registered in sys.modules before it runs:
    dataclasses and pickling look a module up by name; removed again when it raises). NotPython when the file
    cannot be loaded as Python; whatever the file raises, as it is. The tools' process (tool_worker.py)
    imports a user's task file the same way, under the name this process gave it."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise NotPython(f"{path} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(dotted: str, head: str):
    try:
        return importlib.import_module(dotted)
    except BaseException as e:  # noqa: BLE001 -- ModuleNotFoundError or anything the module raises at import
        raise ConfigError(f"{head}: importing module {dotted!r} raised {one_line(e)}") from None


def _where_in(e: BaseException, path: Path) -> str:
    """':LINE' of the deepest frame of the exception inside the user's file (a SyntaxError carries its own)."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f":{e.lineno}"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    return f":{lines[-1]}" if lines else ""


def _candidates(module) -> list[str]:
    """The module's public names a spec could point at: Task subclasses and instances."""
    out = []
    for k, v in vars(module).items():
        if k.startswith("_") or v in (Task, Environment):
            continue
        if isinstance(v, Task) or (isinstance(v, type) and issubclass(v, Task)):
            out.append(k)
    return out


def _instantiate(obj: Any, args: dict, head: str) -> Task:
    if isinstance(obj, Task):
        if args:
            raise ConfigError(f"{head} is an instance, so task.args cannot reach it; point at its class or a factory")
        return obj
    if isinstance(obj, type) and not issubclass(obj, Task):
        raise ConfigError(f"{head} is the class {obj.__name__}, not a subclass of rl_training.tasks.Task")
    if not callable(obj):
        raise ConfigError(f"{head} is of type {type(obj).__name__}, not a Task subclass, factory or instance")
    what = obj.__name__ if isinstance(obj, type) else getattr(obj, "__name__", "the factory")
    try:
        task = obj(**args)
    except Exception as e:  # noqa: BLE001 -- the user's constructor: a wrong argument or anything it raises
        raise ConfigError(f"{head}: {what}(**task.args) with task.args={args!r} raised {one_line(e)}") from None
    if not isinstance(task, Task):
        raise ConfigError(f"{head}: {what}(...) returned a {type(task).__name__}, not a rl_training.tasks.Task")
    return task


def _checked(task: Task, head: str) -> Task:
    """The declared names a task's callers rely on, checked before any model loads."""
    for attr in ("part_names", "count_names", *(("stop", "episode_counts") if isinstance(task, Environment) else ())):
        value = getattr(task, attr)
        if not isinstance(value, tuple | list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(
                f"{head}: {type(task).__name__}.{attr} must be a tuple of non-empty strings, got {value!r}"
            )
    return task

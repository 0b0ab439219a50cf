"""A verifiers environment by id (an installed package) or from a user's file, refused in one line where v1 would
need more than text in and text out, and built as a VerifiersTask or VerifiersEnvironment (`verifiers_task`)."""

from __future__ import annotations

import inspect
from typing import Any

from rl_training.base.errors import one_line
from rl_training.tasks.verifiers_env import FAMILY, SEAT_HARNESS, NotRunnable
from rl_training.tasks.verifiers_env.episode import VerifiersEnvironment
from rl_training.tasks.verifiers_env.task import Source, VerifiersTask

_HOOKS = ("setup", "finalize", "stage_verifier")  # a Task's lifecycle hooks: each prepares or reads a runtime (box)


def package_classes(env_id: str) -> tuple[type, type | None]:
    """An installed environment package by id, resolved by verifiers' own loaders (verifiers.v1.tasksets.<id>, or
    the module <id> with '-' as '_'; a hub id 'owner/name@version' is its name): its Taskset, and the Env it
    exports (None: v1's SingleAgentEnv)."""
    from verifiers.v1.envs.single_agent import SingleAgentEnv
    from verifiers.v1.utils import loaders

    try:
        taskset_cls = loaders.taskset_class(env_id)
        env_cls = loaders.environment_class(env_id)
        harness = loaders.default_harness_id(env_id)
    except Exception as e:  # noqa: BLE001 -- the package's import may raise anything: one line names it
        raise NotRunnable(f"loading the environment package {env_id!r} raised {one_line(e)}") from None
    if harness != "bash":  # v1's default for a taskset that ships no harness of its own
        raise NotRunnable(_harness_refusal(f"the package's own harness {harness!r}"))
    return taskset_cls, None if env_cls is SingleAgentEnv else env_cls


def user_class(key: str, spec: Any, base: type) -> type:
    """The subclass of `base` (vf.Taskset or vf.Env, or either: a tuple) a spec names in a user's file
    ('path/to/file.py:NAME') or a module ('package.module:NAME'), read by the plugin loader."""
    from rl_training.config import plugins

    bases = base if isinstance(base, tuple) else (base,)
    what = " or ".join(f"verifiers.v1.{b.__name__}" for b in bases)
    if not isinstance(spec, str) or ":" not in spec:
        raise NotRunnable(
            f"{key}={spec!r} must name a {what} subclass: 'path/to/file.py:NAME' or 'package.module:NAME'"
        )
    kind = plugins.Kind(
        key, "verifiers class", "task.args", what, lambda obj: False, lambda obj: issubclass(obj, bases)
    )
    obj, _ = plugins.find(kind, spec, {})
    if not (isinstance(obj, type) and issubclass(obj, bases)):
        raise NotRunnable(f"{key}={spec!r} is {getattr(obj, '__name__', type(obj).__name__)}, not a {what} subclass")
    return obj


def source(env_id: str | None, env: Any, taskset_id: Any) -> Source:
    """Where the environment comes from, as v1 names it by an env id and a taskset id: `verifiers/<id>` is an
    installed package (its Taskset and the Env it exports); `verifiers` takes task.args.env, a Taskset (played by
    one seat, v1's SingleAgentEnv) or an Env, whose taskset is task.args.taskset.id (a file's or module's Taskset,
    or an installed package's id)."""
    import verifiers.v1 as vf

    if env_id is not None:
        if env is not None or taskset_id:
            raise NotRunnable(f"{FAMILY}/{env_id} names the environment: task.args.env and taskset.id are {FAMILY}'s")
        return Source(f"{FAMILY}/{env_id}", *package_classes(env_id), taskset_id=env_id)
    if env is None:
        raise NotRunnable(f"name the environment: task.args.env (a Taskset or Env), or task.name: {FAMILY}/<env-id>")
    cls = user_class("task.args.env", env, (vf.Taskset, vf.Env))
    if issubclass(cls, vf.Taskset):
        if taskset_id:
            raise NotRunnable(f"task.args.env={env!r} is a Taskset already: task.args.taskset.id names an Env's")
        return Source(env, cls, None)
    if not taskset_id:
        raise NotRunnable(f"the Env {cls.__name__} plays a taskset: name it in task.args.taskset.id")
    if isinstance(taskset_id, str) and ":" in taskset_id:
        return Source(env, user_class("task.args.taskset.id", taskset_id, vf.Taskset), cls)
    return Source(env, package_classes(str(taskset_id))[0], cls, taskset_id=str(taskset_id))


def _harness_refusal(what: str) -> str:
    return (
        f"{what} runs an agent program that calls the model over HTTP itself, so its turns are not sampled by "
        f"this trainer's engine; the seat plays v1's tool-less '{SEAT_HARNESS}' chat loop here (docs/verifiers.md)"
    )


def _validated(cls: type, values: Any, key: str):
    """cls.model_validate(values): a pydantic error as one line naming each field."""
    from pydantic import ValidationError

    if not isinstance(values, dict):
        raise NotRunnable(f"{key} must be a mapping of {cls.__name__}'s fields, got {type(values).__name__}")
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(root)'}: {err['msg']}" for err in e.errors())
        raise NotRunnable(f"{key}: {cls.__name__} refuses it ({why})") from None


# ------------------------------------------------------------------------------------------------ refusals
def check_seats(env_cfg, env_cls: type | None) -> tuple[str, Any]:
    """The one seat (name, AgentConfig) of the env's config; NotRunnable for what only v1's own loop can play."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    env_name = env_cls.__name__ if env_cls is not None else "SingleAgentEnv"
    if env_cls is not None and env_cls.__init__ is not vf.Env.__init__:
        raise NotRunnable(f"{env_name} overrides Env.__init__, which loads harnesses and tool servers; not run here")
    seats = agent_config_fields(env_cfg)
    if len(seats) != 1:
        raise NotRunnable(
            f"{env_name} has {len(seats)} seats ({', '.join(seats) or 'none'}): every seat is a model sampling on "
            "its own (a simulated user, a judge, a second agent), and this trainer trains one seat, every token of "
            "which its engine samples"
        )
    ((name, seat),) = seats.items()
    if seat.harness is not None and seat.harness.id != SEAT_HARNESS:
        raise NotRunnable(_harness_refusal(f"seat {name!r}'s harness {seat.harness.id!r}"))
    if seat.model is not None or seat.client is not None:
        raise NotRunnable(f"seat {name!r} is played by another model ({seat.model or seat.client}): its sampling")
    if seat.sampling is not None and seat.sampling.model_dump(exclude_unset=True):
        raise NotRunnable(f"seat {name!r} sets sampling {seat.sampling.model_dump(exclude_unset=True)}: rollout.*")
    for key in ("max_input_tokens", "max_output_tokens", "max_total_tokens"):
        if getattr(seat, key) is not None:
            raise NotRunnable(f"seat {name!r} sets {key}: multiturn.max_response_tokens caps an episode here")
    if seat.max_turns is not None and seat.max_turns < 1:
        raise NotRunnable(f"seat {name!r} sets max_turns={seat.max_turns}: at least the first turn is sampled")
    return name, seat


def check_task(taskset, first) -> None:
    """NotRunnable for what a task needs beyond text in and text out: tools, a box, judges that call a model,
    hooks that rewrite what the model sees; `first` is one task of the taskset (all share its class and config)."""
    import verifiers.v1 as vf
    from verifiers.v1.session import hook_boundary
    from verifiers.v1.utils.decorators import discover_decorated

    cls, config = type(first), first.config
    if type(taskset).toolsets(taskset.config) or cls.toolsets(config):
        raise NotRunnable(
            f"{cls.__name__} has tools: MCP servers a harness calls through its own tool-call protocol, which no "
            "plain chat turn carries (ToolEnvironment is this trainer's tool calling: docs/tools.md)"
        )
    if cls.NEEDS_CONTAINER:
        raise NotRunnable(f"{cls.__name__} needs a container (NEEDS_CONTAINER): no box runs here")
    for hook in _HOOKS:
        if getattr(cls, hook) is not getattr(vf.Task, hook):
            raise NotRunnable(f"{cls.__name__}.{hook} prepares or reads a runtime (a sandbox box): none runs here")
    if config.judges:
        judge = config.judges[0]
        raise NotRunnable(
            f"judge {judge.id!r} calls a model ({judge.model} at {judge.base_url}): it would need that endpoint "
            "reachable from every rank and answering within reward.timeout_s; grade with a @vf.reward instead"
        )
    for attr in ("reward", "metric"):
        for fn in first.hooks(attr):
            param = inspect.signature(fn).parameters.get("runtime")
            if param is not None and param.default is inspect.Parameter.empty:
                raise NotRunnable(f"@vf.{attr} {fn.__name__} reads the runtime (a sandbox box): none runs here")
    if discover_decorated(first, "intercept"):
        raise NotRunnable(
            f"{cls.__name__} has @vf.intercept hooks: they rewrite requests or responses, so what is trained on "
            "would not be what the model saw"
        )
    for fn in first.hooks("stop"):
        if hook_boundary(fn, allow_trace=True) is not vf.Trace:
            raise NotRunnable(f"@vf.stop {fn.__name__} reads a request or response; only Trace stops run here")


def verifiers_task(env_id: str | None, args: dict, cfg=None) -> VerifiersTask:
    """The task `verifiers/<env_id>` (an installed package) or `verifiers` (task.args.env), built with task.args:
    env, taskset (the TasksetConfig's fields; its `id` names an Env's taskset), env_args (the EnvConfig's: the
    seat's max_turns), size, heldout_size, heldout (TasksetConfig fields of the held-out split),
    correct_threshold (docs/verifiers.md)."""
    import verifiers.v1 as vf
    from verifiers.v1.envs.single_agent import SingleAgentEnvConfig
    from verifiers.v1.utils.generic import concrete_type

    args = dict(args)
    taskset_args, env_args = args.pop("taskset", {}), args.pop("env_args", {})
    if not isinstance(taskset_args, dict):
        raise NotRunnable(f"task.args.taskset must be a mapping of the taskset's settings, got {taskset_args!r}")
    taskset_args = dict(taskset_args)
    src = source(env_id, args.pop("env", None), taskset_args.pop("id", None))
    ts_cfg_cls = concrete_type(src.taskset_cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    ts_cfg = _validated(ts_cfg_cls, {**taskset_args, "id": src.taskset_id}, "task.args.taskset")
    try:  # the environment's own code: its constructor and load() (the first task: what the checks read)
        taskset = src.taskset_cls(ts_cfg)
        first = next(iter(taskset), None)
    except Exception as e:  # noqa: BLE001 -- whatever it raises is one line naming it
        raise NotRunnable(f"loading the tasks of {src.taskset_cls.__name__} raised {one_line(e)}") from None
    if first is None:
        raise NotRunnable(f"{type(taskset).__name__} has no tasks")
    env_cls = src.env_cls
    env_cfg_cls = SingleAgentEnvConfig if env_cls is None else concrete_type(env_cls, vf.EnvConfig, origin=vf.Env)
    if isinstance(env_args, dict) and "taskset" in env_args:
        raise NotRunnable("task.args.env_args.taskset: the taskset's settings are task.args.taskset")
    env_cfg = _validated(env_cfg_cls or vf.EnvConfig, env_args, "task.args.env_args")
    seat = check_seats(env_cfg, env_cls)
    try:
        check_task(taskset, first)
    except NotRunnable:
        raise
    except Exception as e:  # noqa: BLE001 -- a plugged hook that does not import, a toolsets() that raises
        raise NotRunnable(f"reading the hooks of {type(first).__name__} raised {one_line(e)}") from None
    if env_cls is None:
        return VerifiersTask(src, taskset, first, seat, **args)
    if cfg is not None and cfg.data.use_chat_template is False:  # auto: the tokenizer must have one (chat_turns)
        raise NotRunnable(f"{env_cls.__name__} writes user turns, which need data.use_chat_template: true")
    env = env_cls.__new__(env_cls)  # Env.__init__ loads harnesses and tool servers: none of them runs here
    env.config, env.taskset = env_cfg, taskset
    return VerifiersEnvironment(src, taskset, first, seat, env, **args)

"""The rollout-backend factory: above the backends it builds (each imports rollout/base.py, never this).

rollout.backend names a row of BUILDERS (hf, vllm, server; 'auto' resolved to vllm or hf; what each needs of the
config and declares to the rest: rollout/kinds.py) or a user's backend, 'path/to/file.py:NAME' or
'package.module:NAME': a class or factory called as NAME(ctx=BackendContext, **rollout.backend_args) that returns
a RolloutBackend (rollout/base.py). A run with rollout.max_async_level > 0 needs a VersionedBackend (checked in
`versioned`).
"""

from __future__ import annotations

from rl_training.config import plugins
from rl_training.config.schema import ConfigError
from rl_training.rollout.base import BackendContext, RolloutBackend, VersionedBackend
from rl_training.rollout.kinds import BACKEND


def hf_backend(ctx: BackendContext) -> RolloutBackend:
    from rl_training.rollout.hf import HFBackend

    return HFBackend(ctx.model, ctx.tokenizer, ctx.cfg.rollout.gen_batch_size, start_version=ctx.start_step)


def vllm_backend(ctx: BackendContext) -> RolloutBackend:
    from rl_training.rollout.vllm_engine import VLLMBackend

    return VLLMBackend(
        ctx.cfg, ctx.model, ctx.tokenizer, ctx.dist_info, ctx.episode_tokens, start_version=ctx.start_step
    )


def server_backend(ctx: BackendContext) -> RolloutBackend:
    from rl_training.rollout.server import ServerBackend

    return ServerBackend(ctx.cfg, ctx.model, ctx.tokenizer, ctx.dist_info, start_version=ctx.start_step)


BUILDERS = {"hf": hf_backend, "vllm": vllm_backend, "server": server_backend}


def build_backend(cfg, model, tokenizer, dist_info, start_step: int = 0, episode_tokens: int = 0) -> RolloutBackend:
    """Chosen once at setup from rollout.backend (already resolved from 'auto'). `start_step`: the optimizer
    steps the model has taken (a resumed run's), where the backends' policy/weight versions continue; `episode_tokens`:
    what a multi-turn episode reaches after its prompt (rollout/episodes.py, episode_budget), which the
    colocated engine's context must hold."""
    ctx = BackendContext(cfg, model, tokenizer, dist_info, start_step, episode_tokens)
    obj, builtin = plugins.find(BACKEND, cfg.rollout.backend, BUILDERS)
    if not builtin:  # a user's: whatever its constructor raises is one line naming the spec
        return plugins.construct(BACKEND, cfg.rollout.backend, obj, cfg.rollout.backend_args, ctx=ctx)
    if cfg.rollout.backend_args:
        raise ConfigError(
            f"rollout.backend={cfg.rollout.backend} is built in and takes no rollout.backend_args (its settings "
            f"are the config's own sections); got {dict(cfg.rollout.backend_args)!r}"
        )
    return obj(ctx)  # an engine's or a server's own errors (a refused adapter, CUDA) reach the caller as they are


def build_rollout(cfg, model, tokenizer, dist_info, task, start_step: int = 0) -> RolloutBackend:
    """What every command generates with: the configured backend, running `task`'s episodes when it is an
    Environment (rollout/episodes.py), with an engine context sized for them."""
    from rl_training.rollout.episodes import episode_budget, with_episodes

    backend = build_backend(cfg, model, tokenizer, dist_info, start_step, episode_budget(cfg, task))
    return with_episodes(cfg, backend, tokenizer, task)


def versioned(backend: RolloutBackend, cfg) -> VersionedBackend:
    """The backend as a VersionedBackend, which rollout.max_async_level > 0 needs; ConfigError (one line) when it
    is not one (pinned, republish and version_dirs are missing)."""
    if not isinstance(backend, VersionedBackend):
        missing = [m for m in ("pinned", "republish", "version_dirs") if not callable(getattr(backend, m, None))]
        raise ConfigError(
            f"rollout.max_async_level={cfg.rollout.max_async_level} needs a versioned backend (rollout/base.py, "
            f"VersionedBackend); rollout.backend={cfg.rollout.backend} has no {', '.join(missing)}"
        )
    return backend

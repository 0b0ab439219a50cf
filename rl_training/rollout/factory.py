"""The rollout-backend factory: above the backends it builds (each imports rollout/base.py, never this)."""

from __future__ import annotations

from rl_training.rollout.base import RolloutBackend


def build_backend(cfg, model, tokenizer, dist_info, start_step: int = 0, episode_tokens: int = 0) -> RolloutBackend:
    """Chosen once at setup from rollout.backend (already resolved from 'auto'). `start_step`: the optimizer
    steps the model has taken (a resumed run's), where the backends' policy/weight versions continue; `episode_tokens`:
    what a multi-turn episode reaches after its prompt (rollout/episodes.py, episode_budget), which the
    colocated engine's context must hold."""
    if cfg.rollout.backend == "server":
        from rl_training.rollout.server import ServerBackend

        return ServerBackend(cfg, model, tokenizer, dist_info, start_version=start_step)
    if cfg.rollout.backend == "vllm":
        from rl_training.rollout.vllm_engine import VLLMBackend

        return VLLMBackend(cfg, model, tokenizer, dist_info, episode_tokens, start_version=start_step)
    from rl_training.rollout.hf import HFBackend

    return HFBackend(model, tokenizer, cfg.rollout.gen_batch_size)


def build_rollout(cfg, model, tokenizer, dist_info, task, start_step: int = 0) -> RolloutBackend:
    """What every command generates with: the configured backend, running `task`'s episodes when it is an
    Environment (rollout/episodes.py), with an engine context sized for them."""
    from rl_training.rollout.episodes import episode_budget, with_episodes

    backend = build_backend(cfg, model, tokenizer, dist_info, start_step, episode_budget(cfg, task))
    return with_episodes(cfg, backend, tokenizer, task)

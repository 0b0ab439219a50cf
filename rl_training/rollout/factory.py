"""The rollout-backend factory: above the backends it builds (each imports rollout/base.py, never this)."""

from __future__ import annotations

from rl_training.rollout.base import RolloutBackend


def resolve_backend_name(name: str) -> str:
    """'auto' -> 'vllm' where vLLM is installed, else 'hf'."""
    if name != "auto":
        return name
    from rl_training.rollout.vllm_engine import vllm_available

    return "vllm" if vllm_available() else "hf"


def build_backend(cfg, model, tokenizer, dist_info, start_step: int = 0) -> RolloutBackend:
    """Chosen once at setup from rollout.backend (already resolved from 'auto'). `start_step`: the optimizer
    steps the model has taken (a resumed run's), the server backend's first policy version."""
    if cfg.rollout.backend == "server":
        from rl_training.rollout.server import ServerBackend

        return ServerBackend(cfg, model, tokenizer, dist_info, start_version=start_step)
    if cfg.rollout.backend == "vllm":
        from rl_training.rollout.vllm_engine import VLLMBackend

        return VLLMBackend(cfg, model, tokenizer, dist_info)
    from rl_training.rollout.hf import HFBackend

    return HFBackend(model, tokenizer, cfg.rollout.gen_batch_size)

"""What the rest of the code asks of a rollout backend, declared by the backends, so that nothing outside rollout/
branches on a backend's name:

- `check(cfg, where, training)`: the backend's config rules, run by every command that builds a backend right after
  its config loads and resolves, before any model loads (`check_backend`; `training`: the RL runner's, whose
  engine sleeps between updates and may run ahead of them);
- `prefix_cache`: whether it prefills a group's prompt once for its K completions (the rollout-budget advisor's
  cost model, probes/budget.py);
- `canary_advice(cfg)`: what to check when the weight guard stops a run on the canary (train/weight_guard.py).

A built-in backend's kind is a row of KINDS. A user's backend ('file.py:NAME', 'package.module:NAME') may define
the same three on its class or factory; without them it is checked by nothing, counts its prompts once per
completion, and gets the generic advice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rl_training.config import plugins
from rl_training.config.plugins import Kind
from rl_training.config.schema import Config, ConfigError
from rl_training.rollout.base import RolloutBackend

BACKEND = Kind(
    key="rollout.backend",
    noun="backend",
    args_key="rollout.backend_args",
    what="rl_training.rollout.base.RolloutBackend",
    accepts=lambda obj: not isinstance(obj, type) and isinstance(obj, RolloutBackend),
    is_class=lambda obj: all(callable(getattr(obj, m, None)) for m in ("generate", "sync_weights", "close")),
)

# vLLM 0.32 takes max_lora_rank only from these (LoRAConfig's MaxLoRARanks, vllm/config/lora.py): lora.r=24 would
# fail at engine build, after the model loaded. The engine is built at the smallest one >= lora.r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM 0.32's CPU attention takes KV blocks of a multiple of 32 tokens and defaults to 128. Its prefix cache shares
# only full blocks, so at 128 a group's repeated prompt shorter than that is prefilled again for every completion;
# at 32 the completions share all of the prompt's full blocks (vllm.block_size).
CPU_BLOCK_SIZE = 32


def vllm_max_lora_rank(r: int) -> int:
    """The max_lora_rank an engine (or a server's --max-lora-rank) needs for adapters of rank `r`."""
    fits = [k for k in VLLM_LORA_RANKS if k >= r]
    if not fits:
        raise ConfigError(
            f"lora.r={r}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; lower lora.r, or push merged weights "
            "(vllm.weight_sync=merge, server.weight_sync=full)"
        )
    return fits[0]


def _lora_rank(cfg: Config, where: str) -> None:
    try:
        vllm_max_lora_rank(cfg.lora.r)
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None


def check_vllm_sleep(cfg: Config, where: str = "") -> None:
    """vllm.weight_sync=lora never sends the base weights again, so the engine may not sleep at level 2, which
    discards them (vLLM's cumem allocator keeps only buffers; wake maps fresh memory): from the second step every
    rollout would sample from freed memory (issue 29, N1). Checked before the model loads and again by the engine."""
    v = cfg.vllm
    if v.weight_sync == "lora" and v.sleep and v.sleep_level == 2:
        raise ConfigError(
            f"{where}vllm.weight_sync=lora with vllm.sleep_level=2: level 2 discards the base weights and a LoRA "
            "sync never sends them again; set vllm.sleep_level=1 (they wait in host memory) or vllm.sleep=false"
        )


def _in_process(cfg: Config, where: str, training: bool) -> None:
    """An in-process engine (HF, the colocated vLLM) generates in the trainer's process, between its updates."""
    k = cfg.rollout.max_async_level
    if training and k > 0:
        raise ConfigError(
            f"{where}rollout.max_async_level={k} needs rollout.backend=server (got {cfg.rollout.backend}): an "
            "in-process engine cannot generate while the trainer runs in the same process"
        )


def _check_hf(cfg: Config, where: str, training: bool) -> None:
    _in_process(cfg, where, training)


def _check_vllm(cfg: Config, where: str, training: bool) -> None:
    _in_process(cfg, where, training)
    if training:
        check_vllm_sleep(cfg, where)
    if cfg.vllm.weight_sync == "lora":  # an adapter pushed through vLLM's LoRA path must have a rank it serves
        _lora_rank(cfg, where)


def _check_server(cfg: Config, where: str, training: bool) -> None:
    s = cfg.server
    if not s.urls:
        raise ConfigError(f"{where}rollout.backend=server needs server.urls (e.g. ['http://127.0.0.1:8000'])")
    k = cfg.rollout.max_async_level
    if training and k > 0 and s.weight_sync != "lora":
        raise ConfigError(
            f"{where}rollout.max_async_level={k} needs server.weight_sync=lora (got {s.weight_sync}): a server "
            "holds one set of full weights, so it cannot sample the older versions queued batches need"
        )
    if s.weight_sync == "lora":
        _lora_rank(cfg, where)


def _hf_advice(cfg: Config) -> str:
    return (
        "the HF backend samples with the trainer's own model, so a gap means generation and the training forward "
        f"disagree: model.dtype={cfg.model.dtype}, model.attn_implementation={cfg.model.attn_implementation}, "
        "rollout.temperature"
    )


def _vllm_advice(cfg: Config) -> str:
    v = cfg.vllm
    sync = (
        "each version a new adapter name and path, the previous one removed"
        if v.weight_sync == "lora"
        else "every tensor pushed with reload_weights after each step"
    )
    return (
        f"the weight sync (vllm.weight_sync={v.weight_sync}: {sync}), the sleep mode (vllm.sleep="
        f"{str(v.sleep).lower()}, vllm.sleep_level={v.sleep_level}: level 2 discards the weights, so the sync after "
        "each wake must rewrite them all) and that rollout/weight_version rises by 1 a step"
    )


def _server_advice(cfg: Config) -> str:
    return (
        f"the server publish (server.weight_sync={cfg.server.weight_sync}): each server's log for the load of the "
        "step's policy version, that every server in server.urls runs the same base model with the same --dtype "
        "as model.dtype, and rollout/policy_version_* against the step"
    )


def _user_advice(cfg: Config) -> str:
    return (
        f"how rollout.backend={cfg.rollout.backend} loads the trainer's weights after each step (sync_weights) and "
        f"that it samples in model.dtype={cfg.model.dtype} at rollout.temperature"
    )


@dataclass(frozen=True)
class BackendKind:
    name: str
    prefix_cache: bool  # a group's prompt is prefilled once for its K completions
    check: Callable[[Config, str, bool], None]
    canary_advice: Callable[[Config], str]
    what: str = ""  # what it is, in rollout.backend's generated help (docs/config.md)


KINDS: dict[str, BackendKind] = {
    k.name: k
    for k in (
        BackendKind("hf", False, _check_hf, _hf_advice, "transformers' generate in the trainer's process"),
        BackendKind(
            "vllm", True, _check_vllm, _vllm_advice, "a colocated in-process vLLM engine, asleep while training"
        ),
        BackendKind(
            "server", True, _check_server, _server_advice, "vLLM OpenAI servers at server.urls, docs/server.md"
        ),
    )
}


def _no_check(cfg: Config, where: str, training: bool) -> None:
    return None


def backend_kind(cfg: Config) -> BackendKind:
    """rollout.backend's kind (resolved from 'auto' already): a built-in's row, or what a user's backend declares
    (its file is imported here: its errors come before any model loads)."""
    name = cfg.rollout.backend
    if name in KINDS:
        return KINDS[name]
    if name == "auto":
        raise ConfigError("rollout.backend=auto must be resolved (config/resolve.py) before its kind is asked")
    obj, _ = plugins.find(BACKEND, name, KINDS)  # a user's: imported as the factory will build it
    check = getattr(obj, "check", None)
    advice = getattr(obj, "canary_advice", None)
    return BackendKind(
        name,
        bool(getattr(obj, "prefix_cache", False)),
        (lambda cfg, where, training: check(cfg)) if callable(check) else _no_check,
        advice if callable(advice) else _user_advice,
    )


def check_backend(cfg: Config, where: str = "", training: bool = True) -> None:
    """The chosen backend's config rules: every command that builds a backend calls it after its config loads
    and resolves, before any model loads (`training`: the RL runner). One line (ConfigError) naming the keys."""
    backend_kind(cfg).check(cfg, where, training)

"""Policy construction: any HF causal LM (hub id or local path, offline-safe) plus a peft LoRA adapter.

The reference policy for KL is the same model with the adapter disabled (`model.disable_adapter()`), so
no second copy of the weights exists. The optimizer sees trainable parameters only, and
`assert_only_adapter_trainable` checks after build and after resume that exactly the LoRA tensors train.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from rl_training.base.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(UserError, RuntimeError):
    pass


def _looks_local(name: str) -> bool:
    # Hub ids are 'name' or 'org/name'; anything else is a filesystem path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def check_model_path(name_or_path: str) -> None:
    """A local-looking path that does not exist is a one-line error, not a hub lookup."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"model.name_or_path={name_or_path}: directory has no config.json")
        return
    if _looks_local(name_or_path):
        raise ModelLoadError(f"model.name_or_path={name_or_path}: no such model directory")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    check_model_path(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise ModelLoadError(
            f"model.name_or_path={name_or_path}: cannot load tokenizer "
            f""
            f"(not a local directory; hub offline={os.environ.get('HF_HUB_OFFLINE', '0')}): "
            f"{str(e).splitlines()[0]}"
        ) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def check_attn_implementation(name: str) -> None:
    """flash_attention_2 needs the flash-attn package (not in requirements: it is built per CUDA/torch pair);
    transformers' own error appears deep inside from_pretrained."""
    import importlib.util

    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ModelLoadError(
            "model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not installed; "
            "use sdpa (the default) or install flash-attn for this torch and CUDA"
        )


def load_base_model(model_cfg, device: torch.device):
    from transformers import AutoModelForCausalLM

    check_model_path(model_cfg.name_or_path)
    check_attn_implementation(model_cfg.attn_implementation)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_cfg.name_or_path,
            dtype=DTYPES[model_cfg.dtype],
            attn_implementation=model_cfg.attn_implementation,
            trust_remote_code=model_cfg.trust_remote_code,
        )
    except OSError as e:
        raise ModelLoadError(
            f"model.name_or_path={model_cfg.name_or_path}: cannot load model "
            f""
            f"(not a local directory; hub offline={os.environ.get('HF_HUB_OFFLINE', '0')}): "
            f"{str(e).splitlines()[0]}"
        ) from None
    model.to(device)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def apply_lora(model, lora_cfg):
    from peft import LoraConfig, get_peft_model

    targets = lora_cfg.target_modules
    peft_cfg = LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
    )
    model = get_peft_model(model, peft_cfg)
    assert_only_adapter_trainable(model)
    return model


def build_policy(cfg, device: torch.device):
    """(tokenizer, peft model). Seed the RNG identically on every rank before calling: LoRA init is random."""
    tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
    model = apply_lora(load_base_model(cfg.model, device), cfg.lora)
    return tokenizer, model


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def assert_only_adapter_trainable(model) -> None:
    wrong = [n for n, p in model.named_parameters() if p.requires_grad != ("lora_" in n)]
    if wrong:
        raise RuntimeError(f"exactly the LoRA parameters must require grad; wrong for: {wrong[:5]}")
    if not any(p.requires_grad for p in model.parameters()):
        raise RuntimeError("no trainable LoRA parameters: check lora.target_modules")


def merged_hf_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's current weights in the base model's HF names, each LoRA delta merged in (lazily).

    `model` is the peft model; nothing is modified. Tied weights appear once (as the HF state dict would
    list them for loading). Used to push the trained policy into a rollout engine. The merges are computed
    together up front (one baddbmm per weight shape), then yielded one by one.
    """
    from peft.tuners.lora import LoraLayer

    from rl_training.policy.lora_merge import merged_weights

    base = model.get_base_model()
    adapter = model.active_adapter
    lora_modules = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    merged = merged_weights(lora_modules, adapter)  # batched by shape (lora_merge.py); one dict of views
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        if ".base_layer." not in name:
            yield name, p.detach()
            continue
        module_name, leaf = name.split(".base_layer.")
        layer, w = lora_modules[module_name], p.detach()
        if leaf == "weight" and module_name in merged:
            w = merged[module_name]
        elif leaf == "weight" and adapter in layer.lora_A and not layer.disable_adapters:
            w = w + layer.get_delta_weight(adapter).to(w.dtype)  # one at a time: a model too big to batch
        yield f"{module_name}.{leaf}", w

"""The policy's weights with each LoRA delta merged in, batched: one baddbmm per weight shape, not three small
ops per LoRA layer.

`merged_hf_weights` (models.py) feeds every weight sync into a rollout engine. Per layer it computed
W + (B @ A) * s: on a small model each of those ~3 x 7 x n_layers tiny ops costs more in dispatch than in
arithmetic (on a loaded 2-core CPU 20-50 ms each; the merge was 9% of a vLLM step, docs/benchmarks.md). Here
layers whose (W, A, B) shapes, dtype, device and scale agree are stacked and merged by one
torch.baddbmm(W, B, A, alpha=s), and the stack is unbound into per-layer views. Same formula; the float
result can differ from the per-layer one in the last bit (another matmul blocking), far below the canary.
Layers peft would treat specially (fan_in_fan_out, DoRA, a half-precision adapter on CPU) keep peft's own
get_delta_weight. Batching holds every merged weight at once, so it is done only while they total at most
BATCH_BYTES (a small model, where dispatch dominates); larger models get {} and merge lazily, one layer at a
time, as before (their merge is arithmetic-bound and a second copy of the weights would not fit).
"""

from __future__ import annotations

import torch


def _plain(layer, adapter: str) -> bool:
    w = layer.get_base_layer().weight
    use_dora = getattr(layer, "use_dora", {}).get(adapter, False)
    half_on_cpu = w.device.type == "cpu" and w.dtype in (torch.float16, torch.bfloat16)
    return not getattr(layer, "fan_in_fan_out", False) and not use_dora and not half_on_cpu


BATCH_BYTES = 256 * 2**20


def merged_weights(lora_modules: dict, adapter: str) -> dict[str, torch.Tensor]:
    """{module name: W + delta} for every LoRA layer with `adapter` active (no grad, nothing modified); {} when
    those weights total more than BATCH_BYTES (the caller merges lazily)."""
    weights = [m.get_base_layer().weight for m in lora_modules.values()]
    if sum(w.numel() * w.element_size() for w in weights) > BATCH_BYTES:
        return {}
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple, list[str]] = {}
    for name, layer in lora_modules.items():
        if adapter not in layer.lora_A or layer.disable_adapters:
            continue
        w = layer.get_base_layer().weight.detach()
        if not _plain(layer, adapter):
            out[name] = w + layer.get_delta_weight(adapter).to(w.dtype)
            continue
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        key = (tuple(w.shape), tuple(a.shape), tuple(b.shape), w.dtype, a.dtype, w.device, layer.scaling[adapter])
        groups.setdefault(key, []).append(name)
    with torch.no_grad():
        for key, names in groups.items():
            layers = [lora_modules[n] for n in names]
            w = torch.stack([m.get_base_layer().weight for m in layers])
            a = torch.stack([m.lora_A[adapter].weight for m in layers]).to(w.dtype)
            b = torch.stack([m.lora_B[adapter].weight for m in layers]).to(w.dtype)
            merged = torch.baddbmm(w, b, a, alpha=key[-1])
            out.update(zip(names, merged.unbind(0), strict=True))
    return out

"""The batched LoRA merge (rl_training/policy/lora_merge.py) equals peft's per-layer W + get_delta_weight."""

from __future__ import annotations

import torch

from rl_training.policy.lora_merge import merged_weights
from rl_training.policy.models import merged_hf_weights
from tests.helpers import lora_policy


def test_batched_merge_equals_peft_per_layer(tiny_model, monkeypatch):
    from peft.tuners.lora import LoraLayer

    model = lora_policy(tiny_model)  # float64, random B: every delta is non-zero
    layers = {n: m for n, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}
    got = merged_weights(layers, "default")
    assert set(got) == set(layers) and len(got) == 7 * 4  # q,k,v,o,gate,up,down x 4 layers
    for name, layer in layers.items():
        want = layer.get_base_layer().weight + layer.get_delta_weight("default")
        assert (want - layer.get_base_layer().weight).abs().max() > 1e-4
        torch.testing.assert_close(got[name], want, rtol=1e-12, atol=1e-14)
    # above BATCH_BYTES: {} and merged_hf_weights merges lazily, to the same values
    batched = dict(merged_hf_weights(model))
    monkeypatch.setattr("rl_training.policy.lora_merge.BATCH_BYTES", 0)
    assert merged_weights(layers, "default") == {}
    lazy = dict(merged_hf_weights(model))
    assert batched.keys() == lazy.keys()
    for k in lazy:
        torch.testing.assert_close(batched[k], lazy[k], rtol=1e-12, atol=1e-14)

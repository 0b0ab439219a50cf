"""SFT precision (issue 12, item 12): a bf16 full fine-tune keeps fp32 master weights, so updates smaller
than bf16's resolution accumulate instead of rounding away."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from rl_training.runners import sft_runner
from tests.helpers import REPO, data_overrides


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_bf16_full_finetune_keeps_updates_below_bf16_resolution(tiny_model, reverse_data, tmp_path):
    # Weights with |w| in [2^-6, 2^-5) have bf16 spacing 2^-6 * 2^-7 = 2^-13 ~ 1.22e-4, so a bf16 weight moves
    # only for an update above half that, ~6.1e-5. Adam's step is about lr = 2e-5 per element: AdamW on bf16
    # weights leaves every one of them exactly as loaded (fraction changed 0). With fp32 masters the steps add
    # up (20 steps, cosine from 2e-5: up to ~2e-4, about 1.6 spacings) and most of them move.
    rc = sft_runner.main(
        [
            "--cfg",
            str(REPO / "cfg" / "tiny_sft.yaml"),
            f"model.name_or_path={tiny_model}",
            *data_overrides(reverse_data),
            f"run.output_dir={tmp_path}",
            "run.name=bf16",
            "model.dtype=bfloat16",
            "sft.steps=20",
            "sft.batch_size=8",
            "sft.warmup_steps=0",
            "sft.lr=2e-5",
        ]
    )
    assert rc == 0
    final_dir = tmp_path / "bf16" / "final_model"
    before, after = weights(tiny_model), weights(final_dir)
    assert all(t.dtype == torch.bfloat16 for t in after.values())  # saved in the configured dtype
    assert json.loads((final_dir / "config.json").read_text())["dtype"] == "bfloat16"
    changed = total = 0
    for name, w0 in before.items():
        w0_bf16 = w0.to(torch.bfloat16)
        band = (w0_bf16.abs() >= 2**-6) & (w0_bf16.abs() < 2**-5)
        changed += (after[name][band] != w0_bf16[band]).sum().item()
        total += band.sum().item()
    assert total > 1000  # the band is well populated (init std 0.02)
    assert changed / total > 0.3

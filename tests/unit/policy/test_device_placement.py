"""The trainer's tensor code on torch's "meta" device (shapes and dtypes, no data, no GPU needed): a tensor
left on the CPU, or a host sync inside the update (`.item()`, `.tolist()`, `bool(tensor)`), raises here as it
would misbehave on a GPU (a device-mismatch error, or one stall per call). The meta device rather than
FakeTensorMode with a fake CUDA device: in torch 2.13 a matmul on a fake CUDA tensor aborts a CPU-only process
(no CUDA device guard) instead of raising."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from rl_training.algs.corrections import TruncatedIS
from rl_training.algs.objectives import OBJECTIVES, StepNorm
from rl_training.base.meter import Meter
from rl_training.train import learner
from rl_training.train.batches import make_micro_batches
from rl_training.train.learner import UpdateHParams, step_advantages, train_on_rollouts
from tests.helpers import G, fake_rollouts

DEVICE = torch.device("meta")


class TinyLM(torch.nn.Module):
    """Embedding + linear head with the two entry points the update uses (forward, peft's disable_adapter)."""

    def __init__(self, device: torch.device, vocab: int = 256, dim: int = 8):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.empty(vocab, dim, device=device))
        self.head = torch.nn.Parameter(torch.empty(vocab, dim, device=device))

    def forward(self, input_ids, attention_mask, use_cache):
        h = torch.nn.functional.embedding(input_ids, self.emb) * attention_mask.unsqueeze(-1)
        return SimpleNamespace(logits=h @ self.head.T)

    @contextmanager
    def disable_adapter(self):
        yield


@pytest.mark.parametrize("objective", ["dr_grpo", "gspo", "reinforce_pp"])
def test_update_runs_on_a_non_cpu_device_without_host_syncs(monkeypatch, objective):
    ro = fake_rollouts(4, seed=5)  # built on the host, as the rollout backends return them
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.9, 0.0, 1.0], dtype=torch.float64)
    o = OBJECTIVES[objective]
    norm = StepNorm(seqs=len(ro), tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=8)
    hp = UpdateHParams(
        objective=o,
        clip_low=o.clip_low,
        clip_high=o.clip_high,
        inner_epochs=2,
        kl_coef=0.1,
        correction=TruncatedIS(2.0),
    )
    decided: list[torch.device] = []
    # The update's host reads are where a real run syncs: the non-finite decision once per optimizer step (record
    # the device it reads) and the meter's one copy of the step's numbers (Meter.reduce, after the update).
    monkeypatch.setattr(learner, "nonfinite", lambda loss, norm: decided.append(norm.device) or ())
    model = TinyLM(DEVICE)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    adv = step_advantages(o, rewards, G, DEVICE)
    mbs = make_micro_batches(ro, adv, G, 2, 0, DEVICE)
    assert all(t.device == DEVICE for mb in mbs for t in (mb.input_ids, mb.mask, mb.advantages, mb.rollout_logp))
    meter = Meter()
    train_on_rollouts(model, opt, sched, params, mbs, hp, norm, meter=meter)
    assert all(p.grad.device == DEVICE for p in params)
    metered = [*meter.sums.values(), *meter.maxes.values(), *(t for ts in meter.kept.values() for t in ts)]
    tensors = [v for v in metered if isinstance(v, torch.Tensor)]
    # every measured number stays where it was computed (the Python ones are counts: a per=1, a sequence count)
    assert len(tensors) > 10 and all(t.device == DEVICE for t in tensors)
    assert {"train/entropy", "train/kl", "is/trunc_frac", "rollout/logp_diff_mean"} <= set(meter.kinds)
    assert decided == [DEVICE, DEVICE]  # inner_epochs=2: one decision per optimizer step


def test_meta_device_catches_a_host_sync_and_a_cpu_tensor():
    # Negative controls for the test above: what it would catch.
    x = torch.ones(3, device=DEVICE)
    with pytest.raises(RuntimeError, match="meta"):
        x.sum().item()
    with pytest.raises(RuntimeError, match="device"):
        x + torch.ones(3)

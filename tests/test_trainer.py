"""The Dr-GRPO update on the real tiny model (float64): micro-batch split and padding invariance,
zero-advantage groups, old log-probs and the trainer-vs-sampler canary."""

from __future__ import annotations

import pytest
import torch

from rl_training.config import LoraCfg
from rl_training.models import apply_lora, trainable_parameters
from rl_training.rollout.base import Rollouts
from rl_training.trainer import UpdateHParams, make_micro_batches, train_on_rollouts

G = 2


@pytest.fixture(scope="module")
def policy(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # sdpa (the default): transformers 5's eager path shifts logits by ~1e-7 when every row carries padding.
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64, attn_implementation="sdpa")
    model = apply_lora(base, LoraCfg(r=4, alpha=8))
    with torch.no_grad():  # LoRA B starts at 0, which would zero every A gradient; make both matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def fake_rollouts(n_groups: int, seed: int = 0) -> Rollouts:
    g = torch.Generator().manual_seed(seed)
    prompts, comps, lps = [], [], []
    for _ in range(n_groups):
        p = torch.randint(2, 200, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(G):
            c = torch.randint(2, 200, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
            prompts.append(p)
            comps.append(c)
            lps.append([-1.0] * len(c))
    return Rollouts(prompts, comps, lps, [False] * len(comps), [""] * len(comps))


def grads_after(model, rollouts, adv, groups_per_micro, *, extra_pad=0, kl_coef=0.0, drop=False, epochs=1):
    params = trainable_parameters(model)
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mbs = make_micro_batches(rollouts, adv, G, groups_per_micro, 0, torch.device("cpu"), drop, extra_pad)
    hp = UpdateHParams(normalizer=len(rollouts) * 8, inner_epochs=epochs, kl_coef=kl_coef, max_grad_norm=0.0)
    stats = train_on_rollouts(model, opt, sched, params, mbs, hp)
    return torch.cat([p.grad.reshape(-1).clone() for p in params]), stats


def test_gradient_invariant_to_micro_batch_split_and_padding(policy):
    ro = fake_rollouts(4)  # 4 groups x G=2 = 8 sequences
    adv = torch.tensor([0.5, -0.5, 0.3, -0.3, 0.0, 0.0, 1.0, -1.0], dtype=torch.float64)
    g_1x8, _ = grads_after(policy, ro, adv, groups_per_micro=4)
    g_2x4, _ = grads_after(policy, ro, adv, groups_per_micro=2)
    g_4x2, _ = grads_after(policy, ro, adv, groups_per_micro=1)
    g_pad, _ = grads_after(policy, ro, adv, groups_per_micro=2, extra_pad=7)
    assert g_1x8.abs().max() > 1e-4  # the gradient is not trivially zero
    for other in (g_2x4, g_4x2, g_pad):
        torch.testing.assert_close(other, g_1x8, rtol=1e-9, atol=1e-12)


def test_zero_advantage_group_gives_zero_gradient_without_kl(policy):
    ro = fake_rollouts(1)
    adv = torch.zeros(G, dtype=torch.float64)
    g, _ = grads_after(policy, ro, adv, 1)
    assert g.abs().max().item() == 0.0
    # Negative control: the KL term does move a zero-advantage group (policy != reference here).
    g_kl, _ = grads_after(policy, ro, adv, 1, kl_coef=0.1)
    assert g_kl.abs().max().item() > 1e-8


def test_dropping_zero_advantage_groups_keeps_the_gradient(policy):
    # With the normaliser fixed for the step, skipping A=0 groups only saves compute (no KL term).
    ro = fake_rollouts(4, seed=1)
    adv = torch.tensor([0.0, 0.0, 0.4, -0.4, 0.0, 0.0, 0.2, -0.2], dtype=torch.float64)
    g_all, _ = grads_after(policy, ro, adv, 2)
    g_drop, _ = grads_after(policy, ro, adv, 2, drop=True)
    torch.testing.assert_close(g_drop, g_all, rtol=1e-9, atol=1e-12)


def test_epoch_zero_is_on_policy_and_canary_sees_sampler_logps(policy):
    ro = fake_rollouts(2, seed=2)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    _, stats = grads_after(policy, ro, adv, 2)
    assert stats.clipped_tokens == 0.0  # ratio == 1 exactly in the first epoch
    # The fake sampler log-probs are all -1.0: the canary measures |trainer logp + 1| per token.
    params = trainable_parameters(policy)
    mbs = make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu"))
    with torch.no_grad():
        logits = policy(input_ids=mbs[0].input_ids, attention_mask=mbs[0].attention_mask).logits[:, :-1]
        from rl_training.algs.dr_grpo import token_logprobs

        lp = token_logprobs(logits, mbs[0].targets)
    m = mbs[0].mask.bool()
    assert stats.logp_absdiff_sum == pytest.approx((lp[m] + 1.0).abs().sum().item(), rel=1e-9)
    assert len(params) > 0

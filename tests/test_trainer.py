"""The Dr-GRPO update on the real tiny model (float64): micro-batch split and padding invariance,
zero-advantage groups, old log-probs and the trainer-vs-sampler canary."""

from __future__ import annotations

import pytest
import torch

from rl_training.algs.objectives import OBJECTIVES
from rl_training.models import trainable_parameters
from rl_training.trainer import make_micro_batches, step_advantages
from tests.helpers import G, fake_rollouts, grads_after, lora_policy


@pytest.fixture(scope="module")
def policy(tiny_model):
    return lora_policy(tiny_model)


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


# Dropping holds for every objective, derived: a group is dropped only when all its advantages are exactly
# 0 (make_micro_batches tests adv != 0), and every surrogate is linear in A there: PPO clip
# -min(r*0, clip(r)*0) = 0, GSPO the same with the sequence ratio, CISPO -sg(w)*0*logp = 0. So the dropped
# group's loss is 0 with zero gradient, and every normaliser (StepNorm: seqs, tokens, max_new_tokens) counts
# the step's sequences and tokens whether or not they were dropped, so the kept groups' terms do not change.
# The advantages themselves are computed before dropping: a zero-variance group stays exactly 0 under GRPO's
# std scale (0 / (0 + 1e-6)), RLOO's G/(G-1) factor and REINFORCE++'s batch std, and REINFORCE++'s batch std
# includes the zero groups whether or not they are dropped later. (Equal rewards whose float group mean
# differs from them still give exactly 0: group_advantages zeroes every group with max == min.)
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_dropping_zero_advantage_groups_keeps_the_gradient(policy, name):
    ro = fake_rollouts(4, seed=1)
    rewards = torch.tensor([0.7, 0.7, 1.0, 0.2, 0.0, 0.0, 0.5, 0.9], dtype=torch.float64)  # groups 0, 2: A = 0
    adv = step_advantages(OBJECTIVES[name], rewards, G, torch.device("cpu"))
    assert (adv.view(4, G)[[0, 2]] == 0).all() and (adv.view(4, G)[[1, 3]] != 0).all()
    g_all, _ = grads_after(policy, ro, adv, 2, objective=name)
    g_drop, _ = grads_after(policy, ro, adv, 2, drop=True, objective=name)
    assert g_all.abs().max() > 1e-5  # the kept groups do move the policy
    torch.testing.assert_close(g_drop, g_all, rtol=1e-9, atol=1e-12)


def test_dropping_zero_advantage_groups_would_lose_their_kl_gradient(policy):
    # Why the config refuses drop_zero_adv_groups with loss.kl_coef > 0: the dropped groups' KL gradient goes.
    ro = fake_rollouts(4, seed=1)
    adv = torch.tensor([0.0, 0.0, 0.4, -0.4, 0.0, 0.0, 0.2, -0.2], dtype=torch.float64)
    g_all, _ = grads_after(policy, ro, adv, 2, kl_coef=0.1)
    g_drop, _ = grads_after(policy, ro, adv, 2, drop=True, kl_coef=0.1)
    assert (g_drop - g_all).abs().max() > 1e-8


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


def test_inner_epochs_reuse_first_epoch_logprobs_as_old(policy):
    ro = fake_rollouts(2, seed=3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    g1, s1 = grads_after(policy, ro, adv, 2, epochs=1)
    # lr 0: the weights never move, so epoch 2 sees ratio 1 again: same gradient, twice the summed loss.
    g2, s2 = grads_after(policy, ro, adv, 2, epochs=2)
    torch.testing.assert_close(g2, g1, rtol=1e-12, atol=0.0)
    assert s2.loss == pytest.approx(2 * s1.loss, rel=1e-12) and s2.clipped_tokens == 0.0
    # A real step between epochs (SGD, large lr): epoch 2's ratio departs from 1 and the clip engages.
    params = trainable_parameters(policy)
    saved = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=50.0)
    from rl_training.algs.objectives import StepNorm
    from rl_training.trainer import UpdateHParams, train_on_rollouts

    mbs = make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu"))
    norm = StepNorm(seqs=4, tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=8)
    stats = train_on_rollouts(
        policy,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        params,
        mbs,
        UpdateHParams(inner_epochs=2, max_grad_norm=0.0),
        norm,
    )
    with torch.no_grad():
        for p, v in zip(params, saved, strict=True):
            p.copy_(v)  # leave the module-scoped policy as it was
    assert stats.clipped_tokens > 0

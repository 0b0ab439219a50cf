"""The Dr-GRPO update on the real tiny model (float64): micro-batch split and padding invariance,
zero-advantage groups, old log-probs and the trainer-vs-sampler canary."""

from __future__ import annotations

import math

import pytest
import torch

from rl_training.algs.common import token_logprobs
from rl_training.algs.corrections import TruncatedIS
from rl_training.algs.objectives import OBJECTIVES, LossInput, StepNorm, policy_loss
from rl_training.base.meter import Meter
from rl_training.policy.models import trainable_parameters
from rl_training.rollout.base import Rollouts
from rl_training.train.batches import MicroBatch, forward_logits, make_micro_batches
from rl_training.train.canary import rollout_canary
from rl_training.train.learner import correction_weights, step_advantages
from tests.helpers import G, fake_rollouts, grads_after, lora_policy, with_observations

CPU = torch.device("cpu")


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


def test_the_lm_head_skips_only_positions_no_loss_term_reads(policy):
    """forward_logits runs the LM head from the micro-batch's shortest prompt's last token (head_from): the
    log-probs of every position a loss term reads equal the full head's, and the gradient too."""
    ro = fake_rollouts(4)  # prompts of 3-8 tokens: head_from = shortest prompt - 1 in each micro-batch
    adv = torch.tensor([0.5, -0.5, 0.3, -0.3, 0.2, -0.2, 1.0, -1.0], dtype=torch.float64)
    mbs = make_micro_batches(ro, adv, G, 2, 0, CPU)
    for mb in mbs:
        rows = [g * G + i for g in mb.group_ids for i in range(G)]
        assert mb.head_from == min(len(ro.prompt_ids[r]) for r in rows) - 1 > 0
        with torch.no_grad():
            logits = forward_logits(policy, mb)
            trimmed = mb.unpack(token_logprobs(logits, mb.row_targets))
            mb.head_from, width = 0, logits.shape[1]
            full = mb.unpack(token_logprobs(forward_logits(policy, mb), mb.row_targets))
        assert full.shape == trimmed.shape and width == full.shape[1] - min(len(ro.prompt_ids[r]) for r in rows) + 1
        on = mb.mask.bool()
        torch.testing.assert_close(trimmed[on], full[on], rtol=1e-12, atol=1e-12)
        assert (trimmed[:, : full.shape[1] - width] == 0).all()  # nothing computed before head_from
    g_trim, _ = grads_after(policy, ro, adv, groups_per_micro=2)
    g_pad, _ = grads_after(policy, ro, adv, groups_per_micro=4, extra_pad=5)  # another head_from, more padding
    torch.testing.assert_close(g_trim, g_pad, rtol=1e-9, atol=1e-12)


def test_overlong_filtering_is_a_zero_advantage_for_the_loss_and_only_the_token_count_changes(policy):
    """loss.overlong_filter masks truncated responses out of the loss. Derived: in epoch 0 every surrogate is linear
    in A on a row, so a row with mask 0 contributes what a row with A = 0 does (nothing). Dr-GRPO's normaliser is
    the constant seqs x max_new_tokens either way: the same gradient. DAPO's token mean divides by the trained tokens,
    which the filter lowers from T_all to T_kept: the filtered gradient is the zeroed one times T_all / T_kept."""
    import dataclasses

    from rl_training.train.learner import without_truncated

    ro = fake_rollouts(4)
    truncated = [i in (1, 4, 5) for i in range(len(ro))]
    ro = dataclasses.replace(ro, truncated=truncated)
    adv = torch.tensor([0.5, -0.5, 0.3, -0.3, 0.2, -0.2, 1.0, -1.0], dtype=torch.float64)
    zeroed = torch.where(torch.tensor(truncated), 0.0, adv)
    filtered = without_truncated(ro)
    assert filtered.loss_mask[1] == [0] * len(ro.completion_ids[1]) and filtered.loss_mask[0] == [1] * len(
        ro.completion_ids[0]
    )
    g_filtered, _ = grads_after(policy, filtered, adv, groups_per_micro=2)
    g_zeroed, _ = grads_after(policy, ro, zeroed, groups_per_micro=2)
    assert g_zeroed.abs().max() > 1e-4
    torch.testing.assert_close(g_filtered, g_zeroed, rtol=1e-9, atol=1e-12)
    t_all = sum(len(c) for c in ro.completion_ids)
    t_kept = sum(len(c) for c, t in zip(ro.completion_ids, truncated, strict=True) if not t)
    g_filtered, _ = grads_after(policy, filtered, adv, groups_per_micro=2, objective="dapo")
    g_zeroed, _ = grads_after(policy, ro, zeroed, groups_per_micro=2, objective="dapo")
    # to float32's round-off: token_logprobs runs in float32, and the two normalisers round differently before it
    torch.testing.assert_close(g_filtered, g_zeroed * t_all / t_kept, rtol=1e-6, atol=1e-6 * g_zeroed.abs().max())
    assert not torch.allclose(g_filtered, g_zeroed, rtol=1e-2)  # t_all / t_kept = 28 / 17 here: a real difference


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
    # One group per micro-batch: a dropped group is a skipped micro-batch whose gradient is exactly 0, and
    # adding exact zeros to the accumulated .grad changes no bit, so the update is bit-identical (any kernel).
    g_all, _ = grads_after(policy, ro, adv, 1, objective=name)
    g_drop, _ = grads_after(policy, ro, adv, 1, drop=True, objective=name)
    assert g_all.abs().max() > 1e-5  # the kept groups do move the policy
    assert torch.equal(g_drop, g_all)
    # Kept and dropped groups sharing a micro-batch: the same sum, over fewer rows (and maybe a narrower pad),
    # which a matmul may block differently: equal to the reduction's round-off, like any micro-batch split
    # (1e-16 relative in float64, 1e-7 in float32, measured on 32 sequences of up to 140 tokens).
    g_drop2, _ = grads_after(policy, ro, adv, 2, drop=True, objective=name)
    torch.testing.assert_close(g_drop2, g_all, rtol=1e-12, atol=1e-15)


def test_learner_skips_zero_advantage_groups_and_counts_their_tokens(policy):
    # The runner's path (Learner.learn, then the step's Part) with dropping on and off, same rewards: groups 0
    # and 2 of 4 have equal rewards (A = 0). One group per micro-batch, so the update is bit-identical (see
    # above), and train/skipped_token_frac is the trainable tokens of groups 0 and 2 over all 8 sequences'.
    from rl_training.rollout.base import StepBatch

    ro = fake_rollouts(4, seed=1)
    rewards = [0.7, 0.7, 1.0, 0.2, 0.0, 0.0, 0.5, 0.9]
    batch = StepBatch(list(range(4)), ro, G, [None] * 8)
    params = trainable_parameters(policy)

    def learn(drop):
        meter = Meter()
        zero_lr_learner(policy, params, 1, drop).learn(batch, rewards, 0, meter)
        return torch.cat([p.grad.reshape(-1).clone() for p in params]), meter.reduce(torch.device("cpu"))

    g_all, m_all = learn(False)
    g_drop, m_drop = learn(True)
    assert torch.equal(g_drop, g_all) and g_all.abs().max() > 1e-5
    lengths = [len(c) for c in ro.completion_ids]
    skipped = sum(lengths[0:2]) + sum(lengths[4:6])
    assert 0 < skipped < sum(lengths)
    assert m_drop["train/skipped_token_frac"] == skipped / sum(lengths)
    assert m_all["train/skipped_token_frac"] == 0.0
    assert m_drop["rollout/zero_adv_group_frac"] == m_all["rollout/zero_adv_group_frac"] == 0.5  # groups 0, 2


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
    assert stats.logged["train/clip_frac"] == 0.0  # ratio == 1 exactly in the first epoch
    # The fake sampler log-probs are all -1.0: the canary measures |trainer logp + 1| per token.
    params = trainable_parameters(policy)
    mbs = make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu"))
    with torch.no_grad():
        logits = policy(input_ids=mbs[0].input_ids, attention_mask=mbs[0].attention_mask).logits[:, :-1]
        from rl_training.algs.common import token_logprobs

        lp = token_logprobs(logits, mbs[0].targets)
    m = mbs[0].mask.bool()
    assert stats.totals["rollout/logp_diff_mean"] == pytest.approx((lp[m] + 1.0).abs().sum().item(), rel=1e-9)
    assert len(params) > 0


def test_inner_epochs_reuse_first_epoch_logprobs_as_old(policy):
    ro = fake_rollouts(2, seed=3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    g1, s1 = grads_after(policy, ro, adv, 2, epochs=1)
    # lr 0: the weights never move, so epoch 2 sees ratio 1 again: same gradient, twice the summed loss (the
    # logged loss is its mean over epochs: the same).
    g2, s2 = grads_after(policy, ro, adv, 2, epochs=2)
    torch.testing.assert_close(g2, g1, rtol=1e-12, atol=0.0)
    assert s2.totals["train/loss"] == pytest.approx(2 * s1.totals["train/loss"], rel=1e-12)
    assert s2.logged["train/loss"] == pytest.approx(s1.logged["train/loss"], rel=1e-12)
    assert s2.logged["train/clip_frac"] == 0.0
    # A real step between epochs (SGD, large lr): epoch 2's ratio departs from 1 and the clip engages.
    params = trainable_parameters(policy)
    saved = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=50.0)
    from rl_training.algs.objectives import StepNorm
    from rl_training.train.learner import UpdateHParams, train_on_rollouts

    mbs = make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu"))
    norm = StepNorm(seqs=4, tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=8)
    meter = Meter()
    hp = UpdateHParams(inner_epochs=2, max_grad_norm=0.0)
    train_on_rollouts(
        policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), params, mbs, hp, norm, meter=meter
    )
    with torch.no_grad():
        for p, v in zip(params, saved, strict=True):
            p.copy_(v)  # leave the module-scoped policy as it was
    assert meter.reduce(torch.device("cpu"))["train/clip_frac"] > 0


def test_truncated_is_weights_the_surrogate_by_min_rho_cap():
    # One sequence, 3 tokens, A = +1, on-policy (old = trainer log-probs = -1 each), cap C = 1.5.
    # Sampler log-probs -1 - ln 2, -1 + ln 2, -1 -> rho = pi_train_old / pi_vllm = 2, 0.5, 1 -> w = 1.5, 0.5, 1.
    # (The inverse pi_vllm / pi_train would give 0.5, 1.5 (2 capped), 1.) Dr-GRPO, normaliser 1 seq x 4:
    # loss = -sum_t w_t r_t A / 4 = -(1.5 + 0.5 + 1) / 4 = -0.75; d loss / d logp_t = -w_t / 4 = -0.375, -0.125, -0.25.
    d = torch.float64
    logp = torch.full((1, 3), -1.0, dtype=d, requires_grad=True)
    mask = torch.ones(1, 3, dtype=d)
    rollout_logp = torch.tensor([[-1.0 - math.log(2), -1.0 + math.log(2), -1.0]], dtype=d)
    ids = torch.zeros(1, 4, dtype=torch.long)
    mb = MicroBatch(ids, ids, ids[:, 1:], mask, torch.ones(1, dtype=d), rollout_logp, [0])
    meter = Meter()
    rollout_canary(meter, logp.detach(), mb)
    w = correction_weights(meter, TruncatedIS(cap=1.5), logp.detach(), mb)
    logged = meter.reduce(torch.device("cpu"))
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5, 1.0]], dtype=d))
    assert meter.totals["is/trunc_frac"] == 1 and logged["is/trunc_frac"] == pytest.approx(1 / 3, rel=1e-12)
    assert logged["is/ratio_max"] == pytest.approx(2.0, rel=1e-12)
    norm = StepNorm(seqs=1, tokens=3, max_new_tokens=4)
    out = policy_loss(
        LossInput(OBJECTIVES["dr_grpo"], logp, logp.detach(), mb.advantages, mask, norm, 0.2, 0.2, is_weights=w)
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.75, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.375, -0.125, -0.25]], dtype=d))


def with_sampler_offset(policy, ro: Rollouts, offset: float) -> Rollouts:
    """The rollouts with sampler log-probs = the policy's own + offset on every token (rho = exp(-offset))."""
    adv = torch.zeros(len(ro), dtype=torch.float64)
    (mb,) = make_micro_batches(ro, adv, G, len(ro) // G, 0, torch.device("cpu"))
    with torch.no_grad():
        lp = mb.unpack(token_logprobs(forward_logits(policy, mb), mb.row_targets))
    rows = [lp[b][mb.mask[b].bool()].tolist() for b in range(len(ro))]
    return Rollouts(ro.prompt_ids, ro.completion_ids, [[x + offset for x in r] for r in rows], ro.truncated, ro.texts)


def test_truncated_is_scales_the_trainer_gradient(policy):
    # Every token with the same rho scales every token's gradient by min(rho, C): rho = 0.5 (sampler log-probs
    # ln 2 above the trainer's) -> 0.5 x the gradient without TIS; rho = 2, C = 1.5 -> 1.5 x. (KL off, A fixed.)
    ro = fake_rollouts(2, seed=4)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    g, _ = grads_after(policy, ro, adv, 2)
    assert g.abs().max() > 1e-4
    g_half, _ = grads_after(policy, with_sampler_offset(policy, ro, math.log(2)), adv, 2, tis_cap=1.5)
    g_capped, s = grads_after(policy, with_sampler_offset(policy, ro, -math.log(2)), adv, 2, tis_cap=1.5)
    # To ~1e-7 of the largest entry, not 1e-12: micro-batches hold sampler log-probs in float32 (what vLLM
    # returns), so rho is 0.5 to ~1e-7, and Qwen2's RMSNorm computes in float32 even in this float64 model,
    # so a backward pass whose upstream gradient is scaled by 1.5 rounds differently at that level.
    tol = {"rtol": 1e-6, "atol": 1e-6 * g.abs().max().item()}
    torch.testing.assert_close(g_half, 0.5 * g, **tol)
    torch.testing.assert_close(g_capped, 1.5 * g, **tol)
    assert (g_capped - 2.0 * g).abs().max() > 0.1 * g.abs().max()  # the cap did bind: not the uncapped 2x
    assert s.totals["is/trunc_frac"] == sum(len(c) for c in ro.completion_ids)  # every token's rho = 2 > 1.5


def checkpointed_policy_with_dropout(model_dir):
    """The float64 tiny policy with gradient checkpointing on (as models.load_base_model enables it) and
    dropout 0.5 in attention and LoRA: dropout that leaked into the update would change its log-probs."""
    from transformers import AutoModelForCausalLM

    from rl_training.config.schema import LoraCfg
    from rl_training.policy.models import apply_lora

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="sdpa", attention_dropout=0.5
    )
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = apply_lora(base, LoraCfg(r=4, alpha=8, dropout=0.5))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def test_update_recomputes_checkpointed_layers_with_dropout_off(tiny_model):
    # eval() alone turns transformers' gradient checkpointing off (it checks the layer's `training` flag):
    # every layer's activations were then kept for backward. Counted here by the calls into layer 0's MLP (a
    # pre-hook: torch's recompute stops early, inside the MLP, once every saved tensor is back). Epoch 0:
    # 2 micro-batches x (reference pass + forward + recompute in backward) = 6; epoch 1: 2 x 2 = 4. Without
    # the recompute: 2 + 2 + 2 = 6. Every call runs with the MLP in eval mode (no dropout anywhere).
    from rl_training.train.learner import UpdateHParams, train_on_rollouts

    policy = checkpointed_policy_with_dropout(tiny_model)
    calls: list[bool] = []
    policy.get_base_model().model.layers[0].mlp.register_forward_pre_hook(lambda m, i: calls.append(m.training))
    ro = fake_rollouts(2, seed=2)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    params = trainable_parameters(policy)
    opt = torch.optim.SGD(params, lr=0.0)
    mbs = make_micro_batches(ro, adv, G, 1, 0, torch.device("cpu"))
    norm = StepNorm(seqs=4, tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=8)
    # Clip bounds of 1e-15: any ratio other than exactly 1 in either epoch (lr 0) would count as clipped.
    hp = UpdateHParams(inner_epochs=2, clip_low=1e-15, clip_high=1e-15, max_grad_norm=0.0)
    policy.train()  # the update must not depend on the mode it is handed
    meter = Meter()
    train_on_rollouts(
        policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), params, mbs, hp, norm, meter=meter
    )
    assert len(calls) == 2 * 3 + 2 * 2 and not any(calls)  # epoch 1: forward + recompute per micro-batch
    assert meter.reduce(torch.device("cpu"))["train/clip_frac"] == 0.0 and policy.training  # mode restored
    # Dropout off: the update's log-probs equal an eval-mode no-grad forward (sampler log-probs are all -1).
    policy.eval()
    with torch.no_grad():
        expected = sum(
            ((mb.unpack(token_logprobs(forward_logits(policy, mb), mb.row_targets)) + 1.0).abs() * mb.mask).sum().item()
            for mb in mbs
        )
    assert meter.totals["rollout/logp_diff_mean"] == pytest.approx(expected, rel=1e-12)


def test_reference_forward_runs_only_on_kl_log_steps():
    """kl_coef = 0: the reference forward (only for train/kl) runs on steps 0, k, 2k, ...; kl_coef > 0: always."""
    from rl_training.train.learner import UpdateHParams

    hp = UpdateHParams(kl_log_every=10)
    assert [s for s in range(25) if hp.for_step(s).needs_reference] == [0, 10, 20]
    assert not any(UpdateHParams(kl_log_every=0).for_step(s).needs_reference for s in range(25))
    assert all(UpdateHParams(kl_coef=0.1, kl_log_every=0).for_step(s).needs_reference for s in range(25))


def test_skipped_reference_forward_leaves_kl_unmeasured(policy):
    import dataclasses

    from rl_training.train.learner import UpdateHParams, train_on_rollouts

    ro = fake_rollouts(2)
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64)
    params = trainable_parameters(policy)
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    norm = StepNorm(seqs=4, tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=8)
    hp = dataclasses.replace(UpdateHParams(kl_log_every=10), max_grad_norm=0.0)
    mbs = make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu"))
    on, off = Meter(), Meter()
    train_on_rollouts(policy, opt, sched, params, mbs, hp.for_step(0), norm, meter=on)
    train_on_rollouts(policy, opt, sched, params, mbs, hp.for_step(1), norm, meter=off)
    on_m, off_m = on.reduce(torch.device("cpu")), off.reduce(torch.device("cpu"))
    # the random LoRA B makes policy != reference: a measured k3 KL is > 0; unmeasured it is not logged, not a 0
    assert on_m["train/kl"] > 1e-6 and "train/kl" not in off_m
    assert off_m["train/loss"] == pytest.approx(on_m["train/loss"], rel=1e-12)  # kl_coef = 0: no dependence


# ------------------------------------------------------------------------------ multi-turn: masks with holes
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_observation_tokens_are_never_trained(policy, name):
    """Completions with observation holes (Rollouts.loss_mask): the gradient, the KL, the canary, TIS and the
    token count do not depend on what the observation tokens' sampler log-probs say, and the gradient keeps
    its micro-batch split and padding invariance."""
    base = fake_rollouts(4)
    ro = with_observations(base, obs_logp=5.0)
    ro_other = with_observations(base, obs_logp=-30.0)
    adv = torch.tensor([0.5, -0.5, 0.3, -0.3, 0.0, 0.0, 1.0, -1.0], dtype=torch.float64)
    kw = {"objective": name, "kl_coef": 0.1, "tis_cap": 2.0}
    g, s = grads_after(policy, ro, adv, groups_per_micro=4, **kw)
    g_other, s_other = grads_after(policy, ro_other, adv, groups_per_micro=4, **kw)
    g_split, _ = grads_after(policy, ro, adv, groups_per_micro=1, extra_pad=5, **kw)
    assert g.abs().max() > 1e-4
    torch.testing.assert_close(g_other, g, rtol=0, atol=0)
    torch.testing.assert_close(g_split, g, rtol=1e-9, atol=1e-12)
    for k in ("rollout/logp_diff_mean", "rollout/logp_diff_max", "is/ratio_mean", "is/ratio_max", "is/trunc_frac"):
        assert s_other.totals[k] == s.totals[k], k
    assert s_other.totals["train/kl"] == s.totals["train/kl"]
    tokens = s.pers["rollout/logp_diff_mean"]
    assert tokens == sum(len(c) for c in base.completion_ids)  # trainable tokens only
    # the per-turn canary splits the same sum by turn: turn 1 is each sequence's first token
    turns = [f"rollout/logp_diff_turn{t}" for t in range(1, 33)]
    assert s.pers[turns[0]] == len(ro) and sum(s.pers[k] for k in turns) == tokens
    assert sum(s.totals[k] for k in turns) == pytest.approx(s.totals["rollout/logp_diff_mean"], rel=1e-12)


def test_masked_dr_grpo_gradient_equals_the_sum_over_sampled_tokens(policy):
    """Oracle: on policy (epoch 0, ratio 1) without KL, Dr-GRPO's gradient is
    -sum_i A_i sum_{t sampled} grad log pi(y_it) / (N x max_new_tokens), observation tokens left out."""
    ro = with_observations(fake_rollouts(2))
    adv = torch.tensor([0.7, -0.7, 0.2, -0.2], dtype=torch.float64)
    g, _ = grads_after(policy, ro, adv, groups_per_micro=2)
    params = trainable_parameters(policy)
    for p in params:
        p.grad = None
    policy.eval()  # dropout off, as in the update
    total = 0.0
    for i in range(len(ro)):
        seq = torch.tensor([ro.prompt_ids[i] + ro.completion_ids[i]])
        logp = token_logprobs(policy(input_ids=seq).logits[:, :-1], seq[:, 1:])[0, len(ro.prompt_ids[i]) - 1 :]
        total = total - adv[i] * (logp * torch.tensor(ro.loss_mask[i], dtype=torch.float64)).sum()
    (total / (len(ro) * 8)).backward()
    ref = torch.cat([p.grad.reshape(-1) for p in params])
    torch.testing.assert_close(g, ref, rtol=1e-8, atol=1e-12)


def test_a_step_whose_groups_all_skip_still_feeds_the_canary(policy):
    # 3 groups, every advantage 0 (each group got one reward): dropping would train no token and leave the weight
    # guard blind on exactly the steps a broken sync produces (garbage rollouts, all rewards 0). The first group
    # stays: its gradient is exactly 0 (A = 0, no KL), and the canary measures its tokens.
    ro = fake_rollouts(3)
    adv = torch.zeros(len(ro), dtype=torch.float64)
    mbs = make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu"), drop_zero_adv_groups=True)
    assert [mb.group_ids for mb in mbs] == [[0]]
    g, stats = grads_after(policy, ro, adv, 2, drop=True)
    assert torch.count_nonzero(g) == 0
    assert stats.pers["rollout/logp_diff_mean"] == sum(len(ro.completion_ids[i]) for i in range(G))
    assert stats.totals["rollout/logp_diff_mean"] > 0
    # one kept group is enough: then nothing else is added
    adv[G : 2 * G] = torch.tensor([0.5, -0.5], dtype=torch.float64)
    mbs = make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu"), drop_zero_adv_groups=True)
    assert [mb.group_ids for mb in mbs] == [[1]]


def test_learner_takes_each_group_s_own_size(policy):
    # rollout.allocation: per_prompt's unequal groups through Learner.learn: groups of 3, 1, 2 and 2 rows. Each
    # group is centred on its own mean: group 0 [0.7, 0.7, 1.0] -> mean 0.8, group 1 [0.2] alone -> 0, group 2
    # [0.0, 0.0] ties -> 0, group 3 [0.5, 0.9] -> -0.2, 0.2. Groups of 2 as the config's G would give other values.
    from rl_training.rollout.base import StepBatch

    ro = fake_rollouts(4, seed=1)
    rewards = [0.7, 0.7, 1.0, 0.2, 0.0, 0.0, 0.5, 0.9]
    batch = StepBatch(list(range(4)), ro, G, [None] * 8, sizes=[3, 1, 2, 2])
    meter = Meter()
    learned = zero_lr_learner(policy, trainable_parameters(policy), 2, True).learn(batch, rewards, 0, meter)
    want = [-0.1, -0.1, 0.2, 0.0, 0.0, 0.0, -0.2, 0.2]
    assert learned.advantages.tolist() == pytest.approx(want, abs=1e-12)
    assert meter.reduce(torch.device("cpu"))["rollout/zero_adv_group_frac"] == 0.5  # groups 1 and 2 of 4
    assert sorted(learned.rows) == [0, 1, 2, 6, 7]  # the zero-advantage groups' rows are skipped


def zero_lr_learner(policy, params, micro_batch_groups: int, drop: bool):
    """A Learner of 8 sequences per rank whose update leaves the weights (lr 0) and keeps the gradients."""
    from rl_training.probes.probe import NullProbes
    from rl_training.train.learner import Learner, UpdateHParams

    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return Learner(model=policy, optimizer=opt, scheduler=sched, params=params,
                   hparams=UpdateHParams(max_grad_norm=0.0, kl_log_every=0), probes=NullProbes(),
                   device=torch.device("cpu"), seqs_per_rank=8, max_trainable_tokens=8,
                   micro_batch_groups=micro_batch_groups, drop_zero_adv_groups=drop, pad_id=0,
                   pack_row_tokens=None)  # fmt: skip

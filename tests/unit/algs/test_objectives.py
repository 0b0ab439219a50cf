"""Every objective's loss and gradient against hand-derived values, its documented invariances, and a short
run of the real runner with each one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rl_training.algs.common import group_advantages, zero_adv_groups
from rl_training.algs.objectives import (
    KL_ESTIMATORS,
    OBJECTIVES,
    LossInput,
    StepNorm,
    batch_moments,
    batch_std_scale,
    group_std_scale,
    leave_one_out_advantages,
    policy_loss,
)
from rl_training.base.meter import Meter
from rl_training.base.timer import PhaseTimer
from rl_training.metrics.step import measure_step
from rl_training.runners import rl_runner
from rl_training.tasks.base import Scores
from rl_training.train.batches import make_micro_batches
from rl_training.train.learner import step_advantages
from tests.helpers import REPO, fake_rollouts, grads_after, lora_policy

D = torch.float64

# Shared hand example. old log-probs are -1 everywhere; the new ones add these log-ratios:
#   seq 0 (A = +1):   ratios 1, 1.5        (2 valid tokens, third is padding)
#   seq 1 (A = -0.5): ratios 0.5, 1, 1.1   (3 valid tokens)
# Step normalisers: 2 sequences, 5 valid tokens, max_new_tokens 4.
OLD = torch.full((2, 3), -1.0, dtype=D)
DELTA = torch.tensor([[0.0, math.log(1.5), 0.0], [math.log(0.5), 0.0, math.log(1.1)]], dtype=D)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=D)
ADV = torch.tensor([1.0, -0.5], dtype=D)
NORM = StepNorm(seqs=2, tokens=5, max_new_tokens=4)


def loss_and_grad(name, clip_low=None, clip_high=None, **kw):
    o = OBJECTIVES[name]
    logp = (OLD + DELTA).clone().requires_grad_(True)
    out = policy_loss(
        LossInput(
            o,
            logp,
            OLD,
            ADV,
            MASK,
            NORM,
            o.clip_low if clip_low is None else clip_low,
            o.clip_high if clip_high is None else clip_high,
            **kw,
        )
    )
    out.loss.backward()
    return out, logp.grad


# PPO-clip per-token losses with eps 0.2/0.2 (derivation in test_dr_grpo.test_loss_hand_values):
#   seq 0: -1, -1.2 (ratio 1.5 clipped to 1.2)    seq 1: 0.4 (0.5 clipped to 0.8), 0.5, 0.55
# Gradient of seq 1's last token (ratio 1.1, A = -0.5, inside every clip range here, also DAPO's 0.8/1.28):
# its loss is -r A / Z with r = exp(logp - old), so d/dlogp = -r A / Z = 1.1 * 0.5 / Z = 0.55 / Z, with Z the
# objective's normaliser for that token: dr_grpo 2 seqs x 4 = 8 -> 0.06875; grpo 3 tokens x 2 seqs = 6 ->
# 0.0916667; rloo 2 seqs -> 0.275; dapo and reinforce_pp 5 valid tokens -> 0.11.
@pytest.mark.parametrize(
    "name, expected, clipped, unclipped_grad",
    [
        ("dr_grpo", (-2.2 + 1.45) / (2 * 4), 2, 0.06875),  # token sum / (2 seqs x 4) = -0.09375
        ("grpo", (-2.2 / 2 + 1.45 / 3) / 2, 2, 0.55 / 6),  # per-sequence token means, then the mean over 2 seqs
        ("rloo", (-2.2 + 1.45) / 2, 2, 0.275),  # per-sequence token sums, mean over sequences
        ("reinforce_pp", (-2.2 + 1.45) / 5, 2, 0.11),  # token mean over the step's 5 tokens
        # DAPO clip-higher 0.28: seq 0 token 2 becomes -1.28 -> (-2.28 + 1.45) / 5
        ("dapo", (-2.28 + 1.45) / 5, 2, 0.11),
    ],
)
def test_ppo_clip_family_hand_values(name, expected, clipped, unclipped_grad):
    out, grad = loss_and_grad(name)
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.clipped_tokens.item() == clipped
    assert grad[0, 1].item() == 0.0  # the clip removed the gradient of seq 0's ratio-1.5 token
    assert grad[1, 0].item() == 0.0  # ... and of seq 1's ratio-0.5 token (A < 0, below 1 - 0.2)
    assert grad[1, 2].item() == pytest.approx(unclipped_grad, rel=1e-12)
    assert grad[0, 2].item() == 0.0  # padding


def test_cispo_hand_values_and_gradient_survives_clipping():
    # weights w = clamp(r, 1 - 1.0, 1 + 0.28): seq 0 [1, 1.28]; seq 1 [0.5, 1, 1.1]; loss_t = -w A logp.
    # logp: seq 0 [-1, -1 + ln 1.5]; seq 1 [-1 + ln 0.5, -1, -1 + ln 1.1]
    lp = OLD + DELTA
    terms = [
        -1.0 * 1.0 * lp[0, 0],
        -1.28 * 1.0 * lp[0, 1],
        -0.5 * -0.5 * lp[1, 0],
        -1.0 * -0.5 * lp[1, 1],
        -1.1 * -0.5 * lp[1, 2],
    ]
    expected = sum(t.item() for t in terms) / 5  # = (1 + 0.761005 - 0.423287 - 0.5 - 0.497580) / 5
    out, grad = loss_and_grad("cispo")
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.loss.item() == pytest.approx(0.0680277, abs=1e-6)
    # d/dlogp = -w A / 5: the ratio-1.5 token keeps a gradient (-1.28/5) where PPO's clip gives 0.
    assert grad[0, 1].item() == pytest.approx(-1.28 / 5, rel=1e-12)
    assert grad[1, 0].item() == pytest.approx(-0.5 * -0.5 / 5, rel=1e-12)
    assert out.clipped_tokens.item() == 1  # only the ratio above 1.28 was truncated (no lower bound)


def test_gspo_hand_values():
    # log s_0 = (0 + ln 1.5)/2 -> s_0 = sqrt(1.5) = 1.224745; log s_1 = (ln 0.5 + ln 1.1)/3 -> s_1 = 0.55^(1/3)
    s0, s1 = math.sqrt(1.5), 0.55 ** (1 / 3)
    # Paper clip 3e-4 / 4e-4: seq 0 (A>0) is capped at 1.0004, seq 1 (A<0) at 0.9997 -> both clipped, no gradient.
    out, grad = loss_and_grad("gspo")
    assert out.loss.item() == pytest.approx((-1.0004 * 1 + 0.9997 * 0.5) / 2, abs=1e-12)
    assert out.clipped_tokens.item() == 5 and grad.abs().max().item() == 0.0
    # A wide clip (0.5) leaves both unclipped: loss = (-s_0 + 0.5 s_1)/2; d/dlogp_{0,t} = -s_0/(2*2 tokens)
    out, grad = loss_and_grad("gspo", clip_low=0.5, clip_high=0.5)
    assert out.loss.item() == pytest.approx((-s0 + 0.5 * s1) / 2, rel=1e-12)
    assert grad[0, 0].item() == pytest.approx(-s0 / 4, rel=1e-12)
    assert grad[1, 2].item() == pytest.approx(0.5 * s1 / 6, rel=1e-12)  # (1/2 seqs)(0.5)(s_1)(1/3 tokens)


def test_kl_estimators_and_aggregation():
    # A = 0 so only KL counts. ref = logp - ln 2 on every token: k1 = ln 2; k3 = exp(-ln2) + ln2 - 1 = ln2 - 0.5
    ref = OLD + DELTA - math.log(2.0)
    for est, per_tok in (("k1", math.log(2)), (None, math.log(2) - 0.5)):
        kw = {"kl_estimator": KL_ESTIMATORS[est]} if est else {}
        o = OBJECTIVES["grpo"]
        out = policy_loss(LossInput(o, OLD + DELTA, OLD, torch.zeros(2, dtype=D), MASK, NORM, 0.2, 0.2, ref, 0.1, **kw))
        # grpo aggregation of a constant c: mean over seqs of the per-seq token mean = c
        assert out.loss.item() == pytest.approx(0.1 * per_tok, rel=1e-12)
        assert out.kl_sum.item() == pytest.approx(5 * per_tok, rel=1e-12)


# One token from a categorical policy pi = softmax(theta) over 4 symbols, reference softmax(REF_LOGITS). The
# exact expectation of a per-sample gradient over y ~ q is sum_y q(y) grad term(y); the targets are analytic:
#   grad KL(pi || ref) = sum_y pi(y) (log pi(y) - log ref(y)) grad log pi(y)   (reverse KL, what k1 must give)
#   grad KL(ref || pi) = -sum_y ref(y) grad log pi(y)                         (forward KL, what k3 gives)
#   naive k1, grad (log pi(y) - log ref(y)) = grad log pi(y): sum_y pi(y) grad log pi(y) = grad sum_y pi = 0.
THETA = torch.tensor([0.5, -0.3, 1.2, 0.0], dtype=D)
REF_LOGITS = torch.tensor([0.0, 0.4, -0.5, 0.9], dtype=D)


def expected_kl_grad(estimator, sample_logits=None, old_logits=None):
    """sum_y q(y) grad_theta[loss(y)] for the one-token loss with A = 0, kl_coef 1 (dr_grpo, normaliser 1).
    q = softmax(sample_logits) (default: pi), pi_old = softmax(old_logits) (default: pi, the first epoch);
    off-policy, the trainer's TIS weight pi_old/q (cap not reached) goes in too."""
    q = torch.softmax(THETA if sample_logits is None else sample_logits, 0)
    old = torch.log_softmax(THETA if old_logits is None else old_logits, 0)
    ref = torch.log_softmax(REF_LOGITS, 0)
    total = torch.zeros_like(THETA)
    for y in range(4):
        theta = THETA.clone().requires_grad_(True)
        logp = torch.log_softmax(theta, 0)[y].view(1, 1)
        tis = (old[y].exp() / q[y]).view(1, 1) if sample_logits is not None else None
        out = policy_loss(
            LossInput(
                OBJECTIVES["dr_grpo"],
                logp,
                old[y].view(1, 1),
                torch.zeros(1, dtype=D),
                torch.ones(1, 1, dtype=D),
                StepNorm(seqs=1, tokens=1, max_new_tokens=1),
                0.2,
                0.2,
                ref[y].view(1, 1),
                1.0,
                KL_ESTIMATORS[estimator],
                tis,
            )
        )
        total += q[y] * torch.autograd.grad(out.loss, theta)[0]
    return total


def kl_grads():
    theta = THETA.clone().requires_grad_(True)
    logpi, ref = torch.log_softmax(theta, 0), torch.log_softmax(REF_LOGITS, 0)
    reverse = torch.autograd.grad((logpi.exp() * (logpi - ref)).sum(), theta)[0]
    theta = THETA.clone().requires_grad_(True)
    forward = torch.autograd.grad((ref.exp() * (ref - torch.log_softmax(theta, 0))).sum(), theta)[0]
    return reverse, forward


def test_k1_penalty_has_the_reverse_kl_gradient_in_expectation():
    reverse, forward = kl_grads()
    assert reverse.abs().max() > 0.1 and (reverse - forward).abs().max() > 0.05  # the two targets differ
    torch.testing.assert_close(expected_kl_grad("k1"), reverse, rtol=1e-12, atol=1e-14)
    # Off-policy (a later epoch: pi_old != pi; sampled by q != pi_old with TIS): the weight pi/pi_old x
    # pi_old/q keeps the expectation at grad KL(pi || ref).
    q_logits, old_logits = torch.tensor([0.2, 0.2, 0.0, -0.4], dtype=D), torch.tensor([0.1, 0.0, 1.0, 0.3], dtype=D)
    torch.testing.assert_close(expected_kl_grad("k1", q_logits, old_logits), reverse, rtol=1e-12, atol=1e-14)
    # The naive k1 loss (differentiating log pi - log ref) would have had expected gradient 0 (see above).
    theta = THETA.clone().requires_grad_(True)
    naive = sum(
        torch.softmax(THETA, 0)[y] * torch.autograd.grad(torch.log_softmax(theta, 0)[y], theta)[0] for y in range(4)
    )
    assert naive.abs().max().item() < 1e-15


def test_k3_penalty_has_the_forward_kl_gradient_on_policy():
    reverse, forward = kl_grads()
    torch.testing.assert_close(expected_kl_grad("k3"), forward, rtol=1e-12, atol=1e-14)
    assert (expected_kl_grad("k3") - reverse).abs().max() > 0.05  # not the reverse KL's gradient


# --------------------------------------------------------------------------------------- advantages
def test_advantage_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=D)
    # RLOO: r_i - mean of the other 3: 1 - 1/3, 0 - 2/3, ...
    torch.testing.assert_close(leave_one_out_advantages(r, 4), torch.tensor([2, -2, -2, 2], dtype=D) / 3)
    # GRPO: (r - 0.5) / (unbiased std = sqrt(1/3) ) = +-0.8660254
    torch.testing.assert_close(
        group_std_scale(group_advantages(r, 4), 4),
        torch.tensor([1, -1, -1, 1], dtype=D) * 0.5 / (math.sqrt(1 / 3) + 1e-6),
    )


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_unequal_groups_get_each_group_s_own_advantages(name):
    # Groups of 1 (tied by itself), 3, 2, 4 and 2 completions (rollout.allocation: per_prompt): every objective's
    # baseline and scale, given each group's size, equal that group computed alone as a batch of one group, so a
    # group's size and its neighbours change nothing of its advantages. (REINFORCE++'s batch std is over the whole
    # step: it is compared on the centered rewards, before its global scale.)
    sizes = [1, 3, 2, 4, 2]
    r = torch.tensor([0.7, 1.0, 0.0, 0.0, 0.5, 0.5, 0.2, 1.0, 0.0, 0.6, 0.3, 0.9], dtype=D)
    obj = OBJECTIVES[name]
    got = obj.baseline(r, sizes) if obj.scale is None else obj.scale(obj.baseline(r, sizes), sizes)
    alone = []
    for g in r.split(sizes):
        c = obj.baseline(g, len(g))
        alone.append(c if obj.scale is None else obj.scale(c, len(g)))
    torch.testing.assert_close(got, torch.cat(alone), rtol=0, atol=1e-15)
    assert got[0] == 0 and (got[4:6] == 0).all()  # a group of one and a tied group (rows 4-5) teach nothing
    assert zero_adv_groups(got, sizes).tolist() == [True, False, True, False, False]
    # equal sizes given as a list are the int form
    torch.testing.assert_close(obj.baseline(r, [3] * 4), obj.baseline(r, 3), rtol=0, atol=0)
    with pytest.raises(ValueError, match="12 values for groups of 11"):
        obj.baseline(r, [1, 3, 2, 4, 1])


def test_grpo_advantages_invariant_to_reward_scale_and_shift():
    r = torch.rand(16, generator=torch.Generator().manual_seed(0), dtype=D)
    a = step_advantages(OBJECTIVES["grpo"], r, 4, torch.device("cpu"))
    b = step_advantages(OBJECTIVES["grpo"], 7.0 * r + 3.0, 4, torch.device("cpu"))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # exact but for the 1e-6 in the denominator


def test_dr_grpo_advantages_scale_with_rewards_but_ignore_shift():
    r = torch.rand(16, generator=torch.Generator().manual_seed(1), dtype=D)
    a = step_advantages(OBJECTIVES["dr_grpo"], r, 4, torch.device("cpu"))
    torch.testing.assert_close(step_advantages(OBJECTIVES["dr_grpo"], 3 * r + 1, 4, torch.device("cpu")), 3 * a)


def test_rloo_advantages_sum_to_zero_per_group():
    r = torch.rand(24, generator=torch.Generator().manual_seed(2), dtype=D)
    a = step_advantages(OBJECTIVES["rloo"], r, 6, torch.device("cpu")).view(-1, 6)
    assert a.sum(1).abs().max().item() < 1e-14
    torch.testing.assert_close(a.view(-1), group_advantages(r, 6) * 6 / 5)


def test_reinforce_pp_batch_normalisation_and_sharded_moments():
    r = torch.rand(32, generator=torch.Generator().manual_seed(3), dtype=D)
    a = step_advantages(OBJECTIVES["reinforce_pp"], r, 4, torch.device("cpu"))
    assert a.mean().abs().item() < 1e-12 and a.std().item() == pytest.approx(1.0, abs=1e-5)
    # Two ranks: summed moments give exactly the single-process scale (what the all-reduce does).
    c = group_advantages(r, 4)
    m0, m1 = batch_moments(c[:16]), batch_moments(c[16:])
    summed = {k: m0[k] + m1[k] for k in m0}
    torch.testing.assert_close(torch.cat([batch_std_scale(c[:16], summed), batch_std_scale(c[16:], summed)]), a)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_equal_float32_rewards_give_exactly_zero_advantages(name):
    # Group 0: eight float32 copies of 5/7. Their float32 mean is 5/7 - 5.96e-8 (the running sum rounds), so
    # r - mean used to be -5.96e-8 (dr_grpo), and the std scales made it (r - mean) / (0 + 1e-6) = -0.0596 for
    # every member (grpo, dapo, gspo, cispo, reinforce_pp): a zero-signal group pushed all its samples down.
    # Now it is exactly 0 for every objective. Group 1 (rewards 0,1,...; mean 0.5) keeps all 8 non-zero.
    cpu = torch.device("cpu")
    r = torch.tensor([5 / 7] * 8 + [0.0, 1.0] * 4, dtype=torch.float32)
    assert r[:8].mean().item() != r[0].item()  # the float32 trap the test is about
    adv = step_advantages(OBJECTIVES[name], r, 8, cpu)
    assert adv.dtype == torch.float64 and (adv[:8] == 0).all() and (adv[8:] != 0).all()
    assert zero_adv_groups(adv, 8).tolist() == [True, False]
    # by each group's size (Groups.sizes): 8 zeros, 5 of group 1's non-zero advantages, 3 zeros
    assert zero_adv_groups(adv, [8, 8]).tolist() == [True, False]
    assert zero_adv_groups(torch.cat([adv[:8], adv[8:13], adv[:3]]), [8, 5, 3]).tolist() == [True, False, True]
    # One micro-batch of both groups: dropping keeps group 1 only; without dropping both stay.
    ro = fake_rollouts(8)  # 16 sequences, regrouped here as 2 groups of 8
    assert [mb.group_ids for mb in make_micro_batches(ro, adv, 8, 2, 0, cpu, True)] == [[1]]
    assert [mb.group_ids for mb in make_micro_batches(ro, adv, 8, 2, 0, cpu, False)] == [[0, 1]]
    # (the learner logs the fraction: 1 of 2 groups, tests/unit/train/test_learner.py)
    meter, scores = Meter(), Scores(r.tolist(), [False] * 16, [True] * 16, 0, 0, 0)
    measure_step(meter, ro, scores, PhaseTimer())
    assert not any(k.startswith("reward/") for k in meter.reduce(cpu))  # a task without parts or counts logs none


def test_task_reward_parts_and_counts_are_logged():
    # 4 completions with pass fractions 1, 0.5, 0, 0.5 -> reward/pass_frac_mean = 2/4 = 0.5; the counter is a
    # per-step sum (1 rank here): reward/fail_timeout = 3.
    cpu = torch.device("cpu")
    ro = fake_rollouts(2)  # 4 sequences (G = 2)
    scores = Scores([1.0, 0.0, 0.0, 0.0], [True] + [False] * 3, [True] * 4, 0, 0, 0)
    scores.parts, scores.counts = {"pass_frac": [1.0, 0.5, 0.0, 0.5]}, {"fail_timeout": 3.0}
    meter = Meter()
    measure_step(meter, ro, scores, PhaseTimer())
    m = meter.reduce(cpu)
    assert m["reward/pass_frac_mean"] == 0.5 and m["reward/fail_timeout"] == 3.0


# ---------------------------------------------------------------------------------- gradient identities
def test_on_policy_gspo_equals_grpo_and_cispo_equals_dapo():
    # At ratio 1 (first epoch) nothing is clipped: GSPO's d s_i = (1/|o_i|) sum_t d logp -> GRPO's gradient;
    # CISPO's -A logp with weight 1 -> the token-mean PG gradient of DAPO.
    logp = OLD + 0.3 * torch.randn(2, 3, generator=torch.Generator().manual_seed(4), dtype=D)

    def grad(name):
        x = logp.clone().requires_grad_(True)
        o = OBJECTIVES[name]
        policy_loss(LossInput(o, x, x.detach(), ADV, MASK, NORM, o.clip_low, o.clip_high)).loss.backward()
        return x.grad

    torch.testing.assert_close(grad("gspo"), grad("grpo"))
    torch.testing.assert_close(grad("cispo"), grad("dapo"))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_gradient_invariant_to_micro_batch_split(name, tiny_model):
    """Each objective's normaliser is a step constant, so 1 x 8 and 4 x 2 micro-batches give one gradient."""
    model = lora_policy(tiny_model)
    ro = fake_rollouts(4, seed=5)
    adv = torch.tensor([0.5, -0.5, 0.3, -0.3, 0.0, 0.0, 1.0, -1.0], dtype=D)
    g_one, _ = grads_after(model, ro, adv, 4, objective=name)
    g_four, _ = grads_after(model, ro, adv, 1, objective=name)
    assert g_one.abs().max() > 1e-5
    torch.testing.assert_close(g_four, g_one, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------ short real runs
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_short_run_with_each_objective(name, run_overrides, tmp_path):
    extra = ["train.inner_epochs=2", "loss.kl_coef=0.05", "loss.kl_estimator=k1"] if name in ("grpo", "gspo") else []
    if name == "cispo":
        extra = ["loss.tis_cap=2.0"]
    rc = rl_runner.main(
        [
            "--cfg",
            str(REPO / "cfg" / "testconfig.yaml"),
            *run_overrides,
            f"loss.type={name}",
            "train.total_steps=2",
            "ckpt.every=0",
            *extra,
        ]
    )
    assert rc == 0
    run_dir = tmp_path / "runs" / "testconfig"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:
        # GNS values are NaN by design until the estimate is valid (never a clamped number); all else finite.
        assert all(math.isfinite(v) for k, v in m.items() if not k.startswith("probe/gns/")), m
        assert all(not math.isinf(v) for v in m.values())
    assert any(m["train/grad_norm"] > 0 for m in metrics)
    saved = (run_dir / "config.yaml").read_text()
    o = OBJECTIVES[name]
    assert f"type: {name}" in saved and f"clip_high: {o.clip_high}" in saved  # resolved paper defaults, logged

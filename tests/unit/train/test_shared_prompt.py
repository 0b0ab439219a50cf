"""Shared-prompt rows (train/shared_prompt.py): one row per prompt group gives the padded rows' log-probs, loss and
gradient, with the prompt run once per group."""

from __future__ import annotations

import pytest
import torch

from rl_training.algs.common import token_logprobs
from rl_training.base.groups import Groups
from rl_training.rollout.base import Rollouts
from rl_training.train.batches import forward_logits, make_micro_batches
from rl_training.train.shared_prompt import groups_share_prompts, share_prompts, shared_tokens
from tests.helpers import grads_after, lora_policy, unit_sq_norms

CPU = torch.device("cpu")
K = 4  # completions per prompt in these tests


def test_layout_values():
    # group 0: prompt [5,6,7] + [8,9], [10]; group 1: prompt [11,12] + [13], [14,15]; pad 0.
    # Rows: [5,6,7,8,9,10] and [11,12,13,14,15,0]: L = 6. The shortest prompt has 2 tokens: head_from = 1, so the
    # logits kept per row are columns 1..5 (5 of them) and row g's column c is flat index g*5 + c - 1.
    s = share_prompts(
        [[5, 6, 7]] * 2 + [[11, 12]] * 2, [[8, 9], [10], [13], [14, 15]], Groups.uniform(2, 2), 0, padded_width=5
    )
    assert s.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 0]]
    # each completion restarts at its prompt's length; the pad block at 0
    assert s.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 2, 3, 0]]
    assert s.head_from == 1
    # completion token 0 is predicted at the prompt's last column (2 in row 0, 1 in row 1); token j >= 1 at the
    # column of token j-1: [8,9] -> columns 2, 3 -> flat 1, 2; [10] -> 2 -> 1; [13] -> row 1 column 1 -> 5;
    # [14,15] -> columns 1, 3 -> 5, 7. Past a completion's end: 0 (never unpacked).
    assert s.take.tolist() == [[1, 2], [1, 0], [5, 0], [5, 7]]
    assert s.targets.tolist() == [[8, 9], [10, 0], [13, 0], [14, 15]]
    # padded layout T = 5 (the longest sequence, 3 + 2): completion token j of a P-token prompt is predicted at
    # t = P - 1 + j, stored at flat b*C + j with C = 2; 8 = none
    assert s.index.tolist() == [[8, 8, 0, 1], [8, 8, 2, 8], [8, 4, 8, 8], [8, 6, 7, 8]]
    a = s.allowed[:, 0].int().tolist()
    # row 0 segments: prompt x3, completion 0 x2, completion 1: a completion sees the prompt and itself, causally
    assert a[0][3] == [1, 1, 1, 1, 0, 0]
    assert a[0][4] == [1, 1, 1, 1, 1, 0]
    assert a[0][5] == [1, 1, 1, 0, 0, 1]  # not its sibling's tokens
    # row 1: prompt x2, completion 0, completion 1 x2, a pad that attends to itself only (no real token sees it)
    assert a[1] == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    x = torch.arange(1.0, 9.0).reshape(4, 2)  # [[1,2],[3,4],[5,6],[7,8]]
    assert s.unpack(x).tolist() == [[0, 0, 1, 2], [0, 0, 3, 0], [0, 5, 0, 0], [0, 7, 8, 0]]


def test_groups_share_prompts():
    assert groups_share_prompts([[1, 2], [1, 2], [3], [3]], Groups.uniform(2, 2))
    assert not groups_share_prompts([[1, 2], [1, 3], [3], [3]], Groups.uniform(2, 2))


def long_prompt_rollouts(n_groups: int, seed: int = 0, group_size: int = K, sizes=None) -> Rollouts:
    """Prompts of 6-20 tokens, completions of 1-8 (the shape a chat template gives: the prompt dominates);
    `sizes`: each group's completions instead of `group_size` each."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for size in sizes or [group_size] * n_groups:
        p = torch.randint(2, 200, (int(torch.randint(6, 21, (1,), generator=g)),), generator=g).tolist()
        for _ in range(size):
            prompts.append(p)
            comps.append(torch.randint(2, 200, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist())
    lps = [[-1.0] * len(c) for c in comps]
    return Rollouts(prompts, comps, lps, [False] * len(comps), [""] * len(comps))


@pytest.fixture(scope="module")
def policy(tiny_model):
    return lora_policy(tiny_model)


@pytest.fixture(scope="module")
def eager_policy(tiny_model):
    return lora_policy(tiny_model, attn_implementation="eager")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_logprobs_equal_padded_on_every_completion_token(policy, eager_policy, attn):
    """The mask in each implementation's form. Eager attention takes its softmax in float32 whatever the model's
    dtype (transformers' eager_attention_forward), so its rows agree to float32's ~1e-7, not float64's."""
    model = policy if attn == "sdpa" else eager_policy
    ro = long_prompt_rollouts(3)
    adv = torch.linspace(-1, 1, len(ro), dtype=torch.float64)
    (mb,) = make_micro_batches(ro, adv, K, 3, 0, CPU)
    (sh,) = make_micro_batches(ro, adv, K, 3, 0, CPU, share_prompt=True)
    assert sh.shared is not None and mb.shared is None
    padded_n, shared_n = shared_tokens(ro.prompt_ids, ro.completion_ids, Groups.of_rows(len(ro), K))
    assert (padded_n, shared_n) == (mb.input_ids.numel(), sh.shared.input_ids.numel())
    assert shared_n < padded_n / 2  # the prompt once instead of K = 4 times
    with torch.no_grad():
        padded = mb.unpack(token_logprobs(forward_logits(model, mb), mb.row_targets))
        shared = sh.unpack(token_logprobs(forward_logits(model, sh), sh.row_targets))
    m = mb.mask.bool()
    assert m.sum() == sum(len(c) for c in ro.completion_ids)
    assert padded[m].std() > 0.1  # log-probs that differ from token to token: a mix-up would show
    torch.testing.assert_close(shared[m], padded[m], rtol=0, atol=1e-10 if attn == "sdpa" else 1e-6)
    assert (shared[~m] == 0).all()


@pytest.mark.parametrize(("objective", "kl_coef"), [("dr_grpo", 0.0), ("dr_grpo", 0.1), ("gspo", 0.0)])
def test_shared_gradient_and_stats_equal_padded(policy, objective, kl_coef):
    ro = long_prompt_rollouts(4, seed=3)
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(len(ro), generator=g, dtype=torch.float64)
    adv[4:8] = 0.0  # one zero-advantage group
    common = dict(objective=objective, kl_coef=kl_coef, group_size=K)
    g_pad, s_pad = grads_after(policy, ro, adv, 2, **common)
    g_sh, s_sh = grads_after(policy, ro, adv, 2, share_prompt=True, **common)
    assert g_pad.abs().max() > 1e-4
    # Not float64-exact: the model's RMSNorm runs in float32 whatever its dtype (transformers' Qwen2/Llama
    # RMSNorm casts to float32 and back), so in backward a prompt token's gradient, here already the sum of its K
    # completions' before the cast, is rounded once where the padded rows round each of the K terms. The forward
    # is bit-identical (the log-probs test); a wrong mask or a wrong gather moves the gradient by O(1).
    torch.testing.assert_close(g_sh, g_pad, rtol=0, atol=1e-6 * g_pad.abs().max().item())
    for f in ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "rollout/logp_diff_mean"):
        assert s_sh.totals[f] == pytest.approx(s_pad.totals[f], rel=1e-9, abs=1e-12), f
    assert s_sh.logged["train/clip_frac"] == 0.0  # epoch 0's ratio is exactly 1 on the shared rows too


def test_groups_of_unequal_sizes_share_and_pack_to_the_padded_log_probs(policy):
    """The group is a type (base/groups.py): groups of 1, 3, 2 and 5 completions behind shared prompts or packed
    rows give the padded rows' log-probs on every completion token, and each micro-batch holds whole groups."""
    sizes = (1, 3, 2, 5)
    groups = Groups(sizes)
    ro = long_prompt_rollouts(len(sizes), seed=5, sizes=sizes)
    adv = torch.linspace(-1, 1, len(ro), dtype=torch.float64)
    mbs = make_micro_batches(ro, adv, groups, 2, 0, CPU)
    assert [mb.rows for mb in mbs] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]  # groups 0-1 (1 + 3), 2-3 (2 + 5)
    for share, pack in ((True, None), (False, 0)):
        for mb, other in zip(mbs, make_micro_batches(ro, adv, groups, 2, 0, CPU, pack_row_tokens=pack,
                                                     share_prompt=share), strict=True):  # fmt: skip
            assert (other.shared is not None) == share and (other.packed is not None) == (pack is not None)
            with torch.no_grad():
                padded = mb.unpack(token_logprobs(forward_logits(policy, mb), mb.row_targets))
                got = other.unpack(token_logprobs(forward_logits(policy, other), other.row_targets))
            m = mb.mask.bool()
            assert m.sum() == sum(len(ro.completion_ids[r]) for r in mb.rows) and padded[m].std() > 0.1
            torch.testing.assert_close(got[m], padded[m], rtol=0, atol=1e-10)
    assert shared_tokens(ro.prompt_ids, ro.completion_ids, groups)[1] == len(sizes) * max(
        len(ro.prompt_ids[s]) + sum(len(ro.completion_ids[r]) for r in groups.rows(g))
        for g, s in enumerate(groups.starts)
    )


def test_groups_with_different_prompts_stay_padded(policy):
    ro = long_prompt_rollouts(2)
    ro.prompt_ids[1] = ro.prompt_ids[1] + [7]  # the first group's second sequence has another prompt
    adv = torch.linspace(-1, 1, len(ro), dtype=torch.float64)
    (mb,) = make_micro_batches(ro, adv, K, 2, 0, CPU, share_prompt=True)
    assert mb.shared is None


def test_unit_capture_of_shared_rows_gives_each_groups_norm(policy):
    """The GNS unit level on shared rows: one row per group, so the capture's rows-in-group-order reading gives each
    group's exact squared gradient norm (RMSNorm's float32 rounding aside: the gradient test)."""
    from rl_training.algs.objectives import StepNorm

    ro = long_prompt_rollouts(3, seed=9)
    adv = torch.linspace(-1, 1, len(ro), dtype=torch.float64)
    norm = StepNorm(seqs=len(ro), tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=8)
    out = []
    for share in (False, True):
        (mb,) = make_micro_batches(ro, adv, K, 3, 0, CPU, share_prompt=share)
        out.append(unit_sq_norms(policy, mb, norm))
    assert out[0].min() > 0 and out[0].max() / out[0].min() > 1.5  # distinct groups: a mix-up would show
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=0)


def test_the_learner_runs_the_advisors_per_sequence_steps_padded(policy):
    """The advisor's ANOVA reads each sequence's gradient, which shared rows cannot give: on its steps (every
    probe.unit_every) the learner builds padded micro-batches and the ANOVA is fed every group; on the others it
    shares. A shared micro-batch reaching the per-sequence capture would break the probes (probe.py micro)."""
    from rl_training.base.meter import Meter
    from rl_training.policy.models import trainable_parameters
    from rl_training.probes.budget import RolloutBudget
    from rl_training.probes.probe import StepProbes
    from rl_training.rollout.base import StepBatch
    from rl_training.train.learner import Learner, UpdateHParams

    n = 4
    ro = long_prompt_rollouts(n, seed=2)
    g = torch.Generator().manual_seed(4)
    rewards = torch.rand(len(ro), generator=g).tolist()  # every group mixed: all informative
    params = trainable_parameters(policy)
    cpu = torch.device("cpu")
    budget = RolloutBudget(
        group_size=K, units_per_step=n, world_size=1, ema_beta=0.9, exact_zero=True, b_multiple=2, device=cpu
    )
    probes = StepProbes(policy, params, levels=["unit", "micro"], ema_beta=0.9, units_per_step=n, world_size=1,
                        micro_batch_groups=2, device=cpu, unit_every=2, budget=budget)  # fmt: skip
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    learner = Learner(model=policy, optimizer=opt, scheduler=sched, params=params,
                      hparams=UpdateHParams(max_grad_norm=0.0, kl_log_every=0), probes=probes, device=cpu,
                      seqs_per_rank=len(ro), max_trainable_tokens=8, micro_batch_groups=2, drop_zero_adv_groups=True,
                      pad_id=0, pack_row_tokens=None, share_prompt=True)  # fmt: skip
    built = []
    import rl_training.train.learner as learner_module

    real = learner_module.make_micro_batches

    def spy(*args, **kwargs):
        built.append(kwargs["share_prompt"])
        return real(*args, **kwargs)

    learner_module.make_micro_batches = spy
    try:
        for step in (0, 1):
            learner.learn(StepBatch(list(range(n)), ro, K, [None] * len(ro)), rewards, step, Meter())
            out = probes.metrics()
            assert out["probe/failures"] == 0.0, out
            if step == 0:
                assert budget.last is not None and budget.last.groups == n  # the ANOVA read every group
    finally:
        learner_module.make_micro_batches = real
        probes.remove_hooks()
    assert built == [False, True]  # step 0 is a unit_every step: padded; step 1 shares


def test_the_unit_level_reads_unequal_groups_in_every_layout(policy):
    """rollout.allocation: per_prompt's groups (1, 3, 2 and 5 completions) through StepProbes: the unit level's
    per-group norms are the same padded, shared (one row per group: read as it is) and packed (gathered by
    group_tokens). Padded rows are gathered by the groups' sizes (probes/capture.py); read as equal groups they gave
    a one-row group the norm of two rows (tests/unit/probes/test_budget.py)."""
    from rl_training.algs.objectives import StepNorm
    from rl_training.policy.models import trainable_parameters
    from rl_training.probes.probe import StepProbes
    from tests.helpers import backward

    sizes = (1, 3, 2, 5)
    groups = Groups(sizes)
    ro = long_prompt_rollouts(len(sizes), seed=5, sizes=sizes)
    adv = torch.linspace(-1, 1, len(ro), dtype=torch.float64)
    norm = StepNorm(seqs=len(ro), tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=8)
    params = trainable_parameters(policy)
    out = []
    for share, pack in ((False, None), (True, None), (False, 0)):
        (mb,) = make_micro_batches(ro, adv, groups, len(sizes), 0, CPU, pack_row_tokens=pack, share_prompt=share)
        assert (mb.shared is not None) == share and (mb.packed is not None) == (pack is not None)
        probes = StepProbes(policy, params, levels=["unit"], ema_beta=0.9, units_per_step=len(sizes), world_size=1,
                            micro_batch_groups=len(sizes), device=CPU)  # fmt: skip
        try:
            probes.begin_step(groups, adv, [len(c) for c in ro.completion_ids])
            for p in params:
                p.grad = None
            with probes.micro(mb):
                backward(policy, mb, norm)
            assert probes.unit_cap.hooks_ok and not probes.broken
            out.append(probes.unit_cap.unit_sq_norms.clone())
        finally:
            probes.remove_hooks()
    padded, shared, packed = out
    assert packed.min() > 0 and packed.max() / packed.min() > 1.5  # distinct groups: a mix-up would show
    torch.testing.assert_close(padded, packed, rtol=1e-9, atol=0)
    torch.testing.assert_close(shared, packed, rtol=1e-5, atol=0)  # RMSNorm's float32 rounding (the test above)

"""rollout.group_size_auto (probes/group_size.py, issue 52 item 3): the split's choice from the advice, the prompts
for a group size within the budget, the sampler's schedule of splits against a step-by-step walk, the probes'
new units, and the config's refusals."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rl_training.config.fields import ConfigError
from rl_training.config.load import load_config
from rl_training.config.schema import derive, with_split
from rl_training.data.prompts import PromptSampler
from rl_training.probes.anova import AnovaEstimate
from rl_training.probes.budget import RolloutBudget
from rl_training.probes.group_size import GroupSizeAuto, choose_k, prompts_for, segments_of

NAN = math.nan


def advice(k_star, lo, hi, trusted=1.0) -> dict:
    return {"probe/advisor/k_star": k_star, "probe/advisor/k_lo": lo, "probe/advisor/k_hi": hi,
            "probe/advisor/trusted": trusted}  # fmt: skip


# ------------------------------------------------------------------------------------------------ the choice
def test_k_follows_a_trusted_k_star_only_outside_its_band():
    assert choose_k(advice(4.4, 3.0, 6.0), 8, 2, 16) == 4  # 8 outside [3, 6]: K* 4.4 rounds to 4
    assert choose_k(advice(4.6, 3.0, 6.0), 8, 2, 16) == 5  # rounds to the nearest
    assert choose_k(advice(4.4, 3.0, 8.0), 8, 2, 16) is None  # 8 inside the band: the estimate cannot tell them
    assert choose_k(advice(4.4, 3.0, 6.0, trusted=0.0), 8, 2, 16) is None  # not trusted: no switch
    assert choose_k({}, 8, 2, 16) is None  # no advice yet
    assert choose_k(advice(NAN, NAN, NAN), 8, 2, 16) is None  # warm-up
    assert choose_k(advice(40.0, 30.0, 64.0), 8, 2, 16) == 16  # clipped to group_size_max
    assert choose_k(advice(1.0, 1.0, 1.2), 8, 3, 16) == 3  # and to group_size_min
    # the band is clipped the same way: K at the bound it would be clipped to stays
    assert choose_k(advice(40.0, 30.0, 64.0), 16, 2, 16) is None
    assert choose_k(advice(1.0, 1.0, 1.2), 3, 3, 16) is None


@pytest.mark.parametrize(
    ("budget", "k", "multiple", "n", "least", "b"),
    [
        (128, 4, 1, 1000, 0, 32),  # 128 / 4
        (128, 3, 2, 1000, 0, 42),  # 128 // 3 = 42, a multiple of 2: 126 completions
        (128, 5, 4, 1000, 0, 24),  # 128 // 5 = 25 -> 24, a multiple of 4
        (128, 2, 4, 40, 0, 40),  # 64 prompts wanted, the dataset has 40
        (128, 2, 3, 40, 0, 39),  # ... and a multiple of 3
        (16, 16, 1, 100, 2, 2),  # 1 prompt wanted, 2 at least: 32 completions, but k_max keeps K <= 16 / 2
    ],
)
def test_prompts_for_a_group_size(budget, k, multiple, n, least, b):
    assert prompts_for(budget, k, multiple, n, least) == b


def test_from_config_bounds_k_by_the_budget_and_restores_the_advice():
    cfg = load_config(None, ["rollout.prompts_per_step=16", "rollout.group_size=8", "train.micro_batch_groups=4"])
    a = GroupSizeAuto.from_config(cfg, 1, 1000, None)
    assert a is None  # off
    on = ["rollout.group_size_auto=true", "probe.advisor=true", "model.gradient_checkpointing=false"]
    cfg = load_config(None, ["rollout.prompts_per_step=16", "rollout.group_size=8", "train.micro_batch_groups=4", *on])
    a = GroupSizeAuto.from_config(cfg, 1, 1000, {"advice": advice(4.0, 3.0, 5.0), "segments": [[4, 32, 4]]})
    # budget 128; one rank: at least 2 micro-batches of 4 groups, so B >= 8 and K <= 128 / 8 = 16 = 2 x 8
    assert (a.budget, a.multiple, a.least, a.k_min, a.k_max) == (128, 4, 8, 2, 16)
    assert a.decide(8) == (32, 4)  # the restored advice: K 4, B 128 / 4
    assert a.decide(4) is None
    a = GroupSizeAuto.from_config(cfg, 4, 1000, None)  # 4 ranks: B a multiple of 16, one micro-batch each at least
    assert (a.multiple, a.least, a.k_max) == (16, 16, 8)  # K <= 128 / 16
    a.observe({"rollout/reward_mean": 0.5})  # a step without advice keeps the last
    assert a.advice is None
    a.observe({**advice(2.2, 1.0, 3.0), "probe/advisor/b_star": 58.0})
    assert a.decide(8) == (64, 2)
    assert a.state_dict(((4, 64, 2),)) == {"segments": [[4, 64, 2]], "advice": advice(2.2, 1.0, 3.0)}
    assert segments_of(a.state_dict(((4, 64, 2),))) == ((4, 64, 2),) and segments_of(None) == ()


# ------------------------------------------------------------------------------------------------ the sampler
def walk(n: int, b0: int, segments, step: int) -> tuple[int, int]:
    """The position at the start of `step`, step by step: each step takes its split's b from the epoch, or starts
    the next epoch where fewer than b are left."""
    epoch = offset = 0
    for t in range(step + 1):
        b = b0
        for start, sb, _ in segments:
            if start <= t:
                b = sb
        if offset + b > n:
            epoch, offset = epoch + 1, 0
        if t < step:
            offset += b
    return epoch, offset


@st.composite
def schedules(draw):
    n = draw(st.integers(1, 60))
    b0 = draw(st.integers(1, n))
    starts = sorted(draw(st.sets(st.integers(1, 40), max_size=4)))
    segments = tuple((s, draw(st.integers(1, n)), draw(st.integers(2, 9))) for s in starts)
    return n, b0, segments


@given(schedules(), st.integers(0, 80))
def test_the_sampler_s_position_is_the_step_by_step_walk(schedule, step):
    n, b0, segments = schedule
    s = PromptSampler(n, b0, 4, 1, 0, segments)
    assert s.position(step) == walk(n, b0, segments, step)
    if not segments:  # the closed form every run had before the schedule
        assert s.position(step) == (step // (n // b0), step % (n // b0) * b0)


def test_a_switch_continues_the_epoch_with_disjoint_prompts():
    s = PromptSampler(20, 4, 8, 2, 7).switched(3, 8, 4).switched(6, 2, 16)
    assert [s.split(t) for t in (0, 2, 3, 5, 6, 9)] == [(4, 8), (4, 8), (8, 4), (8, 4), (2, 16), (2, 16)]
    # 3 steps of 4 prompts (0-11), one of 8 (12-19), the next epoch's 8 and 8, then 2 at a time from offset 16
    assert [s.position(t) for t in range(8)] == [(0, 0), (0, 4), (0, 8), (0, 12), (1, 0), (1, 8), (1, 16), (1, 18)]
    epoch0 = [i for t in range(4) for r in (0, 1) for i in s.indices(t, r)]
    assert len(epoch0) == len(set(epoch0)) == 20  # the whole first epoch, no prompt twice
    assert [len(s.indices(t, 1)) for t in (2, 3, 6)] == [2, 4, 1]  # a rank's share of each split
    assert s.switched(3, 8, 4).segments == ((3, 8, 4),)  # a switch drops the later ones
    with pytest.raises(Exception, match="dataset has 20 prompts < the 32 prompts per step of the split from step 5"):
        s.switched(5, 32, 2)


def test_derived_follows_the_split():
    cfg = load_config(None, ["rollout.prompts_per_step=16", "rollout.group_size=8", "train.micro_batch_groups=2"])
    d = with_split(derive(cfg, 2), 32, 4, 2)
    assert (d.groups_per_rank, d.seqs_per_rank, d.accum_steps, d.micro_batch_seqs) == (16, 64, 8, 8)
    assert with_split(d, 16, 8, 2) == derive(cfg, 2)


# ------------------------------------------------------------------------------------------------ the probes
def fed_budget(group_size: int, units: int) -> RolloutBudget:
    return RolloutBudget(group_size=group_size, units_per_step=units, world_size=1, ema_beta=0.9, exact_zero=True,
                         b_multiple=1, device=torch.device("cpu"))  # fmt: skip


def test_a_budget_given_a_new_split_reads_groups_of_that_size():
    # 4 groups of 8 rewards, informative; the per-sequence and per-group norms of a step
    torch.manual_seed(0)
    rewards = [float(i % 3 == 0) for i in range(32)]
    adv = torch.tensor(rewards) - 0.5
    seq, grp = torch.rand(32, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    moved, fresh = fed_budget(4, 8), fed_budget(8, 4)
    moved.set_split(4, 8)
    for b in (moved, fresh):
        b.begin_step(adv, rewards)
        b.add(seq, grp, (8,) * 4)
        b.update([*(float(x) for x in b.local_sums())], q=0.3, valid=True)
    assert moved.last is not None and moved.last == fresh.last  # the same ANOVA as a budget built for K = 8
    assert moved.waste_sum == fresh.waste_sum and moved.groups_local == 4
    # the advice stays for the budget: without waste K* = sqrt((c_p / c_r) tr S_w / tr S_b) = sqrt(1 x 16) = 4 and
    # B* = 32 // 4 = 8 after a split of 3 x 10 (30 completions would give 7)
    advised = fed_budget(4, 8)
    advised.exact_zero = False  # no waste term: the closed form
    for _ in range(5):
        advised.state.update(AnovaEstimate(1.0, 16.0, 1.0, 5.0, 8.0, 4))
    advised.costs.update([1.0, 1.0])
    advised.set_split(3, 10)
    out = advised._advice_metrics()
    assert (out["probe/advisor/k_star"], out["probe/advisor/b_star"], out["probe/advisor/k_current"]) == (4, 8, 10)


# ------------------------------------------------------------------------------------------------ the config
AUTO = ["rollout.group_size_auto=true", "probe.advisor=true", "model.gradient_checkpointing=false"]


@pytest.mark.parametrize(
    ("others", "message"),
    [
        (["probe.advisor=false"], "probe.advisor off: the advisor's K* is what it follows"),
        (["ckpt.every=0"], "ckpt.every=0: it switches at checkpoint boundaries"),
        (["rollout.max_async_level=1", "loss.tis_cap=2.0"], "rollout.max_async_level > 0: a producer thread"),
        (["rollout.group_size_min=10"], "rollout.group_size=8 outside [group_size_min, group_size_max] = [10, 16]"),
        (["rollout.group_size_max=4"], "rollout.group_size=8 outside [group_size_min, group_size_max] = [2, 4]"),
        (
            ["rollout.group_size_min=6", "rollout.group_size_max=5"],
            "rollout.group_size_max=5 < rollout.group_size_min=6",
        ),
    ],
)
def test_group_size_auto_refuses_what_it_cannot_follow(others, message):
    with pytest.raises(ConfigError, match=re.escape(f"rollout.group_size_auto=true with {message}")):
        load_config(None, [*AUTO, *others])
    load_config(None, AUTO)

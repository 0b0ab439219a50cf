"""Dynamic sampling (rollout/refill.py): which groups a step keeps, what it draws and counts, and the Dr-GRPO
normaliser's identity on the real update."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rl_training.base.groups import Groups
from rl_training.base.meter import Meter
from rl_training.data.prompts import PromptSampler
from rl_training.rollout.base import Rollouts, StepBatch
from rl_training.rollout.refill import Scored, concat, informative_groups, refill, select_groups
from rl_training.tasks.base import Scores
from tests.helpers import G, fake_rollouts, grads_after, lora_policy


def scripted(indices: list[int], rewards: list[float], k: int = 2) -> Scored:
    """A scored batch whose prompt i is dataset index indices[i]; completion j of group g reads 'g<idx>.<j>'."""
    n = len(indices) * k
    texts = [f"g{indices[r // k]}.{r % k}" for r in range(n)]
    ro = Rollouts([[1, 2]] * n, [[3 + r] for r in range(n)], [[-1.0]] * n, [False] * n, texts, policy_version=[0] * n)
    scores = Scores(rewards=list(rewards), correct=[x > 0 for x in rewards], formatted=[True] * n, parts={"p": rewards})
    return Scored(StepBatch(indices, ro, k, [f"ex{indices[r // k]}" for r in range(n)]), scores, list(rewards))


def test_informative_groups():
    assert informative_groups([1, 1, 0, 1, 0.5, 0.5], Groups.uniform(3, 2)) == [False, True, False]
    assert informative_groups([1, 1, 0, 1, 0.5, 0.5], Groups((3, 1, 2))) == [True, False, False]  # unequal


def test_select_and_concat_keep_every_row_with_its_group():
    a = scripted([10, 11, 12], [0, 0, 1, 0, 1, 1])
    b = scripted([20], [0, 1])
    out = concat([select_groups(a, [1]), select_groups(b, [0]), select_groups(a, [2])])
    assert out.batch.indices == [11, 20, 12]
    assert out.batch.rollouts.texts == ["g11.0", "g11.1", "g20.0", "g20.1", "g12.0", "g12.1"]
    assert out.batch.examples == ["ex11", "ex11", "ex20", "ex20", "ex12", "ex12"]
    assert out.rewards == [1, 0, 0, 1, 1, 1] == out.scores.rewards == out.scores.parts["p"]
    assert out.batch.rollouts.completion_ids == [[5], [6], [3], [4], [7], [8]]
    assert out.scores.correct == [True, False, False, True, True, True]


def test_refill_keeps_informative_groups_and_draws_the_shortfall_over_the_informative_fraction():
    # B = 4 drawn, groups 0 and 2 informative: need 2, fraction 2/4 -> round 1 asks for ceil(2 / 0.5) = 4 prompts.
    # Round 1 has one informative group (its second): need 1, fraction (2+1)/(4+4) -> ceil(1 * 8 / 3) = 3 prompts.
    # Round 2's first group is informative: the step holds 4, in the order found.
    first = scripted([0, 1, 2, 3], [1, 0, 1, 1, 0, 1, 0, 0])
    asked = []

    def draw(round_, n):
        asked.append((round_, n))
        if round_ == 1:
            return scripted([100, 101, 102, 103][:n], [1, 1, 0, 1, 0, 0, 1, 1])
        return scripted([200, 201, 202][:n], [0, 1, 1, 0, 0, 0])

    out, stats = refill(first, draw, max_rounds=3)
    assert asked == [(1, 4), (2, 3)]
    assert out.batch.indices == [0, 2, 101, 200]
    assert all(informative_groups(out.rewards, out.batch.groups))
    assert (stats.rounds, stats.prompts, stats.informative_first, stats.informative_kept) == (2, 7, 2, 4)
    assert stats.completions_generated == (4 + 4 + 3) * 2
    # every scripted prompt is 2 tokens and every completion 1: 11 prompts once, 22 completions
    assert (stats.prompt_tokens_generated, stats.completion_tokens_generated) == (11 * 2, 22 * 1)
    m = Meter()
    stats.measure(m, Groups.uniform(4, 2))
    got = m.reduce(torch.device("cpu"))
    assert got["rollout/refill_rounds"] == 2 and got["rollout/refill_prompts"] == 7
    assert got["rollout/completions_generated"] == 22 and got["rollout/completions_trained"] == 8
    assert got["rollout/informative_group_frac"] == 0.5 and got["rollout/informative_group_frac_trained"] == 1.0


def test_short_after_the_last_round_the_batchs_tied_groups_fill_the_step():
    first = scripted([0, 1, 2], [1, 1, 0, 1, 0, 0])  # only group 1 informative

    def draw(round_, n):  # every refill ties
        return scripted(list(range(50, 50 + n)), [1.0] * (2 * n))

    out, stats = refill(first, draw, max_rounds=2)
    assert out.batch.indices == [1, 0, 2]  # the informative group, then the tied ones in their order
    assert len(out.rewards) == 6 and stats.rounds == 2 and stats.informative_kept == 1


def test_no_refill_when_every_group_is_informative():
    first = scripted([0, 1], [1, 0, 0, 1])
    out, stats = refill(first, lambda r, n: (_ for _ in ()).throw(AssertionError("drew")), max_rounds=3)
    assert out.batch.indices == [0, 1] and stats.rounds == 0 and stats.completions_generated == 4


def test_refill_prompts_are_a_pure_function_of_seed_step_rank_and_round():
    s = PromptSampler(n=50, prompts_per_step=8, group_size=4, world_size=2, seed=3)
    a = s.refill_indices(step=7, rank=1, round_=2, n=6)
    assert a == PromptSampler(50, 8, 4, 2, 3).refill_indices(7, 1, 2, 6)  # a resumed run draws the same
    assert len(set(a)) == 6 and all(0 <= i < 50 for i in a)
    others = [s.refill_indices(7, 0, 2, 6), s.refill_indices(7, 1, 1, 6), s.refill_indices(8, 1, 2, 6)]
    assert all(o != a for o in others)
    assert sorted(s.refill_indices(0, 0, 1, 80)) == list(range(50))  # never more than the dataset


def test_the_normaliser_is_the_configured_constant_so_a_refilled_step_is_n_over_b_times_the_standard_step(tiny_model):
    """Dr-GRPO divides by c = (sequences) x L_max, fixed by the config, never by what the step holds. A standard
    step over all N generated groups has gradient (1/(N K L)) sum over its informative groups (a tied group's is 0);
    the refilled step trains B groups, exactly those informative ones here, and has (1/(B K L)) times the same sum:
    N/B times the standard step's. Checked on the real update (float64)."""
    policy = lora_policy(tiny_model)
    ro = fake_rollouts(6, seed=4)  # N = 6 groups of G = 2: the batch as drawn (3) and one refill round (3)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.9, 1.0, 1.0, 0.0, 1.0, 0.3, 0.3], dtype=torch.float64)
    info = informative_groups(rewards.tolist(), Groups.of_rows(len(rewards), G))
    assert info == [True, False, True, False, True, False]  # B = 3 informative of N = 6
    adv = rewards.view(-1, G) - rewards.view(-1, G).mean(1, keepdim=True)  # Dr-GRPO: r - group mean
    everything, _ = grads_after(policy, ro, adv.reshape(-1), 6)
    keep = [r for g in (0, 2, 4) for r in range(g * G, (g + 1) * G)]
    refilled_ro = Rollouts(
        [ro.prompt_ids[r] for r in keep],
        [ro.completion_ids[r] for r in keep],
        [ro.logprobs[r] for r in keep],
        [ro.truncated[r] for r in keep],
        [ro.texts[r] for r in keep],
    )
    refilled, _ = grads_after(policy, refilled_ro, adv.reshape(-1)[keep], 3)
    assert everything.abs().max() > 1e-5
    torch.testing.assert_close(refilled, (6 / 3) * everything, rtol=1e-9, atol=1e-12)


def test_the_advisors_costs_count_what_the_step_generated():
    """rl_batch.step_work: with dynamic sampling the generate phase made every drawn group (the batch's 2 and the
    refill's 3), so the advisor's per-prompt and per-completion costs divide by those, not by the 2 trained."""
    from rl_training.probes.budget import split_seconds
    from rl_training.runners.rl_batch import step_work

    first = scripted([0, 1], [1, 1, 0, 1])  # group 0 ties: one refill round of ceil(1 * 2 / 1) = 2 prompts

    def draw(round_, n):
        return scripted([10, 11][:n], [0, 0, 1, 0])

    out, stats = refill(first, draw, max_rounds=1)
    timer = SimpleNamespace(seconds={"generate": 3.0, "score": 1.0, "train": 2.0})
    plain = step_work(out.batch, timer, prompt_once=True)
    assert (plain.prompts, plain.completions, plain.prompt_tokens, plain.completion_tokens) == (2, 4, 4, 4)
    work = step_work(out.batch, timer, prompt_once=True, drawn=stats)
    assert (work.prompts, work.completions, work.prompt_tokens, work.completion_tokens) == (4, 8, 8, 8)
    # generate 3 s split by tokens: 8 of 16 read by the prompts -> 1.5 s; the completions 1.5 + score + train
    assert split_seconds(work) == (1.5, 1.5 + 1.0 + 2.0)

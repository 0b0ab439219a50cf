"""Padding-free micro-batches (rl_training/train/packing.py): the layout itself, and the packed computation equal to the
padded one on the real tiny model in float64 (log-probs, loss, entropy, KL, gradients, per-group probe norms)."""

from __future__ import annotations

import pytest
import torch

from rl_training.algs.common import token_logprobs
from rl_training.base.groups import Groups
from rl_training.rollout.base import Rollouts
from rl_training.train.batches import forward_logits, make_micro_batches
from rl_training.train.packing import ONE_ROW, first_fit_rows, pack_sequences, padded_tokens, row_tokens_for
from tests.helpers import G, grads_after, lora_policy, unit_sq_norms

CPU = torch.device("cpu")


def test_first_fit_decreasing_rows():
    # lengths 5,2,4,3,1 into width 6, longest first: 5 -> row0 (free 1); 4 -> row1 (free 2); 3 -> row2 (free 3);
    # 2 -> row1 (free 0); 1 -> row0 (free 0)
    assert first_fit_rows([5, 2, 4, 3, 1], 6) == [[0, 4], [2, 1], [3]]


def test_pack_layout_values():
    # two groups of G=2: [1,2,3] [4,5] | [6] [7,8,9]; width = 3. FFD: 0 (len 3) row0; 3 (len 3) row1;
    # 1 (len 2) row2; 2 (len 1) row2 -> rows [1,2,3] [7,8,9] [4,5,6]
    p = pack_sequences([[1, 2, 3], [4, 5], [6], [7, 8, 9]], Groups.uniform(2, 2), pad_id=0)
    assert p.input_ids.tolist() == [[1, 2, 3], [7, 8, 9], [4, 5, 6]]
    assert p.position_ids.tolist() == [[0, 1, 2], [0, 1, 2], [0, 1, 0]]
    # padded prediction (b, t) -> flat row position r*(W-1) + o + t, W-1 = 2; none = 3*2 = 6
    assert p.index.tolist() == [[0, 1], [4, 6], [6, 6], [2, 3]]
    # group tokens, flat r*W + o: group 0 = seq 0 (0,1,2) + seq 1 (6,7); group 1 = seq 2 (8) + seq 3 (3,4,5)
    assert p.group_tokens.tolist() == [[0, 1, 2, 6, 7], [8, 3, 4, 5, 9]]  # 9 = R*W: padding
    x = torch.arange(6.0).view(3, 2) + 10
    assert p.unpack(x).tolist() == [[10, 11], [14, 0], [0, 0], [12, 13]]


def test_pad_block_keeps_its_own_positions():
    # one row of width 4 holding [1,2] then 2 pads: the pads restart at 0, a block of their own
    p = pack_sequences([[1, 2], [3, 4, 5, 6]], Groups.uniform(1, 2), pad_id=0)
    assert p.input_ids.tolist() == [[3, 4, 5, 6], [1, 2, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]


def skewed_rollouts(n_groups: int, seed: int = 0) -> Rollouts:
    """Length-skewed: most completions 1-3 tokens, one per group 20-30 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for _ in range(n_groups):
        p = torch.randint(2, 200, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for i in range(G):
            n = int(torch.randint(20, 31, (1,), generator=g)) if i == 0 else int(torch.randint(1, 4, (1,), generator=g))
            prompts.append(p)
            comps.append(torch.randint(2, 200, (n,), generator=g).tolist())
    lps = [[-1.0] * len(c) for c in comps]
    return Rollouts(prompts, comps, lps, [False] * len(comps), [""] * len(comps))


@pytest.fixture(scope="module")
def policy(tiny_model):
    return lora_policy(tiny_model)


@pytest.mark.parametrize("row_tokens", [0, 1000, ONE_ROW])
def test_packed_logprobs_equal_padded_on_every_real_position(policy, row_tokens):
    ro = skewed_rollouts(4)
    adv = torch.linspace(-1, 1, len(ro), dtype=torch.float64)
    (mb,) = make_micro_batches(ro, adv, G, 4, 0, CPU)
    mb.head_from = 0  # the LM head on every position, prompt ones included: compared to the packed rows
    (pk,) = make_micro_batches(ro, adv, G, 4, 0, CPU, pack_row_tokens=row_tokens)
    assert pk.packed.input_ids.shape[0] == (1 if row_tokens else pk.packed.input_ids.shape[0])
    assert pk.packed.input_ids.numel() < mb.input_ids.numel()  # fewer tokens through the model
    with torch.no_grad():
        padded = mb.unpack(token_logprobs(forward_logits(policy, mb), mb.row_targets))
        packed = pk.unpack(token_logprobs(forward_logits(policy, pk), pk.row_targets))
    real = mb.attention_mask[:, 1:].bool()  # every prediction position of a real token, prompt ones included
    assert real.sum() > 2 * mb.mask.sum() / 3
    torch.testing.assert_close(packed[real], padded[real], rtol=0, atol=1e-10)
    assert (packed[~real] == 0).all()


@pytest.mark.parametrize(("objective", "kl_coef"), [("dr_grpo", 0.0), ("dr_grpo", 0.1), ("gspo", 0.0)])
def test_packed_gradient_and_stats_equal_padded(policy, objective, kl_coef):
    ro = skewed_rollouts(4, seed=3)
    adv = torch.tensor([0.5, -0.5, 0.3, -0.3, 0.0, 0.0, 1.0, -1.0], dtype=torch.float64)
    g_pad, s_pad = grads_after(policy, ro, adv, 2, objective=objective, kl_coef=kl_coef)
    g_pk, s_pk = grads_after(policy, ro, adv, 2, objective=objective, kl_coef=kl_coef, pack_row_tokens=0)
    g_one, _ = grads_after(policy, ro, adv, 4, objective=objective, kl_coef=kl_coef, pack_row_tokens=10**4)
    assert g_pad.abs().max() > 1e-4
    torch.testing.assert_close(g_pk, g_pad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(g_one, g_pad, rtol=1e-9, atol=1e-12)
    for f in ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "rollout/logp_diff_mean"):
        assert s_pk.totals[f] == pytest.approx(s_pad.totals[f], rel=1e-9, abs=1e-12), f
    assert s_pk.pers["rollout/logp_diff_mean"] == s_pad.pers["rollout/logp_diff_mean"]  # the trained tokens
    assert s_pk.kept["logp_gap"] == pytest.approx(s_pad.kept["logp_gap"], rel=1e-9)


def test_packed_old_logprobs_equal_new_in_epoch_zero(policy):
    # PPO ratio exactly 1 in epoch 0, packed as padded: nothing clipped, whatever the clip range
    ro = skewed_rollouts(2, seed=5)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    _, s = grads_after(policy, ro, adv, 2, pack_row_tokens=0)
    assert s.logged["train/clip_frac"] == 0.0


def test_unit_probe_norms_equal_padded(policy):
    """LoraUnitCapture's exact per-group squared norms, packed rows gathered group by group = padded rows."""
    from rl_training.algs.objectives import StepNorm

    ro = skewed_rollouts(3, seed=9)
    adv = torch.linspace(-1, 1, len(ro), dtype=torch.float64)
    norm = StepNorm(seqs=len(ro), tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=32)
    out = []
    for row_tokens in (None, 0):
        (mb,) = make_micro_batches(ro, adv, G, 3, 0, CPU, pack_row_tokens=row_tokens)
        out.append(unit_sq_norms(policy, mb, norm, None if mb.packed is None else mb.packed.group_tokens))
    assert out[0].min() > 0
    torch.testing.assert_close(out[1], out[0], rtol=1e-9, atol=0)


def test_flash_attention_packs_a_micro_batch_into_one_row():
    """Issue 29 N4: transformers takes flash-attention's varlen path from position ids only for a batch of one
    row, so under flash_attention_2 every micro-batch is one row, whatever its size; other kernels keep the
    configured width, and an explicit width with flash-attention is refused."""
    from rl_training.config.load import load_config
    from rl_training.config.schema import ConfigError

    assert row_tokens_for("flash_attention_2", 0) == ONE_ROW and row_tokens_for("sdpa", 0) == 0
    lengths = [30, 7, 7, 7, 25, 3]
    seqs = [[5] * n for n in lengths]
    pairs = Groups.of_rows(len(seqs), 2)
    assert pack_sequences(seqs, pairs, 0, ONE_ROW).input_ids.shape == (1, sum(lengths))
    assert pack_sequences(seqs, pairs, 0, 0).input_ids.shape[0] == 3  # rows of 30: [30], [25, 3], [7, 7, 7]
    fa = ["model.attn_implementation=flash_attention_2", "train.pack_sequences=true"]
    with pytest.raises(
        ConfigError, match="train.pack_row_tokens=4096 with model.attn_implementation=flash_attention_2"
    ):
        load_config(None, [*fa, "train.pack_row_tokens=4096"])
    assert load_config(None, fa).train.pack_row_tokens == 0
    # what the runner's learner packs with: one row under flash-attention, bins of the longest sequence otherwise
    from rl_training.config.resolve import resolve
    from rl_training.config.schema import derive
    from rl_training.train.learner import Learner

    def learner_packing(overrides):
        cfg = resolve(load_config(None, overrides)).cfg  # as the runner builds it: auto values resolved
        parts = dict(model=None, optimizer=None, scheduler=None, params=[], probes=None, device=torch.device("cpu"))
        return Learner.from_config(cfg, derive(cfg, 1), max_trainable_tokens=8, pad_id=0, **parts).pack_row_tokens

    assert learner_packing(fa) == ONE_ROW
    assert learner_packing(["train.pack_sequences=true"]) == 0 and learner_packing([]) is None


def test_padded_tokens_of_a_skewed_batch():
    ro = skewed_rollouts(16)
    seqs = [p + c for p, c in zip(ro.prompt_ids, ro.completion_ids, strict=True)]
    padded, packed = padded_tokens(seqs)
    real = sum(len(s) for s in seqs)
    assert packed < padded / 1.5  # at least a third of the padded work was pads
    assert real <= packed

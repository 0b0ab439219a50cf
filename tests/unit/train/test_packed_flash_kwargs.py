"""Packed flash-attention without host syncs (issue 41, item 5): the packer hands the model the sequence
boundaries it already knows (`cu_seq_lens_q/k`, `max_length_q/k`, transformers' FlashAttentionKwargs), so
transformers does not recompute them from the position ids in every layer behind `if _is_packed_sequence(...)`.

flash-attn needs CUDA, so the kernel is a stand-in: transformers' own flash path (integrations.flash_attention,
modeling_flash_attention_utils._flash_attention_forward) runs on the CPU with a varlen function that computes
causal attention block by block with sdpa. Everything up to the kernel call is transformers' real code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_training.algs.common import token_logprobs
from rl_training.base.groups import Groups
from rl_training.rollout.base import Rollouts
from rl_training.train.batches import forward_logits, make_micro_batches
from rl_training.train.packing import ONE_ROW, pack_sequences
from tests.helpers import G, lora_policy

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("seqs", "row_tokens", "cu", "longest"),
    [
        ([[1, 2, 3], [4, 5], [6]], ONE_ROW, [0, 3, 5, 6], 3),  # one row: the sequences end to end, no pads
        ([[1, 2], [3, 4, 5, 6]], 0, [0, 4, 6, 8], 4),  # rows [3,4,5,6] [1,2,pad,pad]: the pads are a block too
        ([[1, 2, 3], [4, 5], [6], [7, 8, 9]], 0, [0, 3, 6, 8, 9], 3),  # rows [1,2,3] [7,8,9] [4,5,6]
    ],
)
def test_packer_boundaries_are_the_ones_transformers_would_compute(seqs, row_tokens, cu, longest):
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    p = pack_sequences(seqs, Groups.uniform(len(seqs), 1), pad_id=0, row_tokens=row_tokens)
    assert p.cu_seq_lens.tolist() == cu and p.cu_seq_lens.dtype == torch.int32
    assert p.max_length == longest and isinstance(p.max_length, int)  # a host int: no .item() on the device
    (theirs, _), (their_max, _) = prepare_fa_kwargs_from_position_ids(p.position_ids)
    assert theirs.tolist() == cu and int(their_max) == longest


def uneven_rollouts(n_groups: int) -> Rollouts:
    """Groups of G completions of 1 to 12 tokens after prompts of 3 to 8: blocks of many lengths in one row."""
    g = torch.Generator().manual_seed(1)
    draw = lambda lo, hi: torch.randint(2, 200, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)  # noqa: E731
    prompts = [draw(3, 9).tolist() for _ in range(n_groups) for _ in range(G)]
    comps = [draw(1, 13).tolist() for _ in prompts]
    return Rollouts(prompts, comps, [[-1.0] * len(c) for c in comps], [False] * len(comps), [""] * len(comps))


def varlen_on_cpu(calls):
    """flash_attn_varlen_func's contract on [total, heads, dim] tensors: causal attention within each block."""

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, **_):
        calls.append((cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
        out = []
        for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), strict=True):
            qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [heads, n, dim]
            rep = qs.shape[0] // ks.shape[0]  # grouped-query attention
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=softmax_scale).transpose(0, 1))
        return torch.cat(out)

    return varlen


@pytest.fixture
def cpu_flash(monkeypatch):
    """transformers' flash-attention path under the name 'cpu_flash', its kernel the stand-in above; the
    per-layer boundary recomputation (a host sync on CUDA) raises."""
    import transformers.modeling_flash_attention_utils as fa
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("cpu_flash", flash_attention_forward)
    AttentionMaskInterface.register("cpu_flash", flash_attention_mask)
    calls: list = []

    def kwargs_of(**kw):
        return {
            "max_seqlen_q": kw["max_seqlen_q"],
            "max_seqlen_k": kw["max_seqlen_k"],
            "softmax_scale": kw.get("softmax_scale"),
        }

    monkeypatch.setattr(
        fa,
        "lazy_import_flash_attention",
        lambda *a, **k: ((None, varlen_on_cpu(calls), None, None, None), (kwargs_of, None)),
    )

    def host_sync(*a, **k):
        raise AssertionError("transformers recomputed the packed boundaries from position_ids (a host sync per layer)")

    monkeypatch.setattr(fa, "_is_packed_sequence", host_sync)
    return calls


def test_packed_boundaries_reach_every_flash_attention_call(tiny_model, cpu_flash):
    policy = lora_policy(tiny_model)
    ro = uneven_rollouts(n_groups=3)
    adv = torch.linspace(-1, 1, len(ro), dtype=torch.float64)
    (mb,) = make_micro_batches(ro, adv, G, 4, 0, CPU)
    mb.head_from = 0  # the LM head on every position, prompt ones included: compared to the packed rows
    (pk,) = make_micro_batches(ro, adv, G, 4, 0, CPU, pack_row_tokens=ONE_ROW)
    with torch.no_grad():
        padded = mb.unpack(token_logprobs(forward_logits(policy, mb), mb.row_targets))  # sdpa, padded
        policy.get_base_model().config._attn_implementation = "cpu_flash"  # set_attn_implementation would load a kernel
        packed = pk.unpack(token_logprobs(forward_logits(policy, pk), pk.row_targets))
    layers = policy.get_base_model().config.num_hidden_layers
    assert len(cpu_flash) == layers  # every layer took the varlen path, with the packer's boundaries as they are
    for cu_q, cu_k, max_q, max_k in cpu_flash:
        assert cu_q is pk.packed.cu_seq_lens and cu_k is pk.packed.cu_seq_lens
        assert max_q == max_k == pk.packed.max_length and isinstance(max_q, int)
    real = mb.attention_mask[:, 1:].bool()
    torch.testing.assert_close(packed[real], padded[real], rtol=0, atol=1e-10)  # each sequence saw itself only

"""Dr-GRPO math against hand-derived values, and the invariances the constant normaliser buys."""

from __future__ import annotations

import math

import pytest
import torch

from rl_training.algs.common import group_advantages, k3_kl, token_entropy, token_logprobs
from rl_training.algs.objectives import OBJECTIVES, LossInput, StepNorm, policy_loss

DR_GRPO = OBJECTIVES["dr_grpo"]


def dr_grpo(logp, old_logp, adv, mask, normalizer, clip_low=0.2, clip_high=0.2, **kw):
    """The trainer's Dr-GRPO loss with the step constant `normalizer` (= seqs x max_new_tokens, seqs = 1)."""
    norm = StepNorm(seqs=1, tokens=float(mask.sum()), max_new_tokens=normalizer)
    return policy_loss(LossInput(DR_GRPO, logp, old_logp, adv, mask, norm, clip_low, clip_high, **kw))


def test_group_advantages_hand_values():
    # group 1: rewards 1,0,0,1 -> mean 0.5 -> +0.5,-0.5,-0.5,+0.5 (no std division: Dr-GRPO)
    # group 2: rewards 0.2,0.4,0.6,0.8 -> mean 0.5 -> -0.3,-0.1,+0.1,+0.3
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.4, 0.6, 0.8], dtype=torch.float64)
    a = group_advantages(r, 4)
    assert torch.allclose(a, torch.tensor([0.5, -0.5, -0.5, 0.5, -0.3, -0.1, 0.1, 0.3], dtype=torch.float64))
    assert torch.allclose(a.view(2, 4).sum(1), torch.zeros(2, dtype=torch.float64), atol=1e-15)


def test_advantages_not_std_normalised():
    # Scaling rewards by c scales Dr-GRPO advantages by c (GRPO's std division would cancel it).
    r = torch.rand(12, dtype=torch.float64)
    assert torch.allclose(group_advantages(3.0 * r, 4), 3.0 * group_advantages(r, 4))


def test_group_advantages_rejects_ragged():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)


def test_loss_hand_values():
    # Two sequences, L = 3 positions; seq 0 has 2 valid tokens, seq 1 has 3. normalizer = 2 seqs x 4 tokens = 8.
    # seq 0: A=+1, log-ratios (0, log 1.5) -> ratios 1, 1.5. clip_high 0.2 -> min(1.5, 1.2)*1 = 1.2 for token 2.
    #        per-token loss: -1, -1.2 -> sum -2.2 ; token 2 is clipped.
    # seq 1: A=-0.5, log-ratios (log 0.5, 0, log 1.1) -> ratios 0.5, 1, 1.1.
    #        token 1: min(0.5*-0.5, 0.8*-0.5) = min(-0.25,-0.4) = -0.4 -> loss 0.4 (clipped, ratio < 0.8, A < 0)
    #        token 2: -(1*-0.5) = 0.5 ; token 3: min(-0.55, -0.55) = -0.55 -> 0.55
    #        sum 1.45. Total (-2.2 + 1.45)/8 = -0.09375
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.0, math.log(1.5), 0.0], [math.log(0.5), 0.0, math.log(1.1)]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    out = dr_grpo(new, old, adv, mask, normalizer=8, clip_low=0.2, clip_high=0.2)
    assert out.loss.item() == pytest.approx(-0.09375, abs=1e-12)
    assert out.clipped_tokens.item() == 2 and out.tokens.item() == 5


def test_loss_gradient_hand_value():
    # One token, A = 2, ratio 1 (on-policy): loss = -exp(lp - old)*A / N -> d/d lp = -A/N = -2/10.
    lp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    out = dr_grpo(
        lp, lp.detach(), torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), normalizer=10
    )
    out.loss.backward()
    assert lp.grad.item() == pytest.approx(-0.2, abs=1e-15)


def test_decoupled_clip_bounds():
    # ratio 1.25 with A>0: clip_high 0.28 leaves it (1.25 < 1.28); clip_high 0.2 clips to 1.2.
    lp = torch.tensor([[math.log(1.25)]], dtype=torch.float64)
    args = (
        torch.zeros(1, 1, dtype=torch.float64),
        torch.tensor([1.0], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.float64),
        1,
    )
    assert dr_grpo(lp, *args, clip_low=0.2, clip_high=0.28).loss.item() == pytest.approx(-1.25)
    assert dr_grpo(lp, *args, clip_low=0.2, clip_high=0.2).loss.item() == pytest.approx(-1.2)


def test_k3_kl_values():
    # d = ref - logp = log 2 -> exp(d) - d - 1 = 2 - 0.693147... - 1 = 0.306853
    lp, ref = torch.tensor([0.0]), torch.tensor([math.log(2.0)])
    assert k3_kl(lp, ref).item() == pytest.approx(1 - math.log(2), rel=1e-6)
    assert k3_kl(ref, ref).item() == 0.0


def test_kl_term_in_loss():
    # A = 0 so only KL: k3 = 1 - log 2 on 2 valid tokens, coef 0.1, normalizer 4 -> 0.1*2*(1-log2)/4
    lp = torch.zeros(1, 3, dtype=torch.float64)
    ref = torch.full((1, 3), math.log(2.0), dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    out = dr_grpo(lp, lp, torch.zeros(1, dtype=torch.float64), mask, 4, ref_logp=ref, kl_coef=0.1)
    assert out.loss.item() == pytest.approx(0.1 * 2 * (1 - math.log(2)) / 4, rel=1e-12)


def test_token_logprobs_temperature():
    # logits (2, 0), T = 2 -> scaled (1, 0): log p(0) = 1 - log(e + 1)
    logits = torch.tensor([[[2.0, 0.0]]], dtype=torch.float64)
    lp = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    assert lp.item() == pytest.approx(1 - math.log(math.e + 1), rel=1e-12)


def _full_logprobs(logits, targets, temperature):
    """The pre-chunking computation (autograd through gather - logsumexp over the whole [B,L,V] tensor)."""
    x = (logits.float() if logits.dtype == torch.bfloat16 else logits) / temperature
    return torch.gather(x, -1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)


@pytest.mark.parametrize("chunk_elements", [1, 3 * 11, 10**9])  # one position, 3 of 7 (uneven), everything
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_the_full_computation(chunk_elements, temperature):
    # B=3, L=7, V=11: chunk_elements // (B*V) positions per chunk -> 1 (1 // 33 clamps to 1), 1, all 7.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, dtype=torch.float64, generator=g) * 3
    targets = torch.randint(0, 11, (3, 7), generator=g)
    weights = torch.randn(3, 7, dtype=torch.float64, generator=g)  # an arbitrary upstream gradient
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    lp = token_logprobs(a, targets, temperature, chunk_elements=chunk_elements)
    ref = _full_logprobs(b, targets, temperature)
    torch.testing.assert_close(lp, ref, rtol=1e-12, atol=1e-12)
    (lp * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)
    full_h = -(torch.log_softmax(logits / temperature, -1).exp() * torch.log_softmax(logits / temperature, -1)).sum(-1)
    torch.testing.assert_close(token_entropy(logits, temperature, chunk_elements), full_h, rtol=1e-12, atol=1e-12)


def test_logprobs_gradcheck():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0, 4, 2], [1, 1, 3]])
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, 0.5, chunk_elements=10), (logits,))


def test_bf16_logprobs_keep_no_float32_copy_of_the_logits_for_backward():
    # Autograd through gather - logsumexp saved a float32 [B,L,V] copy (2x the bf16 logits) per micro-batch;
    # the chunked version saves the bf16 logits, the targets and one float32 log-sum-exp per position.
    # B=2, L=64, V=1000: logits 256,000 B in bf16; the old float32 copy alone would be 512,000 B.
    logits = torch.randn(2, 64, 1000, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1000, (2, 64))
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = token_logprobs(logits, targets, 1.0, chunk_elements=2 * 8 * 1000)  # 8 positions per chunk
        ref_saved = len(saved)
        _full_logprobs(logits, targets, 1.0)
    ours, full = saved[:ref_saved], saved[ref_saved:]
    assert sum(t.numel() * t.element_size() for t in ours) == 256_000 + 2 * 64 * 8 + 2 * 64 * 4  # logits, ids, lse
    assert max(t.numel() * t.element_size() for t in full) == 512_000  # the float32 copy the old code kept
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()

"""The SFT loss with the LM head trimmed to the labelled positions equals transformers' own causal-LM loss."""

from __future__ import annotations

import torch

from rl_training.runners.sft_runner import answer_loss, collate
from tests.helpers import lora_policy


def test_answer_loss_is_transformers_loss_and_its_gradient(tiny_model):
    model = lora_policy(tiny_model)
    # three pairs: prompts of 5, 2 and 7 tokens (the earliest label at index 2), answers of 3, 4 and 1 tokens
    pairs = [
        ([5, 6, 7, 8, 9, 10, 11, 12], [0] * 5 + [1] * 3),
        ([20, 21, 22, 23, 24, 25], [0] * 2 + [1] * 4),
        ([30, 31, 32, 33, 34, 35, 36, 37], [0] * 7 + [1]),
    ]
    ids, attn, labels = collate(pairs, 0, torch.device("cpu"))
    ours = answer_loss(model, ids, attn, labels)
    ours.backward()
    g_ours = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    ref = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss  # mean over 8 answer tokens
    ref.backward()
    g_ref = [p.grad for p in model.parameters() if p.requires_grad]
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # an invariance: more padding on the right changes neither
    wide = collate([(s + [0] * 3, m + [0] * 3) for s, m in pairs], 0, torch.device("cpu"))
    torch.testing.assert_close(answer_loss(model, *wide), ref.detach(), rtol=1e-12, atol=1e-12)

"""Shared-prompt rows: each prompt group runs as one row, its prompt once and its K completions after it.

A group's K sequences repeat one prompt. The padded and packed layouts run that prompt K times through every
layer; with a chat template and short answers it is most of the tokens (SmolLM2 on basic_arithmetic: a prompt of
about 70 tokens before completions of at most 16). Here row g is

    prompt_g | completion_g1 | completion_g2 | ... | completion_gK | pads

with position ids 0..P-1 on the prompt and P.. again on each completion (each sits where it sat when sampled), and a
custom attention mask: a completion token attends to the prompt and to its own completion's earlier tokens, never
to a sibling's; a prompt token attends causally to the prompt; a pad attends to itself and to other pads, and no
real token attends to a pad. Each completion therefore sees exactly the context it was sampled with, and its
log-probs are those of its own padded row, up to floating-point summation order. The prompt's last position predicts
the first token of every completion: its logits are gathered K times, and backward adds their gradients, which is
the sum the K padded rows form. The model runs on G rows of P + sum(len c) tokens instead of K*G rows of P + len c.

Like packing (train/packing.py), only the model runs on these rows: `take` gathers the logits predicting each
sequence's completion tokens into [B, C] (C the longest completion), and `unpack` maps per-token values back into
the padded [B, T-1] layout every loss, canary and probe reads. The mask is boolean for sdpa and additive for eager;
flash-attention takes no custom mask (config/rules.py refuses the combination).

What it cannot give is a per-sequence gradient: a prompt token's activation gradient is the sum over the group's K
completions. The probes' per-sequence capture (the rollout advisor's ANOVA, on probe.unit_every steps) therefore
runs those steps' micro-batches padded (Learner.learn).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_training.base.groups import Groups

PROMPT, PAD = -1, -2  # segment ids of a row's prompt and pad tokens; completion k has segment k


@dataclass
class SharedRows:
    input_ids: torch.Tensor  # [G, L] prompt, then the group's completions end to end, then pad_id
    position_ids: torch.Tensor  # [G, L] 0..P-1 on the prompt, P.. on each completion, 0.. on the pads
    allowed: torch.Tensor  # [G, 1, L, L] bool: query position q may attend to key position k
    head_from: int  # first column whose logits any sequence needs: the shortest prompt's last token
    take: torch.Tensor  # [B, C] flat index into [G * (L - head_from)] of the logits predicting completion token j
    targets: torch.Tensor  # [B, C] completion token j of each sequence (0 past its end)
    index: torch.Tensor  # [B, T-1] flat index into [B*C] of padded prediction position (b, t); B*C = none

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C] per-completion-token values -> [B, T-1] in the padded layout, 0 where that layout has none."""
        flat = torch.cat([x.reshape(-1), x.new_zeros(1)])
        return flat[self.index]

    def mask_for(self, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """The mask in the form the attention implementation adds or selects with: eager adds a float mask (0 where
        allowed, the dtype's minimum elsewhere); sdpa takes the boolean one (transformers passes a 4D mask through
        unchanged: masking_utils._preprocess_mask_arguments)."""
        if attn_implementation == "eager":
            return torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device).masked_fill(
                ~self.allowed, torch.finfo(dtype).min
            )
        return self.allowed

    def to(self, device: torch.device) -> SharedRows:
        return SharedRows(
            **{k: getattr(self, k).to(device) for k in self.__dataclass_fields__ if k != "head_from"},
            head_from=self.head_from,
        )


def groups_share_prompts(prompts: list[list[int]], groups: Groups) -> bool:
    """Whether each group's prompts are one prompt (always, for rollouts of GRPO groups)."""
    return all(all(p == group[0] for p in group[1:]) for group in groups.split(prompts))


def share_prompts(
    prompts: list[list[int]], completions: list[list[int]], groups: Groups, pad_id: int, padded_width: int
) -> SharedRows:
    """The shared-prompt rows of whole groups (`groups`' rows, one prompt per group: groups_share_prompts);
    `padded_width` is the padded layout's width T that `index` maps from."""
    B = len(prompts)
    rows = [
        prompts[s] + [t for c in cs for t in c] for s, cs in zip(groups.starts, groups.split(completions), strict=True)
    ]
    L = max(len(r) for r in rows)
    head_from = min(len(prompts[s]) for s in groups.starts) - 1
    keep = L - head_from
    C = max(1, max(len(c) for c in completions))
    ids = [r + [pad_id] * (L - len(r)) for r in rows]
    pos: list[list[int]] = []
    seg: list[list[int]] = []
    take = [[0] * C for _ in range(B)]
    targets = [[0] * C for _ in range(B)]
    none = B * C
    index = [[none] * (padded_width - 1) for _ in range(B)]
    for g, s in enumerate(groups.starts):
        P = len(prompts[s])
        p_row, s_row = list(range(P)), [PROMPT] * P
        col = P
        for k, b in enumerate(groups.rows(g)):
            c = completions[b]
            for j in range(len(c)):
                # completion token j is predicted at the prompt's last column (j = 0) or at its own token j - 1
                source = P - 1 if j == 0 else col + j - 1
                take[b][j] = g * keep + source - head_from
                targets[b][j] = c[j]
                index[b][P - 1 + j] = b * C + j
            p_row += range(P, P + len(c))
            s_row += [k] * len(c)
            col += len(c)
        p_row += range(L - col)
        s_row += [PAD] * (L - col)
        pos.append(p_row)
        seg.append(s_row)
    seg_t = torch.tensor(seg, dtype=torch.long)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    same = seg_t[:, :, None] == seg_t[:, None, :]
    prompt_key = (seg_t[:, None, :] == PROMPT).expand(-1, L, -1)
    allowed = causal & (same | (prompt_key & (seg_t[:, :, None] != PAD)))
    return SharedRows(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        allowed=allowed[:, None],
        head_from=head_from,
        take=torch.tensor(take, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        index=torch.tensor(index, dtype=torch.long),
    )


def shared_tokens(prompts: list[list[int]], completions: list[list[int]], groups: Groups) -> tuple[int, int]:
    """(tokens the padded layout runs the model on, tokens the shared-prompt rows run on) for whole groups."""
    seqs = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    rows = [
        len(prompts[s]) + sum(len(c) for c in cs)
        for s, cs in zip(groups.starts, groups.split(completions), strict=True)
    ]
    return len(seqs) * max(seqs), len(rows) * max(rows)

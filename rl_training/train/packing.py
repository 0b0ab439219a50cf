"""Padding-free micro-batches: a micro-batch's sequences packed end to end into rows, no padding between them.

The padded layout runs the model on [B, T] with T the longest sequence: a batch of mostly short completions
and a few long ones spends most of its forward/backward on pads. Packed, the sequences are laid end to end
into R rows of width W (first-fit decreasing by length), each with position ids restarting at 0, and the
model is called with `position_ids`, no attention mask, and the blocks' boundaries (`cu_seq_lens`,
`max_length`). transformers 5 builds a block-diagonal causal mask from the position ids
(masking_utils.find_packed_sequence_indices: a position that does not follow its predecessor by 1 starts a new
block) for sdpa and eager attention, which ignore the boundaries; flash-attention takes its variable-length
path from the boundaries (`cu_seq_lens_q/k`, `max_length_q/k`: transformers' FlashAttentionKwargs). A sequence
attends to itself only, exactly as in its padded row.

Only the model runs packed. Per-token outputs (log-probs, entropy) are computed on the packed rows, then
`unpack` gathers them back into the padded [B, T-1] layout the losses, the canary and the probes read, so
every objective and every per-token mask (a completion span or any other) works unchanged; the gradient
flows back through the gather. Prediction positions across a boundary between two packed sequences, and
the row-end pads, are never gathered.

Row width: `row_tokens` = 0 packs into rows as wide as the longest sequence (bin packing: the attention cost
per row stays that of one padded row, the right choice for sdpa/eager, whose block-diagonal mask is a dense
[W, W] mask); a larger value packs more sequences per row. flash_attention_2 always gets ONE_ROW, every
sequence of the micro-batch in a single row: transformers reads its varlen boundaries from the position ids
only for a batch of one row (modeling_flash_attention_utils), so with two rows the packed sequences would
attend to their row neighbours (issue 29, N4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_training.base.groups import Groups


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [R, W] sequences end to end, pad_id after the last one of a row
    position_ids: torch.Tensor  # [R, W] 0.. within each sequence; the row-end pads count on as their own block
    targets: torch.Tensor  # [R, W-1] input_ids shifted left (across a boundary: never gathered)
    index: torch.Tensor  # [B, T-1] flat index into [R*(W-1)] of padded prediction position (b, t); R*(W-1) = none
    group_tokens: torch.Tensor  # [n_groups, Tg] flat index into [R*W] of each prompt group's tokens; R*W = none
    seq_tokens: torch.Tensor  # [B, Ts] flat index into [R*W] of each sequence's tokens (the ANOVA probe); R*W = none
    # flash-attention's varlen boundaries, known here without a look at the device: transformers would otherwise
    # recompute them from position_ids in every layer, behind a host sync (`if _is_packed_sequence(...)`)
    cu_seq_lens: torch.Tensor  # [n_blocks + 1] int32 starts of every block (sequence, row-end pads) in [R*W], then R*W
    max_length: int  # the longest block (a Python int: flash_attn_varlen_func takes max_seqlen as an int)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[R, W-1] per-position values -> [B, T-1] in the padded layout, 0 where the padded layout has a pad."""
        flat = torch.cat([x.reshape(-1), x.new_zeros(1)])
        return flat[self.index]


def first_fit_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Sequence indices per row: first-fit decreasing by length into rows of `width` tokens (ties keep order)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((k for k, f in enumerate(free) if f >= lengths[i]), None)
        if r is None:
            rows.append([])
            free.append(width)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


ONE_ROW = -1  # row_tokens: all sequences of a micro-batch in one row (flash-attention's varlen path)


def row_tokens_for(attn_implementation: str, row_tokens: int) -> int:
    """The row width a packed micro-batch gets: ONE_ROW under flash_attention_2 (module docstring), else
    train.pack_row_tokens."""
    return ONE_ROW if attn_implementation == "flash_attention_2" else row_tokens


def pack_sequences(
    seqs: list[list[int]], groups: Groups, pad_id: int, row_tokens: int = 0, padded_width: int = 0
) -> PackedRows:
    """Pack `seqs` (group by group: `groups`' rows) into rows of at most
    max(row_tokens, longest sequence) tokens (trimmed to the fullest row); `index` maps the padded layout of
    width max(padded_width, longest) onto them."""
    lengths = [len(s) for s in seqs]
    T = max(padded_width, max(lengths))
    cap = sum(lengths) if row_tokens == ONE_ROW else max(row_tokens, max(lengths))
    rows = first_fit_rows(lengths, cap)
    W = max(sum(lengths[b] for b in members) for members in rows)  # trimmed to the fullest row
    R = len(rows)
    ids = [[pad_id] * W for _ in range(R)]
    pos = [list(range(W)) for _ in range(R)]
    none_pred, none_tok = R * (W - 1), R * W
    index = [[none_pred] * (T - 1) for _ in seqs]
    token_at: list[list[int]] = [[] for _ in seqs]  # flat [R*W] positions of each sequence's tokens
    starts: list[int] = []  # every block's first position in the flattened rows
    for r, members in enumerate(rows):
        o = 0
        for b in members:
            n = lengths[b]
            starts.append(r * W + o)
            ids[r][o : o + n] = seqs[b]
            pos[r][o : o + n] = range(n)
            index[b][: n - 1] = range(r * (W - 1) + o, r * (W - 1) + o + n - 1)
            token_at[b] = list(range(r * W + o, r * W + o + n))
            o += n
        pos[r][o:] = range(W - o)  # the pads: a block of their own, starting at 0
        if o < W:
            starts.append(r * W + o)
    per_group = [[t for b in groups.rows(g) for t in token_at[b]] for g in range(len(groups))]
    tg = max(len(g) for g in per_group)
    group_tokens = [g + [none_tok] * (tg - len(g)) for g in per_group]
    ts = max(lengths)
    seq_tokens = [t + [none_tok] * (ts - len(t)) for t in token_at]
    input_ids = torch.tensor(ids, dtype=torch.long)
    return PackedRows(
        input_ids=input_ids,
        position_ids=torch.tensor(pos, dtype=torch.long),
        targets=input_ids[:, 1:],
        index=torch.tensor(index, dtype=torch.long),
        group_tokens=torch.tensor(group_tokens, dtype=torch.long),
        seq_tokens=torch.tensor(seq_tokens, dtype=torch.long),
        cu_seq_lens=torch.tensor([*starts, R * W], dtype=torch.int32),
        max_length=max(b - a for a, b in zip(starts, [*starts[1:], R * W], strict=True)),
    )


def packed_to(p: PackedRows, device: torch.device) -> PackedRows:
    return PackedRows(
        **{k: getattr(p, k).to(device) for k in p.__dataclass_fields__ if k != "max_length"}, max_length=p.max_length
    )


def padded_tokens(seqs: list[list[int]]) -> tuple[int, int]:
    """(tokens the padded layout runs the model on, tokens the packed layout with row_tokens=0 runs on)."""
    lengths = [len(s) for s in seqs]
    T = max(lengths)
    return len(seqs) * T, len(first_fit_rows(lengths, T)) * T

"""Micro-batches of whole prompt groups, and the policy's forward over them (padded rows, packed ones:
train/packing.py, or one row per group behind a shared prompt: train/shared_prompt.py): the trainer's log-probs
come from `forward_logits` + algs/common.py token_logprobs."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from rl_training.algs.common import token_logprobs, zero_adv_groups
from rl_training.base.groups import Groups
from rl_training.rollout.base import Rollouts
from rl_training.train.packing import PackedRows, pack_sequences, packed_to
from rl_training.train.shared_prompt import SharedRows, groups_share_prompts, share_prompts


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B,T] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [B,T] 1 on real tokens
    targets: torch.Tensor  # [B,T-1] input_ids shifted left: the token each position predicts
    mask: torch.Tensor  # [B,T-1] 1 where the target is a sampled completion token (stop token included; 0 on
    #                     prompt, padding and multi-turn observation tokens: Rollouts.loss_mask)
    advantages: torch.Tensor  # [B]
    rollout_logp: torch.Tensor  # [B,T-1] sampler log-probs aligned with `mask`, 0 elsewhere
    group_ids: list[int]  # indices of the groups in this micro-batch
    n_units: int = 0  # groups of the micro-batch before zero-advantage groups were dropped (>= len(group_ids))
    packed: PackedRows | None = None  # the same sequences without padding (train.pack_sequences); the model runs on it
    turn: torch.Tensor | None = None  # [B,T-1] turn number (1..) of each target in `mask`, 0 elsewhere; multi-turn
    head_from: int = 0  # first position whose logits any row needs (padded rows: the shortest prompt's last token)
    shared: SharedRows | None = None  # one row per group behind its prompt (train.share_prompt); the model runs on it
    rows: list[int] | None = None  # [B] the rollout rows of its sequences, group by group (None: equal groups)

    def __post_init__(self):
        self.n_units = self.n_units or len(self.group_ids)
        if self.rows is None:
            size = len(self.advantages) // len(self.group_ids)
            self.rows = Groups.uniform(max(self.group_ids) + 1, size).rows_of(self.group_ids)

    @property
    def row_targets(self) -> torch.Tensor:
        """The targets of the logits forward_logits returns: [B,T-1-head_from] padded, [R,W-1] packed, [B,C]
        shared (each sequence's completion tokens)."""
        if self.shared is not None:
            return self.shared.targets
        return self.targets[:, self.head_from :] if self.packed is None else self.packed.targets

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Per-position values of the rows the model ran on -> the padded [B,T-1] layout (0 before head_from)."""
        if self.shared is not None:
            return self.shared.unpack(x)
        if self.packed is not None:
            return self.packed.unpack(x)
        return torch.nn.functional.pad(x, (self.head_from, 0)) if self.head_from else x


def make_micro_batches(
    rollouts: Rollouts,
    advantages: torch.Tensor,
    groups: Groups | int,
    groups_per_micro: int,
    pad_id: int,
    device: torch.device,
    drop_zero_adv_groups: bool = False,
    extra_pad: int = 0,
    pack_row_tokens: int | None = None,
    zero_groups: torch.Tensor | None = None,
    share_prompt: bool = False,
) -> list[MicroBatch]:
    """Pack whole prompt groups (`groups`: the rollouts' rows by group, or the size of every group) into
    micro-batches (a group is never split).

    The partition into micro-batches is fixed first (consecutive blocks of the rollout order, which is the
    seeded prompt order); dropping zero-advantage groups then removes them inside their block, and a block
    left empty is not returned (when every group would go, the first stays: the canary's tokens). Dropping never
    re-packs across blocks: the micro-level GNS needs each micro-batch to be a random block of units, whatever
    their advantages (`n_units` keeps its full size).
    `pack_row_tokens` not None: each micro-batch also carries its sequences packed without padding into rows
    of max(pack_row_tokens, longest sequence) tokens (rl_training/train/packing.py), which the model then runs on.
    `zero_groups`: the groups' zero-advantage flags when the caller has them (algs/common.py zero_adv_groups).
    `share_prompt`: each micro-batch also carries its groups as shared-prompt rows (train/shared_prompt.py), which
    the model then runs on, when every group's sequences repeat one prompt (else it stays padded or packed)."""
    groups = Groups.of_rows(len(rollouts), groups) if isinstance(groups, int) else groups
    n_groups = len(groups)
    zero = zero_adv_groups(advantages, groups.sizes) if zero_groups is None else zero_groups
    blocks = [list(range(s, min(s + groups_per_micro, n_groups))) for s in range(0, n_groups, groups_per_micro)]
    kept = [[g for g in b if not zero[g]] if drop_zero_adv_groups else b for b in blocks]
    if blocks and not any(kept):
        # Every group skipped: keep the first anyway (zero advantages and no KL: its gradient is exactly 0), so that
        # the trainer-vs-sampler canary and the weight guard still see this rank's rollouts every step.
        kept[0] = blocks[0][:1]
    out = []
    for block, gids in zip(blocks, kept, strict=True):
        if not gids:
            continue
        rows, mine = groups.rows_of(gids), groups.select(gids)
        seqs = [rollouts.prompt_ids[r] + rollouts.completion_ids[r] for r in rows]
        width = max(len(x) for x in seqs) + extra_pad
        # Python lists, one tensor each: per-row tensor construction and slicing dominated this function
        ids_l = [x + [pad_id] * (width - len(x)) for x in seqs]
        attn_l = [[1] * len(x) + [0] * (width - len(x)) for x in seqs]
        mask_l, rlogp_l, turn_l = _prediction_rows(rollouts, rows, width)
        ids = torch.tensor(ids_l, dtype=torch.long)
        attn = torch.tensor(attn_l, dtype=torch.long)
        mask = torch.tensor(mask_l)
        rlogp = torch.tensor(rlogp_l)
        turn = torch.tensor(turn_l, dtype=torch.long) if turn_l is not None else None
        packed = shared = None
        prompts = [rollouts.prompt_ids[r] for r in rows] if share_prompt else []
        if share_prompt and groups_share_prompts(prompts, mine):
            completions = [rollouts.completion_ids[r] for r in rows]
            shared = share_prompts(prompts, completions, mine, pad_id, width).to(device)
        elif pack_row_tokens is not None:
            packed = packed_to(pack_sequences(seqs, mine, pad_id, pack_row_tokens, width), device)
        out.append(
            MicroBatch(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                targets=ids[:, 1:].to(device),
                mask=mask.to(device),
                advantages=advantages[rows].to(device),
                rollout_logp=rlogp.to(device),
                group_ids=gids,
                n_units=len(block),
                packed=packed,
                shared=shared,
                turn=turn.to(device) if turn is not None else None,
                head_from=min(len(rollouts.prompt_ids[r]) for r in rows) - 1,
                rows=rows,
            )
        )
    return out


def _prediction_rows(rollouts: Rollouts, rows: list[int], width: int):
    """Per row, in the padded layout of `width`: the loss mask, the sampler's log-probs under it, and the turns
    (None for single-turn). Position t predicts token t+1: completion tokens p..p+c-1 are predicted at p-1..p+c-2;
    loss_mask (multi-turn) is 0 on observation tokens, which are never trained on."""
    mask_l, rlogp_l = [], []
    turn_l: list | None = [] if rollouts.turn_index is not None else None
    for r in rows:
        p, c = len(rollouts.prompt_ids[r]), len(rollouts.completion_ids[r])
        lm = [1.0] * c if rollouts.loss_mask is None else [float(x) for x in rollouts.loss_mask[r]]
        tail = [0.0] * (width - p - c)
        mask_l.append([0.0] * (p - 1) + lm + tail)
        rlogp_l.append([0.0] * (p - 1) + [lp * m for lp, m in zip(rollouts.logprobs[r][:c], lm, strict=True)] + tail)
        if turn_l is not None:
            turn_l.append([0] * (p - 1) + list(rollouts.turn_index[r]) + [0] * (width - p - c))
    return mask_l, rlogp_l, turn_l


def forward_logits(model, mb: MicroBatch) -> torch.Tensor:
    """Logits of the rows the model runs on, last position dropped, targets mb.row_targets: [B,T-1-head_from,V]
    padded, [R,W-1,V] packed (no attention mask: transformers builds the block-diagonal causal mask from the
    restarting position ids; the packer's block boundaries go to flash-attention's varlen path, packing.py).

    Padded rows skip the LM head on the prompt positions no loss term reads (transformers' logits_to_keep): with a
    49k vocabulary that projection and its log-softmax are most of a short completion's cost (SmolLM2-135M, 32 x
    80 tokens of which 24 needed: 8.2 s forward + backward instead of 15.8 s on 2 cores).

    Shared-prompt rows return [B,C,V]: each sequence's completion-token logits gathered from its group's row (the
    prompt's last position once per sequence; backward sums those)."""
    if mb.shared is not None:
        s = mb.shared
        keep = s.input_ids.shape[1] - s.head_from
        kw = {"logits_to_keep": keep} if takes_logits_to_keep(model) else {}
        impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        mask = s.mask_for(impl, model.get_input_embeddings().weight.dtype)
        out = model(input_ids=s.input_ids, attention_mask=mask, position_ids=s.position_ids, use_cache=False, **kw)
        logits = out.logits if kw else out.logits[:, s.head_from :]
        return logits.reshape(-1, logits.shape[-1])[s.take]
    if mb.packed is not None:
        p = mb.packed
        n = p.max_length
        bounds = dict(cu_seq_lens_q=p.cu_seq_lens, cu_seq_lens_k=p.cu_seq_lens, max_length_q=n, max_length_k=n)
        return model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False, **bounds).logits[:, :-1]
    keep = {}
    if mb.head_from and takes_logits_to_keep(model):
        keep["logits_to_keep"] = mb.input_ids.shape[1] - mb.head_from
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False, **keep).logits
    return logits[:, :-1] if keep else logits[:, mb.head_from : -1]


def takes_logits_to_keep(model) -> bool:
    """Whether the (peft-wrapped) model's forward has transformers' logits_to_keep (every built-in causal LM of
    transformers 5; a trust_remote_code model may not, and then the full logits are sliced)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _forward_takes(type(base))


@functools.cache
def _forward_takes(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


@torch.no_grad()
def reference_logprobs(model, micro_batches: list[MicroBatch], temperature: float, needed: bool):
    """Log-probs under the reference policy = the same model with the adapter disabled (no second copy).
    One disable/enable for all micro-batches: peft's context manager walks the whole model each time."""
    if not needed:
        return [None] * len(micro_batches)
    with model.disable_adapter():
        return [
            mb.unpack(token_logprobs(forward_logits(model, mb), mb.row_targets, temperature)) for mb in micro_batches
        ]

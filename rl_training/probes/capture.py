"""Autograd hooks that read the small gradients the GNS estimator needs, without touching `.grad`.

- `MicroGradCapture` (docs/probes.md 2.A): a tensor hook on every trainable parameter receives the gradient
  of the armed backward only, before it is accumulated into `.grad` and before any all-reduce. The squared
  norms are summed in float64 on the device (no .item() inside a hook). The hook count per backward is
  checked against the parameter count (pitfall P6: hooks must fire only for the training backward).
- `LoraUnitCapture` (docs/probes.md 2.C): exact per-prompt-group squared gradient norms of the LoRA matrices. For a
  LoRA linear y = base(x) + B(A(x)) * s, a sequence's gradients are sum_t dA_t^T x_t (for A) and
  sum_t dv_t^T u_t (for B), where u = A(x), v = B(u), and dA, dv are the gradients at A's and B's outputs.
  Forward hooks on peft's lora_A / lora_B modules register tensor hooks on their outputs; the per-sequence
  gradients are summed over each group's consecutive rows and square-summed over all layers. Groups of unequal
  sizes (rollout.allocation: per_prompt) are read through their sizes: padded rows are gathered group by group as
  packed ones are. Armed `per_sequence`, one flush also gives each sequence's squared norm (the nested ANOVA's
  per-completion input, docs/probes.md 9.4): the products are formed per sequence and summed into groups, the same
  FLOPs.
  Not valid with gradient checkpointing (the recompute fires forward hooks twice), so the caller disables it.
Neither class calls `zero_grad` or modifies any gradient (PITFALLS: probes must not touch training grads), and
neither raises from a hook: an exception there would abort the training backward, so it is kept in `.error`
for the caller to count (docs/probes.md 5).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import torch


class MicroGradCapture:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self._armed = False
        self._acc: torch.Tensor | None = None
        self.calls = 0
        self.error: BaseException | None = None  # an exception inside a hook, kept for the caller to count
        self._handles = [p.register_hook(self._hook) for p in params]

    def _hook(self, g: torch.Tensor) -> None:
        if not self._armed:
            return
        try:
            self._acc = self._acc + g.detach().double().pow(2).sum()  # float64 like Q (pitfall P3)
            self.calls += 1
        except Exception as e:  # noqa: BLE001 - raised here it would abort the training backward
            self.error = e

    def arm(self) -> None:
        self._acc = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        self.calls = 0
        self.error = None
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    @contextmanager
    def capture(self):
        """Arm the hooks around one forward + backward; read `.sq_norm` afterwards."""
        self.arm()
        try:
            yield self
        finally:
            self.disarm()

    @property
    def sq_norm(self) -> torch.Tensor:
        return self._acc

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _gather_groups(t: torch.Tensor, group_tokens: torch.Tensor) -> torch.Tensor:
    """[L, R, W, F] packed activations -> [L, n_groups * Tg, F] group by group; index R*W picks a zero row."""
    flat = t.reshape(t.shape[0], -1, t.shape[-1])
    flat = torch.cat([flat, flat.new_zeros(flat.shape[0], 1, flat.shape[-1])], 1)
    return flat[:, group_tokens.reshape(-1)]


def product_chunks(n_items: int, group_items: int, item_bytes: int, bound: int) -> list[tuple[int, int]]:
    """[lo, hi) runs of `n_items` per-item products (item_bytes each, group_items consecutive items per group) to
    form at once: as many whole groups as fit in `bound` bytes, or, when one group does not fit, pieces of one
    group (never two groups' items in one piece). One item is the least a chunk holds, whatever its size."""
    return group_chunks(range(group_items, n_items + 1, group_items), item_bytes, bound)


def group_chunks(ends, item_bytes: int, bound: int) -> list[tuple[int, int]]:
    """product_chunks for groups of any sizes: `ends` the item index after each group's last, increasing."""
    per = max(1, bound // item_bytes)
    chunks, lo, start = [], 0, 0  # the open chunk [lo, start) holds whole groups
    for end in ends:
        if end - lo > per and start > lo:  # this group does not fit beside the chunk's: close it
            chunks.append((lo, start))
            lo = start
        if end - start > per:  # a group alone over the bound: pieces of it
            chunks += [(a, min(a + per, end)) for a in range(start, end, per)]
            lo = end
        start = end
    if start > lo:
        chunks.append((lo, start))
    return chunks


def _padded_group_tokens(sizes: tuple[int, ...], width: int, device) -> torch.Tensor:
    """[n_groups, max_k * width] flat positions of each group's padded rows (group by group), R*W for none."""
    n_rows, k_max = sum(sizes), max(sizes)
    out = torch.full((len(sizes), k_max * width), n_rows * width, dtype=torch.long, device=device)
    first = 0
    for i, k in enumerate(sizes):
        out[i, : k * width] = torch.arange(first * width, (first + k) * width, device=device)
        first += k
    return out


def _runs(ends: list[int], run: int, lo: int, hi: int):
    """The group runs [start, end) that items [lo, hi) meet, from run `run` (the one holding item lo) on."""
    while run < len(ends):
        a = ends[run - 1] if run else 0
        if a >= hi:
            return
        yield a, ends[run]
        run += 1


def lora_module_pairs(model) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(lora_A, lora_B) Linear modules of every active adapter in a peft model."""
    from peft.tuners.lora import LoraLayer

    pairs = []
    for m in model.modules():
        if isinstance(m, LoraLayer):
            for name in m.active_adapters:
                if name in m.lora_A:
                    pairs.append((m.lora_A[name], m.lora_B[name]))
    return pairs


class LoraUnitCapture:
    # Pending (gradient, input) pairs are batched per shape and flushed at the end of the backward or when
    # they exceed this many bytes: one bmm per shape instead of one per layer (the per-call overhead dominated
    # on small models), with the extra memory bounded.
    FLUSH_BYTES = 64 * 2**20
    PRODUCT_BYTES = 256 * 2**20  # the per-unit weight gradients formed at once (product_chunks)

    def __init__(self, model):
        self.pairs = lora_module_pairs(model)
        if not self.pairs:
            raise ValueError("no LoRA layers found for per-unit gradient capture")
        self._armed = False
        self._acc: torch.Tensor | None = None
        self._groups = 0
        self.forwards = self.backwards = 0
        self.error: BaseException | None = None  # an exception inside a hook or the flush, for the caller
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_bytes = 0
        self._group_tokens: torch.Tensor | None = None
        self._seq_tokens: torch.Tensor | None = None
        self._sizes: tuple[int, ...] = ()  # the armed micro-batch's group sizes (): equal, rows split evenly
        self._per_seq = False  # per-sequence norms too
        self._seq_acc: torch.Tensor | None = None
        self._handles = []
        for a, b in self.pairs:
            self._handles.append(a.register_forward_hook(self._on_forward))
            self._handles.append(b.register_forward_hook(self._on_forward))

    def _on_forward(self, module, inputs, output) -> None:
        # lora_A: output u, input x -> grad_A = sum_t du_t^T x_t ; lora_B: output v, input u -> grad_B = sum dv^T u
        if self._armed and output.requires_grad:
            self.forwards += 1
            x = inputs[0].detach()
            output.register_hook(lambda g: self._stash(g, x))

    def _stash(self, grad: torch.Tensor, inp: torch.Tensor) -> None:
        try:
            if grad.dim() != 3:
                raise RuntimeError("per-unit capture needs [batch, time, features] activations")
            self.backwards += 1
            self._pending.append((grad.detach(), inp))
            self._pending_bytes += grad.numel() * grad.element_size() + inp.numel() * inp.element_size()
            if self._pending_bytes > self.FLUSH_BYTES:
                self._flush()
        except Exception as e:  # noqa: BLE001 - raised in a tensor hook it would abort the training backward
            self.error = e

    def _flush(self) -> None:
        """Per-group (and, armed per_sequence, per-sequence) squared norms of every pending weight gradient: its
        layers of one shape stacked, their products batched in chunks (`_accumulate`)."""
        n, sizes, gather = self._groups, self._sizes, self._group_tokens
        if self._per_seq:
            gather = self._seq_tokens  # products per sequence, then summed over each group's sequences
        by_shape: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for g, x in self._pending:
            by_shape.setdefault((tuple(g.shape), tuple(x.shape), g.dtype), []).append((g, x))
        for items in by_shape.values():
            g = torch.stack([it[0] for it in items])  # [L, B, T, out]
            x = torch.stack([it[1] for it in items])  # [L, B, T, in]
            if g.dtype in (torch.float16, torch.bfloat16):
                g, x = g.float(), x.float()
            L = g.shape[0]
            rows = gather
            if rows is None and not self._per_seq and len(set(sizes)) > 1:  # padded rows of unequal groups
                rows = _padded_group_tokens(sizes, g.shape[2], g.device)
            if rows is not None:  # each unit's tokens gathered, a zero row for its padding
                g, x = _gather_groups(g, rows), _gather_groups(x, rows)
            units = sum(sizes) if self._per_seq else n  # a sequence's T positions, or a group's
            g = g.reshape(L, units, -1, g.shape[-1]).flatten(0, 1)  # [L * units, T, out]: item i is layer i // units,
            x = x.reshape(L, units, -1, x.shape[-1]).flatten(0, 1)  # unit i % units (layer-major, then group by group)
            self._accumulate(g, x, units, n)
        self._pending, self._pending_bytes = [], 0

    def _accumulate(self, g: torch.Tensor, x: torch.Tensor, units: int, n: int) -> None:
        """The squared norms of the per-item weight gradients g_i^T x_i (items: [layer, unit] flattened), formed at
        most PRODUCT_BYTES at a time (`group_chunks`): a real model's layer can exceed the bound on its own (one
        down_proj A at r=32 is 1.1 MB per sequence: 256 sequences are 294 MB for a 1.5B model, 620 MB for a 7B one),
        so a chunk is a run of whole groups when one group fits, else a run of one group's sequences, whose sum is
        carried to the group's end. Per sequence, units are sequences, the groups' sizes of them each."""
        out, inp = g.shape[-1], x.shape[-1]
        item_bytes = out * inp * g.element_size()
        if not self._per_seq:
            for lo, hi in group_chunks(range(1, g.shape[0] + 1), item_bytes, self.PRODUCT_BYTES):
                per_item = torch.bmm(g[lo:hi].transpose(1, 2), x[lo:hi])  # [hi - lo, out, in]
                items = torch.arange(lo, hi, device=self._acc.device)
                self._acc.index_add_(0, items % n, torch.linalg.vector_norm(per_item, dim=(1, 2)).square().double())
            return
        per_layer = list(itertools.accumulate(self._sizes))
        ends = [layer * units + e for layer in range(g.shape[0] // units) for e in per_layer]
        run, partial = 0, None  # the group run (layer-major: run r is group r % n) of the next item; its sum so far
        for lo, hi in group_chunks(ends, item_bytes, self.PRODUCT_BYTES):
            per_item = torch.bmm(g[lo:hi].transpose(1, 2), x[lo:hi])  # [hi - lo, out, in]
            items = torch.arange(lo, hi, device=self._acc.device)
            self._seq_acc.index_add_(0, items % units, torch.linalg.vector_norm(per_item, dim=(1, 2)).square().double())
            at = lo
            for part in per_item.split([min(e, hi) - max(a, lo) for a, e in _runs(ends, run, lo, hi)]):
                total = part.sum(0) if partial is None else partial + part.sum(0)
                at += part.shape[0]
                if at == ends[run]:  # the group's last sequence
                    self._acc[run % n] += torch.linalg.vector_norm(total).square().double()
                    run, partial = run + 1, None
                else:
                    partial = total

    def arm(
        self,
        n_groups: int,
        group_tokens: torch.Tensor | None = None,
        *,
        group_sizes=(),
        per_sequence: bool = False,
        seq_tokens: torch.Tensor | None = None,
    ) -> None:
        """Arm around one forward + backward of a micro-batch holding `n_groups` whole prompt groups, its rows
        group by group (`group_sizes` each, () for equal groups), or packed: `group_tokens` [n_groups, Tg] flat row
        positions of each group's tokens (PackedRows.group_tokens; R*W = none). `per_sequence`: also each
        sequence's squared norm (`seq_sq_norms`; needs `group_sizes`); packed, `seq_tokens` [n_seq, Ts]
        (PackedRows.seq_tokens) then replaces `group_tokens`."""
        sizes = tuple(int(k) for k in group_sizes)
        if sizes and len(sizes) != n_groups:
            raise ValueError(f"{len(sizes)} group sizes for {n_groups} groups")
        if per_sequence and not sizes:
            raise ValueError("per-sequence capture needs the groups' sizes")
        if per_sequence and group_tokens is not None and seq_tokens is None:
            raise ValueError("per-sequence capture of packed rows needs seq_tokens (PackedRows.seq_tokens)")
        self._group_tokens, self._seq_tokens = group_tokens, seq_tokens
        self._sizes, self._per_seq = sizes, per_sequence
        device = next(self.pairs[0][0].parameters()).device
        self._acc = torch.zeros(n_groups, dtype=torch.float64, device=device)
        self._seq_acc = torch.zeros(sum(sizes) if per_sequence else 0, dtype=torch.float64, device=device)
        self._groups = n_groups
        self.forwards = self.backwards = 0
        self.error = None
        self._armed = True

    def disarm(self) -> None:
        self._armed = False
        try:
            self._flush()
        except Exception as e:  # noqa: BLE001 - the caller counts it; training must go on
            self.error = e
            self._pending, self._pending_bytes = [], 0

    @contextmanager
    def capture(self, n_groups: int, group_tokens: torch.Tensor | None = None, **per_sequence):
        self.arm(n_groups, group_tokens, **per_sequence)
        try:
            yield self
        finally:
            self.disarm()

    @property
    def hooks_ok(self) -> bool:
        """Pitfall P6: each LoRA module ran forward once and received its gradient once in this capture."""
        return self.forwards == self.backwards == 2 * len(self.pairs)

    @property
    def unit_sq_norms(self) -> torch.Tensor:
        """[n_groups] squared norms of each group's contribution to the accumulated gradient."""
        return self._acc

    @property
    def seq_sq_norms(self) -> torch.Tensor:
        """[n_seq] squared norms of each sequence's contribution (armed per_sequence), group by group."""
        return self._seq_acc

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

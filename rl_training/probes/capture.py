"""Autograd hooks that read the small gradients the GNS estimator needs, without touching `.grad`.

- `MicroGradCapture` (docs/probes.md 2.A): a tensor hook on every trainable parameter receives the gradient
  of the armed backward only, before it is accumulated into `.grad` and before any all-reduce. The squared
  norms are summed in float64 on the device (no .item() inside a hook). The hook count per backward is
  checked against the parameter count (pitfall P6: hooks must fire only for the training backward).
- `LoraUnitCapture` (docs/probes.md 2.C): exact per-prompt-group squared gradient norms of the LoRA matrices. For a
  LoRA linear y = base(x) + B(A(x)) * s, a sequence's gradients are sum_t dA_t^T x_t (for A) and
  sum_t dv_t^T u_t (for B), where u = A(x), v = B(u), and dA, dv are the gradients at A's and B's outputs.
  Forward hooks on peft's lora_A / lora_B modules register tensor hooks on their outputs; the per-sequence
  gradients are summed over each group's G consecutive rows and square-summed over all layers. Armed with the
  group size, one flush also gives each sequence's squared norm (the nested ANOVA's per-completion input,
  docs/probes.md 9.4): the products are formed per sequence and summed into groups, the same FLOPs.
  Not valid with gradient checkpointing (the recompute fires forward hooks twice), so the caller disables it.
Neither class calls `zero_grad` or modifies any gradient (PITFALLS: probes must not touch training grads), and
neither raises from a hook: an exception there would abort the training backward, so it is kept in `.error`
for the caller to count (docs/probes.md 5).
"""

from __future__ import annotations

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
    PRODUCT_BYTES = 256 * 2**20  # the per-unit weight gradients formed at once (a flush loops over layers)

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
        self._group_size = 0  # > 0: per-sequence norms too
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
        """Per-group (and, armed with the group size, per-sequence) squared norms of every pending weight
        gradient, one batched bmm per shape."""
        n, gather, k = self._groups, self._group_tokens, self._group_size
        if k:
            gather = self._seq_tokens  # products per sequence, then summed over each group's k sequences
        by_shape: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for g, x in self._pending:
            by_shape.setdefault((tuple(g.shape), tuple(x.shape), g.dtype), []).append((g, x))
        for items in by_shape.values():
            g = torch.stack([it[0] for it in items])  # [L, B, T, out]
            x = torch.stack([it[1] for it in items])  # [L, B, T, in]
            if g.dtype in (torch.float16, torch.bfloat16):
                g, x = g.float(), x.float()
            L = g.shape[0]
            if gather is not None:  # packed rows: each unit's tokens gathered, a zero row for its padding
                g, x = _gather_groups(g, gather), _gather_groups(x, gather)
            units = n * k if k else n  # rows are unit by unit: a sequence's T (or a group's G*T) positions
            g = g.reshape(L, units, -1, g.shape[-1])
            x = x.reshape(L, units, -1, x.shape[-1])
            # the per-unit gradients of `layers` layers at a time: at most PRODUCT_BYTES of them (a real model's
            # down_proj A at r=32 is 1.1 MB per sequence: 28 layers of 64 sequences would be 2 GB at once)
            layers = max(1, self.PRODUCT_BYTES // (units * g.shape[-1] * x.shape[-1] * g.element_size()))
            for lo in range(0, L, layers):
                gl, xl = g[lo : lo + layers].flatten(0, 1), x[lo : lo + layers].flatten(0, 1)
                per_unit = torch.bmm(gl.transpose(1, 2), xl)  # [layers*units, out, in]
                m = per_unit.shape[0] // units
                if k:
                    self._seq_acc += torch.linalg.vector_norm(per_unit, dim=(1, 2)).square().view(m, units).sum(0)
                    per_unit = per_unit.view(m * n, k, *per_unit.shape[1:]).sum(1)
                self._acc += torch.linalg.vector_norm(per_unit, dim=(1, 2)).square().view(m, n).sum(0)
        self._pending, self._pending_bytes = [], 0

    def arm(
        self,
        n_groups: int,
        group_tokens: torch.Tensor | None = None,
        *,
        group_size: int = 0,
        seq_tokens: torch.Tensor | None = None,
    ) -> None:
        """Arm around one forward + backward of a micro-batch holding `n_groups` whole prompt groups, its rows
        group by group, or packed: `group_tokens` [n_groups, Tg] flat row positions of each group's tokens
        (PackedRows.group_tokens; R*W = none). `group_size` > 0: also each sequence's squared norm
        (`seq_sq_norms`); packed, `seq_tokens` [n_groups * group_size, Ts] (PackedRows.seq_tokens) then
        replaces `group_tokens`."""
        if group_size and group_tokens is not None and seq_tokens is None:
            raise ValueError("per-sequence capture of packed rows needs seq_tokens (PackedRows.seq_tokens)")
        self._group_tokens, self._seq_tokens, self._group_size = group_tokens, seq_tokens, group_size
        device = next(self.pairs[0][0].parameters()).device
        self._acc = torch.zeros(n_groups, dtype=torch.float64, device=device)
        self._seq_acc = torch.zeros(n_groups * group_size, dtype=torch.float64, device=device)
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
        """[n_groups * group_size] squared norms of each sequence's contribution (armed with the group size)."""
        return self._seq_acc

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

"""One RL update: rollouts -> micro-batches -> the objective's loss -> accumulated, all-reduced, clipped step.

Old log-probs come for free and exactly: the first inner epoch's forward passes run on the weights before
any update of this step, which is the policy the PPO ratio compares against. Their detached values are
kept and reused by later epochs, so old and new log-probs are computed the same way (full vocabulary,
same precision, same temperature) and the ratio is exactly 1 in epoch 0. The sampler's own log-probs
only feed the trainer-vs-rollout canary and the off-policy correction (loss.correction: algs/corrections.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from rl_training.algs.common import token_entropy, token_logprobs, zero_adv_groups
from rl_training.algs.corrections import Correction
from rl_training.algs.objectives import (
    KL_ESTIMATORS,
    OBJECTIVES,
    KLEstimator,
    LossInput,
    Objective,
    StepNorm,
    batch_moments,
    batch_std_scale,
    policy_loss,
)
from rl_training.base import dist
from rl_training.config.plugins import load_correction, load_objective
from rl_training.probes.probe import NullProbes, StepProbes
from rl_training.rollout.base import Rollouts
from rl_training.train.packing import PackedRows, pack_sequences, packed_to
from rl_training.train.step_guard import nonfinite_agreed


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B,T] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [B,T] 1 on real tokens
    targets: torch.Tensor  # [B,T-1] input_ids shifted left: the token each position predicts
    mask: torch.Tensor  # [B,T-1] 1 where the target is a sampled completion token (stop token included; 0 on
    #                     prompt, padding and multi-turn observation tokens: Rollouts.loss_mask)
    advantages: torch.Tensor  # [B]
    rollout_logp: torch.Tensor  # [B,T-1] sampler log-probs aligned with `mask`, 0 elsewhere
    group_ids: list[int]  # [B/G] indices of the groups in this micro-batch
    n_units: int = 0  # groups of the micro-batch before zero-advantage groups were dropped (>= len(group_ids))
    packed: PackedRows | None = None  # the same sequences without padding (train.pack_sequences); the model runs on it
    turn: torch.Tensor | None = None  # [B,T-1] turn number (1..) of each target in `mask`, 0 elsewhere; multi-turn
    head_from: int = 0  # first position whose logits any row needs (padded rows: the shortest prompt's last token)

    def __post_init__(self):
        self.n_units = self.n_units or len(self.group_ids)

    @property
    def row_targets(self) -> torch.Tensor:
        """The targets of the logits forward_logits returns: [B,T-1-head_from] padded, [R,W-1] packed."""
        return self.targets[:, self.head_from :] if self.packed is None else self.packed.targets

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Per-position values of the rows the model ran on -> the padded [B,T-1] layout (0 before head_from)."""
        if self.packed is not None:
            return self.packed.unpack(x)
        return torch.nn.functional.pad(x, (self.head_from, 0)) if self.head_from else x


def make_micro_batches(
    rollouts: Rollouts,
    advantages: torch.Tensor,
    group_size: int,
    groups_per_micro: int,
    pad_id: int,
    device: torch.device,
    drop_zero_adv_groups: bool = False,
    extra_pad: int = 0,
    pack_row_tokens: int | None = None,
) -> list[MicroBatch]:
    """Pack whole prompt groups into micro-batches (a group is never split).

    The partition into micro-batches is fixed first (consecutive blocks of the rollout order, which is the
    seeded prompt order); dropping zero-advantage groups then removes them inside their block, and a block
    left empty is not returned (when every group would go, the first stays: the canary's tokens). Dropping never
    re-packs across blocks: the micro-level GNS needs each micro-batch to be a random block of units, whatever
    their advantages (`n_units` keeps its full size).
    `pack_row_tokens` not None: each micro-batch also carries its sequences packed without padding into rows
    of max(pack_row_tokens, longest sequence) tokens (rl_training/train/packing.py), which the model then runs on."""
    n_groups = len(rollouts) // group_size
    zero = zero_adv_groups(advantages, group_size)
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
        rows = [g * group_size + i for g in gids for i in range(group_size)]
        seqs = [rollouts.prompt_ids[r] + rollouts.completion_ids[r] for r in rows]
        width = max(len(x) for x in seqs) + extra_pad
        # Python lists, one tensor each: per-row tensor construction and slicing dominated this function
        ids_l = [x + [pad_id] * (width - len(x)) for x in seqs]
        attn_l = [[1] * len(x) + [0] * (width - len(x)) for x in seqs]
        mask_l, rlogp_l = [], []
        turn_l: list | None = [] if rollouts.turn_index is not None else None
        for r in rows:
            p, c = len(rollouts.prompt_ids[r]), len(rollouts.completion_ids[r])
            # position t predicts token t+1: completion tokens p..p+c-1 are predicted at p-1..p+c-2
            # loss_mask (multi-turn): 0 on observation tokens, which are never trained on
            lm = [1.0] * c if rollouts.loss_mask is None else [float(x) for x in rollouts.loss_mask[r]]
            tail = [0.0] * (width - p - c)
            mask_l.append([0.0] * (p - 1) + lm + tail)
            rlogp_l.append(
                [0.0] * (p - 1) + [lp * m for lp, m in zip(rollouts.logprobs[r][:c], lm, strict=True)] + tail
            )
            if turn_l is not None:
                turn_l.append([0] * (p - 1) + list(rollouts.turn_index[r]) + [0] * (width - p - c))
        ids = torch.tensor(ids_l, dtype=torch.long)
        attn = torch.tensor(attn_l, dtype=torch.long)
        mask = torch.tensor(mask_l)
        rlogp = torch.tensor(rlogp_l)
        turn = torch.tensor(turn_l, dtype=torch.long) if turn_l is not None else None
        packed = None
        if pack_row_tokens is not None:
            packed = packed_to(pack_sequences(seqs, group_size, pad_id, pack_row_tokens, width), device)
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
                turn=turn.to(device) if turn is not None else None,
                head_from=min(len(rollouts.prompt_ids[r]) for r in rows) - 1,
            )
        )
    return out


def forward_logits(model, mb: MicroBatch) -> torch.Tensor:
    """Logits of the rows the model runs on, last position dropped, targets mb.row_targets: [B,T-1-head_from,V]
    padded, [R,W-1,V] packed (no attention mask: transformers builds the block-diagonal causal mask from the
    restarting position ids; the packer's block boundaries go to flash-attention's varlen path, packing.py).

    Padded rows skip the LM head on the prompt positions no loss term reads (transformers' logits_to_keep): with a
    49k vocabulary that projection and its log-softmax are most of a short completion's cost (SmolLM2-135M, 32 x
    80 tokens of which 24 needed: 8.2 s forward + backward instead of 15.8 s on 2 cores)."""
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


@dataclass(frozen=True)
class UpdateHParams:
    """Everything one update needs besides the data; built once at setup from the config."""

    objective: Objective = OBJECTIVES["dr_grpo"]
    inner_epochs: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KL_ESTIMATORS["k3"]
    log_kl: bool = True  # this step runs the reference forward to log KL even when kl_coef == 0 (see for_step)
    kl_log_every: int = 1  # with kl_coef == 0, the steps that do: step % kl_log_every == 0 (0 = none)
    temperature: float = 1.0
    max_grad_norm: float = 1.0  # 0 = no clipping
    correction: Correction | None = None  # off-policy correction (loss.correction); None = none

    @classmethod
    def from_config(cls, cfg) -> UpdateHParams:
        """cfg.loss.clip_low/high must already be resolved (rl_training/config/resolve.py)."""
        return cls(
            objective=load_objective(cfg.loss),
            inner_epochs=cfg.train.inner_epochs,
            clip_low=cfg.loss.clip_low,
            clip_high=cfg.loss.clip_high,
            kl_coef=cfg.loss.kl_coef,
            kl_estimator=KL_ESTIMATORS[cfg.loss.kl_estimator],
            temperature=cfg.rollout.temperature,
            max_grad_norm=cfg.optim.max_grad_norm,
            correction=load_correction(cfg.loss),
            kl_log_every=cfg.loss.kl_log_every,
        )

    def for_step(self, step: int) -> UpdateHParams:
        """This step's hyper-parameters: whether its reference forward runs when only train/kl needs it (the
        no-grad forward with the adapter disabled cost ~15% of a step on the tiny model; docs/benchmarks.md)."""
        log_kl = self.kl_coef > 0 or (self.kl_log_every > 0 and step % self.kl_log_every == 0)
        return self if log_kl == self.log_kl else dataclasses.replace(self, log_kl=log_kl)

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0 or self.log_kl


def step_advantages(objective: Objective, rewards: torch.Tensor, group_size: int, device: torch.device) -> torch.Tensor:
    """The objective's advantages; a batch-std scale (REINFORCE++) uses moments summed over all ranks."""
    centered = objective.baseline(rewards, group_size)
    if objective.needs_batch_moments:
        return batch_std_scale(centered, dist.reduce_sums(batch_moments(centered), device))
    return objective.scale(centered, group_size)


def step_norm(rollouts: Rollouts, seqs_per_rank: int, max_new_tokens: int, device: torch.device) -> StepNorm:
    """This step's normalisers; the token count is global (all ranks, zero-advantage groups included) and counts
    trainable tokens only. `max_new_tokens`: the most trainable tokens a sequence holds (Derived)."""
    tokens = dist.reduce_sums({"t": sum(rollouts.trainable(i) for i in range(len(rollouts)))}, device)["t"]
    return StepNorm(seqs=seqs_per_rank, tokens=max(tokens / dist.world_size(), 1.0), max_new_tokens=max_new_tokens)


@dataclass
class TrainStats:
    """Sums over this rank's micro-batches and epochs (the caller reduces across ranks)."""

    loss: float = 0.0  # sum over epochs of the step loss (Dr-GRPO: already / normalizer)
    pg_loss: float = 0.0
    kl_sum: float = 0.0  # token sum of k3 KL to the reference, epoch 0
    clipped_tokens: float = 0.0  # summed over epochs
    tokens: float = 0.0  # valid tokens in one epoch
    entropy_sum: float = 0.0  # token sum of policy entropy, epoch 0
    logp_absdiff_sum: float = 0.0  # token sum of |trainer - sampler| log-prob, epoch 0
    logp_absdiff_max: float = 0.0
    is_ratio_sum: float = 0.0  # token sum of rho = pi_train / pi_rollout, epoch 0
    is_ratio_max: float = 0.0
    sequences: float = 0.0  # sequences trained on in one epoch (zero-advantage groups dropped are absent)
    skipped_tokens: float = 0.0  # trainable tokens of dropped zero-advantage groups (never forwarded); the Learner's
    grad_norm: float = 0.0  # mean over epochs of the pre-clip global grad norm (after the all-reduce)
    epochs: int = 0
    kl_measured: bool = True  # the reference forward ran this step (kl_sum is a measurement, not a 0 default)
    skipped: tuple[str, ...] = ()  # non-finite quantities that skipped this update (agreed over ranks)
    # rollout row -> mean |trainer - sampler| log-prob over its completion tokens, epoch 0 (rows of dropped
    # zero-advantage groups are absent): the per-sample canary the rollout samples show
    seq_logp_gap: dict[int, float] = dataclasses.field(default_factory=dict)
    # multi-turn: turn t -> (token sum of |trainer - sampler| log-prob, tokens) over turn t's sampled tokens, epoch 0
    turn_logp_diff: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # the off-policy correction's counts, epoch 0, and what each counts ('tokens' or 'sequences': Correction.counts)
    correction: dict[str, float] = dataclasses.field(default_factory=dict)
    correction_units: dict[str, str] = dataclasses.field(default_factory=dict)


MAX_TURNS = 32  # the per-turn canary's fixed width (multiturn.max_turns <= 32): no host sync to size it
CORRECTION_PREFIX = "correction."  # DeviceStats' names of the correction's counts


class DeviceStats:
    """TrainStats' sums and maxima kept on the device during the update: adding a micro-batch's values is an
    asynchronous kernel, and `to_stats` copies everything to the host once per step (one sync, not several
    `.item()` calls per micro-batch)."""

    def __init__(self, device: torch.device, epochs: int, kl_measured: bool = True, correction_counts=None):
        host_only = (
            "epochs",
            "skipped_tokens",
            "kl_measured",
            "skipped",
            "seq_logp_gap",
            "turn_logp_diff",
            "correction",
            "correction_units",
        )
        names = [f.name for f in dataclasses.fields(TrainStats) if f.name not in host_only]
        names += [CORRECTION_PREFIX + k for k in correction_counts or {}]
        self.v = {k: torch.zeros((), dtype=torch.float64, device=device) for k in names}
        self.epochs, self.kl_measured = epochs, kl_measured
        self.correction_units = dict(correction_counts or {})
        self.skipped: tuple[str, ...] = ()  # set by the update after the all-reduce (one agreed decision)
        self.seq_gaps: list[tuple[list[int], torch.Tensor]] = []  # (rollout rows, [rows] gap) per micro-batch
        self.turn_sums = torch.zeros((2, MAX_TURNS + 1), dtype=torch.float64, device=device)  # [gap sum, tokens][turn]

    def add(self, name: str, value: torch.Tensor) -> None:
        self.v[name] += value.detach()

    def max(self, name: str, value: torch.Tensor) -> None:
        self.v[name] = torch.maximum(self.v[name], value.detach().to(self.v[name].dtype))

    def nonfinite(self, grad_norm: torch.Tensor) -> tuple[str, ...]:
        """The update's decision point, once per optimizer step: one host read of the loss so far and the grad
        norm after the all-reduce, and one collective so that every rank skips together (step_guard.py)."""
        loss, norm = torch.stack([self.v["loss"], grad_norm.detach().double()]).tolist()
        return nonfinite_agreed({"loss": loss, "grad_norm": norm}, grad_norm.device)

    def to_stats(self) -> TrainStats:
        names = list(self.v)
        n = len(CORRECTION_PREFIX)
        gaps = [g.to(torch.float64) for _, g in self.seq_gaps]
        flat = [torch.stack([self.v[k] for k in names]), *gaps, self.turn_sums.flatten()]
        values = torch.cat(flat).tolist()  # the one host copy
        rows = [r for rs, _ in self.seq_gaps for r in rs]
        turn_gap, turn_tok = values[-2 * (MAX_TURNS + 1) : -(MAX_TURNS + 1)], values[-(MAX_TURNS + 1) :]
        fields = dict(zip(names, values[: len(names)], strict=True))
        return TrainStats(
            **{k: v for k, v in fields.items() if not k.startswith(CORRECTION_PREFIX)},
            correction={k[n:]: v for k, v in fields.items() if k.startswith(CORRECTION_PREFIX)},
            correction_units=self.correction_units,
            epochs=self.epochs,
            kl_measured=self.kl_measured,
            skipped=self.skipped,
            seq_logp_gap=dict(zip(rows, values[len(names) : -2 * (MAX_TURNS + 1)], strict=True)),
            turn_logp_diff={t: (turn_gap[t], turn_tok[t]) for t in range(1, MAX_TURNS + 1) if turn_tok[t] > 0},
        )


def _rollout_canary(
    stats: DeviceStats, logp: torch.Tensor, mb: MicroBatch, correction: Correction | None
) -> torch.Tensor | None:
    """Trainer-vs-sampler log-prob gap and importance ratios on valid tokens; returns the off-policy correction's
    weights, or None without one.
    Masked arithmetic rather than boolean indexing, whose data-dependent size would sync with the host."""
    m = mb.mask.bool()
    log_rho = torch.where(m, logp - mb.rollout_logp, 0.0)
    rho = torch.where(m, log_rho.exp(), 0.0)  # rho > 0 on valid tokens, so 0 elsewhere leaves the max alone
    stats.add("logp_absdiff_sum", log_rho.abs().sum())
    group = len(mb.advantages) // len(mb.group_ids)
    rows = [g * group + i for g in mb.group_ids for i in range(group)]
    stats.seq_gaps.append((rows, log_rho.abs().sum(1) / m.sum(1).clamp(min=1)))
    stats.max("logp_absdiff_max", log_rho.abs().max())
    if mb.turn is not None:  # per-turn canary: 0 (observations, prompt, padding) collects nothing that is read
        t = mb.turn.flatten()
        stats.turn_sums[0].scatter_add_(0, t, log_rho.abs().flatten().double())
        stats.turn_sums[1].scatter_add_(0, t, mb.mask.flatten().double())
    stats.add("is_ratio_sum", rho.sum())
    stats.max("is_ratio_max", rho.max())
    stats.v["sequences"] += len(rows)  # a Python number: no host-to-device copy
    if correction is None:
        return None
    out = correction(logp, mb.rollout_logp, mb.mask)
    for name, count in out.counts.items():
        stats.add(CORRECTION_PREFIX + name, count.double())
    return out.weights.detach()


@contextmanager
def checkpointing_without_dropout(model):
    """Eval mode everywhere (dropout off: epoch-0 log-probs equal a separate no-grad "old" pass), except the
    `training` flag of transformers' checkpointed decoder layers: they recompute activations in backward only
    when that flag is set (GradientCheckpointingLayer.__call__ in transformers 5), so eval() alone silently
    disables gradient checkpointing (~80x the saved activations). The flag is set on the layer object itself,
    not its children, so attention and LoRA dropout stay off; the decoder layers of the supported
    architectures (Qwen2/3, Llama, Mistral, Gemma2, Phi3, MoE variants) read no `self.training` themselves."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    was_training = model.training
    model.eval()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m in layers:
            m.training = False
        model.train(was_training)


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


NULL_PROBES = NullProbes()


def train_on_rollouts(
    model,
    optimizer,
    scheduler,
    params: list[torch.nn.Parameter],
    micro_batches: list[MicroBatch],
    hp: UpdateHParams,
    norm: StepNorm,
    probes: StepProbes | NullProbes = NULL_PROBES,
) -> TrainStats:
    """One rollout batch: `inner_epochs` optimizer steps. `probes` (StepProbes, or NullProbes when off) reads the small
    gradients and importance weights of epoch 0 and the PPO ratios of the last epoch; it never edits `.grad`."""
    with checkpointing_without_dropout(model):
        return _train_on_rollouts(model, optimizer, scheduler, params, micro_batches, hp, norm, probes)


def _train_on_rollouts(model, optimizer, scheduler, params, micro_batches, hp, norm, probes) -> TrainStats:
    old_logps: list[torch.Tensor] = []
    is_weights: list[torch.Tensor | None] = []
    ref_logps = reference_logprobs(model, micro_batches, hp.temperature, hp.needs_reference)
    counts = hp.correction.counts if hp.correction is not None else None
    acc = DeviceStats(params[0].device, hp.inner_epochs, hp.needs_reference, counts)
    for epoch in range(hp.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(micro_batches):
            with probes.micro(mb) if epoch == 0 else nullcontext():
                logits = forward_logits(model, mb)
                logp = mb.unpack(token_logprobs(logits, mb.row_targets, hp.temperature))
                if epoch == 0:
                    old_logps.append(logp.detach())
                    is_weights.append(_rollout_canary(acc, logp.detach(), mb, hp.correction))
                    entropy = mb.unpack(token_entropy(logits.detach(), hp.temperature))
                    acc.add("entropy_sum", (entropy * mb.mask).sum())
                del logits  # else they would outlive backward, into the next micro-batch's forward
                out = policy_loss(
                    LossInput(
                        objective=hp.objective,
                        logp=logp,
                        old_logp=old_logps[i],
                        advantages=mb.advantages,
                        mask=mb.mask,
                        norm=norm,
                        clip_low=hp.clip_low,
                        clip_high=hp.clip_high,
                        ref_logp=ref_logps[i],
                        kl_coef=hp.kl_coef,
                        kl_estimator=hp.kl_estimator,
                        is_weights=is_weights[i],
                    )
                )
                out.loss.backward()
            if epoch == 0:
                probes.observe_rollout(mb, old_logps[i], is_weights[i])
            if epoch == hp.inner_epochs - 1 and epoch > 0:
                probes.observe_ppo(mb, logp, old_logps[i])
            acc.add("loss", out.loss)
            acc.add("pg_loss", out.pg_loss)
            acc.add("clipped_tokens", out.clipped_tokens)
            if epoch == 0:
                acc.add("kl_sum", out.kl_sum)
                acc.add("tokens", out.tokens)
        for p in params:  # a rank whose groups were all dropped still joins the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if epoch == 0:
            probes.before_allreduce()
        dist.average_gradients_(params)
        if epoch == 0:
            probes.after_allreduce()  # collective; Q is read before clipping rescales .grad
        grad_norm = torch.nn.utils.clip_grad_norm_(params, hp.max_grad_norm if hp.max_grad_norm > 0 else float("inf"))
        acc.add("grad_norm", grad_norm / hp.inner_epochs)
        acc.skipped = acc.nonfinite(grad_norm)
        if acc.skipped:  # no optimizer or scheduler step: adapter, AdamW moments and LR stay as they were
            break
        optimizer.step()
        scheduler.step()
    return acc.to_stats()

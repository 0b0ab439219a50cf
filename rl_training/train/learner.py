"""The learner: a step's batch and its rewards in, the adapter updated. It owns the update: the objective and its
hyper-parameters (UpdateHParams), the advantages, the micro-batches (train/batches.py), the step's normaliser, the
off-policy correction, the probe hooks and the optimizer step.

    learned = learner.learn(batch, scores.rewards, step, meter, before_update=backend.sleep)

One update: rollouts -> micro-batches -> the objective's loss -> accumulated, all-reduced, clipped step. Old
log-probs come for free and exactly: the first inner epoch's forward passes run on the weights before any update of
this step, which is the policy the PPO ratio compares against. Their detached values are kept and reused by later
epochs, so old and new log-probs are computed the same way (full vocabulary, same precision, same temperature) and
the ratio is exactly 1 in epoch 0. The sampler's own log-probs only feed the canary (train/canary.py, which only
observes) and the off-policy correction (loss.correction: algs/corrections.py), computed beside the loss.

The update's numbers go to the step's meter (base/meter.py) under their logged names, where they are measured.
Collective: every rank calls `learn` for every step (a non-finite reward anywhere skips the update on every rank;
the advantages of a batch-std objective and the normaliser's token count are global).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from rl_training.algs.common import Sizes, token_entropy, token_logprobs, zero_adv_groups
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
from rl_training.base.meter import Meter
from rl_training.config.plugins import load_correction, load_objective
from rl_training.config.schema import ConfigError
from rl_training.probes.probe import NullProbes, StepProbes
from rl_training.rollout.base import Rollouts, StepBatch
from rl_training.train.batches import MicroBatch, forward_logits, make_micro_batches, reference_logprobs
from rl_training.train.canary import rollout_canary
from rl_training.train.packing import row_tokens_for
from rl_training.train.step_guard import nonfinite_agreed


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


def step_advantages(
    objective: Objective, rewards: torch.Tensor, group_size: Sizes, device: torch.device
) -> torch.Tensor:
    """The objective's advantages; a batch-std scale (REINFORCE++) uses moments summed over all ranks."""
    centered = objective.baseline(rewards, group_size)
    if objective.needs_batch_moments:
        return batch_std_scale(centered, dist.reduce_sums(batch_moments(centered), device))
    return objective.scale(centered, group_size)


def step_norm(trainable_tokens: int, seqs_per_rank: int, max_new_tokens: int, device: torch.device) -> StepNorm:
    """This step's normalisers; the token count is global (all ranks, zero-advantage groups included) and counts
    trainable tokens only (`trainable_tokens`: this rank's). `max_new_tokens`: the most trainable tokens a sequence
    holds (Derived)."""
    tokens = dist.reduce_sums({"t": trainable_tokens}, device)["t"]
    return StepNorm(seqs=seqs_per_rank, tokens=max(tokens / dist.world_size(), 1.0), max_new_tokens=max_new_tokens)


def correction_weights(meter: Meter, correction: Correction | None, logp: torch.Tensor, mb: MicroBatch):
    """The off-policy correction's weights for this micro-batch (None without one), epoch 0; its counts go to the
    meter under their logged names, each over the tokens or the sequences it counts (Correction.counts)."""
    if correction is None:
        return None
    out = correction(logp, mb.rollout_logp, mb.mask)
    per = {"tokens": mb.mask.sum(), "sequences": len(mb.advantages)}
    for name, count in out.counts.items():
        meter.mean(name, count, per=per[correction.counts[name]])
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
    meter: Meter | None = None,
) -> tuple[str, ...]:
    """One rollout batch: `inner_epochs` optimizer steps; its numbers go to `meter` (the step's, base/meter.py;
    None: a meter of its own, unread) under their logged names.
    Returns the non-finite quantities that skipped the update (agreed over ranks; () when it ran). `probes`
    (StepProbes, or NullProbes when off) reads the small gradients and importance weights of epoch 0 and the PPO
    ratios of the last epoch; it never edits `.grad`."""
    with checkpointing_without_dropout(model):
        meter = Meter() if meter is None else meter
        return _train_on_rollouts(model, optimizer, scheduler, params, micro_batches, hp, norm, meter, probes)


def _train_on_rollouts(model, optimizer, scheduler, params, micro_batches, hp, norm, meter, probes):
    old_logps: list[torch.Tensor] = []
    is_weights: list[torch.Tensor | None] = []
    ref_logps = reference_logprobs(model, micro_batches, hp.temperature, hp.needs_reference)
    for epoch in range(hp.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        loss = pg_loss = 0.0
        for i, mb in enumerate(micro_batches):
            with probes.micro(mb) if epoch == 0 else nullcontext():
                logits = forward_logits(model, mb)
                logp = mb.unpack(token_logprobs(logits, mb.row_targets, hp.temperature))
                if epoch == 0:
                    old_logps.append(logp.detach())
                    rollout_canary(meter, logp.detach(), mb)
                    is_weights.append(correction_weights(meter, hp.correction, logp.detach(), mb))
                    entropy = mb.unpack(token_entropy(logits.detach(), hp.temperature))
                    meter.mean("train/entropy", (entropy * mb.mask).sum(), per=mb.mask.sum())
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
            loss, pg_loss = loss + out.loss.detach().double(), pg_loss + out.pg_loss.double()
            meter.mean("train/clip_frac", out.clipped_tokens, per=out.tokens)  # over every epoch's tokens
            if epoch == 0 and hp.needs_reference:  # steps without the reference forward log no KL, not a 0
                meter.mean("train/kl", out.kl_sum, per=out.tokens)
        for p in params:  # a rank whose groups were all dropped still joins the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if epoch == 0:
            probes.before_allreduce()
        dist.average_gradients_(params)
        if epoch == 0:
            probes.after_allreduce()  # collective; Q is read before clipping rescales .grad
        grad_norm = torch.nn.utils.clip_grad_norm_(params, hp.max_grad_norm if hp.max_grad_norm > 0 else float("inf"))
        # DDP semantics: the step loss is the mean of the ranks' losses (each already / its normaliser), over epochs
        meter.mean("train/loss", loss, per=1)
        meter.mean("train/pg_loss", pg_loss, per=1)
        meter.mean("train/grad_norm", grad_norm, per=1)  # the same on every rank after the all-reduce
        skipped = nonfinite(loss, grad_norm)
        if skipped:  # no optimizer or scheduler step: adapter, AdamW moments and LR stay as they were
            return skipped
        optimizer.step()
        scheduler.step()
    return ()


def nonfinite(loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[str, ...]:
    """The update's decision point, once per optimizer step: one host read of the epoch's loss and the grad norm
    after the all-reduce, and one collective so that every rank skips together (step_guard.py)."""
    norm = grad_norm.detach().double()
    loss_v, norm_v = torch.stack([torch.as_tensor(loss, dtype=torch.float64, device=norm.device), norm]).tolist()
    return nonfinite_agreed({"loss": loss_v, "grad_norm": norm_v}, grad_norm.device)


@dataclass
class Learned:
    """What one step's learning did: the advantages it used, the learning rate it ran at, whether it trained, and
    what skipped its update (its numbers are in the step's meter)."""

    advantages: torch.Tensor  # [N] float64, on the device, group by group
    lr: float
    ran: bool  # False: a non-finite reward skipped the update before any forward (nothing was trained on)
    skipped: tuple[str, ...] = ()  # the non-finite quantities that skipped the update, agreed over ranks
    rows: list[int] = dataclasses.field(default_factory=list)  # the rows the update's forwards ran, in order


def without_truncated(ro: Rollouts) -> Rollouts:
    """DAPO's overlong filtering: every token of a truncated response masked out of the loss (loss_mask 0), as an
    observation's is. The sequence keeps its place, its reward (already in its group's advantages) and its
    tokens for the forward; every count of trained tokens (the token-mean normalisers, the probes) drops it."""
    masks = [
        [0] * len(c) if t else ([1] * len(c) if ro.loss_mask is None else list(ro.loss_mask[i]))
        for i, (c, t) in enumerate(zip(ro.completion_ids, ro.truncated, strict=True))
    ]
    return dataclasses.replace(ro, loss_mask=masks)


@dataclass(kw_only=True)
class Learner:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    params: list[torch.nn.Parameter]
    hparams: UpdateHParams
    probes: StepProbes | NullProbes
    device: torch.device
    seqs_per_rank: int  # the step's sequences per rank (Derived): the normaliser's sequence count
    max_trainable_tokens: int  # Dr-GRPO's constant (rollout/episodes.py, max_trainable_tokens)
    micro_batch_groups: int
    drop_zero_adv_groups: bool
    pad_id: int
    pack_row_tokens: int | None  # train.pack_sequences: the packed row width; None = padded micro-batches
    overlong_filter: bool = False  # loss.overlong_filter: truncated responses carry no loss term
    share_prompt: bool = False  # train.share_prompt: each group one row behind its prompt (train/shared_prompt.py)

    @classmethod
    def from_config(cls, cfg, derived, *, max_trainable_tokens: int, pad_id: int, **parts) -> Learner:
        """model, optimizer, scheduler, params, probes and device as keywords (`parts`); the rest from the config."""
        t = cfg.train
        if not isinstance(t.drop_zero_adv_groups, bool):  # 'auto' is truthy: never let it reach make_micro_batches
            raise ValueError("Learner.from_config needs a resolved config (config/resolve.py: drop_zero_adv_groups)")
        packing = row_tokens_for(cfg.model.attn_implementation, t.pack_row_tokens) if t.pack_sequences else None
        if cfg.reward.overlong_buffer > max_trainable_tokens:  # the shaping's buffer lies inside the budget
            raise ConfigError(
                f"reward.overlong_buffer={cfg.reward.overlong_buffer} exceeds the response budget of "
                f"{max_trainable_tokens} tokens (rollout.max_new_tokens, or multiturn.* for an environment)"
            )
        return cls(
            hparams=UpdateHParams.from_config(cfg),
            seqs_per_rank=derived.seqs_per_rank,
            max_trainable_tokens=max_trainable_tokens,
            micro_batch_groups=t.micro_batch_groups,
            drop_zero_adv_groups=t.drop_zero_adv_groups,
            pad_id=pad_id,
            pack_row_tokens=packing,
            overlong_filter=cfg.loss.overlong_filter,
            share_prompt=t.share_prompt,
            **parts,
        )

    def learn(
        self,
        batch: StepBatch,
        rewards: Sequence[float],
        step: int,
        meter: Meter,
        before_update: Callable[[], None] = lambda: None,
    ) -> Learned:
        """Advantages from `rewards` (one per rollout), then the update of step `step` (0-based; its
        hyper-parameters: UpdateHParams.for_step). `before_update` runs just before the first forward (the
        runner puts the rollout engine to sleep there); not when a non-finite reward skips the update."""
        hp, group = self.hparams, batch.groups.sizes  # each group's size (per_prompt allocation: unequal)
        r = torch.tensor(rewards, dtype=torch.float64)
        bad_reward = nonfinite_agreed({"reward": r.sum().item()}, self.device)  # every rank skips together
        advantages = step_advantages(hp.objective, r, group, self.device)
        zero = zero_adv_groups(advantages, group)
        meter.mean("rollout/zero_adv_group_frac", zero.sum(), per=zero.numel())
        lr = self.scheduler.get_last_lr()[0]
        meter.ready("train/lr", lr)
        if bad_reward:  # no forward/backward on NaN advantages; adapter, optimizer and LR untouched
            return Learned(advantages, lr, ran=False, skipped=bad_reward)
        before_update()
        ro = without_truncated(batch.rollouts) if self.overlong_filter else batch.rollouts
        micro = make_micro_batches(
            ro,
            advantages,
            batch.groups,
            self.micro_batch_groups,
            self.pad_id,
            self.device,
            self.drop_zero_adv_groups,
            pack_row_tokens=self.pack_row_tokens,
            zero_groups=zero,
            share_prompt=self.share_prompt and not self.probes.per_sequence(step),
        )
        trainable = [ro.trainable(i) for i in range(len(ro))]
        norm = step_norm(sum(trainable), self.seqs_per_rank, self.max_trainable_tokens, self.device)
        self.probes.begin_step(batch.groups, advantages, trainable, step, rewards)
        skipped = train_on_rollouts(
            self.model, self.optimizer, self.scheduler, self.params, micro, hp.for_step(step), norm, self.probes, meter
        )
        rows = [r for mb in micro for r in mb.rows]
        # the forward/backward work train.drop_zero_adv_groups saved (the groups it skipped are
        # rollout/zero_adv_group_frac when it is on); the update's metrics over trained tokens exclude them
        saved = sum(trainable) - sum(trainable[r] for r in rows)
        meter.mean("train/skipped_token_frac", saved, per=sum(trainable))
        return Learned(advantages, lr, ran=True, skipped=skipped, rows=rows)

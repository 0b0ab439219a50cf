"""The learner: a step's batch and its rewards in, the adapter updated. It owns what the update needs besides the
data: the objective and its hyper-parameters (UpdateHParams), the advantages, the micro-batches, the step's
normaliser, the probe hooks and the optimizer step (train/update.py).

    learned = learner.learn(batch, scores.rewards, step, before_update=backend.sleep)

Collective: every rank calls `learn` for every step (a non-finite reward anywhere skips the update on every rank;
the advantages of a batch-std objective and the normaliser's token count are global).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rl_training.config.schema import ConfigError
from rl_training.probes.probe import NullProbes, StepProbes
from rl_training.rollout.base import Rollouts, StepBatch
from rl_training.train.packing import row_tokens_for
from rl_training.train.step_guard import nonfinite_agreed
from rl_training.train.update import (
    TrainStats,
    UpdateHParams,
    make_micro_batches,
    step_advantages,
    step_norm,
    train_on_rollouts,
)


@dataclass
class Learned:
    """What one step's learning did: the advantages it used, the update's stats, the learning rate it ran at."""

    advantages: torch.Tensor  # [N] float64, on the device, group by group
    stats: TrainStats
    lr: float
    ran: bool  # False: a non-finite reward skipped the update before any forward (nothing was trained on)


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
            **parts,
        )

    def learn(
        self, batch: StepBatch, rewards: Sequence[float], step: int, before_update: Callable[[], None] = lambda: None
    ) -> Learned:
        """Advantages from `rewards` (one per rollout), then the update of step `step` (0-based; its
        hyper-parameters: UpdateHParams.for_step). `before_update` runs just before the first forward (the
        runner puts the rollout engine to sleep there); not when a non-finite reward skips the update."""
        hp, group = self.hparams, batch.group_size
        r = torch.tensor(rewards, dtype=torch.float64)
        bad_reward = nonfinite_agreed({"reward": r.sum().item()}, self.device)  # every rank skips together
        advantages = step_advantages(hp.objective, r, group, self.device)
        lr = self.scheduler.get_last_lr()[0]
        if bad_reward:  # no forward/backward on NaN advantages; adapter, optimizer and LR untouched
            skipped = TrainStats(epochs=hp.inner_epochs, kl_measured=False, skipped=bad_reward)
            return Learned(advantages, skipped, lr, ran=False)
        before_update()
        ro = without_truncated(batch.rollouts) if self.overlong_filter else batch.rollouts
        micro = make_micro_batches(
            ro,
            advantages,
            group,
            self.micro_batch_groups,
            self.pad_id,
            self.device,
            self.drop_zero_adv_groups,
            pack_row_tokens=self.pack_row_tokens,
        )
        norm = step_norm(ro, self.seqs_per_rank, self.max_trainable_tokens, self.device)
        self.probes.begin_step(group, advantages, [ro.trainable(i) for i in range(len(ro))], step, rewards)
        stats = train_on_rollouts(
            self.model, self.optimizer, self.scheduler, self.params, micro, hp.for_step(step), norm, self.probes
        )
        kept = {g for mb in micro for g in mb.group_ids}
        skipped = sum(ro.trainable(i) for i in range(len(ro)) if i // group not in kept)  # the work saved
        return Learned(advantages, dataclasses.replace(stats, skipped_tokens=float(skipped)), lr, ran=True)

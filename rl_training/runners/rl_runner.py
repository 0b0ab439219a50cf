"""Dr-GRPO + LoRA reinforcement learning with verifiable rewards, one process per rank.

    torchrun --nproc_per_node=1 rl_training/runners/rl_runner.py --cfg cfg/tiny_cpu.yaml
    torchrun --nproc_per_node=1 rl_training/runners/rl_runner.py --cfg cfg/testconfig.yaml train.total_steps=3
    torchrun --nproc_per_node=1 rl_training/runners/rl_runner.py --cfg cfg/tiny_cpu.yaml ckpt.resume=latest
    python -m rl_training.runners.rl_runner --cfg cfg/testconfig.yaml      # a world of one, no torchrun
    sbatch scripts/slurm/rl_train.sbatch --cfg cfg/qwen2.5_1.5b_gsm8k.yaml  # SLURM, several nodes (docs/clusters.md)

Each step: sample this rank's prompts -> generate G completions each -> score -> group advantages ->
Dr-GRPO update of the LoRA adapter (gradients averaged over ranks) -> sync weights into the rollout
backend -> in-loop eval every `eval.every` steps (rl_training/evaluation/, the code `python -m evals.run` uses)
-> log -> checkpoint (handed to the background uploader when sync.remote is set). Outputs go to
run.output_dir/run.name (docs/outputs.md). On run.stop_signal (SLURM's time-limit warning) every rank
checkpoints at the next step and the process exits with status 75; `ckpt.resume=latest` continues the run.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_training.base import dist, faults
from rl_training.base.exit_codes import STOPPED_EXIT_CODE
from rl_training.base.meter import Meter
from rl_training.base.timer import PhaseTimer
from rl_training.ckpt.best import BestCheckpoint
from rl_training.ckpt.resume import resolve_resume
from rl_training.ckpt.store import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from rl_training.ckpt.upload import CheckpointSyncer, NullSyncer, make_syncer
from rl_training.config.load import to_dict, to_yaml
from rl_training.config.resolve import resolve
from rl_training.config.schema import Config, Derived
from rl_training.data.prompts import PromptSampler, dedupe_questions, encode_prompts
from rl_training.data.sources import Example, load_examples
from rl_training.evaluation.evaluate import InLoopEval
from rl_training.metrics.episode import measure_episodes
from rl_training.metrics.logger import MetricsLogger
from rl_training.metrics.progress import make_progress
from rl_training.metrics.samples import StepSamples
from rl_training.metrics.step import measure_step
from rl_training.metrics.wandb_log import make_wandb
from rl_training.policy.models import assert_only_adapter_trainable, build_policy, trainable_parameters
from rl_training.probes.allocation import PromptAllocator
from rl_training.probes.budget import RolloutBudget
from rl_training.probes.dashboard import ALERT_TEXT
from rl_training.probes.dashboard import custom_scalar_layout as probe_tb_layout
from rl_training.probes.forecast import RunForecast
from rl_training.probes.group_size import GroupSizeAuto, segments_of
from rl_training.probes.lora_health import lora_health_due
from rl_training.probes.probe import NullProbes, StepProbes
from rl_training.rollout.async_queue import make_rollouts, past_versions, version_metrics
from rl_training.rollout.base import RolloutBackend, StepBatch
from rl_training.rollout.episodes import max_trainable_tokens
from rl_training.rollout.factory import build_rollout, versioned
from rl_training.rollout.kinds import BackendKind, backend_kind
from rl_training.runners.monitor import advice_line
from rl_training.runners.rl_batch import (
    allocate_step,
    apply_split,
    generate_step,
    refill_step,
    score_batch,
    shaped_rewards,
    step_work,
    switch_split,
)
from rl_training.runtime.cli import run_cli
from rl_training.runtime.lifeline import tie_to_launcher
from rl_training.runtime.lock import locked
from rl_training.runtime.platform_check import require_working_cuda
from rl_training.runtime.seeding import seed_all, set_cpu_threads
from rl_training.runtime.stopping import StopOnSignal
from rl_training.tasks.base import Scores, Task
from rl_training.tasks.build import build_task, task_context
from rl_training.train.drift_guard import DriftGuard
from rl_training.train.learner import Learned, Learner
from rl_training.train.optimizer import build_optimizer
from rl_training.train.step_guard import SkipGuard
from rl_training.train.weight_guard import WeightGuard


@dataclass(kw_only=True)
class Run:
    cfg: Config
    derived: Derived
    info: dist.DistInfo
    model: torch.nn.Module
    tokenizer: object
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    backend: RolloutBackend
    kind: BackendKind  # what the backend declares: its prompt cost, its canary advice (rollout/kinds.py)
    task: Task  # started (its resources live) until rl() closes it
    learner: Learner  # advantages, micro-batches, normaliser, probe hooks and the update (train/learner.py)
    examples: list[Example]
    prompts: list[list[int]]
    sampler: PromptSampler
    logger: MetricsLogger
    probes: StepProbes | NullProbes
    start_step: int
    evaluator: InLoopEval | None  # None when eval.every = 0
    syncer: CheckpointSyncer | NullSyncer
    skips: SkipGuard  # non-finite steps skipped so far (rl_training/train/step_guard.py)
    weights: WeightGuard  # were the rollouts sampled from the trained weights? (rl_training/train/weight_guard.py)
    drift: DriftGuard  # does held-out accuracy fall while responses run into the budget? (train/drift_guard.py)
    best: BestCheckpoint  # ckpt.keep_best: the step whose checkpoint pruning keeps (rl_training/ckpt/best.py)
    forecast: RunForecast  # the final held-out reward, forecast from the evals so far (probes/forecast.py)
    samples: StepSamples  # whole rollouts kept every samples_every steps (rl_training/metrics/samples.py)
    alerts: dict = field(default_factory=dict)
    advised_k_star: float | None = None  # the K* report_advice last printed
    rollouts: Any = None  # SyncRollouts or AsyncRollouts (rollout/async_queue.py): get(step) -> StepBatch
    allocator: PromptAllocator | None = None  # rollout.allocation: per_prompt (probes/allocation.py)
    auto: GroupSizeAuto | None = None  # rollout.group_size_auto (probes/group_size.py)


def gns_levels(requested: list[str], gradient_checkpointing: bool, accum_steps: int, world: int) -> list[str]:
    """The requested GNS levels this layout can identify (micro needs >= 2 micro-batches per step over all
    ranks, rank needs >= 2 ranks, unit needs no gradient checkpointing: a recompute fires the forward hooks
    twice). If none is left, the unit level when possible (printed), else none."""
    identifiable = {"unit": not gradient_checkpointing, "micro": accum_steps * world >= 2, "rank": world >= 2}
    levels = [lv for lv in requested if identifiable[lv]]
    if not levels and identifiable["unit"]:
        levels = ["unit"]
        dist.print0(
            "probe: none of probe.gns_levels can be identified with one micro-batch per step on one "
            "rank; using the unit level (exact per-group norms, about one more LoRA weight-gradient pass, on "
            "every probe.unit_every-th step)"
        )
    return levels


def build_probes(
    cfg: Config, derived: Derived, model, params, info: dist.DistInfo, resumed: dict
) -> StepProbes | NullProbes:
    """GNS/ESS probes with the levels this layout can identify; GNS state continues across a resume."""
    if not cfg.probe.enabled:
        return NullProbes()
    levels = gns_levels(cfg.probe.gns_levels, cfg.model.gradient_checkpointing, derived.accum_steps, derived.world_size)
    budget = None
    if cfg.probe.advisor:
        budget = RolloutBudget(
            group_size=cfg.rollout.group_size,
            units_per_step=cfg.rollout.prompts_per_step,
            world_size=derived.world_size,
            ema_beta=cfg.probe.gns_ema_beta,
            exact_zero=cfg.loss.kl_coef == 0,  # a zero-advantage group's gradient is exactly 0
            b_multiple=derived.world_size * cfg.train.micro_batch_groups,
            device=info.device,
            measured_every=cfg.probe.unit_every,
        )
    probes = StepProbes(
        model,
        params,
        levels=levels,
        ema_beta=cfg.probe.gns_ema_beta,
        units_per_step=cfg.rollout.prompts_per_step,
        world_size=derived.world_size,
        micro_batch_groups=cfg.train.micro_batch_groups,
        device=info.device,
        step_time=(cfg.probe.step_time_fixed_s, cfg.probe.step_time_per_group_s),
        unit_every=cfg.probe.unit_every,
        budget=budget,
    )
    state = resumed.get("probes")
    if state:
        probes.load_state_dict(state)
    return probes


def setup(cfg: Config, info: dist.DistInfo) -> Run:
    resolved = resolve(cfg, info.world_size, objective=True, upload=True)  # saved and logged as resolved
    cfg, derived = resolved.cfg, resolved.derived
    kind = backend_kind(cfg)  # a user's backend file is imported here, once
    kind.check(cfg, "", True)  # the backend's own rules (rollout/kinds.py), before any model loads
    task = build_task(cfg)  # a user's task file is imported here: its errors come before any model loads
    set_cpu_threads()
    resume_from = resolve_resume(cfg.ckpt.resume, derived.run_dir, to_yaml(cfg))
    seed_all(cfg.train.seed)  # the same LoRA init on every rank
    tokenizer, model = build_policy(cfg, info.device)
    params = trainable_parameters(model)
    optimizer, scheduler = build_optimizer(params, cfg.optim, cfg.train.total_steps * cfg.train.inner_epochs)
    examples = load_examples(cfg.data.train, task.parse)
    examples, dupes = dedupe_questions(examples, task.problem_key)
    if dupes:
        dist.print0(f"data: dropped {dupes} repeated problems from {cfg.data.train} (one prompt per step, P7)")
    prompts = encode_prompts(examples, cfg.data, tokenizer, task)
    evaluator = InLoopEval(cfg, tokenizer, info, derived.run_dir, task) if cfg.eval.every else None
    seed_all(cfg.train.seed + info.rank)  # per-rank sampling streams
    start_step, resumed_state = 0, {}
    if resume_from is not None:
        restored = load_checkpoint(resume_from, model, optimizer, scheduler, info.rank, info.world_size)
        start_step, resumed_state = restored.step, restored.trainer_state
        assert_only_adapter_trainable(model)
        dist.print0(f"resumed from {resume_from} at step {start_step}")
    auto_state = resumed_state.get("group_size_auto")  # the splits so far (rollout.group_size_auto)
    sampler = PromptSampler.from_config(cfg, len(examples), info.world_size, segments_of(auto_state))
    rng = rng_state()  # building a vLLM engine reseeds the global RNGs; keep the restored or seeded streams
    task.start(task_context(info, tokenizer, cfg))  # a sandbox pool, a retriever: fails here if the node cannot
    backend = build_rollout(cfg, model, tokenizer, info, task, start_step)  # an Environment's episodes
    set_rng_state(rng)
    for v in past_versions(start_step, cfg.rollout.max_async_level):  # what the resumed queue samples first
        versioned(backend, cfg).republish(v, past_version_dir(resume_from, v))
    save_resolved_config(cfg, derived, info)
    wandb = make_wandb(cfg.run.wandb, derived.run_dir, cfg.run.name, to_dict(cfg), info.is_main)
    logger = MetricsLogger(derived.run_dir, info.is_main, cfg.run.tensorboard, resume_step=start_step, wandb=wandb)
    logger.text("config", "```yaml\n" + to_yaml(cfg) + "\n```")
    logger.custom_scalars(probe_tb_layout())
    syncer = make_syncer(cfg.sync, cfg.run.name, info.is_main)
    parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, params=params, device=info.device)
    probes = build_probes(cfg, derived, model, params, info, resumed_state)
    learner = Learner.from_config(cfg, derived, max_trainable_tokens=max_trainable_tokens(cfg, task),
                                  pad_id=tokenizer.pad_token_id, probes=probes, **parts)  # fmt: skip
    run = Run(
        cfg=cfg,
        derived=derived,
        info=info,
        model=model,
        tokenizer=tokenizer,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        backend=backend,
        kind=kind,
        task=task,
        learner=learner,
        examples=examples,
        prompts=prompts,
        sampler=sampler,
        logger=logger,
        probes=probes,
        start_step=start_step,
        evaluator=evaluator,
        syncer=syncer,
        skips=SkipGuard(cfg.train.max_consecutive_skips, resumed_state.get("skips")),
        weights=WeightGuard(cfg, resumed_state.get("weight_guard"), advice=kind.canary_advice(cfg)),
        drift=DriftGuard(cfg.eval, resumed_state.get("drift")),
        best=BestCheckpoint.from_config(cfg, resumed_state.get("best")),
        forecast=RunForecast.from_config(cfg, resumed_state.get("forecast"), task.reward_range),
        samples=StepSamples(cfg.run, cfg.train.seed, tokenizer, derived.run_dir, info.is_main, start_step),
        allocator=PromptAllocator.from_config(cfg.rollout, resumed_state.get("allocation")),
        auto=GroupSizeAuto.from_config(cfg, info.world_size, len(examples), auto_state),
    )
    if sampler.segments:  # a resumed run past a switch: the split of its first step
        apply_split(run, start_step)
    K = cfg.rollout.max_async_level  # > 0: a producer thread starts generating here (rollout/async_queue.py)
    pin = versioned(backend, cfg).pinned if K else None
    run.rollouts = make_rollouts(lambda t: generate_step(run, t), K, start_step, cfg.train.total_steps, pin)
    return run


def save_resolved_config(cfg: Config, derived: Derived, info: dist.DistInfo) -> None:
    """run_dir/config.yaml (what a resume checks against) and the resolved config on stdout, from rank 0."""
    if info.is_main:
        derived.run_dir.mkdir(parents=True, exist_ok=True)
        (derived.run_dir / "config.yaml").write_text(to_yaml(cfg))
        head = f"# resolved config (world size {info.world_size}, {derived.accum_steps} micro-batches/step)"
        print(head + "\n" + to_yaml(cfg), flush=True)


def past_version_dir(ckpt, version: int):
    """Where a checkpoint keeps past policy version `version`'s adapter (rollout.max_async_level > 0)."""
    path = ckpt / "policy_versions" / f"v{version}"
    if not path.is_dir():
        raise CheckpointError(
            f"{ckpt} has no {path.relative_to(ckpt)}: it was saved with a smaller rollout.max_async_level, so "
            "the batches the interrupted run queued cannot be regenerated; resume with that level"
        )
    return path


def publish(run: Run, step: int) -> None:
    """New weights into the rollout backend after step `step`: version step + 1 (a skipped update too, so
    that version n is always the policy after n steps, the number the async producer waits for)."""
    run.backend.sync_weights(run.model)
    run.rollouts.published(step + 1)


def rl_step(run: Run, step: int) -> dict[str, float]:
    """generate -> score -> learn -> publish -> metrics. Every number goes to the step's meter (base/meter.py)
    where it is measured; one reduction over ranks at the end."""
    timer, meter = PhaseTimer(), Meter()
    with timer("generate"):  # async: only the wait for the producer's batch
        batch = run.rollouts.get(step)
    meter.ready({**run.rollouts.metrics(), **version_metrics(step, batch.rollouts.policy_version)})
    if run.auto:  # the split the step generated (rollout.group_size_auto)
        meter.add("rollout/prompts_per_step", len(batch.indices))
        meter.mean("rollout/group_size", len(batch.rollouts), per=len(batch.indices))
    with timer("score"):
        scored = score_batch(run, batch)
    drawn = None  # dynamic sampling: what the step generated, refills included
    if run.cfg.rollout.dynamic_sampling:  # generation and scoring of the refill rounds, in their phases
        scored, drawn = refill_step(run, step, scored, meter, timer)
    if run.allocator is not None:  # per_prompt: the plan and the rest of the step's completions
        scored = allocate_step(run, step, scored, meter, timer)
    batch, scores = scored.batch, scored.scores
    rewards = shaped_rewards(run, meter, batch.rollouts, scored.rewards)
    with timer("train"):  # the engine's memory goes to the update; sync_weights wakes it
        learned = run.learner.learn(batch, rewards, step, meter, before_update=run.backend.sleep)
    with timer("sync"):
        # Also after a skipped update: the weights did not change, but the engine slept (level 2 discards
        # them on CUDA) and this sync is what restores them.
        publish(run, step)
    if run.probes.enabled and learned.ran:  # no perf/probe phase when off
        with timer("probe"):  # ESS reductions, quantile, gather and formatting: part of perf/step_s
            meter.ready(run.probes.metrics(step_work(batch, timer, run.kind.prefix_cache, drawn)))
            # Rank 0 only: the adapter is the same on every rank after the all-reduce, and the other ranks would
            # only wait for rank 0 at the next collective (lora/* are ready values: no reduction)
            if run.info.is_main and lora_health_due(run.cfg.probe.lora_health_every, step):
                meter.ready(run.probes.lora_health(run.model))
    meter.ready(run.backend.metrics())
    metrics = step_metrics(run, meter, step, batch, scores, learned, timer)
    if learned.ran:
        gaps = dict(zip(learned.rows, meter.kept.get("logp_gap", []), strict=True))
        run.samples(step + 1, batch, scores, learned.advantages, gaps, run.logger)
    return metrics


def step_metrics(
    run: Run, meter: Meter, step: int, batch: StepBatch, scores: Scores, learned: Learned, timer: PhaseTimer
) -> dict[str, float]:
    """The step's metrics: the step's own, the episodes', the weight guard's and the skip counters join what the
    phases metered, then the one reduction over ranks (collective). Call it after the step's last timed phase."""
    ro = batch.rollouts
    measure_step(meter, ro, scores, timer)
    if learned.ran:  # a step skipped for a non-finite reward trained on nothing: no episode or guard judgement
        measure_episodes(meter, ro, run.task)
        run.weights.measure(meter, step, ro.policy_version)  # reads the update's canary after the reduction
    meter.ready(run.skips.record(step + 1, learned.skipped))
    return meter.reduce(run.info.device)


def maybe_eval(run: Run, step: int) -> dict[str, float]:
    """eval/* metrics of the held-out set at `step` (completed steps) when due, else {}. Collective."""
    if run.evaluator is None or not run.evaluator.due(step):
        return {}
    return run.evaluator(run.backend, step)


def checkpoint(run: Run, step: int) -> None:
    epoch, offset = run.sampler.position(step)
    past = past_versions(step, run.cfg.rollout.max_async_level)
    run.logger.sync()  # durable first: the checkpoint must never cover a step metrics.jsonl could lose
    path = save_checkpoint(
        run.derived.run_dir,
        step,
        run.model,
        run.optimizer,
        run.scheduler,
        to_yaml(run.cfg),
        {
            "data_epoch": epoch,
            "data_offset": offset,
            "probes": run.probes.state_dict(),
            "skips": run.skips.state_dict(),
            "weight_guard": run.weights.state_dict(),
            "drift": run.drift.state_dict(),
            "forecast": run.forecast.state_dict(),
            "best": run.best.state_dict(),
            "allocation": run.allocator.state_dict() if run.allocator else None,
            "group_size_auto": run.auto.state_dict(run.sampler.segments) if run.auto else None,
        },
        run.cfg.ckpt.keep_last,
        # async: the adapters the queued batches sampled, which a resume must serve again
        {f"policy_versions/v{v}": p for v, p in versioned(run.backend, run.cfg).version_dirs(past).items()}
        if past
        else None,
        best=run.best.protected,
    )
    if path is not None:  # rank 0
        run.syncer.submit(path)


def report_alerts(run: Run, metrics: dict[str, float], step: int) -> None:
    """Print a probe alert on rank 0 when it switches on (not every step it stays on). A step that did not
    compute an alert (LoRA health runs every probe.lora_health_every steps) leaves its state as it was."""
    for key, text in ALERT_TEXT.items():
        if key not in metrics:
            continue
        value = metrics[key]
        if value and not run.alerts.get(key):
            dist.print0(f"[step {step}] probe alert {key}={value:g}: {text}")
        run.alerts[key] = value
    report_advice(run, metrics, step)


def report_advice(run: Run, metrics: dict[str, float], step: int) -> None:
    """The rollout-budget advisor's advice (probe.advisor) in the log on rank 0: when it is first trusted, and
    again whenever the recommended K* moves by 1 or more since it was last printed (docs/probes.md 10)."""
    k_star = metrics.get("probe/advisor/k_star")
    if k_star is None or not metrics.get("probe/advisor/trusted") or not math.isfinite(k_star):
        return
    if run.advised_k_star is None or abs(k_star - run.advised_k_star) >= 1:
        dist.print0(f"[step {step}] {advice_line({'step': step, **metrics})}")
        run.advised_k_star = k_star


def train(run: Run, stop: StopOnSignal) -> int:
    """Train up to train.total_steps; returns the exit status (STOPPED_EXIT_CODE after a stop signal)."""
    total = run.cfg.train.total_steps
    if run.start_step >= total:
        dist.print0(f"nothing to do: at step {run.start_step} of train.total_steps={total}")
        return 0
    enabled = run.info.is_main and run.cfg.run.progress_bar
    bar = make_progress(total, run.start_step, enabled, run.cfg.run.progress_every_s)  # lines in a log file
    every, saved = run.cfg.ckpt.every, run.start_step
    for step in range(run.start_step, total):
        if stop.agreed(run.info.device):  # all ranks, so that none stops alone inside a collective
            if step > saved:
                checkpoint(run, step)
            bar.close()
            saved_at = f"checkpoint at step {step} of {total}" if step else "no step trained yet, nothing saved"
            dist.print0(
                f"stop: {stop.name} received; {saved_at}, exiting with status {STOPPED_EXIT_CODE} "
                "(continue with ckpt.resume=latest)"
            )
            return STOPPED_EXIT_CODE
        metrics = {**rl_step(run, step), **maybe_eval(run, step + 1)}
        metrics |= run.drift.observe(step + 1, metrics) | run.forecast.observe(step + 1, metrics)
        if run.auto:
            run.auto.observe(metrics)
        run.logger.log(step + 1, {**metrics, **run.syncer.metrics()})
        faults.point("loop.after_log")
        run.skips.check(step + 1, f"the checkpoint at step {saved}" if saved else "no checkpoint was written")
        if run.weights.tripped():  # checkpoint first: the trained weights are not what is wrong
            if saved != step + 1:
                checkpoint(run, step + 1)
                saved = step + 1
            raise run.weights.error(step + 1, f"checkpoint at step {saved} saved")
        if run.drift.tripped():
            if saved != step + 1:
                checkpoint(run, step + 1)
                saved = step + 1
            raise run.drift.error(f"checkpoint at step {saved} saved")
        report_alerts(run, metrics, step + 1)
        kl = {"kl": metrics["train/kl"]} if "train/kl" in metrics else {}  # measured every loss.kl_log_every steps
        bar.update(step + 1, metrics["perf/step_s"], reward=metrics["rollout/reward_mean"], **kl)
        improved = run.best.observe(step + 1, metrics)  # agreed: eval and step metrics are the same on every rank
        if (every and (step + 1) % every == 0) or step + 1 == total or improved:
            if run.auto and step + 1 < total:  # before the save: the checkpoint holds the split it chose
                switch_split(run, step + 1)
            checkpoint(run, step + 1)
            saved = step + 1
    bar.close()
    return 0


def rl(cfg: Config, info: dist.DistInfo) -> int:
    with StopOnSignal(cfg.run.stop_signal) as stop:  # before setup: a signal during a long setup still counts
        run = setup(cfg, info)
        try:
            try:
                status = train(run, stop)
                # The last uploads and the final pass over the kept checkpoints, in TensorBoard too. After a
                # stop signal the wait is shorter: SLURM's margin also holds the step and the checkpoint before it.
                run.logger.summary(run.syncer.drain(run.derived.run_dir, stopped=status == STOPPED_EXIT_CODE))
            finally:
                run.logger.close()
                run.syncer.finish(run.derived.run_dir)  # also after a crash; bounded by sync.final_timeout_s
            # Ranks leave together: torchrun stops a node's other workers as soon as one exits non-zero, which
            # must not cut rank 0's final upload short. Before backend.close(): vLLM's engine shutdown destroys
            # the default process group, after which this barrier would silently do nothing.
            dist.barrier()
        finally:
            run.rollouts.close()
            run.backend.close()
            run.task.close()
    return status


def main(argv=None) -> int:
    tie_to_launcher()  # under torchrun: die with the agent, never train on as an orphan
    # never a silent CPU run on a GPU node (require_working_cuda), then the run directory's lock, before any write
    return run_cli(__doc__, locked(rl, "training run", before=require_working_cuda), argv)


if __name__ == "__main__":
    sys.exit(main())

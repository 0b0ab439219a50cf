"""The config schema: one typed tree for every runner, each field with its default, a one-line doc and its
bounds (`_f`: rl_training/config/fields.py; checked at load by rl_training/config/load.py; the generation
sections live in rl_training/config/generation.py), and the values derived from it (per-rank batch,
accumulation steps) with their divisibility checks. Resolution after load: rl_training/config/resolve.py;
the generated reference of every key: docs/config.md (rl_training/config/reference.py).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rl_training.config.fields import ConfigError, _f
from rl_training.config.generation import MultiTurnCfg, RewardCfg, RolloutCfg, SandboxCfg, SearchCfg, ServerCfg, VllmCfg


@dataclass
class WandbCfg:
    project: str = _f("", "Weights & Biases project; '' = no W&B (an optional extra: requirements-extras.txt).")
    entity: str = _f("", "W&B entity (team or user); '' = the account's default.")
    group: str = _f("", "W&B run group (e.g. one per sweep); '' = none.")
    tags: list[str] = _f([], "W&B tags.")
    mode: Literal["online", "offline"] = _f(
        "online", "offline on nodes without internet: written to run_dir/wandb/, uploaded later with `wandb sync`."
    )


@dataclass
class RunCfg:
    output_dir: str = _f("runs", "Parent directory of run directories.")
    name: str = _f("default", "Run name; the run directory is output_dir/name.")
    tensorboard: bool = _f(True, "Write TensorBoard event files under run_dir/tb.")
    progress_bar: bool = _f(
        True, "Show progress on rank 0: a tqdm bar on a terminal, else one line every progress_every_s seconds."
    )
    progress_every_s: float = _f(30.0, "Without a terminal (SLURM logs): seconds between progress lines.", gt=0)
    samples_per_step: int = _f(
        4, "Whole rollouts kept per logged step, drawn from all ranks, in run_dir/samples/ and TensorBoard.", ge=0
    )
    samples_every: int = _f(1, "Keep samples every N steps.", ge=1)
    samples_max_mb: float = _f(50.0, "Size bound of run_dir/samples/ (the oldest files are deleted).", gt=0)
    wandb: WandbCfg = field(default_factory=WandbCfg)
    dist_timeout_s: float = _f(
        1800.0,
        "How long a collective (NCCL on GPU, gloo on CPU) waits for the other ranks before the run fails; more "
        "than sync.final_timeout_s, which the final barrier may wait for rank 0's uploads.",
        gt=0,
    )
    stop_signal: Literal["SIGUSR1", "SIGUSR2", "SIGTERM", "none"] = _f(
        "SIGUSR1",
        "On this signal every rank checkpoints at the next step and exits with status 75 (SLURM's time-limit "
        "warning: --signal=B:USR1@N); none = keep the signal's default action.",
    )
    lock: bool = _f(
        True,
        "Lock the run directory (run_dir/LOCK) so that a second run there fails at once; false only where the file "
        "system cannot lock (docs/reliability.md), and then never start two runs on one directory.",
    )


@dataclass
class ModelCfg:
    name_or_path: str = _f("models/tiny-qwen2", "HF hub id or local path of the base causal LM.")
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32",
        "Weights and compute dtype (trainer and vLLM engine). float16 is for evals only: the RL and SFT "
        "runners refuse it (no fp16 gradient scaler).",
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = _f(
        "sdpa", "Attention kernel used by the trainer's forward passes."
    )
    trust_remote_code: bool = _f(False, "Allow custom model code from the model directory.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")


@dataclass
class LoraCfg:
    r: int = _f(16, "LoRA rank.", ge=1)
    alpha: float = _f(32.0, "LoRA alpha (scaling = alpha / r).", gt=0)
    dropout: float = _f(
        0.0,
        "LoRA dropout. Used by LoRA SFT only: the RL trainer runs the model in eval mode (old and new "
        "log-probs exactly comparable), where dropout does nothing.",
        ge=0,
        le=1,
    )
    target_modules: list[str] = _f(["all-linear"], "Module names to adapt; ['all-linear'] = every linear.")


@dataclass
class TaskCfg:
    """The task (rl_training/tasks, docs/extending.md): one object serves training, SFT, evals and synthesize."""

    name: str = _f(
        "reverse",
        "A built-in task, a family's member 'FAMILY/MEMBER' (docs/extending.md, docs/verifiers.md), or your own: "
        "'path/to/file.py:NAME' or 'package.module:NAME', NAME a Task/Environment subclass, instance or factory. "
        "(data.format, the old key, is read as task.name.)",
    )
    args: dict[str, Any] = _f({}, "Keyword arguments the task is built with (a mapping; task.args.KEY=value).")


@dataclass
class DataCfg:
    train: str = _f(
        "task:train",
        "Training prompts: a .jsonl/.json/.parquet path, a `datasets` name 'name[:config]@split', or 'task:SPLIT', a "
        "split the task makes itself (Task.examples: reverse's generated strings, reasoning-gym's problems, a "
        "verifiers taskset's tasks; a task that reads files makes none and needs them named here).",
    )
    eval: str = _f("task:heldout", "Held-out prompts, same forms as `train` (default: the task's own held-out split).")
    question_key: str = _f("question", "Record field of the question (the built-in math, reverse and search tasks).")
    answer_key: str = _f("answer", "Record field of the reference answer or solution (the same tasks).")
    prompt_template: str = _f(
        "",
        "Prompt text; '{question}' is replaced by the question. '' = the task's own format (Task.prompt_template: "
        "'{question}' for every built-in task but the reverse demo's '{question}=').",
    )
    system_prompt: str = _f("", "System message, used only with the chat template.")
    use_chat_template: Literal["auto", True, False] = _f(
        "auto",
        "Render prompts with the tokenizer's chat template: auto = when the tokenizer has one (an instruct model's "
        "own format), true = always (an error without one), false = plain text.",
    )
    max_prompt_tokens: int = _f(256, "Prompts longer than this are an error.", ge=1)


@dataclass
class TrainCfg:
    total_steps: int = _f(100, "RL steps (rollout batches) to train; resume trains up to this.", ge=1)
    seed: int = _f(0, "Base seed; rank r uses seed + r for sampling.", ge=0)
    micro_batch_groups: int = _f(4, "Prompt groups per micro-batch per rank (groups are never split).", ge=1)
    inner_epochs: int = _f(1, "Optimizer steps over each rollout batch (PPO-style reuse).", ge=1)
    drop_zero_adv_groups: Literal["auto", True, False] = _f(
        "auto",
        "Skip forward/backward for groups whose advantages are all 0 (the same gradient, less compute; "
        "train/skipped_token_frac counts it); auto = on when loss.kl_coef = 0, the only case where the gradient "
        "is provably unchanged; true is refused with loss.kl_coef > 0, whose gradient those groups still carry.",
    )
    max_consecutive_skips: int = _f(
        3, "Stop the run after this many optimizer steps in a row skipped for a non-finite reward/loss/grad.", ge=1
    )
    pack_sequences: bool = _f(
        False,
        "Run the model on each micro-batch's sequences packed end to end without padding (position ids, "
        "block-diagonal attention; rl_training/train/packing.py); same log-probs, loss and gradient as padded.",
    )
    pack_row_tokens: int = _f(
        0,
        "Width of a packed row in tokens; 0 = the micro-batch's longest sequence (bin packing, for sdpa/eager). "
        "flash_attention_2 always packs a micro-batch into one row (must be 0 there).",
        ge=0,
    )
    share_prompt: bool = _f(
        False,
        "Run each prompt group as one row, its prompt once and its completions after it behind a mask that keeps "
        "them apart (rl_training/train/shared_prompt.py): the padded rows' log-probs, and the prompt's tokens "
        "through the model once instead of group_size times. sdpa or eager; the probes' per-sequence steps "
        "(probe.advisor, every probe.unit_every) run padded.",
    )


@dataclass
class LossCfg:
    type: str = _f(
        "dr_grpo",
        "Policy-gradient objective: a built-in one (docs/objectives.md) or your own Objective, 'path/to/file.py:NAME' "
        "or 'package.module:NAME' (docs/extending.md).",
    )
    args: dict[str, Any] = _f({}, "Keyword arguments of a user objective's factory (a mapping).")
    clip_low: float | None = _f(
        None, "Ratio clip below, 1 - clip_low; unset = the objective's paper value.", ge=0, le=1
    )
    clip_high: float | None = _f(None, "Ratio clip above, 1 + clip_high; unset = the objective's paper value.", ge=0)
    kl_coef: float = _f(0.0, "Coefficient of the KL penalty to the adapter-disabled reference.", ge=0)
    overlong_filter: bool = _f(
        False,
        "DAPO's overlong filtering: responses cut by the token budget (rollout/truncation_rate) carry no loss term; "
        "their rewards still count in their group's advantages, and Dr-GRPO's normaliser stays the constant.",
    )
    kl_log_every: int = _f(
        10,
        "With kl_coef = 0 the reference forward only measures train/kl: run it on every this many steps (the "
        "first included), train/kl logged on those steps only; 0 = never. With kl_coef > 0 it runs every step.",
        ge=0,
    )
    kl_estimator: Literal["k1", "k3"] = _f(
        "k3",
        "Per-token KL penalty: k1 = log(pi/ref) with the gradient sg(w k1) grad log pi, w = pi/pi_old x the TIS "
        "weight (that of KL(pi||ref)); "
        "k3 = Schulman's k3 as is (on-policy, the gradient of KL(ref||pi)). docs/objectives.md.",
    )
    correction: str = _f(
        "none",
        "Off-policy correction of the sampler/trainer mismatch: none, a built-in one (tis: truncated IS; "
        "rl_training/algs/corrections.py, docs/objectives.md), or your own Correction, 'path/to/file.py:NAME'.",
    )
    correction_args: dict[str, Any] = _f(
        {}, "Keyword arguments of the correction: tis {cap}, token_mask / seq_geo_mask {low, high}, or your own's."
    )
    tis_cap: float = _f(
        0.0,
        "Shorthand for loss.correction=tis with correction_args {cap: tis_cap}: weight tokens by "
        "min(pi_train/pi_rollout, cap); 0 disables.",
        ge=0,
    )

    def correction_spec(self) -> tuple[str, dict[str, Any]]:
        """(loss.correction, its arguments) with the tis_cap shorthand read in; ConfigError when they disagree."""
        if self.tis_cap <= 0:
            return self.correction, dict(self.correction_args)
        if self.correction not in ("none", "tis"):
            raise ConfigError(
                f"loss.tis_cap={self.tis_cap} with loss.correction={self.correction}: tis_cap is the tis correction's "
                "cap; set one of them"
            )
        cap = self.correction_args.get("cap", self.tis_cap) if self.correction == "tis" else self.tis_cap
        if cap != self.tis_cap:
            raise ConfigError(f"loss.tis_cap={self.tis_cap} and loss.correction_args.cap={cap} disagree; set one")
        return "tis", {**self.correction_args, "cap": self.tis_cap}


@dataclass
class ProbeCfg:
    enabled: bool = _f(True, "Run the gradient-noise-scale and effective-sample-size probes every step.")
    gns_levels: list[Literal["unit", "micro", "rank"]] = _f(
        ["micro", "rank"],
        "GNS small-gradient levels: micro, rank (nearly free), unit (exact per prompt group, costs about one "
        "more LoRA weight-gradient pass); unidentifiable levels (one micro-batch, one rank) are dropped.",
    )
    unit_every: int = _f(
        4,
        "The unit level measures on every this many steps only (its per-group norms cost about one more LoRA "
        "weight-gradient pass); its EMA skips the other steps. micro and rank measure every step.",
        ge=1,
    )
    gns_ema_beta: float = _f(
        0.95, "EMA factor for the GNS numerator and denominator (window ~ (1+b)/(1-b)).", ge=0, le=0.9999
    )
    step_time_fixed_s: float = _f(
        0.0,
        "t_f of the step-time model t_f + t_u*B (per-step overhead: sync, generation tail, optimizer), from "
        "`scripts/bench.py --batches 8,16`; with step_time_per_group_s it enables probe/gns/b_star. 0 = unknown.",
        ge=0,
    )
    step_time_per_group_s: float = _f(0.0, "t_u: marginal step time per prompt group (see step_time_fixed_s).", ge=0)
    advisor: bool = _f(
        False,
        "The rollout-budget advisor (docs/probes.md 9-10): between/within-prompt gradient noise (probe/anova/*) and "
        "the recommended completions per prompt K* and prompts per step B* (probe/advisor/*), logged every "
        "probe.unit_every steps; adds the unit level to probe.gns_levels (its capture is what it reads).",
    )
    lora_health_every: int = _f(
        10,
        "LoRA health (lora/*: singular values of every adapter update, stable ranks, the rank-collapse alert; "
        "docs/probes.md 8) after every this many steps, on rank 0 (needs probe.enabled); 0 = off.",
        ge=0,
    )
    forecast_from: int = _f(
        50,
        "From this step on, each in-loop eval (eval.every) also forecasts the run's final held-out reward: a "
        "saturating curve of eval/reward_mean against completions generated, at the planned total, with an 80% "
        "bootstrap band (probe/forecast/*, docs/probes.md 11); 0 = off.",
        ge=0,
    )


@dataclass
class OptimCfg:
    lr: float = _f(1e-4, "Peak learning rate (AdamW).", gt=0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0)
    beta1: float = _f(0.9, "AdamW beta1.", ge=0, le=1)
    beta2: float = _f(0.999, "AdamW beta2.", ge=0, le=1)
    eps: float = _f(1e-8, "AdamW epsilon.", gt=0)
    warmup_steps: int = _f(0, "Linear warmup, in optimizer steps.", ge=0)
    schedule: Literal["constant", "cosine", "linear"] = _f("constant", "LR schedule after warmup.")
    max_grad_norm: float = _f(1.0, "Clip the global grad norm to this (0 disables clipping).", ge=0)


@dataclass
class CkptCfg:
    every: int = _f(50, "Save a checkpoint every N steps (and at the end); 0 = only at the end.", ge=0)
    keep_last: int = _f(3, "Checkpoints to keep (older ones are deleted after a successful save).", ge=1)
    resume: str = _f("none", "'none', 'latest' (newest complete checkpoint of this run) or a path.")
    keep_best: str = _f(
        "auto",
        "Save a checkpoint whenever this metric improves and never prune it (checkpoints/best names it): "
        "'<metric>[:max|:min]' (e.g. eval/pass@4, rollout/reward_mean:max), 'none', or 'auto' = eval/accuracy:max "
        "when eval.every > 0, else none.",
    )


@dataclass
class SyncCfg:
    # No field can carry a credential: the remote is a bare name (its keys live in RCLONE_CONFIG_<NAME>_*
    # environment variables) and check_sync_target rejects rclone's inline ':backend,key=value:' syntax.
    remote: str = _f(
        "",
        "rclone remote for checkpoint uploads, configured by RCLONE_CONFIG_<NAME>_* environment variables; "
        "'' = $RL_SYNC_REMOTE, and no uploads when both are empty.",
    )
    bucket: str = _f("", "Bucket (or top directory) on the remote; '' = $RL_SYNC_BUCKET.")
    path: str = _f("", "Prefix in the bucket; '' = $RL_SYNC_PATH. Uploads go to remote:bucket/path/<run.name>/.")
    retries: int = _f(3, "Retries of a failed upload (after the first attempt).", ge=0)
    backoff_s: float = _f(5.0, "Wait before the first retry; it doubles with every further retry.", ge=0)
    final_timeout_s: float = _f(
        300.0,
        "At the end of a run, wait at most this long for pending uploads; then they are abandoned (logged).",
        gt=0,
    )
    stop_timeout_s: float = _f(
        120.0,
        "After a stop signal, wait at most this long instead (if shorter): SLURM's --signal margin must also "
        "hold a step and a checkpoint.",
        gt=0,
    )


@dataclass
class EvalCfg:
    every: int = _f(0, "In-loop held-out eval (data.eval) every N steps and at the last step; 0 = off.", ge=0)
    num_prompts: int = _f(64, "Held-out prompts scored by the demo / in-loop eval (0 = all).", ge=0)
    max_new_tokens: int = _f(32, "Generation limit at eval.", ge=1)
    num_samples: int = _f(
        8, "Sampled completions per problem for pass@k / maj@k (n >= every k; 0 = greedy only).", ge=0
    )
    ks: list[int] = _f([1, 4, 8], "k values of pass@k and maj@k (each 1 <= k <= num_samples).")
    temperature: float = _f(1.0, "Sampling temperature of the pass@k / maj@k samples.", gt=0)
    top_p: float = _f(1.0, "Nucleus sampling mass of the eval samples.", gt=0, le=1)
    seed: int = _f(
        1234, "Eval sampling seed (problem i uses seed + i): every checkpoint draws with the same seeds.", ge=0
    )
    drift_accuracy_drop: float = _f(
        0.1,
        "Length-drift guard (train/drift_guard.py): an in-loop eval drifts when eval/accuracy is this far below the "
        "best eval so far and eval/truncation_rate is drift_truncation_rise above the lowest rate of the evals so far.",
        ge=0,
        le=1,
    )
    drift_truncation_rise: float = _f(
        0.2, "See drift_accuracy_drop: the rise of the greedy truncation rate.", ge=0, le=1
    )
    drift_stop_evals: int = _f(
        2,
        "Checkpoint and stop the run (exit status 65) after this many drifting in-loop evals in a row "
        "(eval/alert/length_drift); 0 = only the alert.",
        ge=0,
    )


@dataclass
class SftCfg:
    steps: int = _f(200, "SFT optimizer steps.", ge=1)
    batch_size: int = _f(32, "Prompt/answer pairs per step, summed over ranks.", ge=1)
    lr: float = _f(
        1e-3,
        "SFT peak learning rate (AdamW with optim's betas, eps, weight decay and clipping; warmup, then sft.schedule).",
        gt=0,
    )
    warmup_steps: int = _f(10, "SFT linear warmup steps.", ge=0)
    schedule: Literal["constant", "cosine", "linear"] = _f("cosine", "SFT LR schedule after warmup.")
    full_finetune: bool = _f(True, "Train all weights (True) or a LoRA adapter that is merged at the end.")
    max_examples: int = _f(0, "Use only the first N training pairs (0 = all).", ge=0)
    eval_every: int = _f(
        0,
        "Held-out check every N steps and at the last: greedy eval of eval.num_prompts of data.eval (episodes for "
        "an environment), logged as eval/* and written to run_dir/eval/inloop; 0 = none.",
        ge=0,
    )
    stop_when: list[str] = _f(
        [],
        "Gate a learned skill: stop at the first check (sft.eval_every) that meets every condition, a check metric "
        "against a number ('accuracy>=0.75', 'tool_errors_mean<=0'), and write final_model. When sft.steps end "
        "first, final_model is still written, run_dir/sft_result.json says not passed and the run exits with "
        "status 65. [] = train all sft.steps. The schedule spans sft.steps.",
    )
    gold_episodes: str = _f(
        "", "Multi-turn gold episodes jsonl (scripts/make_search_data.py): train on them, observations masked."
    )
    overwrite: bool = _f(
        False, "Replace an existing run_dir/final_model (and its metrics.jsonl); false = refuse to start."
    )


@dataclass
class Config:
    run: RunCfg = field(default_factory=RunCfg)
    model: ModelCfg = field(default_factory=ModelCfg)
    lora: LoraCfg = field(default_factory=LoraCfg)
    task: TaskCfg = field(default_factory=TaskCfg)
    data: DataCfg = field(default_factory=DataCfg)
    reward: RewardCfg = field(default_factory=RewardCfg)
    sandbox: SandboxCfg = field(default_factory=SandboxCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    vllm: VllmCfg = field(default_factory=VllmCfg)
    server: ServerCfg = field(default_factory=ServerCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    loss: LossCfg = field(default_factory=LossCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    probe: ProbeCfg = field(default_factory=ProbeCfg)
    ckpt: CkptCfg = field(default_factory=CkptCfg)
    sync: SyncCfg = field(default_factory=SyncCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    sft: SftCfg = field(default_factory=SftCfg)
    search: SearchCfg = field(default_factory=SearchCfg)
    multiturn: MultiTurnCfg = field(default_factory=MultiTurnCfg)


@dataclass(frozen=True)
class Derived:
    """Values computed once from the config and the world size."""

    world_size: int
    groups_per_rank: int  # prompt groups each rank generates and trains per step
    seqs_per_rank: int  # groups_per_rank * group_size
    accum_steps: int  # micro-batches per optimizer step on each rank
    micro_batch_seqs: int  # sequences per micro-batch
    run_dir: Path


def derive(cfg: Config, world_size: int) -> Derived:
    r, t = cfg.rollout, cfg.train
    if r.prompts_per_step % world_size:
        raise ConfigError(
            f"rollout.prompts_per_step={r.prompts_per_step} is not divisible by the world "
            f"size {world_size}: every rank must train the same number of prompt groups"
        )
    groups = r.prompts_per_step // world_size
    if groups % t.micro_batch_groups:
        raise ConfigError(
            f"prompt groups per rank ({groups} = rollout.prompts_per_step / world size) is not "
            f"divisible by train.micro_batch_groups={t.micro_batch_groups}"
        )
    out = Derived(world_size, 0, 0, 0, 0, Path(cfg.run.output_dir) / cfg.run.name)
    return with_split(out, r.prompts_per_step, r.group_size, t.micro_batch_groups)


def with_split(d: Derived, prompts_per_step: int, group_size: int, micro_batch_groups: int) -> Derived:
    """`d` for a step of `prompts_per_step` prompts of `group_size` completions (rollout.group_size_auto changes
    the split during a run; the caller keeps prompts_per_step a multiple of world size x micro_batch_groups)."""
    groups = prompts_per_step // d.world_size
    return dataclasses.replace(
        d,
        groups_per_rank=groups,
        seqs_per_rank=groups * group_size,
        accum_steps=groups // micro_batch_groups,
        micro_batch_seqs=micro_batch_groups * group_size,
    )


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        tp = _field_types(cls)[f.name]
        out += all_keys(tp, f"{prefix}{f.name}.") if dataclasses.is_dataclass(tp) else [prefix + f.name]
    return out


def get_key(cfg: Config, key: str) -> Any:
    """The value of a dotted key such as 'model.name_or_path'."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)

"""Supervised warm start on prompt/answer pairs, with the RL runner's config system.

    torchrun --nproc_per_node=1 rl_training/runners/sft_runner.py --cfg cfg/tiny_sft.yaml [key=value ...]
    python -m rl_training.runners.sft_runner --cfg cfg/tiny_sft.yaml sft.steps=100

Trains all weights (sft.full_finetune=true) or a LoRA adapter (merged into the weights at the end) on
prompt -> answer-field text + EOS, with the loss on answer tokens only, prompts rendered by the same
template as RL. Writes run_dir/final_model/ (a plain HF model + tokenizer, written atomically): point the
RL runner's model.name_or_path at it to start RL from the SFT checkpoint. A run directory that already has
a final_model is refused unless sft.overwrite=true.

A learned skill is gated, not hoped for: with sft.eval_every=N the runner checks the greedy held-out accuracy
(evaluation/evaluate.py's in-loop eval on data.eval: a task's prompts, an environment's episodes) every N steps,
and with sft.stop_when (e.g. ['accuracy>=0.75']) it stops at the first check that meets every condition. When
sft.steps end first, final_model is
still written, run_dir/sft_result.json says `"passed": false` and the run exits with status 65, so a script can
try another data order (scripts/demo_tools.py does) instead of building on a warm start that did not learn.

A full fine-tune with model.dtype=bfloat16 trains fp32 weights under bf16 autocast and saves bf16: AdamW
on bf16 weights rounds away every update below half the weight's bf16 spacing (2^-9 to 2^-8 of its magnitude).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
from contextlib import nullcontext

import numpy as np
import torch

from rl_training.base import dist
from rl_training.base.exit_codes import UNLEARNED_EXIT_CODE
from rl_training.config.load import to_yaml
from rl_training.config.resolve import resolve
from rl_training.config.schema import ConfigError, OptimCfg
from rl_training.data.gold import encode_gold_episodes
from rl_training.data.prompts import encode_prompts
from rl_training.data.sources import load_examples
from rl_training.evaluation.evaluate import InLoopEval
from rl_training.metrics.logger import MetricsLogger
from rl_training.metrics.step import peak_memory
from rl_training.policy.models import DTYPES, apply_lora, load_base_model, load_tokenizer, trainable_parameters
from rl_training.rollout.episodes import with_episodes
from rl_training.rollout.hf import HFBackend
from rl_training.runtime.cli import run_cli
from rl_training.runtime.lifeline import tie_to_launcher
from rl_training.runtime.lock import locked
from rl_training.runtime.platform_check import require_working_cuda
from rl_training.runtime.seeding import seed_all, set_cpu_threads
from rl_training.tasks.base import Environment
from rl_training.tasks.build import build_task, task_context
from rl_training.train.batches import takes_logits_to_keep
from rl_training.train.optimizer import build_optimizer
from rl_training.train.step_guard import SkipGuard, nonfinite_agreed


def encode_pairs(examples, data_cfg, tokenizer, task) -> list[tuple[list[int], list[int]]]:
    """(prompt + answer + EOS token ids, loss mask: 1 on the answer and EOS) per example; the prompt rendered by
    the task, as in RL."""
    prompts = encode_prompts(examples, data_cfg, tokenizer, task)
    out = []
    for p, ex in zip(prompts, examples, strict=True):
        answer = [*tokenizer(ex.solution, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        out.append((p + answer, [0] * len(p) + [1] * len(answer)))
    return out


def collate(pairs, pad_id: int, device):
    """`pairs`: (token ids, loss mask) per sequence; labels are -100 wherever the mask is 0."""
    width = max(len(s) for s, _ in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (seq, mask) in enumerate(pairs):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        m = torch.tensor(mask, dtype=torch.bool)
        labels[i, : len(seq)] = torch.where(m, ids[i, : len(seq)], -100)
    return ids.to(device), attn.to(device), labels.to(device)


TRIM_HEAD_VOCAB = 4096  # answer_loss trims the LM head from this vocabulary size on


def answer_loss(model, ids: torch.Tensor, attn: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled tokens (transformers' causal-LM loss), with the LM head run
    only from the earliest labelled position's predecessor on (logits_to_keep): prompt positions carry no loss,
    and with a 49k vocabulary their logits were most of a short answer's step (train/batches.py forward_logits).
    Below TRIM_HEAD_VOCAB tokens the head costs little and the model's own loss runs, on the full logits: that keeps
    the tiny model's warm starts bit for bit, which the search demo's stage 1 depends on (docs/search.md)."""
    if model.config.get_text_config().vocab_size < TRIM_HEAD_VOCAB:
        return model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss
    labelled = (labels != -100).any(0).nonzero()
    first = max(1, int(labelled[0])) if len(labelled) else 1  # the earliest labelled token; token 0 has no predecessor
    keep = {"logits_to_keep": ids.shape[1] - first + 1} if takes_logits_to_keep(model) else {}
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False, **keep).logits
    logits = logits[:, :-1] if keep else logits[:, first - 1 : -1]
    targets = labels[:, first:]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def save_final_model(model, tokenizer, out_dir, merge: bool, dtype: torch.dtype) -> None:
    tmp = out_dir.parent / f".tmp_{out_dir.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (model.merge_and_unload() if merge else model).to(dtype).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def ignored_optim_keys(cfg) -> list[str]:
    """optim.lr, optim.warmup_steps and optim.schedule set away from their defaults: RL's, not SFT's (sft.*). A
    warning, not an error: one YAML may serve both runners, and a saved RL config sets every key."""
    defaults = OptimCfg()
    return [
        f"optim.{key}={getattr(cfg.optim, key)} (SFT uses sft.{key}={getattr(cfg.sft, key)})"
        for key in ("lr", "warmup_steps", "schedule")
        if getattr(cfg.optim, key) != getattr(defaults, key)
    ]


CONDITION = re.compile(r"^\s*([A-Za-z_][\w/@.]*)\s*(>=|<=)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


def parse_conditions(conditions: list[str]) -> list[tuple[str, str, float]]:
    """sft.stop_when's conditions as (metric, '>=' or '<=', number); a malformed one is a ConfigError."""
    out = []
    for c in conditions:
        m = CONDITION.match(c) if isinstance(c, str) else None
        if m is None:
            raise ConfigError(f"sft.stop_when: {c!r} is not METRIC>=NUMBER or METRIC<=NUMBER (e.g. 'accuracy>=0.75')")
        out.append((m[1], m[2], float(m[3])))
    return out


def met(conditions: list[tuple[str, str, float]], metrics: dict[str, float]) -> bool:
    """Whether a check's metrics (eval/* names without the prefix) meet every condition; a metric the check does
    not have is a ConfigError naming those it has."""
    for name, op, bar in conditions:
        if name not in metrics:
            raise ConfigError(f"sft.stop_when names {name!r}, which the check does not measure: {', '.join(metrics)}")
        if not (metrics[name] >= bar if op == ">=" else metrics[name] <= bar):
            return False
    return True


class SkillGate:
    """The held-out check of sft.eval_every / sft.stop_when (module docstring): greedy only (eval.num_samples
    is RL's), on the model being trained, through the HF backend and, for an environment, the episode engine RL
    uses. Collective, as InLoopEval: every rank checks its block of the problems and gets the same metrics."""

    def __init__(self, cfg, model, tokenizer, info, run_dir, task, autocast):
        if not cfg.data.eval:
            raise ConfigError("sft.eval_every needs data.eval (the held-out problems the check scores)")
        greedy = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, num_samples=0, ks=[]))
        self.evaluator = InLoopEval(greedy, tokenizer, info, run_dir, task)
        self.backend = with_episodes(cfg, HFBackend(model, tokenizer), tokenizer, task)
        self.model, self.autocast = model, autocast
        self.conditions = parse_conditions(cfg.sft.stop_when)
        self.every, self.last = cfg.sft.eval_every, cfg.sft.steps
        self.passed_at: tuple[int, dict] | None = None  # (step, metrics) of the first check that met the conditions

    def __call__(self, step: int) -> dict[str, float]:
        """The check's metrics at a due step ({} otherwise); records the first pass."""
        if step % self.every and step != self.last:
            return {}
        self.model.eval()
        with self.autocast:
            metrics = self.evaluator(self.backend, step)
        self.model.train()
        plain = {k.removeprefix("eval/"): v for k, v in metrics.items() if k.startswith("eval/")}
        if self.conditions and self.passed_at is None and met(self.conditions, plain):
            self.passed_at = (step, plain)
        return metrics

    def result(self, step: int) -> dict:
        """run_dir/sft_result.json's gate entry."""
        when = [f"{n}{op}{bar:g}" for n, op, bar in self.conditions]
        out = {"when": when, "every": self.every, "passed": self.passed_at is not None, "steps_run": step}
        if self.passed_at:
            out["passed_at"], out["metrics"] = self.passed_at
        return out


def sft(cfg, info) -> int:
    ignored = ignored_optim_keys(cfg)
    if ignored and info.is_main:
        print(f"warning: SFT does not use {', '.join(ignored)}", flush=True)
    resolved = resolve(cfg, info.world_size, backend=False)  # the saved config means the same from anywhere
    cfg, d = resolved.cfg, resolved.derived
    s = cfg.sft
    parse_conditions(s.stop_when)  # a malformed condition is one line before anything loads
    if s.stop_when and not s.eval_every:
        raise ConfigError(f"sft.stop_when={s.stop_when} needs sft.eval_every > 0 (the checks it stops at)")
    if s.batch_size % info.world_size:
        raise ConfigError(f"sft.batch_size={s.batch_size} is not divisible by the world size {info.world_size}")
    # Like the RL runner's fresh start, never replace a finished result implicitly.
    if (d.run_dir / "final_model").exists() and not s.overwrite:
        raise ConfigError(
            f"{d.run_dir} already has a final_model; pass sft.overwrite=true to replace it (and its "
            "metrics.jsonl), or choose another run.name (nothing was changed)"
        )
    task = build_task(cfg)  # its prompt rendering and record parsing; a user's file fails here, before the model
    set_cpu_threads()
    seed_all(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
    # the data before the model: a bad record or episode is one line without the wait
    examples = load_examples(cfg.data.train, task.parse, limit=s.max_examples)
    pairs = encode_pairs(examples, cfg.data, tokenizer, task)
    if s.gold_episodes:  # multi-turn: the gold episodes replace the prompt/answer pairs
        limits = cfg.multiturn if isinstance(task, Environment) else None  # what RL's episodes can hold
        pairs = encode_gold_episodes(s.gold_episodes, cfg.data, tokenizer, task, s.max_examples, limits)
    # Low-precision full fine-tunes keep fp32 master weights and compute under autocast (module docstring).
    # LoRA needs neither: peft keeps the adapter in fp32 over a bf16 base (autocast_adapter_dtype).
    mixed = s.full_finetune and cfg.model.dtype != "float32"
    model = load_base_model(dataclasses.replace(cfg.model, dtype="float32") if mixed else cfg.model, info.device)
    if not s.full_finetune:
        model = apply_lora(model, cfg.lora)
    autocast = torch.autocast(info.device.type, dtype=DTYPES[cfg.model.dtype]) if mixed else nullcontext()
    gate = SkillGate(cfg, model, tokenizer, info, d.run_dir, task, autocast) if s.eval_every else None
    if info.is_main:
        d.run_dir.mkdir(parents=True, exist_ok=True)
        (d.run_dir / "config.yaml").write_text(to_yaml(cfg))
    logger = MetricsLogger(d.run_dir, info.is_main, cfg.run.tensorboard)
    if gate is not None:
        task.start(task_context(info, tokenizer, cfg))  # a tool's workers, a retriever: what the episodes need
    try:
        steps_run = train_steps(cfg, info, model, tokenizer, pairs, autocast, logger, gate)
    finally:
        if gate is not None:
            task.close()
    logger.close()
    result = {"steps": steps_run} | ({"gate": gate.result(steps_run)} if gate is not None else {})
    if info.is_main:
        save_final_model(model, tokenizer, d.run_dir / "final_model", not s.full_finetune, DTYPES[cfg.model.dtype])
        (d.run_dir / "sft_result.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {d.run_dir / 'final_model'} after {steps_run} steps", flush=True)
    dist.barrier()
    if s.stop_when and not result["gate"]["passed"]:
        if info.is_main:
            print(
                f"error: no held-out check met sft.stop_when={s.stop_when} in {s.steps} steps "
                f"(every check is in {d.run_dir / 'eval' / 'inloop'}; final_model was written)",
                file=sys.stderr,
                flush=True,
            )
        return UNLEARNED_EXIT_CODE
    return 0


def train_steps(cfg, info, model, tokenizer, pairs, autocast, logger, gate: SkillGate | None) -> int:
    """The SFT loop; the steps it ran (fewer than sft.steps when the skill gate passed)."""
    s = cfg.sft
    params = trainable_parameters(model)
    # SFT's own lr, warm-up and schedule; AdamW's betas, eps, weight decay and clipping from the optim section
    sft_optim = dataclasses.replace(cfg.optim, lr=s.lr, warmup_steps=s.warmup_steps, schedule=s.schedule)
    optimizer, scheduler = build_optimizer(params, sft_optim, s.steps)
    rng = np.random.default_rng(cfg.train.seed)  # same stream on every rank: ranks take disjoint slices
    per_rank = s.batch_size // info.world_size
    model.train()
    skips = SkipGuard(cfg.train.max_consecutive_skips)
    for step in range(1, s.steps + 1):
        batch = rng.choice(len(pairs), size=s.batch_size, replace=len(pairs) < s.batch_size)
        mine = batch[info.rank * per_rank : (info.rank + 1) * per_rank]
        ids, attn, labels = collate([pairs[i] for i in mine], tokenizer.pad_token_id, info.device)
        with autocast:
            loss = answer_loss(model, ids, attn, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dist.average_gradients_(params)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm or float("inf"))
        lr = scheduler.get_last_lr()[0]
        skipped = nonfinite_agreed({"loss": loss.item(), "grad_norm": norm.item()}, info.device)
        if not skipped:  # a non-finite step reaches neither the weights nor AdamW nor the schedule
            optimizer.step()
            scheduler.step()
        mean_loss = dist.reduce_sums({"loss": loss.item()}, info.device)["loss"] / info.world_size
        checked = gate(step) if gate is not None else {}
        logger.log(
            step,
            {
                "sft/loss": mean_loss,
                "sft/grad_norm": norm.item(),
                "sft/lr": lr,
                **peak_memory(),
                **skips.record(step, skipped),
                **checked,
            },
        )
        skips.check(step, "nothing was saved (SFT writes final_model at the end)")
        if info.is_main and (step % 50 == 0 or step == s.steps or checked):
            shown = f", held-out accuracy {checked['eval/accuracy']:.3f}" if checked else ""
            print(f"sft step {step}/{s.steps} loss {mean_loss:.4f}{shown}", flush=True)
        if gate is not None and gate.passed_at is not None:
            break
    return step


def main(argv=None) -> int:
    tie_to_launcher()  # under torchrun: die with the agent, never train on as an orphan
    # never a silent CPU run on a GPU node (require_working_cuda), then the run directory's lock, before any write
    return run_cli(__doc__, locked(sft, "SFT run", before=require_working_cuda), argv)


if __name__ == "__main__":
    sys.exit(main())

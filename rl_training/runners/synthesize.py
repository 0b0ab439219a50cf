"""Rejection-sampled SFT data (STaR / RFT): sample k completions per problem, keep the ones the task's grader
verifies, dedupe, and write SFT jsonl that `sft_runner.py` reads as it is.

    python -m rl_training.synthesize --cfg cfg/tiny_cpu.yaml --out data/synth/reverse.jsonl --k 8
    python -m rl_training.synthesize --cfg cfg/qwen2.5_1.5b_gsm8k.yaml --out data/synth/gsm8k.jsonl --k 16 \\
        --checkpoint runs/qwen/checkpoints/step_000200 --max-problems 2000 rollout.temperature=0.8

The policy is the config's model (model.name_or_path), or that model with a checkpoint's LoRA adapter;
problems come from data.train (or --dataset), read by the config's task (task.name); sampling uses
rollout.backend (vLLM by default), rollout.temperature / top_p and --max-new-tokens (default
rollout.max_new_tokens); a multi-turn task samples whole episodes with its environment and resources, as
training does. The grader is the one training and evals use (the task's), and "verified" means what accuracy
counts as correct.

Writes OUT (one record per kept completion, `data.sources.synthesized_row`: the problem's Example, answer = the
completion's sampled text; for a multi-turn task also `segments`, the episode as gold-episode segments for
sft.gold_episodes), which every command reads back as those Examples without the task's parse, and
OUT.stats.jsonl (per problem: samples, verified, kept after dedupe, pass rate), and prints the pass-rate
summary and the SFT command: the same config, task and task.args, by absolute paths, runnable from any
directory. Output is written whole or not at all (temp file + rename).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from rl_training.base import dist
from rl_training.ckpt.store import CheckpointError
from rl_training.config.load import load_config
from rl_training.config.resolve import absolute_path, resolve
from rl_training.config.schema import Config, ConfigError
from rl_training.data.prompts import dedupe_questions, encode_prompts
from rl_training.data.sources import Example, load_examples, synthesized_row
from rl_training.rollout.base import Rollouts, SamplingSpec
from rl_training.rollout.factory import build_rollout
from rl_training.rollout.kinds import check_backend
from rl_training.runtime.cli import exit_status_of
from rl_training.tasks.base import Environment, score_completions
from rl_training.tasks.build import build_task, task_context


def canonical(text: str) -> str:
    """Dedupe key: the completion with runs of whitespace collapsed (the same answer, differently spaced)."""
    return " ".join(text.split())


def select(
    examples: Sequence[Example],
    texts: Sequence[str],
    correct: Sequence[bool],
    k: int,
    segments: Sequence[list[dict]] | None = None,
) -> tuple[list[dict], list[dict]]:
    """(kept records, per-problem stats) for problems[i] with samples texts[i*k:(i+1)*k] (and, multi-turn, their
    gold-episode segments)."""
    kept, stats = [], []
    for i, ex in enumerate(examples):
        seen: set[str] = set()
        n_ok = 0
        for j in range(i * k, (i + 1) * k):
            if not correct[j]:
                continue
            n_ok += 1
            key = canonical(texts[j])
            if not key or key in seen:
                continue
            seen.add(key)
            rec = synthesized_row(ex, texts[j])
            kept.append(rec | ({"segments": segments[j]} if segments is not None else {}))
        stats.append(
            {"source": ex.source, "question": ex.question, "samples": k, "verified": n_ok, "kept": len(seen)}
            | {"pass_rate": n_ok / k}
        )
    return kept, stats


def summary(stats: Sequence[dict]) -> str:
    n = len(stats)
    solved = sum(s["verified"] > 0 for s in stats)
    mean = sum(s["pass_rate"] for s in stats) / max(n, 1)
    bins = [0, 0, 0, 0, 0]  # pass rate 0, (0, .25], (.25, .5], (.5, 1), 1
    for s in stats:
        p = s["pass_rate"]
        bins[0 if p == 0 else 4 if p == 1 else 1 if p <= 0.25 else 2 if p <= 0.5 else 3] += 1
    return (
        f"{n} problems: {solved} with >= 1 verified sample ({solved / max(n, 1):.1%}), mean pass rate {mean:.3f}, "
        f"{sum(s['kept'] for s in stats)} records kept; pass rate 0: {bins[0]}, (0,0.25]: {bins[1]}, "
        f"(0.25,0.5]: {bins[2]}, (0.5,1): {bins[3]}, 1: {bins[4]}"
    )


def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, path)


def load_policy(cfg, checkpoint: Path | None, device):
    """The config's model with a fresh LoRA (B = 0: exactly the base model), or with a checkpoint's adapter."""
    from rl_training.policy.models import build_policy, load_base_model, load_tokenizer

    if checkpoint is None:
        return build_policy(cfg, device)
    from peft import PeftModel

    adapter = checkpoint / "adapter"
    if not (adapter / "adapter_config.json").exists():
        raise CheckpointError(f"{checkpoint}: no adapter/adapter_config.json (not a checkpoint directory?)")
    tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
    return tokenizer, PeftModel.from_pretrained(load_base_model(cfg.model, device), str(adapter))


def synthesize(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    cfg = load_config(a.cfg, a.overrides, training=False)
    cfg = resolve(cfg).cfg
    check_backend(cfg, training=False)  # the backend's rules, before any model loads
    info = dist.init_distributed()
    if info.world_size > 1:
        raise ConfigError("synthesize runs as one process (python -m rl_training.synthesize), not under torchrun")
    task = build_task(cfg)  # before the model: a user's task file fails here
    source = a.dataset or cfg.data.train
    examples, dupes = dedupe_questions(load_examples(source, task.parse), task.problem_key)
    examples = examples[: a.max_problems] if a.max_problems else examples
    tokenizer, model = load_policy(cfg, a.checkpoint, info.device)
    model.eval()
    prompts = encode_prompts(examples, cfg.data, tokenizer, task)
    task.start(task_context(info, tokenizer, cfg))  # the training run's sandbox pool or retriever
    multi_turn = isinstance(task, Environment)
    max_new = a.max_new_tokens or cfg.rollout.max_new_tokens
    texts: list[str] = []
    correct: list[bool] = []
    segments: list[list[dict]] = []
    t0 = time.perf_counter()
    bar = tqdm(total=len(prompts), desc="synthesize", unit="problem", mininterval=0.1 if sys.stderr.isatty() else 30)
    backend = None
    try:
        backend = build_rollout(cfg, model, tokenizer, info, task)
        if a.checkpoint is not None:
            backend.sync_weights(model)
        for lo in range(0, len(prompts), a.chunk):
            spec = SamplingSpec(a.k, max_new, cfg.rollout.temperature, cfg.rollout.top_p, seed=a.seed + lo)
            batch = examples[lo : lo + a.chunk]
            ro = backend.generate(prompts[lo : lo + a.chunk], spec, examples=batch)
            exs = [ex for ex in batch for _ in range(a.k)]
            scores = score_completions(task, ro.texts, exs, cfg.reward.timeout_s)
            texts += ro.texts
            correct += scores.correct
            if multi_turn:
                segments += [episode_segments(ro, i, tokenizer) for i in range(len(ro))]
            bar.update(len(ro.texts) // a.k)
    finally:
        bar.close()
        if backend is not None:
            backend.close()
        task.close()
    kept, stats = select(examples, texts, correct, a.k, segments if multi_turn else None)
    _write_jsonl(a.out, kept)
    _write_jsonl(a.out.with_name(a.out.name + ".stats.jsonl"), stats)
    print(
        f"synthesize: {summary(stats)} in {time.perf_counter() - t0:.1f} s"
        + (f"; {dupes} repeated problems" if dupes else "")
    )
    print(f"wrote {a.out} and {a.out.name}.stats.jsonl; SFT on it:")
    print(f"  {sft_command(a, cfg, source, multi_turn)}")
    return 0


# What sft_command sets itself; the user's other overrides (prompt settings, say) are carried as typed.
SFT_KEYS = ("model.name_or_path", "task.", "data.format", "data.train", "sft.gold_episodes", "run.name")


def sft_command(a: argparse.Namespace, cfg: Config, source: str, multi_turn: bool) -> str:
    """The SFT command on OUT, as a shell line that runs from any directory: the config, the data, the model
    and the task file by absolute path, task.args as resolved (the config's and the command line's), the
    user's other overrides as given, and a run of its own (OUT's stem + '_sft', beside the RL runs)."""
    out = os.path.abspath(a.out)
    data = [f"sft.gold_episodes={out}", f"data.train={absolute_path(source)}"] if multi_turn else [f"data.train={out}"]
    words = [
        *("python", "-m", "rl_training.runners.sft_runner", "--cfg", os.path.abspath(a.cfg)),
        *(ov for ov in a.overrides if not ov.split("=", 1)[0].startswith(SFT_KEYS)),
        f"model.name_or_path={cfg.model.name_or_path}",
        f"task.name={cfg.task.name}",
        *(f"task.args.{k}={override_text(v)}" for k, v in cfg.task.args.items()),
        *data,
        f"run.name={a.out.stem}_sft",
    ]
    return shlex.join(words)


def override_text(value) -> str:
    """`value` as the text of a key=value override that reads back as `value` (overrides are YAML): a string
    that YAML reads unchanged as itself, else JSON (a subset of YAML: "it's 1: ok" stays a string, "true" too)."""
    if isinstance(value, str):
        try:
            if yaml.safe_load(value) == value:
                return value
        except yaml.YAMLError:
            pass
    return json.dumps(value, ensure_ascii=False)


def episode_segments(ro: Rollouts, i: int, tokenizer) -> list[dict]:
    """Episode i as gold-episode segments (data/gold.py): runs of sampled (trainable) and observation tokens."""
    ids, mask = ro.completion_ids[i], ro.loss_mask[i]
    out: list[dict] = []
    start = 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or mask[j] != mask[start]:
            text = tokenizer.decode(ids[start:j], skip_special_tokens=True)
            out.append({"text": text, "trainable": bool(mask[start])})
            start = j
    return out


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m rl_training.synthesize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--cfg", required=True, help="YAML config: model, data, rollout settings")
    ap.add_argument("--out", required=True, type=Path, help="output SFT jsonl")
    ap.add_argument("--k", type=int, default=8, help="samples per problem (default 8)")
    ap.add_argument("--checkpoint", type=Path, help="a checkpoint directory (RUN/checkpoints/step_N) to sample from")
    ap.add_argument("--dataset", help="problems (default data.train): jsonl/json/parquet or datasets spec")
    ap.add_argument("--max-problems", type=int, default=0, help="use only the first N problems (0 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="generation limit (default rollout.max_new_tokens)")
    ap.add_argument("--chunk", type=int, default=64, help="problems per generate call (default 64)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.temperature=0.8")
    a = ap.parse_args(argv)
    for name in ("k", "chunk"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    return exit_status_of(lambda: synthesize(a))


if __name__ == "__main__":
    sys.exit(main())

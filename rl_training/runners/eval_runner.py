"""Evaluate a run's checkpoints, and the step-0 base model, on a held-out set: accuracy, pass@k, maj@k, plots.

    python -m evals.run --run-dir runs/tiny_cpu                         # every checkpoint + step 0
    python -m evals.run --run-dir runs/tiny_cpu --steps 50,100 --backend hf --k 1,4,8 --n 8
    python -m evals.run --run-dir runs/qwen --dataset data/gsm8k/test.jsonl --task gsm8k
    python -m evals.run --run-dir runs/qwen --dataset HuggingFaceH4/MATH-500@test --task math \\
        --question-key problem --answer-key answer data.max_prompt_tokens=1024
    python -m evals.run --run-dir runs/tiny_cpu vllm.kv_cache_gb=0.1   # key=value: any config key but model/lora

Each checkpoint's base model, adapter shape and prompt template come from its own saved config.yaml, which
must name its model. The policy most of the selected checkpoints share is evaluated (a tie: the earliest
checkpoint's); a checkpoint whose config disagrees with it is reported and skipped (evaluate it alone with
--steps N --no-base --name OTHER), and step 0 is that policy's base model. The policy and the
rollout engine are built once; each checkpoint's adapter is loaded into the same peft model and, with
vLLM, pushed into the live engine (`sync_weights`), so there is no rebuild per checkpoint. Step 0 is the
same model with every LoRA B matrix zeroed: the adapter's delta is exactly 0, i.e. the base model.

Beside accuracy, each result counts the completions the grader failed on (grader_errors, grader_timeouts,
grader_invalid: each scored 0), in the table, the JSON, summary.csv and TensorBoard.
Results go to RUN/eval/NAME/ (NAME: --name, default from the dataset): step_NNNNNN.json (metrics, timing,
problems/s, backend, dtype, settings), step_NNNNNN.problems.jsonl (every completion with its grade),
summary.csv (one row per step), plots/*.png (each metric against step, overview.png), and TensorBoard scalars
eval/NAME/<metric> in the run's own log RUN/tb (its own event file, events.out.tfevents.0000000000.eval_NAME),
next to the training curves and the in-loop eval's eval/<metric>. Re-runs (what is evaluated again, --redo)
and broken checkpoints (skipped, exit status 3): docs/evaluation.md, "Re-runs and broken checkpoints".
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from rl_training.base import dist
from rl_training.ckpt.marker import COMPLETE, STEP_RE, step_name
from rl_training.ckpt.store import ADAPTER_FILE, ADAPTER_KEYS, CheckpointError, list_checkpoints, load_adapter
from rl_training.config.load import load_config
from rl_training.config.resolve import resolve
from rl_training.config.schema import Config, ConfigError, get_key
from rl_training.evaluation.evaluate import (
    GRADER_METRICS,
    EvalSettings,
    GradingCounts,
    evaluate_policy,
    load_eval_set,
    write_step_result,
)
from rl_training.evaluation.pass_at_k import metric_names, summarize
from rl_training.evaluation.report import best_step, load_results, write_plots, write_summary_csv, write_tensorboard
from rl_training.policy.models import load_tokenizer
from rl_training.rollout.kinds import KINDS, check_backend
from rl_training.runtime.cli import exit_status_of
from rl_training.runtime.lock import RunLock
from rl_training.runtime.platform_check import require_working_cuda
from rl_training.tasks.build import BUILTIN, build_task, task_context

EXIT_SKIPPED = 3
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
# What must be the same for every checkpoint of one call: the policy being built and how it is prompted.
IDENTITY = [
    "model.name_or_path",
    "model.dtype",
    "model.trust_remote_code",
    *ADAPTER_KEYS,
    "data.prompt_template",
    "data.system_prompt",
    "data.use_chat_template",
    "data.eval",
    "task.name",
    "task.args",
    "data.question_key",
    "data.answer_key",
]


@dataclass
class Target:
    step: int
    path: Path | None  # None: the step-0 base model
    cfg: Config | None = None
    fingerprint: str = ""  # of the weights (weights_fingerprint), saved with the result


def cli_overrides(a: argparse.Namespace) -> list[str]:
    """The flags as config overrides (validated like any key=value), then the user's key=value list."""
    for ov in a.overrides:
        if ov.startswith(("model.name_or_path=", "lora.")):
            raise ConfigError(f"override '{ov}': the base model and adapter come from each checkpoint's config.yaml")
    flags = {
        "data.eval": a.dataset,
        "task.name": a.task,
        "data.question_key": a.question_key,
        "data.answer_key": a.answer_key,
        "eval.num_prompts": a.limit,
        "rollout.backend": a.backend,
        "eval.ks": None if a.k is None else f"[{a.k}]",
        "eval.num_samples": a.n,
        "eval.temperature": a.temperature,
        "eval.top_p": a.top_p,
        "eval.max_new_tokens": a.max_new_tokens,
        "eval.seed": a.seed,
    }
    # The saved config may name a resume path that is meaningless here.
    return ["ckpt.resume=none", *(f"{k}={v}" for k, v in flags.items() if v is not None), *a.overrides]


def select_targets(run_dir: Path, steps: str, base: bool) -> tuple[list[Target], list[str]]:
    """(targets, skip reports). 'all' = every checkpoint directory, complete or not (incomplete ones are
    reported); a list names steps, and a step without a directory is reported."""
    root = run_dir / "checkpoints"
    found = {}
    if root.is_dir():
        found = {int(m.group(1)): p for p in root.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir()}
    if steps == "all":
        wanted = sorted(found)
    else:
        try:
            wanted = sorted({int(s) for s in steps.split(",") if s.strip()})
        except ValueError:
            raise ConfigError(f"--steps {steps!r}: expected 'all' or comma-separated step numbers") from None
    targets = [Target(0, None)] if base or 0 in wanted else []
    skipped = []
    for s in wanted:
        if s == 0:
            continue
        if s in found:
            targets.append(Target(s, found[s]))
        else:
            skipped.append(f"{root / step_name(s)}: no such checkpoint")
    return targets, skipped


def checkpoint_config(path: Path, overrides: list[str]) -> Config:
    """The checkpoint's own config with the call's overrides; CheckpointError when it is not usable."""
    if not (path / COMPLETE).exists():
        raise CheckpointError(f"{path}: incomplete checkpoint (no {COMPLETE} marker)")
    for name in ("config.yaml", ADAPTER_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: missing {name}")
    try:
        # An empty or truncated config.yaml would otherwise load as the defaults: another base model.
        cfg = load_config(path / "config.yaml", overrides, required=["model.name_or_path"], training=False)
    except ConfigError as e:
        raise CheckpointError(f"{path}: unusable config.yaml ({e})") from None
    # Configs saved before runners wrote absolute paths name them relative to the training directory: read
    # from here, as they always were, so that they compare equal to newer checkpoints' absolute ones.
    return resolve(cfg, backend=False).cfg


def base_config(run_dir: Path, overrides: list[str]) -> Config:
    """When no selected checkpoint is usable (e.g. --steps 0): the policy most complete checkpoints share."""
    cfgs = []
    for _, path in list_checkpoints(run_dir):
        try:
            cfgs.append(checkpoint_config(path, overrides))
        except CheckpointError:
            continue
    if not cfgs:
        raise CheckpointError(f"{run_dir / 'checkpoints'}: no usable checkpoint (the base model comes from one)")
    return majority_policy(cfgs)


def majority_policy(cfgs: list[Config]) -> Config:
    """The config whose IDENTITY values most of `cfgs` (in step order) share; a tie goes to the earliest."""
    policy = [tuple(repr(get_key(c, k)) for k in IDENTITY) for c in cfgs]
    counts = Counter(policy)
    return cfgs[max(range(len(cfgs)), key=lambda i: (counts[policy[i]], -i))]


def policy_mismatch(cfg: Config, chosen: Config) -> str | None:
    """The first IDENTITY key on which `cfg` differs from the chosen policy's, as 'key=value, not value'."""
    for key in IDENTITY:
        if get_key(cfg, key) != get_key(chosen, key):
            return f"{key}={get_key(cfg, key)!r}, not {get_key(chosen, key)!r}"
    return None


def weights_fingerprint(t: Target, cfg: Config) -> str:
    """What names the weights a result was made with: the adapter file's sha256, or the step-0 base model."""
    if t.path is None:
        return f"base:{cfg.model.name_or_path}"
    h = hashlib.sha256()
    with (t.path / ADAPTER_FILE).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return f"sha256:{h.hexdigest()}"


def zero_adapter(model) -> None:
    """Step 0: every LoRA B is 0, so each adapted layer adds exactly 0 to the base layer's output."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.zero_()


def dataset_tag(spec: str) -> str:
    p = Path(spec)
    name = f"{p.parent.name}_{p.stem}" if p.suffix in (".jsonl", ".json", ".parquet") else spec.split("/")[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "eval"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="the run directory (holds checkpoints/)")
    ap.add_argument("--steps", default="all", help="'all' or a list such as 100,200 (step 0 is always added)")
    ap.add_argument("--no-base", action="store_true", help="do not evaluate the step-0 base model")
    ap.add_argument("--dataset", help="jsonl/json/parquet path or `datasets` name[:config]@split (default data.eval)")
    ap.add_argument(
        "--task",
        "--format",
        dest="task",
        help=f"the task of --dataset: {', '.join(BUILTIN)} or path/file.py:NAME (default: the run's task.name)",
    )
    ap.add_argument("--question-key", help="record field of the question (default data.question_key)")
    ap.add_argument("--answer-key", help="record field of the answer; math takes it as-is when it has no \\boxed")
    ap.add_argument("--limit", type=int, default=0, help="first N problems only (0 = all)")
    ap.add_argument(
        "--backend",
        help=f"auto, {', '.join(KINDS)} or a user backend 'file.py:NAME' (default: the run's rollout.backend)",
    )
    ap.add_argument("--k", help='pass@k / maj@k values, e.g. 1,4,8; "" with --n 0: greedy only (default eval.ks)')
    ap.add_argument("--n", type=int, help="samples per problem, >= every k (default eval.num_samples)")
    ap.add_argument("--temperature", type=float, help="sampling temperature (default eval.temperature)")
    ap.add_argument("--top-p", type=float, help="default eval.top_p")
    ap.add_argument("--max-new-tokens", type=int, help="default eval.max_new_tokens")
    ap.add_argument("--seed", type=int, help="sampling seed (default eval.seed)")
    ap.add_argument("--name", help="results directory RUN/eval/NAME (default: from the dataset)")
    ap.add_argument("--redo", action="store_true", help="re-evaluate steps that already have results")
    ap.add_argument("--chunk", type=int, default=64, help="problems per generate call (progress granularity)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. vllm.kv_cache_gb=0.1)")
    return ap.parse_args(argv)


def evaluate_run(a: argparse.Namespace) -> int:
    run_dir = Path(a.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: no such run directory")
    if a.name is not None and not _NAME.fullmatch(a.name):  # a path here would let the TB rebuild escape tb/
        raise ConfigError(f"--name {a.name!r}: use letters, digits, '.', '_' and '-' (it names RUN/eval/NAME)")
    if a.name is not None:
        check_name_free(a.name)
    require_working_cuda()  # never a silent CPU run on a GPU node
    info = dist.init_distributed()
    if info.world_size > 1:
        raise ConfigError("evals.run runs in one process: launch it with python, not torchrun")
    overrides = cli_overrides(a)
    load_config(None, overrides, training=False)  # bad flags or overrides fail here, once, not as N skipped checkpoints
    usable, skipped, cfg = usable_targets(run_dir, a.steps, not a.no_base, overrides)
    task = build_task(cfg)  # the run's own task (or --task): its parsing, prompts, grader and resources
    tokenizer = load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code)
    examples, prompts = load_eval_set(cfg, tokenizer, task)
    es = EvalSettings.from_config(cfg)
    settings = eval_settings(cfg, es, len(examples))
    name = a.name or dataset_tag(cfg.data.eval)
    check_name_free(name)
    out_dir = run_dir / "eval" / name
    done, other = load_results(out_dir, settings)
    if other and not a.redo:
        raise ConfigError(
            f"{out_dir} has results made with other settings (steps {other[:5]}); pass --redo to re-evaluate "
            "the selected steps with these settings, or --name to write elsewhere"
        )
    done_weights = {r["step"]: r["weights_fingerprint"] for r in done}
    todo = []
    for t in usable:
        t.fingerprint = weights_fingerprint(t, cfg)
        saved = out_dir / f"{step_name(t.step)}.json"
        if a.redo or t.step not in done_weights:
            todo.append(t)
        elif done_weights[t.step] != t.fingerprint:
            print(f"{step_name(t.step)}: the weights differ from those of {saved} (rewritten since?); evaluating again")
            todo.append(t)
        else:
            print(f"{step_name(t.step)}: already evaluated ({saved}); --redo to redo")
    n_skipped = len(skipped)
    if todo:
        task.start(task_context(info, tokenizer, cfg))  # a code task's sandbox pool, a search task's retriever
        try:
            n_skipped += run_evals(
                cfg, todo, tokenizer, task, examples, prompts, es, settings, run_dir, name, info, a.chunk
            )
        finally:
            task.close()
    results, other = load_results(out_dir, settings)
    if other:
        print(f"summary ignores steps {other}: evaluated with other settings")
    if results:
        report(results, es, settings, out_dir, f"{run_dir.name}: {name}", run_dir / "checkpoints" / "best")
        if cfg.run.tensorboard:
            write_tensorboard(results, run_dir / "tb", name)
    return EXIT_SKIPPED if n_skipped else 0


def eval_lock(a: argparse.Namespace) -> RunLock | nullcontext:
    """The lock on RUN/eval/ (nothing to lock when --run-dir is not a directory: evaluate_run says so)."""
    if not Path(a.run_dir).is_dir():
        return nullcontext()
    enabled = load_config(None, cli_overrides(a), training=False).run.lock
    return RunLock(Path(a.run_dir) / "eval", "evals.run", enabled)


def check_name_free(name: str) -> None:
    """RUN/eval/inloop belongs to the in-loop eval (evaluation.evaluate.InLoopEval): evals.run must not mix into it."""
    if name == "inloop":
        raise ConfigError("--name 'inloop' is the in-loop eval's folder RUN/eval/inloop; pass another --name")


def usable_targets(run_dir: Path, steps: str, base: bool, overrides: list[str]):
    """(targets to evaluate, skip reports, the config the policy is built from); prints the skips."""
    targets, skipped = select_targets(run_dir, steps, base)
    usable = []
    for t in targets:
        try:
            if t.path is not None:
                t.cfg = checkpoint_config(t.path, overrides)
            usable.append(t)
        except CheckpointError as e:
            skipped.append(str(e))
    with_cfg = [t for t in usable if t.cfg is not None]
    cfg = majority_policy([t.cfg for t in with_cfg]) if with_cfg else base_config(run_dir, overrides)
    for t in with_cfg:
        mismatch = policy_mismatch(t.cfg, cfg)
        if mismatch:
            usable.remove(t)
            skipped.append(
                f"{t.path}: config.yaml has another policy than most checkpoints ({mismatch}); evaluate it "
                f"alone: --steps {t.step} --no-base --name OTHER"
            )
    for msg in skipped:
        print(f"skip: {msg}", file=sys.stderr, flush=True)
    cfg = resolve(cfg).cfg
    check_backend(cfg, training=False)  # the backend's rules, before any model loads
    for t in usable:
        t.cfg = t.cfg or cfg
    return usable, skipped, cfg


def eval_settings(cfg: Config, es: EvalSettings, num_problems: int) -> dict:
    """Everything besides the weights that decides the numbers; saved with each result, compared on re-runs."""
    d = cfg.data
    return {
        "dataset": d.eval,
        "format": cfg.task.name,
        **({"task_args": dict(cfg.task.args)} if cfg.task.args else {}),
        "question_key": d.question_key,
        "answer_key": d.answer_key,
        "num_problems": num_problems,
        **dataclasses.asdict(es),
        "ks": list(es.ks),
        "backend": cfg.rollout.backend,
        "base_model": cfg.model.name_or_path,
        "dtype": cfg.model.dtype,
        "prompt_template": d.prompt_template,
        "use_chat_template": d.use_chat_template,
        "system_prompt": d.system_prompt,
    }


def run_evals(cfg, todo, tokenizer, task, examples, prompts, es, settings, run_dir, name, info, chunk) -> int:
    """Build the policy and engine once, evaluate each target in turn; returns how many failed to load."""
    from tqdm import tqdm

    from rl_training.policy.models import build_policy
    from rl_training.rollout.factory import build_rollout
    from rl_training.runtime.seeding import seed_all, set_cpu_threads

    set_cpu_threads()
    seed_all(cfg.train.seed)
    t0 = time.perf_counter()
    _, model = build_policy(cfg, info.device)
    model.eval()
    backend = build_rollout(cfg, model, tokenizer, info, task)  # an Environment's episodes
    print(f"built the {backend.name} engine once for {len(todo)} evaluations in {time.perf_counter() - t0:.1f} s")
    out_dir = run_dir / "eval" / name
    bar = tqdm(
        total=len(todo) * len(examples),
        desc="eval",
        unit="problem",
        dynamic_ncols=True,
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    )
    failed = 0
    try:
        for t in todo:
            t_load = time.perf_counter()
            try:
                if t.path is None:
                    zero_adapter(model)
                else:
                    load_adapter(model, t.path)
            except CheckpointError as e:
                bar.write(f"skip: {e}", file=sys.stderr)
                bar.update(len(examples))
                failed += 1
                continue
            t_sync = time.perf_counter()
            backend.sync_weights(model)
            t_eval = time.perf_counter()
            grading = GradingCounts()
            records, timing = evaluate_policy(
                backend, prompts, examples, task, es, chunk=chunk, progress=bar.update, grading=grading
            )
            timing = {"load_s": t_sync - t_load, "sync_s": t_eval - t_sync, **timing}
            metrics = {**summarize(records, es.ks), **grading.metrics()}
            result = {
                "step": t.step,
                "checkpoint": None if t.path is None else str(t.path),
                "weights_fingerprint": t.fingerprint,
                "num_problems": len(records),
                "metrics": metrics,
                "timing": timing,
                "backend": backend.name,
                "dtype": cfg.model.dtype,
                "device": str(info.device),
                "settings": settings,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            write_step_result(out_dir, t.step, result, records)
            bar.write(f"{step_name(t.step)}: " + _one_line(metrics, timing))
    finally:
        bar.close()
        backend.close()
    return failed


def _one_line(m: dict, t: dict) -> str:
    keys = ["accuracy"] + [k for k in m if k.startswith(("pass@", "maj@"))] + ["format_rate", "truncation_rate"]
    failed = "  ".join(f"{k} {m[k]}" for k in GRADER_METRICS)
    return "  ".join(f"{k} {m[k]:.3f}" for k in keys) + f"  {failed}  ({t['problems_per_s']:.1f} problems/s)"


def _count(value) -> str:
    """A grader count in the table; '-' for a result written before evals.run counted them."""
    return "-" if value is None else str(value)


def report(results, es, settings, out_dir, title, run_best: Path | None = None) -> None:
    columns = [*metric_names(es.ks, es.num_samples > 0), *GRADER_METRICS]
    write_summary_csv(results, columns, out_dir / "summary.csv")
    subtitle = f"{title} | {settings['num_problems']} problems, n={es.num_samples}, T={es.temperature}"
    plots = write_plots(results, es.ks, out_dir / "plots", f"{subtitle}, {settings['backend']}")
    shown = ["accuracy"] + ([f"pass@{k}" for k in es.ks] + [f"maj@{k}" for k in es.ks] if es.num_samples else [])
    best = best_step(results)
    failed = [k.removeprefix("grader_") for k in GRADER_METRICS]  # completions the grader failed on
    print("\n" + f"{'step':>9}" + "".join(f"{k:>11}" for k in [*shown, *failed, "problems/s"]))
    for r in results:
        vals = "".join(f"{r['metrics'][k]:>11.3f}" for k in shown)
        counts = "".join(f"{_count(r['metrics'].get(k)):>11}" for k in GRADER_METRICS)
        mark = "*" if r["step"] == best else " "
        print(f"{r['step']:>8}{mark}{vals}{counts}{r['timing']['problems_per_s']:>11.3f}")
    if best is not None:
        top = next(r for r in results if r["step"] == best)["metrics"]["accuracy"]
        line = f"* best: step {best} (accuracy {top:.3f})"
        if run_best is not None and run_best.is_symlink():  # the training run's own pick (ckpt.keep_best)
            line += f"; the run's checkpoints/best is {run_best.resolve().name}"
        print(line)
    print(f"\nresults: {out_dir}/ (summary.csv, step_*.json, step_*.problems.jsonl); plots: {plots[-1]}")


def main(argv=None) -> int:
    a = parse_args(argv)

    def run() -> int:
        with eval_lock(a):  # one evals.run per run directory (a training run may write beside it)
            return evaluate_run(a)

    return exit_status_of(run)


if __name__ == "__main__":
    sys.exit(main())

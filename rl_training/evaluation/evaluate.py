"""Evaluate one policy on held-out problems: the code `python -m evals.run` and the runner's in-loop eval share.

For each problem: one greedy completion (accuracy, format, length, truncation) and `eval.num_samples`
sampled ones (pass@k, maj@k), all from the rollout backend, rendered with the training prompt template
(`encode_prompts`) and graded with the training grader (the run's task, `score_completions`).
The result is one record per problem (what the per-problem jsonl holds) and the timing; `evaluation.pass_at_k`
turns the records into metrics. The grader's failures (`GradingCounts`) are counted per grading call, beside them.

Seeding: problem i (its index in the whole dataset) is sampled with seed `eval.seed + i` (vLLM takes it per
request), and the torch RNG is seeded the same way for the HF backend inside `torch.random.fork_rng`, so
the caller's RNG stream (the training run's) is left exactly as it was. The same problem therefore draws
with the same seeds at every checkpoint; vLLM's draws do not depend on the batching, HF's do (one chunk's
seed drives all of its rows).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rl_training.base import dist
from rl_training.base.timer import PhaseTimer
from rl_training.ckpt.marker import step_name
from rl_training.data.prompts import encode_prompts
from rl_training.data.sources import Example, load_examples
from rl_training.evaluation.pass_at_k import summarize
from rl_training.rollout.base import RolloutBackend, Rollouts, SamplingSpec
from rl_training.tasks.base import Scores, Task, score_completions

GRADER_METRICS = ("grader_errors", "grader_timeouts", "grader_invalid")  # GradingCounts.metrics(), in order


@dataclass
class GradingCounts:
    """The eval's completions (greedy and sampled) the grader failed on, each scored 0 like a wrong answer. Counted
    per grading call, as score_completions counts them: a batch grader's failures belong to no one problem, so they
    sit beside the per-problem records, not in them."""

    errors: int = 0  # the grader raised
    timeouts: int = 0  # it ran past reward.timeout_s
    invalid: int = 0  # it returned no finite number

    def add(self, scores: Scores) -> None:
        self.errors += scores.errors
        self.timeouts += scores.timeouts
        self.invalid += scores.invalid

    def metrics(self) -> dict[str, int]:
        return dict(zip(GRADER_METRICS, (self.errors, self.timeouts, self.invalid), strict=True))


@dataclass(frozen=True)
class EvalSettings:
    """Everything that decides an eval's numbers besides the weights (saved with every result)."""

    max_new_tokens: int
    num_samples: int  # sampled completions per problem (0 = greedy only)
    ks: tuple[int, ...]
    temperature: float
    top_p: float
    seed: int
    timeout_s: float  # grader time limit per completion

    @classmethod
    def from_config(cls, cfg) -> EvalSettings:
        e = cfg.eval
        return cls(e.max_new_tokens, e.num_samples, tuple(e.ks), e.temperature, e.top_p, e.seed, cfg.reward.timeout_s)


def _completion_rows(ro: Rollouts, scores, lo: int, hi: int) -> list[dict]:
    return [
        {
            "text": ro.texts[j],
            "reward": scores.rewards[j],
            "correct": scores.correct[j],
            "formatted": scores.formatted[j],
            "length": len(ro.completion_ids[j]),
            "truncated": ro.truncated[j],
            # multi-turn episodes: turns and the environment's counts (the length above counts observation tokens)
            **(_episode_counts(ro.episodes[j]) if ro.episodes else {}),
        }
        for j in range(lo, hi)
    ]


def _episode_counts(summary: dict) -> dict:
    """An episode's turns and counts for its eval record (Episode.summary without the token bookkeeping)."""
    return {k: v for k, v in summary.items() if k not in ("obs_tokens", "obs_capped", "truncated")}


def evaluate_policy(
    backend: RolloutBackend,
    prompts: Sequence[list[int]],
    examples: Sequence[Example],
    task: Task,
    s: EvalSettings,
    first_index: int = 0,
    chunk: int = 0,
    progress: Callable[[int], None] | None = None,
    grading: GradingCounts | None = None,
) -> tuple[list[dict], dict[str, float]]:
    """(per-problem records, timing) for the backend's current weights.

    `first_index` is the dataset index of prompts[0] (seeds are per dataset index); `chunk` problems are
    generated per backend call (0 = all at once); `progress(n)` is called after each chunk; `grading`, when given,
    gets the grader's failures added.
    """
    grading = GradingCounts() if grading is None else grading
    records: list[dict] = []
    timer = PhaseTimer()
    gen_tokens = 0
    step = chunk or max(len(prompts), 1)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    for lo in range(0, len(prompts), step):
        batch, exs = list(prompts[lo : lo + step]), examples[lo : lo + step]
        seed = s.seed + first_index + lo
        with torch.random.fork_rng(devices=devices), timer("generate"):
            torch.manual_seed(seed)
            greedy_spec = SamplingSpec(n=1, max_new_tokens=s.max_new_tokens, greedy=True)
            greedy = backend.generate(batch, greedy_spec, examples=exs)
            sampled = None
            if s.num_samples:
                spec = SamplingSpec(s.num_samples, s.max_new_tokens, s.temperature, s.top_p, seed=seed)
                sampled = backend.generate(batch, spec, examples=exs)
        with timer("score"):
            g_scores = score_completions(task, greedy.texts, exs, s.timeout_s)
            grading.add(g_scores)
            if sampled is not None:
                n = s.num_samples
                s_scores = score_completions(task, sampled.texts, [ex for ex in exs for _ in range(n)], s.timeout_s)
                grading.add(s_scores)
        gen_tokens += sum(map(len, greedy.completion_ids)) + (sum(map(len, sampled.completion_ids)) if sampled else 0)
        for i, ex in enumerate(exs):
            samples = []
            if sampled is not None:
                samples = _completion_rows(sampled, s_scores, i * n, (i + 1) * n)
                with timer("score"):
                    classes = task.answer_classes([x["text"] for x in samples], s.timeout_s)
                for x, c in zip(samples, classes, strict=True):
                    x["answer_class"] = c
            records.append(
                {
                    "index": first_index + lo + i,
                    "source": ex.source,
                    "question": ex.question,
                    "reference": ex.reference,
                    "greedy": _completion_rows(greedy, g_scores, i, i + 1)[0],
                    "num_correct": sum(x["correct"] for x in samples),
                    "samples": samples,
                }
            )
        if progress is not None:
            progress(len(batch))
    seconds = sum(timer.seconds.values())
    timing = {
        "eval_s": seconds,
        "generate_s": timer.seconds.get("generate", 0.0),
        "score_s": timer.seconds.get("score", 0.0),
        "problems_per_s": len(records) / seconds if seconds else 0.0,
        "gen_tokens_per_s": gen_tokens / timer.seconds["generate"] if timer.seconds.get("generate") else 0.0,
    }
    return records, timing


# ------------------------------------------------------------------------------------------- result files
def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp_{path.name}")
    tmp.write_text(text)
    tmp.replace(path)


def load_eval_set(cfg, tokenizer, task: Task) -> tuple[list[Example], list[list[int]]]:
    """The held-out problems (the first eval.num_prompts of data.eval) and their prompt ids, rendered as in
    training (`encode_prompts`): what both evals.run and the in-loop eval score."""
    examples = load_examples(cfg.data.eval, task.parse, limit=cfg.eval.num_prompts)
    return examples, encode_prompts(examples, cfg.data, tokenizer, task)


def write_step_result(out_dir: Path, step: int, result: dict, records: Sequence[dict]) -> Path:
    """step_NNNNNN.problems.jsonl, then step_NNNNNN.json (written last: its presence means 'done')."""
    out_dir.mkdir(parents=True, exist_ok=True)
    problems = out_dir / f"{step_name(step)}.problems.jsonl"
    _atomic_write(problems, "".join(json.dumps(r) + "\n" for r in records))
    path = out_dir / f"{step_name(step)}.json"
    _atomic_write(path, json.dumps({**result, "problems_file": problems.name}, indent=2) + "\n")
    return path


def read_problems(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ in loop
class InLoopEval:
    """The held-out eval the RL runner calls every `eval.every` steps on its live policy and backend.

    Problems are the first `eval.num_prompts` of `data.eval`, split into contiguous per-rank blocks (the
    seeds follow the dataset index, so the numbers do not depend on the world size with vLLM); records are
    gathered, every rank computes the same metrics, rank 0 writes run_dir/eval/inloop/step_NNNNNN.{json,
    problems.jsonl}. Collective: every rank must call it.
    """

    def __init__(self, cfg, tokenizer, info: dist.DistInfo, run_dir: Path, task: Task):
        examples, prompts = load_eval_set(cfg, tokenizer, task)
        per_rank = -(-len(examples) // info.world_size)
        self.first = min(info.rank * per_rank, len(examples))
        self.examples = examples[self.first : self.first + per_rank]
        self.prompts = prompts[self.first : self.first + per_rank]
        self.settings = EvalSettings.from_config(cfg)
        self.task = task
        self.every, self.total = cfg.eval.every, cfg.train.total_steps
        self.info, self.out_dir = info, Path(run_dir) / "eval" / "inloop"
        self.meta = {"dataset": cfg.data.eval, "format": cfg.task.name, "num_problems": len(examples)}

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total

    def __call__(self, backend: RolloutBackend, step: int) -> dict[str, float]:
        grading = GradingCounts()
        records, timing = evaluate_policy(
            backend, self.prompts, self.examples, self.task, self.settings, self.first, grading=grading
        )
        records = [r for part in dist.all_gather_objects(records) for r in part]
        timing = dist.reduce_max(timing, self.info.device)  # the slowest rank sets the pace
        timing["problems_per_s"] = len(records) / timing["eval_s"] if timing["eval_s"] else 0.0
        failed = dist.reduce_sums(grading.metrics(), self.info.device)  # what evals.run reports, over all ranks
        metrics = {**summarize(records, self.settings.ks), **{k: int(v) for k, v in failed.items()}}
        if self.info.is_main:
            result = {"step": step, "metrics": metrics, "timing": timing, "backend": backend.name}
            result["settings"] = {**self.meta, **asdict(self.settings)}
            write_step_result(self.out_dir, step, result, records)
        perf = {"perf/eval_s": timing["eval_s"], "perf/eval_problems_per_s": timing["problems_per_s"]}
        return {**{f"eval/{k}": v for k, v in metrics.items()}, **perf}

"""Rollout samples: a few whole rollouts per step, kept where a researcher reads them first.

Each kept step, `samples.per_step` sequences are drawn from all ranks' groups by a generator seeded with (seed,
step), so a resumed run keeps the same ones; beside them each rank keeps the first episode of each kind its
environment ended (`failed_rows`: the episode's `error` says why). Each rank formats the chosen rows it holds and
rank 0 gathers them (one collective, every rank calls it), appends them to run_dir/samples/samples_NNNNNN.jsonl (a
new file when the current one passes `samples.file_mb`; the oldest files are deleted beyond `samples.max_mb`) and
writes them to TensorBoard as text. The monitor (`python -m rl_training.monitor`) prints the lowest-reward ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rl_training.base import dist
from rl_training.base.groups import Groups

FILE_PATTERN = "samples_{:06d}.jsonl"  # numbered by the first step the file holds, so names sort by time


def choose(seed: int, step: int, rows_per_rank: Sequence[int], k: int) -> list[tuple[int, int]]:
    """k distinct (rank, row) pairs over all ranks' rows, a pure function of (seed, step, layout)."""
    total = sum(rows_per_rank)
    if k <= 0 or total == 0:
        return []
    rng = np.random.default_rng(np.random.SeedSequence([seed, step, 0x5A3]))
    picks = sorted(rng.choice(total, size=min(k, total), replace=False).tolist())
    starts = np.cumsum([0, *rows_per_rank])
    out = []
    for p in picks:
        rank = int(np.searchsorted(starts, p, side="right") - 1)
        out.append((rank, int(p - starts[rank])))
    return out


def sample_record(
    *,
    step: int,
    rank: int,
    row: int,
    groups: Groups,
    prompt: str,
    completion: str,
    reward: float,
    parts: dict[str, float],
    advantage: float,
    length: int,
    truncated: bool,
    policy_version: int,
    logp_gap: float | None,
    episode: dict | None = None,
) -> dict:
    """One sample line: what a researcher needs to judge a rollout without the run's other files. Multi-turn
    episodes add `episode`: the whole response with its observations (`text`) and the episode's counts."""
    group, index = groups.place(row)
    return {
        **({"episode": episode} if episode is not None else {}),
        "step": step,
        "rank": rank,
        "group": group,
        "index": index,
        "prompt": prompt,
        "completion": completion,
        "reward": reward,
        "parts": parts,
        "advantage": advantage,
        "length": length,
        "finish_reason": "length" if truncated else "stop",
        "policy_version": policy_version,
        "logp_gap": logp_gap,  # mean |trainer - sampler| log-prob over the sequence's sampled tokens
    }


def failed_rows(rollouts) -> list[int]:
    """The first episode of each kind an environment ended (its summary's `error`: env_error, env_invalid), kept
    beside the drawn samples so that every failure a step counted can be read whole."""
    first: dict[str, int] = {}
    for row, e in enumerate(rollouts.episodes or []):
        kind = e.get("error", "").split(":", 1)[0]
        if kind:
            first.setdefault(kind, row)
    return sorted(first.values())


def episode_record(rollouts, row: int, tokenizer) -> dict | None:
    """A multi-turn episode's whole response (sampled turns and observations, in order) and its counts."""
    if rollouts.episodes is None:
        return None
    return {"text": tokenizer.decode(rollouts.completion_ids[row], skip_special_tokens=True), **rollouts.episodes[row]}


class SampleWriter:
    """Rank 0's rotating, size-bounded samples/ directory; a null object on other ranks."""

    def __init__(self, run_dir: Path, enabled: bool, file_mb: float = 5.0, max_mb: float = 50.0):
        self.enabled = enabled
        self.dir = Path(run_dir) / "samples"
        self.file_bytes, self.max_bytes = int(file_mb * 2**20), int(max_mb * 2**20)
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)

    def _current(self, step: int) -> Path:
        files = sorted(self.dir.glob("samples_*.jsonl"))
        if files and files[-1].stat().st_size < self.file_bytes:
            return files[-1]
        return self.dir / FILE_PATTERN.format(step)

    def write(self, records: Sequence[dict], logger=None) -> None:
        if not self.enabled or not records:
            return
        step = records[0]["step"]
        with self._current(step).open("a") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in records))
        self._trim()
        if logger is not None:
            logger.text("samples", markdown(records), step)

    def drop_after(self, step: int) -> None:
        """On resume from `step`: drop the lines of later steps (the interrupted run's), as metrics.jsonl does."""
        if not self.enabled:
            return
        for f in sorted(self.dir.glob("samples_*.jsonl")):
            lines = f.read_text().splitlines()
            keep = [ln for ln in lines if _step_of(ln) <= step]
            if len(keep) == len(lines):
                continue
            if keep:
                tmp = f.with_suffix(".tmp")
                tmp.write_text("".join(ln + "\n" for ln in keep))
                tmp.replace(f)
            else:
                f.unlink()

    def _trim(self) -> None:
        files = sorted(self.dir.glob("samples_*.jsonl"))
        sizes = [f.stat().st_size for f in files]
        while len(files) > 1 and sum(sizes) > self.max_bytes:
            files.pop(0).unlink()
            sizes.pop(0)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return 1 << 62  # a torn line: dropped by a resume's rewrite


def markdown(records: Sequence[dict]) -> str:
    """TensorBoard text: one block per sample (TensorBoard renders markdown; code spans keep text literal)."""
    out = []
    for r in records:
        head = (
            f"**reward {r['reward']:.4g}**, advantage {r['advantage']:.4g}, {r['length']} tokens "
            f"({r['finish_reason']}), rank {r['rank']} group {r['group']}, policy v{r['policy_version']}"
        )
        out.append(f"{head}\n\n    {r['prompt']!r}\n    -> {r['completion']!r}")
    return "\n\n---\n\n".join(out)


def gather_samples(local: list[dict]) -> list[dict]:
    """Every rank's chosen records on every rank (one collective), in (rank, row) order."""
    return [r for part in dist.all_gather_objects(local) for r in part]


class StepSamples:
    """The runner's hook: every `samples_every` steps, choose, format, gather and write a step's samples.
    Collective when due (every rank calls it with its own rollouts)."""

    def __init__(self, run_cfg, seed: int, tokenizer, run_dir: Path, is_main: bool, start_step: int):
        self.k, self.every, self.seed = run_cfg.samples_per_step, run_cfg.samples_every, seed
        self.tokenizer = tokenizer
        self.writer = SampleWriter(run_dir, is_main and self.k > 0, max_mb=run_cfg.samples_max_mb)
        self.writer.drop_after(start_step)

    def __call__(self, step: int, batch, scores, advantages, seq_gap: dict[int, float], logger) -> None:
        """`step`: the completed step (1-based, as logged); `batch` (a StepBatch) was sampled by the policy of step
        - 1."""
        if self.k <= 0 or step % self.every:
            return
        rollouts, rank, world = batch.rollouts, dist.rank(), dist.world_size()
        mine = [row for r, row in choose(self.seed, step, [len(rollouts)] * world, self.k) if r == rank]
        mine += [row for row in failed_rows(rollouts) if row not in mine]
        versions = rollouts.policy_version
        local = [
            sample_record(
                step=step,
                rank=rank,
                row=row,
                groups=batch.groups,
                # as the model saw it: a chat template's turns and headers included
                prompt=self.tokenizer.decode(rollouts.prompt_ids[row], skip_special_tokens=False),
                completion=rollouts.texts[row],
                reward=float(scores.rewards[row]),
                parts={k: float(v[row]) for k, v in scores.parts.items()},
                advantage=float(advantages[row]),
                length=len(rollouts.completion_ids[row]),
                truncated=bool(rollouts.truncated[row]),
                policy_version=int(versions[row]) if versions is not None else step - 1,
                logp_gap=seq_gap.get(row),
                episode=episode_record(rollouts, row, self.tokenizer),
            )
            for row in mine
        ]
        records = gather_samples(local)
        self.writer.write(records, logger)
        if self.writer.enabled:
            logger.wandb.samples(step, records)

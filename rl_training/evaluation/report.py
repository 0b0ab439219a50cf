"""What `python -m evals.run` makes from the per-checkpoint results: summary.csv, PNG plots, TensorBoard scalars.

Everything is rebuilt from the step_NNNNNN.json files of one eval directory, so a re-run that evaluates
only new checkpoints still produces complete tables and curves, and one that re-evaluates them (--redo)
does not add a second point for a step.
"""

from __future__ import annotations

import csv
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

# Plots: (file stem, title, metric keys drawn in it). `{k}` expands to one line per k.
PLOTS = [
    ("accuracy", "greedy accuracy", ["accuracy"]),
    ("pass_at_k", "pass@k (sampled)", ["pass@{k}"]),
    ("maj_at_k", "maj@k (sampled)", ["maj@{k}"]),
    ("reward_mean", "mean reward", ["reward_mean", "sampled_reward_mean"]),
    ("format_rate", "format rate", ["format_rate", "sampled_format_rate"]),
    ("response_len_mean", "mean response length (tokens)", ["response_len_mean", "sampled_response_len_mean"]),
    ("truncation_rate", "truncation rate", ["truncation_rate", "sampled_truncation_rate"]),
]
PERF_COLUMNS = ["problems_per_s", "eval_s", "generate_s", "score_s", "load_s", "sync_s", "gen_tokens_per_s"]


def load_results(out_dir: Path, settings: dict | None = None) -> tuple[list[dict], list[int]]:
    """(results sorted by step, steps ignored because they were made with other settings)."""
    results, other = [], []
    for path in sorted(Path(out_dir).glob("step_*.json")):
        r = json.loads(path.read_text())
        if settings is not None and r["settings"] != settings:
            other.append(r["step"])
        else:
            results.append(r)
    return sorted(results, key=lambda r: r["step"]), other


def best_step(results: Sequence[dict], metric: str = "accuracy") -> int | None:
    """The step with the highest `metric` (a tie: the earliest); None when no step has a finite value."""
    scored = [(r["metrics"].get(metric), r["step"]) for r in results]
    scored = [(v, s) for v, s in scored if v is not None and v == v]
    return max(scored, key=lambda vs: (vs[0], -vs[1]))[1] if scored else None


def write_summary_csv(results: Sequence[dict], columns: Sequence[str], path: Path) -> None:
    """One row per step: the metrics, throughput and timing, backend and dtype; `best` is 1 on the step with
    the highest accuracy (best_step)."""
    best = best_step(results)
    header = ["step", *columns, "num_problems", *PERF_COLUMNS, "backend", "dtype", "checkpoint", "best"]
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for r in results:
            m, t = r["metrics"], r["timing"]
            w.writerow(
                [
                    r["step"],
                    *(_fmt(m.get(c)) for c in columns),
                    r["num_problems"],
                    *(_fmt(t.get(c)) for c in PERF_COLUMNS),
                    r["backend"],
                    r["dtype"],
                    r.get("checkpoint") or "base",
                    1 if r["step"] == best else "",
                ]
            )


def _fmt(x) -> str:
    return "" if x is None else f"{x:.6g}"


def _expand(keys: Sequence[str], ks: Sequence[int]) -> list[str]:
    return [k.format(k=kk) for k in keys for kk in (ks if "{k}" in k else [None])]


def write_plots(results: Sequence[dict], ks: Sequence[int], plot_dir: Path, title: str) -> list[Path]:
    """One PNG per metric family against step, plus overview.png with all of them (matplotlib, Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    plot_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in results]
    panels = [(stem, name, [k for k in _expand(keys, ks) if k in results[0]["metrics"]]) for stem, name, keys in PLOTS]
    panels = [p for p in panels if p[2]]

    def draw(ax, name, keys):
        for key in keys:
            ax.plot(steps, [r["metrics"][key] for r in results], marker="o", markersize=3, label=key)
        ax.set_title(name, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)

    written = []
    for stem, name, keys in panels:
        fig = Figure(figsize=(4.5, 3.2), dpi=100)
        FigureCanvasAgg(fig)
        draw(fig.add_subplot(), name, keys)
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        fig.savefig(plot_dir / f"{stem}.png")
        written.append(plot_dir / f"{stem}.png")
    cols = 4
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(3.6 * cols, 2.8 * rows), dpi=80)
    FigureCanvasAgg(fig)
    for i, (_, name, keys) in enumerate(panels):
        draw(fig.add_subplot(rows, cols, i + 1), name, keys)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(plot_dir / "overview.png")
    return [*written, plot_dir / "overview.png"]


def write_tensorboard(results: Sequence[dict], tb_dir: Path, name: str) -> None:
    """eval/<name>/<metric> scalars at each checkpoint's step, in the training log's directory RUN/tb itself,
    so training and eval curves sit together in one TensorBoard run.

    They go to an event file of their own, `events.out.tfevents.0000000000.eval_<name>`, which is deleted and
    written again from `results`, in step order, on every call: a --redo or a run that adds checkpoints leaves
    exactly one point per step, and training's event files and other eval names' files are left alone. The
    zero timestamp sorts the file before training's: TensorBoard's legacy loader (--load_fast=false, or where
    the fast one is not built) follows only the last file of a directory, so a later-sorting eval file would
    freeze a live run's training curves. The tags cannot collide with the in-loop eval's `eval/<metric>`
    (metric names hold no '/').
    """
    from torch.utils.tensorboard import SummaryWriter

    tb_dir.mkdir(parents=True, exist_ok=True)
    final = tb_dir / f"events.out.tfevents.0000000000.eval_{name}"
    final.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=tb_dir.parent, prefix=".eval_tb_") as tmp:  # outside tb/: not a run
        writer = SummaryWriter(tmp)
        try:
            for r in sorted(results, key=lambda r: r["step"]):
                for k, v in r["metrics"].items():
                    writer.add_scalar(f"eval/{name}/{k}", v, r["step"])
                writer.add_scalar(f"eval/{name}/problems_per_s", r["timing"]["problems_per_s"], r["step"])
        finally:
            writer.close()
        (written,) = Path(tmp).glob("events.out.tfevents.*")
        shutil.move(str(written), final)

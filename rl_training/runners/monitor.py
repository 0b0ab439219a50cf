"""A run at a glance, live or finished, without a GPU: state, key curves, latest low-reward samples, plots.

    python -m rl_training.monitor runs/tiny_cpu
    python -m rl_training.monitor runs/a runs/b --last 50            # several runs side by side
    python -m rl_training.monitor runs/tiny_cpu --save-dir plots/     # PNGs: loss, reward, lengths, ...
    python -m rl_training.monitor runs/tiny_cpu --watch 60            # re-print every 60 s (Ctrl-C stops)

Everything is read from the run directory the runner writes (config.yaml, metrics.jsonl, step_* checkpoints,
eval/*/step_*.json, samples/*.jsonl) and nothing is written there, so it is safe beside a live run: a torn
last line of metrics.jsonl (a write in progress) is skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rl_training.ckpt.store import list_checkpoints

# (label, metric key): the curves a researcher reads first, in this order.
KEY_CURVES = [
    ("reward", "rollout/reward_mean"),
    ("accuracy", "rollout/accuracy"),
    ("format rate", "rollout/format_rate"),
    ("response length", "rollout/response_len_mean"),
    ("truncation", "rollout/truncation_rate"),
    ("zero-adv groups", "rollout/zero_adv_group_frac"),
    ("loss", "train/loss"),
    ("KL", "train/kl"),
    ("entropy", "train/entropy"),
    ("clip fraction", "train/clip_frac"),
    ("grad norm", "train/grad_norm"),
    ("canary |dlogp| mean", "rollout/logp_diff_mean"),
    ("canary |dlogp| max", "rollout/logp_diff_max"),
    ("IS trunc fraction", "is/trunc_frac"),
    ("GNS B_simple", "probe/gns/b_simple"),
    ("GNS B/B_simple", "probe/gns/batch_ratio"),
    ("ESS token", "probe/ess/token"),
    ("ESS seq", "probe/ess/seq"),
    ("advisor K*", "probe/advisor/k_star"),  # probe.advisor: every probe.unit_every steps
    ("tr S_w / tr S_b", "probe/anova/within_between_ratio"),
    ("LoRA stable rank median", "lora/stable_rank/median"),  # every probe.lora_health_every steps
    ("LoRA stable rank min", "lora/stable_rank/min"),
    ("step time (s)", "perf/step_s"),
    ("tokens/s", "perf/tokens_per_s"),
]

# PNG pages for --save-dir: (file stem, title, keys); keys absent from a run are left out, empty pages skipped.
PLOTS = [
    ("loss", "loss", ["train/loss", "train/pg_loss", "train/kl"]),
    ("reward", "reward and accuracy", ["rollout/reward_mean", "rollout/accuracy", "rollout/format_rate"]),
    ("lengths", "response length (tokens)", ["rollout/response_len_mean", "rollout/response_len_max"]),
    ("optimizer", "optimizer", ["train/grad_norm", "train/lr", "train/clip_frac", "train/entropy"]),
    ("canary", "trainer vs sampler", ["rollout/logp_diff_mean", "rollout/logp_diff_max", "is/trunc_frac"]),
    ("gns", "gradient noise scale", ["probe/gns/b_simple", "probe/gns/batch_units", "probe/gns/recommended_batch"]),
    ("ess", "effective sample size", ["probe/ess/token", "probe/ess/seq", "probe/ess/ppo_token"]),
    (
        "advisor",
        "rollout budget: K* and its band, current K",
        ["probe/advisor/k_star", "probe/advisor/k_lo", "probe/advisor/k_hi", "probe/advisor/k_current"],
    ),
    ("lora", "LoRA health (stable rank)", ["lora/stable_rank/median", "lora/stable_rank/min", "lora/entropy_rank/min"]),
]


@dataclass
class RunView:
    """What the monitor knows about one run directory."""

    path: Path
    name: str
    total_steps: int | None
    rows: list[dict]  # metrics.jsonl, one dict per logged step, in step order
    checkpoints: list[int]  # steps of the complete checkpoints
    evals: dict[str, list[dict]] = field(default_factory=dict)  # eval name -> results sorted by step
    samples: list[dict] = field(default_factory=list)  # the latest samples/*.jsonl lines
    age_s: float | None = None  # seconds since metrics.jsonl last changed
    torn_lines: int = 0

    @property
    def step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(r["step"], float(r[key])) for r in self.rows if isinstance(r.get(key), int | float)]


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Whole lines that parse as JSON objects, and how many did not (a torn last line of a live run)."""
    rows, bad = [], 0
    if not path.exists():
        return rows, bad
    for line in path.read_text(errors="replace").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            bad += 1
    return rows, bad


def load_run(path: Path, max_samples: int = 2000) -> RunView:
    path = Path(path)
    if not path.is_dir():
        raise SystemExit(f"monitor: {path} is not a run directory")
    cfg = {}
    if (path / "config.yaml").exists():
        cfg = yaml.safe_load((path / "config.yaml").read_text()) or {}
    rows, torn = read_jsonl(path / "metrics.jsonl")
    by_step = {r["step"]: r for r in rows if isinstance(r.get("step"), int)}  # a re-logged step: the last wins
    evals = {}
    for d in sorted((path / "eval").glob("*/")) if (path / "eval").is_dir() else []:
        results = []
        for f in sorted(d.glob("step_*.json")):
            try:
                results.append(json.loads(f.read_text()))
            except json.JSONDecodeError:
                continue
        if results:
            evals[d.name] = sorted(results, key=lambda r: r.get("step", 0))
    samples: list[dict] = []
    for f in sorted((path / "samples").glob("*.jsonl"), reverse=True) if (path / "samples").is_dir() else []:
        got, _ = read_jsonl(f)
        samples = got + samples
        if len(samples) >= max_samples:
            break
    metrics_file = path / "metrics.jsonl"
    return RunView(
        path=path,
        name=(cfg.get("run") or {}).get("name") or path.name,
        total_steps=(cfg.get("train") or {}).get("total_steps"),
        rows=[by_step[s] for s in sorted(by_step)],
        checkpoints=[s for s, _ in list_checkpoints(path)],
        evals=evals,
        samples=samples[-max_samples:],
        age_s=time.time() - metrics_file.stat().st_mtime if metrics_file.exists() else None,
        torn_lines=torn,
    )


# ------------------------------------------------------------------------------------------------ summary
def _fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x == 0 or 1e-3 <= abs(x) < 1e5:
        return f"{x:.4g}"
    return f"{x:.3e}"


def _duration(s: float) -> str:
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def state_lines(run: RunView, last: int) -> list[str]:
    """Step of total, ETA, throughput, checkpoint and upload state."""
    total = run.total_steps
    out = [f"== {run.name}  ({run.path})"]
    if not run.rows:
        out.append("   no step logged yet")
        return out
    recent = run.rows[-last:]
    step_s = [r["perf/step_s"] for r in recent if isinstance(r.get("perf/step_s"), int | float)]
    med = statistics.median(step_s) if step_s else None
    done = total is not None and run.step >= total
    progress = f"step {run.step}/{total}" if total else f"step {run.step}"
    if done:
        progress += " (finished)"
    elif med is not None and total:
        progress += f", ETA {_duration(med * (total - run.step))} at the median {med:.3g} s/step of the last {last}"
    if run.age_s is not None:
        progress += f"; metrics.jsonl written {_duration(run.age_s)} ago"
    out.append("   " + progress)
    tps = [r["perf/tokens_per_s"] for r in recent if isinstance(r.get("perf/tokens_per_s"), int | float)]
    if tps:
        out.append(f"   throughput: {statistics.median(tps):.4g} generated tokens/s (median of the last {len(tps)})")
    ck = (
        f"last checkpoint: step {run.checkpoints[-1]} ({len(run.checkpoints)} kept)"
        if run.checkpoints
        else "no checkpoint yet"
    )
    last_row = run.rows[-1]
    if "sync/last_uploaded_step" in last_row:
        ck += (
            f"; uploaded up to step {int(last_row['sync/last_uploaded_step'])}, "
            f"{int(last_row.get('sync/ckpt_pending', 0))} pending, "
            f"{int(last_row.get('sync/ckpt_upload_failures', 0))} failed"
        )
    out.append("   " + ck)
    split = "probe/alert/rollout_split"  # with the advice, every probe.unit_every steps
    alerts = sorted(k.split("/")[-1] for k, v in last_row.items() if k.startswith("probe/alert/") and v and k != split)
    lora = [r for r in run.rows if "lora/alert/rank_collapse" in r]  # logged every probe.lora_health_every steps
    if lora and lora[-1]["lora/alert/rank_collapse"]:
        alerts.append(f"rank_collapse (LoRA, step {lora[-1]['step']})")
    advice = [r for r in run.rows if "probe/advisor/k_star" in r]
    if advice:
        out.append("   " + advice_line(advice[-1]))
        if advice[-1].get(split):
            alerts.append(f"rollout_split (step {advice[-1]['step']})")
    forecast = [r for r in run.rows if "probe/forecast/final_reward" in r]  # with an in-loop eval
    if forecast:
        f = forecast[-1]
        out.append(
            f"   forecast (step {f['step']}): final held-out reward {_fmt(f['probe/forecast/final_reward'])} "
            f"[{_fmt(f.get('probe/forecast/final_reward_lo'))}-{_fmt(f.get('probe/forecast/final_reward_hi'))}], "
            f"asymptote {_fmt(f.get('probe/forecast/asymptote'))}"
        )
    if alerts:
        out.append("   probe alerts on: " + ", ".join(alerts))
    if run.torn_lines:
        out.append(f"   note: {run.torn_lines} unreadable line(s) in metrics.jsonl skipped (a write in progress?)")
    return out


def advice_line(r: dict) -> str:
    """The rollout-budget advisor's latest advice (docs/probes.md 10) in one line."""
    k, b = r.get("probe/advisor/k_current"), r.get("probe/gns/batch_units")
    budget = f"{_fmt(k * b)} completions/step" if isinstance(k, int | float) and isinstance(b, int | float) else "-"
    trust = "trusted" if r.get("probe/advisor/trusted") else "not trusted yet"
    return (
        f"rollout budget (step {r['step']}, {trust}): K* {_fmt(r.get('probe/advisor/k_star'))} "
        f"[{_fmt(r.get('probe/advisor/k_lo'))}-{_fmt(r.get('probe/advisor/k_hi'))}], "
        f"B* {_fmt(r.get('probe/advisor/b_star'))} for {budget} (now K {_fmt(k)}, B {_fmt(b)}); "
        f"efficiency of the current split {_fmt(r.get('probe/advisor/efficiency'))}, "
        f"critical rollouts/step {_fmt(r.get('probe/advisor/critical_rollouts'))}"
    )


def curve_table(runs: Sequence[RunView], last: int) -> list[str]:
    """One row per key curve: for each run, the mean over its last `last` steps and the change across them."""
    header = ["curve", *(f"{r.name}: mean (last {last}) / change" for r in runs)]
    rows = []
    for label, key in KEY_CURVES:
        cells, seen = [], False
        for run in runs:
            vals = [v for _, v in run.series(key)[-last:]]
            if not vals:
                cells.append("-")
                continue
            seen = True
            cells.append(
                f"{_fmt(statistics.fmean(vals))} / {'+' if vals[-1] >= vals[0] else ''}{_fmt(vals[-1] - vals[0])}"
            )
        if seen:
            rows.append([label, *cells])
    for run_i, run in enumerate(runs):  # the latest eval of each eval set
        for name, results in run.evals.items():
            m = results[-1].get("metrics", {})
            for k in ("accuracy", "reward_mean"):
                if k in m:
                    cells = ["-"] * len(runs)
                    cells[run_i] = f"{_fmt(m[k])} at step {results[-1].get('step')}"
                    rows.append([f"eval {name} {k}", *cells])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def distinct_parts(texts: list[str]) -> list[str]:
    """Each text without the prefix and suffix all of them share: a chat template's system turn and its closing
    assistant header (and a task's fixed instruction) are the same in every prompt, and the question between them is
    what tells samples apart. One text, or texts that share nothing, are returned as they are."""
    if len(texts) < 2:
        return texts
    lo = _shared(texts)
    hi = _shared([t[lo:][::-1] for t in texts])
    return [t[lo : len(t) - hi] or t for t in texts]


def _shared(texts: list[str]) -> int:
    """Characters at the start of every text that are the same in all of them."""
    n = min(len(t) for t in texts)
    return next((i for i in range(n) if len({t[i] for t in texts}) > 1), n)


def low_reward_samples(run: RunView, k: int, width: int = 160) -> list[str]:
    """The k lowest-reward samples among the latest logged step's (ties: the earlier sample first)."""
    if not run.samples or k <= 0:
        return []
    step = max(s.get("step", 0) for s in run.samples)
    latest = [s for s in run.samples if s.get("step", 0) == step]
    latest.sort(key=lambda s: float(s.get("reward", 0.0)))
    out = [f"-- {run.name}: {min(k, len(latest))} lowest-reward samples of step {step}"]
    prompts = distinct_parts([" ".join(str(s.get("prompt", "")).split()) for s in latest])
    for s, prompt in list(zip(latest, prompts, strict=True))[:k]:
        text = " ".join(str(s.get("completion", "")).split())
        out.append(
            f"   reward {_fmt(float(s.get('reward', 0.0)))} adv {_fmt(s.get('advantage'))} "
            f"len {s.get('length', '-')} {s.get('finish_reason', '')}: "
            f"{prompt[-60:]!r} -> {text[:width]!r}"
        )
    return out


def report(runs: Sequence[RunView], last: int, samples: int) -> str:
    lines = []
    for run in runs:
        lines += state_lines(run, last)
    lines += ["", *curve_table(runs, last)]
    for run in runs:
        got = low_reward_samples(run, samples)
        if got:
            lines += ["", *got]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ plots
def save_plots(runs: Sequence[RunView], out_dir: Path) -> list[Path]:
    """One PNG per page of PLOTS (one line per run and key), plus eval curves when a run has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    pages = [(stem, title, keys, None) for stem, title, keys in PLOTS]
    eval_names = sorted({n for r in runs for n in r.evals})
    pages += [(f"eval_{n}", f"eval: {n}", ["accuracy", "reward_mean"], n) for n in eval_names]
    for stem, title, keys, eval_name in pages:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        drawn = 0
        for run in runs:
            for key in keys:
                if eval_name is None:
                    pts = run.series(key)
                else:
                    pts = [(r["step"], r["metrics"][key]) for r in run.evals.get(eval_name, []) if key in r["metrics"]]
                if not pts:
                    continue
                label = key if len(runs) == 1 else f"{run.name}: {key}"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker="o" if len(pts) < 20 else None)
                drawn += 1
        if drawn:
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            path = out_dir / f"{stem}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
        plt.close(fig)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rl_training.monitor", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (run.output_dir/run.name)")
    ap.add_argument("--last", type=int, default=20, help="steps the summary covers (default 20)")
    ap.add_argument("--samples", type=int, default=3, help="low-reward samples shown per run (default 3)")
    ap.add_argument("--save-dir", type=Path, help="write PNG plots here")
    ap.add_argument("--watch", type=float, default=0.0, help="re-print every this many seconds")
    args = ap.parse_args(argv)
    if args.last < 1:
        ap.error("--last must be >= 1")
    while True:
        runs = [load_run(p) for p in args.runs]
        print(report(runs, args.last, args.samples), flush=True)
        if args.save_dir:
            for p in save_plots(runs, args.save_dir):
                print(f"plot: {p}")
        if args.watch <= 0:
            return 0
        time.sleep(args.watch)
        print()


if __name__ == "__main__":
    sys.exit(main())

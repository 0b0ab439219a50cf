"""Scaling: step time against prompts per step, group size, max new tokens and ranks, with fitted costs.

    make bench-scaling
    .venv/bin/python scripts/bench_scaling.py --cfg cfg/tiny_cpu.yaml [--steps 20 --warmup 3] [--backends hf,vllm]
        [--base 8,8,16] [--prompts 4,8,16,32] [--groups 4,8,16] [--tokens 8,16,32,64] [--ranks 1,2]
        [--micro-groups 0] [--out bench_results/scaling.json] [key=value ...]

One factor at a time around a base point (prompts per step P, group size G, max new tokens T; 1 rank): each
axis is one sweep, the base point and the axis's values, for every backend. Within a sweep every (point,
backend) is its own run in its own worker process (scripts/bench.py's --serve), and the workers take turns
step by step, so a noisy machine slows them alike; the base point is measured again in every sweep. Each
point generates exactly T tokens per completion (rollout.min_new_tokens = T masks EOS until the cap), so
the T axis measures T and not where the policy happens to stop; the rewards are then meaningless, the timing
is what matters. One micro-batch per rank unless --micro-groups N (prompt groups per micro-batch) is given.

Ranks (1 vs 2, at the base point) are plain N-step torchrun runs of the runner, one layout after the other
(NOT interleaved: 2 ranks cannot share the stdin protocol), read back from their metrics.jsonl (medians after
--warmup). Rank rows are not in the fits.

Fits, per backend, by least squares over the 1-rank sweep rows (medians per row):
    generate_s = gen_fixed + gen_per_token * generated tokens          (P * G * T)
    train_s    = train_fixed + train_per_token * trained tokens        (P * G * (mean prompt tokens + T))
    sync_s     = sync_fixed                                            (the median over rows; 0 on hf)
with R^2 of each line. Prints the table and the fits, writes JSON (bench_results/scaling.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # scripts/bench.py: the Worker / --serve machinery

from rl_training.base.dist import DEVICE_ENV

REPO = bench.REPO
AXES = ("prompts", "groups", "tokens")  # the swept fields of Point, in order


class Point(NamedTuple):
    prompts: int  # rollout.prompts_per_step (summed over ranks)
    groups: int  # rollout.group_size (completions per prompt)
    tokens: int  # rollout.max_new_tokens (= rollout.min_new_tokens: every completion is this long)
    ranks: int = 1


# ------------------------------------------------------------------------------------------- planning
def plan_sweeps(base: Point, axes: dict[str, list[int]]) -> dict[str, list[Point]]:
    """One-factor-at-a-time sweeps: for each axis with values, the base point with that field replaced by each
    value, plus the base itself, sorted and without repeats. Axes without values are not swept."""
    sweeps = {}
    for axis in AXES:
        values = axes.get(axis) or []
        if values:
            sweeps[axis] = [base._replace(**{axis: v}) for v in sorted({*values, getattr(base, axis)})]
    return sweeps


def micro_groups(point: Point, micro: int) -> int:
    """train.micro_batch_groups for a point: `micro` (0 = all of a rank's groups, one micro-batch per rank).
    Raises ValueError where the point's groups per rank are not a multiple of it (the runner would refuse)."""
    if point.prompts % point.ranks:
        raise ValueError(f"{point}: prompts per step {point.prompts} not divisible by {point.ranks} ranks")
    per_rank = point.prompts // point.ranks
    m = micro or per_rank
    if per_rank % m:
        raise ValueError(f"{point}: {per_rank} prompt groups per rank not divisible by --micro-groups {m}")
    return m


def point_overrides(point: Point, micro: int, total_steps: int) -> list[str]:
    """The config overrides of one grid point (after the user's own)."""
    return [
        f"rollout.prompts_per_step={point.prompts}",
        f"rollout.group_size={point.groups}",
        f"rollout.max_new_tokens={point.tokens}",
        f"rollout.min_new_tokens={point.tokens}",
        f"train.micro_batch_groups={micro_groups(point, micro)}",
        "train.drop_zero_adv_groups=false",  # every generated token is trained, whatever the rewards
        f"train.total_steps={total_steps}",
        "eval.every=0",
        "ckpt.every=0",
    ]


def label(backend: str, p: Point) -> str:
    return f"{backend} P{p.prompts} G{p.groups} T{p.tokens}" + (f" x{p.ranks}r" if p.ranks > 1 else "")


# ------------------------------------------------------------------------------------------------ fits
def fit_line(x: list[float], y: list[float]) -> dict[str, float]:
    """Least squares y = fixed + per * x (numpy lstsq) and its R^2 = 1 - SS_res / SS_tot (NaN when every y is
    equal). Needs two or more distinct x."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xa) != len(ya) or len(set(xa.tolist())) < 2:
        raise ValueError("fit_line needs values at two or more distinct x")
    (fixed, per), *_ = np.linalg.lstsq(np.stack([np.ones_like(xa), xa], 1), ya, rcond=None)
    ss_res = float(((ya - fixed - per * xa) ** 2).sum())
    ss_tot = float(((ya - ya.mean()) ** 2).sum())
    return {"fixed": float(fixed), "per": float(per), "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")}


def fit_costs(rows: list[dict]) -> dict[str, dict]:
    """Per backend, the phase fits of the module docstring over the 1-rank rows."""
    out = {}
    for b in sorted({r["backend"] for r in rows}):
        rs = [r for r in rows if r["backend"] == b and r["ranks"] == 1]
        out[b] = {
            "generate": fit_line([r["gen_tokens"] for r in rs], [r["generate_s"] for r in rs]),
            "train": fit_line([r["train_tokens"] for r in rs], [r["train_s"] for r in rs]),
            "sync_fixed": statistics.median(r["sync_s"] for r in rs),
            "other_fixed": statistics.median(r["other_s"] for r in rs),  # scoring + probe metrics
            "rows": len(rs),
        }
    return out


def step_model(f: dict, prompt_tokens: float, tokens: int) -> dict[str, float]:
    """step_s ~ F + c N in N generated tokens per step, at completions of `tokens` tokens (each also trains
    its prompt): F = the fixed parts, c = gen_per + train_per x (1 + prompt / tokens). The fixed share
    F / (F + c N) is at most 10% from N = 9 F / c on (inf when c <= 0: noise)."""
    fixed = f["generate"]["fixed"] + f["train"]["fixed"] + f["sync_fixed"] + f["other_fixed"]
    per = f["generate"]["per"] + f["train"]["per"] * (1 + prompt_tokens / tokens)
    n10 = 9 * fixed / per if per > 0 else math.inf
    return {"fixed_s": fixed, "per_gen_token_s": per, "tokens_for_10pct_fixed": n10}


def crossover(hf: dict, vllm: dict) -> float:
    """Generated tokens per step above which vllm's step is the shorter: (F_vllm - F_hf) / (c_hf - c_vllm);
    0 when vllm is never slower, inf when it is never faster."""
    df, dc = vllm["fixed_s"] - hf["fixed_s"], hf["per_gen_token_s"] - vllm["per_gen_token_s"]
    if dc <= 0:  # vllm's per-token cost is not lower: faster everywhere only if also cheaper fixed and level
        return 0.0 if dc == 0 and df < 0 else math.inf
    return max(0.0, df / dc)


# ------------------------------------------------------------------------------------------ measuring
def summarize(label_: str, backend: str, point: Point, steps: list[dict], prompt_tokens: float, sweep: str) -> dict:
    """One table row: medians over the measured steps of one run."""
    every = set.intersection(*(set(s) for s in steps))  # metrics.jsonl: train/kl etc. only on some steps
    med = {k: statistics.median(s[k] for s in steps) for k in every if isinstance(steps[0][k], int | float)}
    n_seq = point.prompts * point.groups
    gen_len = med["rollout/response_len_mean"]
    return {
        "label": label_,
        "sweep": sweep,
        "backend": backend,
        **point._asdict(),
        "prompt_tokens_mean": prompt_tokens,
        "gen_len_mean": gen_len,  # = tokens when the cap is reached (rollout.min_new_tokens)
        "gen_tokens": n_seq * gen_len,
        "train_tokens": n_seq * (prompt_tokens + gen_len),
        "step_s": med["perf/step_s"],
        "generate_s": med["perf/generate_s"],
        "train_s": med["perf/train_s"],
        "sync_s": med["perf/sync_s"],
        "other_s": med["perf/score_s"] + med.get("perf/probe_s", 0.0),
        "tokens_per_s": med["perf/tokens_per_s"],
        "peak_rss_gb": max(s["mem/peak_rss_gb"] for s in steps),  # the worker's (torchrun: the largest rank's)
        "steps_measured": len(steps),
    }


def run_sweep(name: str, points: list[Point], backends: list[str], a, tmp: str) -> list[dict]:
    """Every (backend, point) of one sweep as a bench.py worker; the workers alternate step by step."""
    total = a.steps + a.warmup
    workers: dict[str, tuple[str, Point, bench.Worker]] = {}
    try:
        for b in backends:
            for p in points:  # one at a time: engine start-ups do not overlap
                lab = label(b, p)
                over = [*a.overrides, *point_overrides(p, a.micro_groups, total)]
                cmd = [sys.executable, bench.__file__, "--serve", "--cfg", a.cfg, "--backend", b, "--out-dir", tmp]
                run_name = f"{name}_{lab}".replace(" ", "_")
                workers[lab] = (b, p, bench.Worker(lab, [*cmd, "--name", run_name, "--", *over]))
        steps: dict[str, list[dict]] = {lab: [] for lab in workers}
        for step in range(total):
            for lab, (_, _, w) in workers.items():
                m = w.step(step)
                if step >= a.warmup:
                    steps[lab].append(m)
    finally:
        for _, _, w in workers.values():
            w.close()
    return [summarize(lab, b, p, steps[lab], w.ready["prompt_tokens_mean"], name) for lab, (b, p, w) in workers.items()]


def read_metrics(path: Path, warmup: int) -> list[dict]:
    """The step records of a metrics.jsonl after the first `warmup` steps."""
    from rl_training.runners.monitor import read_jsonl

    recs, _ = read_jsonl(path)
    return [r for r in recs if r["step"] > warmup]  # steps are logged 1-based (completed steps)


def run_layouts(base: Point, ranks: list[int], backends: list[str], a, tmp: str, prompt_tokens: dict) -> list[dict]:
    """Plain torchrun runs of the runner at the base point, one per (backend, ranks), one after the other."""
    rows = []
    for b in backends:
        for r in ranks:
            p = base._replace(ranks=r)
            lab = label(b, p)
            name = f"ranks_{lab}".replace(" ", "_")
            over = [*a.overrides, *point_overrides(p, a.micro_groups, a.steps + a.warmup)]
            over += [f"rollout.backend={b}", f"run.output_dir={tmp}", f"run.name={name}", "run.tensorboard=false"]
            over += ["run.progress_bar=false"]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r}"]
            cmd += [str(REPO / "rl_training" / "runners" / "rl_runner.py"), "--cfg", a.cfg, *over]
            env = {**os.environ, "PYTHONPATH": str(REPO), DEVICE_ENV: os.environ.get(DEVICE_ENV, "cpu")}
            res = subprocess.run(cmd, stdout=subprocess.DEVNULL, env=env)
            if res.returncode:
                raise RuntimeError(f"bench_scaling: the {lab} torchrun run exited with status {res.returncode}")
            steps = read_metrics(Path(tmp) / name / "metrics.jsonl", a.warmup)
            rows.append(summarize(lab, b, p, steps, prompt_tokens.get(b, float("nan")), "ranks"))
    return rows


# ------------------------------------------------------------------------------------------- printing
COLS = ("step_s", "generate_s", "train_s", "sync_s", "other_s", "tokens_per_s", "peak_rss_gb")


def table(rows: list[dict]) -> str:
    head = f"{'sweep':<8}{'run':<24}{'gen tok':>8}" + "".join(f"{c:>13}" for c in COLS)
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['sweep']:<8}{r['label']:<24}{r['gen_tokens']:>8.0f}" + "".join(f"{r[c]:>13.4g}" for c in COLS)
        )
    return "\n".join(lines)


def fits_text(fits: dict[str, dict], base: Point) -> str:
    lines = []
    for b, f in fits.items():
        g, t, m = f["generate"], f["train"], f["step_model"]
        lines.append(
            f"{b}: generate_s = {g['fixed']:.4g} + {g['per'] * 1e3:.4g} ms x generated tokens (R^2 {g['r2']:.3f}); "
            f"train_s = {t['fixed']:.4g} + {t['per'] * 1e3:.4g} ms x trained tokens (R^2 {t['r2']:.3f}); "
            f"sync_s = {f['sync_fixed']:.4g}; other_s = {f['other_fixed']:.4g}  [{f['rows']} rows]\n"
            f"  at T={base.tokens}: step_s ~ {m['fixed_s']:.4g} + {m['per_gen_token_s'] * 1e3:.4g} ms x generated "
            f"tokens; fixed share <= 10% from {m['tokens_for_10pct_fixed']:.4g} generated tokens per step "
            f"(base point: {base.prompts * base.groups * base.tokens})"
        )
        if min(g["fixed"], g["per"], t["fixed"], t["per"]) < 0:
            lines.append(
                f"  warning: {b} has a negative fitted cost: the timing is noise-dominated (a busy machine); "
                "rerun with more --steps on a quiet one"
            )
    if "crossover_tokens" in fits.get("vllm", {}):
        n = fits["vllm"]["crossover_tokens"]
        where = f"above {n:.4g} generated tokens per step (N*)" if math.isfinite(n) else "nowhere on these fits"
        lines.append(f"vllm's step is shorter than hf's {where}")
    return "\n".join(lines)


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_run_args(ap)  # --cfg, --steps 20, --warmup 3, --backends
    ap.add_argument("--base", default="8,8,16", help="the base point: prompts,group size,max new tokens")
    ap.add_argument("--prompts", default="4,8,16,32", help="prompts per step to sweep ('' = no sweep)")
    ap.add_argument("--groups", default="4,8,16", help="group sizes to sweep ('' = no sweep)")
    ap.add_argument("--tokens", default="8,16,32,64", help="max new tokens to sweep ('' = no sweep)")
    ap.add_argument("--ranks", default="1,2", help="torchrun layouts at the base point ('' = none)")
    ap.add_argument("--micro-groups", type=int, default=0, help="prompt groups per micro-batch; 0 = all per rank")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "scaling.json"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    base = Point(*ints(a.base))
    backends = a.backends.split(",")
    sweeps = plan_sweeps(base, {"prompts": ints(a.prompts), "groups": ints(a.groups), "tokens": ints(a.tokens)})
    ranks = ints(a.ranks)
    for p in [q for ps in sweeps.values() for q in ps] + [base._replace(ranks=r) for r in ranks]:
        micro_groups(p, a.micro_groups)  # refuse a bad grid before any run starts
    # The scaling of the CPU path (cfg/tiny_cpu.yaml, docs/benchmarks.md): every run on the CPU, the sweeps' workers
    # and the torchrun layouts alike, also on a GPU machine (a 2-rank layout would stop at rank 1 on a 1-GPU box);
    # RL_DEVICE set by the caller (e.g. cuda) measures there instead, every run alike.
    os.environ.setdefault(DEVICE_ENV, "cpu")
    t0 = time.time()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, points in sweeps.items():
            rows += run_sweep(name, points, backends, a, tmp)
            print(f"[{time.time() - t0:.0f} s] sweep {name} done", flush=True)
        prompt_tokens = {r["backend"]: r["prompt_tokens_mean"] for r in rows}  # the data set's, per backend
        if ranks:
            rows += run_layouts(base, ranks, backends, a, tmp, prompt_tokens)
    short = [r for r in rows if r["ranks"] == 1 and r["gen_len_mean"] < r["tokens"] - 1e-9]
    for r in short:
        print(f"warning: {r['label']}: completions of {r['gen_len_mean']:.2f} tokens, under the cap {r['tokens']}")
    fits = fit_costs([r for r in rows if r["sweep"] != "ranks"]) if sweeps else {}
    for b, f in fits.items():
        f["step_model"] = step_model(f, prompt_tokens[b], base.tokens)
    if {"hf", "vllm"} <= set(fits):
        fits["vllm"]["crossover_tokens"] = crossover(fits["hf"]["step_model"], fits["vllm"]["step_model"])
    print(f"\n{a.steps} measured steps per run after {a.warmup} warm-up ({time.time() - t0:.0f} s); {a.cfg}")
    print(table(rows))
    print(fits_text(fits, base))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = vars(a) | {"base": base._asdict(), "seconds": time.time() - t0}
    out.write_text(json.dumps({"settings": settings, "rows": rows, "fits": fits}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

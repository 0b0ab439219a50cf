"""The tool-calling demo on CPU: tiny chat model -> two-stage SFT warm start -> Dr-GRPO over chat-template tool
episodes -> held-out success, against an ablation whose tool returns nothing.

    make demo-tools
    .venv/bin/python scripts/demo_tools.py [--output-dir /tmp/demo] [--skip-ablation] [key=value ...]

Everything is local: the tiny chat model (models/tiny-qwen2-chat, its template declares tools), the task of
scripts/multiply_tool.py (one file, as a researcher's own environment: multiply a 3-digit by a 2-digit number,
which the tiny model cannot do, with a `multiply` tool; data written on every run, held-out first factors never
seen in training), then
- runs/tools_<time>_sft: stage 1, SFT on gold episodes that all call the tool (tool turns masked): it learns to
  call it with the question's factors and to copy the result;
- runs/tools_<time>_start: stage 2, a few steps on a mix where only --tool-frac of the episodes call and the rest
  guess at once: the start RL gets, which can call the tool but seldom does;
- runs/tools_<time>_rl: RL with the tool, and, unless --skip-ablation, runs/tools_<time>_empty: the same RL with
  task.args.empty_results=true (every call answered with an empty result: calling cannot pay).
Held-out success is measured with the episode engine the training uses (greedy episodes, the training reward) on
the start and on each RL result, each with the tool it trained with; the training episodes' sampled success
(first and last steps) and tool-use rate are read from each run's metrics. Extra key=value arguments override
the RL config. Numbers and times go to runs/tools_<time>_rl/demo_summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from demo import data_order, order_overrides, sh, torchrun_cmd  # noqa: E402  (the single-turn demo's launch helpers)
from demo_search import gated_sft, heldout_summary, rl_runs  # noqa: E402
from multiply_tool import write_data  # noqa: E402


def heldout_success(model_path: Path, adapter: Path | None, cfg) -> dict:
    """Greedy held-out episodes (demo_search.heldout_summary): success, tool use, calls and errors per episode."""
    m, example = heldout_summary(model_path, adapter, cfg)
    keys = {
        "success": "accuracy",
        "tool_use": "used_tools_mean",
        "calls": "tool_calls_mean",
        "errors": "tool_errors_mean",
    }
    return {k: m[v] for k, v in keys.items()} | {"example": example}


def sampled(metrics: Path, n: int = 3) -> dict:
    """The training episodes' success and tool-use rate (sampled): means of the first and last `n` steps."""
    from rl_training.runners.monitor import read_jsonl

    rows, _ = read_jsonl(metrics)
    out = {}
    for key, name in (("rollout/reward_mean", "success"), ("rollout/tool_use_rate", "tool_use")):
        v = [r[key] for r in rows if key in r]
        if not v:
            raise SystemExit(f"{metrics}: no {key} logged")
        out[name] = {"first": sum(v[:n]) / len(v[:n]), "last": sum(v[-n:]) / len(v[-n:])}
    return out


def sft_ranks(cfg: str, over: list[str], check: bool = True) -> int:
    """The SFT runner as two ranks of one thread each (DDP over gloo; one rank where the machine has one core), on
    2 cores about 0.6 of one rank's time (448 -> 273 s); its exit status (`check`: raise unless 0)."""
    cmd = torchrun_cmd("sft_runner.py", cfg, over, nproc=min(2, len(os.sched_getaffinity(0))))
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=check).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft-cfg", default="cfg/tools_sft.yaml")
    ap.add_argument("--start-cfg", default="cfg/tools_start.yaml")
    ap.add_argument("--rl-cfg", default="cfg/tools_cpu.yaml")
    ap.add_argument("--tool-frac", type=float, default=0.25, help="share of the start's episodes that call the tool")
    ap.add_argument("--output-dir", help="parent of the run directories (default: the configs' run.output_dir)")
    ap.add_argument("--skip-ablation", action="store_true", help="no task.args.empty_results=true RL run")
    ap.add_argument("--start-dir", help="an earlier run's tools_<time>_start: no SFT, RL from its final_model")
    ap.add_argument("--orders", type=int, default=3, help="data orders stage 1 may try (its config's seed, then +1...)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rl_training.config.load import load_config

    t0 = time.time()
    stamp = time.strftime("%Y%m%d_%H%M%S")
    data = REPO / "data" / "multiply"
    files = [f"data.train={data}/train.jsonl", f"data.eval={data}/heldout.jsonl"]
    out = [f"run.output_dir={a.output_dir}"] if a.output_dir else []
    # stage 1's skill gate checks valid.jsonl, never the held-out products the table reports
    sft_over = [*out, f"data.train={data}/train.jsonl", f"data.eval={data}/valid.jsonl"]
    sft_over += [f"sft.gold_episodes={data}/gold_train.jsonl"]
    sft_cfg = load_config(REPO / a.sft_cfg, sft_over)
    if not (REPO / sft_cfg.model.name_or_path / "config.json").exists():
        sh([sys.executable, "scripts/make_tiny_model.py", "--out", sft_cfg.model.name_or_path, "--chat"])
    write_data(data, a.tool_frac)  # on every run (< 1 s): a copy from an older generator is never used
    start_dir = Path(a.start_dir or Path(sft_cfg.run.output_dir) / f"tools_{stamp}_start")
    stage1 = None
    if not a.start_dir:
        orders = [data_order(sft_cfg.train.seed) + i for i in range(a.orders)]

        def run_dir(order: int) -> Path:
            return Path(sft_cfg.run.output_dir) / f"tools_{stamp}_sft_order{order}"

        sft_dir, stage1 = gated_sft(lambda cfg, over: sft_ranks(cfg, over, False), a.sft_cfg, sft_over, run_dir, orders)
        start_over = [f"run.name={start_dir.name}", *out, *files, f"model.name_or_path={sft_dir / 'final_model'}"]
        start_over += [f"sft.gold_episodes={data}/gold_train_mix.jsonl"]
        sft_ranks(a.start_cfg, [*start_over, *order_overrides(load_config(REPO / a.start_cfg, start_over))])
    t_sft = time.time()
    runs = {"tool": f"tools_{stamp}_rl"} | ({} if a.skip_ablation else {"empty": f"tools_{stamp}_empty"})
    times, results, cfgs, overs = {"sft_s": t_sft - t0}, {}, {}, {}
    for label, name in runs.items():
        over = [f"run.name={name}", *out, *files, f"model.name_or_path={start_dir / 'final_model'}"]
        over += order_overrides(load_config(REPO / a.rl_cfg, over))
        overs[label] = [*over, f"task.args.empty_results={label == 'empty'}", *a.overrides]
        cfgs[label] = load_config(REPO / a.rl_cfg, overs[label])
    times["rl_s"] = rl_runs(a.rl_cfg, overs)
    t = time.time()
    for label, cfg in cfgs.items():
        run_dir = REPO / cfg.run.output_dir / cfg.run.name
        final = run_dir / "checkpoints" / f"step_{cfg.train.total_steps:06d}" / "adapter"
        results[label] = {
            "before": heldout_success(REPO / start_dir / "final_model", None, cfg),
            "after": heldout_success(REPO / start_dir / "final_model", final, cfg),
            "sampled": sampled(run_dir / "metrics.jsonl"),
        }
    times["eval_s"], times["total_s"] = time.time() - t, time.time() - t0
    cfg = cfgs["tool"]
    print(f"\n== Tool demo: {cfg.eval.num_prompts} held-out products, greedy episodes ==")
    if stage1:
        print(
            f"stage 1 (every gold episode calls): data order {stage1['order']}, its skill gate passed at step "
            f"{stage1['steps']} (success {stage1['accuracy']:.2f} on {sft_cfg.eval.num_prompts} validation products)"
        )
    print(
        f"{'tool':<8}{'success start':>15}{'after RL':>10}{'change':>9}{'tool use start':>16}{'after RL':>10}"
        f"{'sampled success, RL steps':>28}{'sampled tool use':>20}"
    )
    for label, r in results.items():
        b, f, smp = r["before"], r["after"], r["sampled"]
        print(
            f"{label:<8}{b['success']:>15.3f}{f['success']:>10.3f}{f['success'] - b['success']:>+9.3f}"
            f"{b['tool_use']:>16.2f}{f['tool_use']:>10.2f}"
            f"{smp['success']['first']:>19.3f} -> {smp['success']['last']:.3f}"
            f"{smp['tool_use']['first']:>11.2f} -> {smp['tool_use']['last']:.2f}"
        )
    print(f"\nexample episode after RL (sampled text): {results['tool']['after']['example']!r}")
    print("times: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    rl_dir = REPO / cfg.run.output_dir / cfg.run.name
    summary = {"stage1": stage1, "results": results, "times": times}
    (rl_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"summary: {rl_dir / 'demo_summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

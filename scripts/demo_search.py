"""The multi-turn search demo on CPU: tiny model -> two-stage SFT warm start -> Dr-GRPO over episodes -> held-out EM.

    make demo-search
    .venv/bin/python scripts/demo_search.py [--hops 2] [--output-dir /tmp/demo] [--skip-ablation] [key=value ...]

Everything is local: the tiny model (models/tiny-qwen2), the synthetic task (data/search<hops>, written on every
run: facts reachable only through the retriever, held-out keys disjoint from training keys), then
- runs/search_<time>_sft: stage 1, SFT on gold episodes that all search (observations masked): it learns to
  search and to copy the code out of the passage;
- runs/search_<time>_start: stage 2, a few steps on a mix where only --search-frac of the episodes search and
  the rest answer "unknown": the start RL gets, which can search and read but seldom does;
- runs/search_<time>_rl: RL with the BM25 retriever, and, unless --skip-ablation, runs/search_<time>_none: the
  same RL with search.retriever=none (the policy never sees a passage).
Held-out exact match is measured with the episode engine the training uses (greedy episodes, the training
grader) on stage 1, on the start and on each RL result, each with the retriever it trained with; the training
episodes' sampled EM (first and last steps) is read from each run's metrics. Extra key=value arguments
override the RL config. Numbers and times go to runs/search_<time>_rl/demo_summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from demo import data_order, order_overrides, pinned, sh, torchrun, torchrun_cmd  # noqa: E402  (the single-turn demo's launch helpers)


def heldout_summary(model_path: Path, adapter: Path | None, cfg) -> tuple[dict, str]:
    """Greedy held-out episodes with the training episode engine and grader (rl_training/evaluation) on HF: the
    summary metrics (evaluation/pass_at_k.summarize, the environment's counts included) and the first episode."""
    import dataclasses

    import torch

    from rl_training.data.prompts import encode_prompts
    from rl_training.data.sources import load_examples
    from rl_training.evaluation.evaluate import EvalSettings, evaluate_policy
    from rl_training.evaluation.pass_at_k import summarize
    from rl_training.policy.models import load_base_model, load_tokenizer
    from rl_training.rollout.episodes import with_episodes
    from rl_training.rollout.hf import HFBackend
    from rl_training.tasks.build import build_task, task_context

    tok = load_tokenizer(str(model_path))
    model = load_base_model(dataclasses.replace(cfg.model, name_or_path=str(model_path)), torch.device("cpu"))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    task = build_task(cfg)
    examples = load_examples(cfg.data.eval, task.parse, limit=cfg.eval.num_prompts)
    prompts = encode_prompts(examples, cfg.data, tok, task)
    task.start(task_context(tokenizer=tok, cfg=cfg))
    try:
        backend = with_episodes(cfg, HFBackend(model.eval(), tok), tok, task)
        settings = EvalSettings(0, 0, (), 1.0, 1.0, 1234, cfg.reward.timeout_s)
        records, _ = evaluate_policy(backend, prompts, examples, task, settings)
    finally:
        task.close()
    return summarize(records, ()), records[0]["greedy"]["text"]


def heldout_em(model_path: Path, adapter: Path | None, cfg, retriever: str) -> dict:
    """heldout_summary with the given retriever."""
    import dataclasses

    cfg = dataclasses.replace(cfg, search=dataclasses.replace(cfg.search, retriever=retriever))
    m, example = heldout_summary(model_path, adapter, cfg)
    return {"em": m["accuracy"], "turns": m["turns_mean"], "searches": m["searches_mean"], "example": example}


def sampled_em(metrics: Path, n: int = 3) -> dict:
    """The training episodes' EM (sampled, temperature as configured): mean of the first and last `n` steps."""
    from rl_training.runners.monitor import read_jsonl

    rows, _ = read_jsonl(metrics)
    em = [r["reward/em_mean"] for r in rows if "reward/em_mean" in r]
    if not em:
        raise SystemExit(f"{metrics}: no reward/em_mean logged")
    return {"first": sum(em[:n]) / len(em[:n]), "last": sum(em[-n:]) / len(em[-n:])}


def sft_on_one_core(cfg: str, over: list[str], core: int, check: bool = True) -> int:
    """The SFT runner as one rank pinned to one core (so one torch thread); its exit status (`check`: raise
    unless 0). docs/search.md: the step stage 1 learns the copy at depends on the data order and the arithmetic
    (as two ranks, demo_tools.sft_ranks, order 1 had not learned it in 450 steps)."""
    cmd = torchrun_cmd("sft_runner.py", cfg, over)
    print(f"+ [core {core}]", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, check=check, **pinned({core})).returncode


def gated_sft(launch, cfg: str, over: list[str], run_dir, orders: list[int]) -> tuple[Path, dict]:
    """Stage 1 with its skill gate (sft.eval_every, sft.stop_when in `cfg`): trained with data order
    (train.seed) orders[0] until a held-out check passes or sft.steps end; then the next order, until one passes.
    `launch(cfg, overrides)` runs the SFT runner and returns its exit status; `run_dir(order)` is that order's run
    directory. (The passed run's directory, {"order", "steps", "accuracy", "tried": every order's outcome}.)"""
    tried = []
    for order in orders:
        out = Path(run_dir(order))
        status = launch(cfg, [*over, f"run.name={out.name}", f"train.seed={order}"])
        result = out / "sft_result.json"
        if not result.exists():  # the run failed, not the gate
            raise SystemExit(f"stage 1 SFT (data order {order}) failed with exit status {status}; see its output")
        gate = json.loads(result.read_text())["gate"]
        checks = [json.loads(p.read_text())["metrics"]["accuracy"] for p in (out / "eval" / "inloop").glob("*.json")]
        tried.append({"order": order, "passed": gate["passed"], "steps": gate["steps_run"], "best": max(checks)})
        print(f"stage 1, data order {order}: {tried[-1]}", flush=True)
        if gate["passed"]:
            accuracy = gate["metrics"]["accuracy"]
            return out, {"order": order, "steps": gate["passed_at"], "accuracy": accuracy, "tried": tried}
    raise SystemExit(f"stage 1 SFT learned its skill under none of the data orders {orders}: {tried}")


def rl_in_parallel(cfg: str, overs: dict[str, list[str]], cores: list[int]) -> None:
    """One torchrun per run (label -> overrides; here one per retriever) at once, each pinned to its own core
    (set_cpu_threads then gives it one thread); their output is printed when both have ended (the tail of each;
    all of a failed one's)."""
    procs = {}
    for (retriever, over), core in zip(overs.items(), cores, strict=False):
        cmd = torchrun_cmd("rl_runner.py", cfg, over)
        print(f"+ [core {core}]", " ".join(cmd), flush=True)
        log = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, **pinned({core}))
        procs[retriever] = (proc, log)
    failed = []
    for retriever, (proc, log) in procs.items():
        proc.wait()
        log.seek(0)
        text = log.read()
        log.close()
        print(f"--- RL run {retriever!r} (last lines) ---\n" + "\n".join(text.splitlines()[-8:]))
        if proc.returncode:
            failed.append(f"{retriever}: exit {proc.returncode}\n{text[-3000:]}")
    if failed:
        raise SystemExit("RL failed: " + "\n".join(failed))


def rl_runs(cfg: str, overs: dict[str, list[str]]) -> float:
    """The RL runs (label -> overrides) side by side, one core each, where the machine has a core per run, else
    one after another; the seconds they took."""
    cores, t = sorted(os.sched_getaffinity(0)), time.time()
    if len(overs) > 1 and len(cores) >= len(overs):
        rl_in_parallel(cfg, overs, cores)
    else:
        for over in overs.values():
            torchrun("rl_runner.py", cfg, over)
    return time.time() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hops", type=int, choices=[1, 2], default=1)
    ap.add_argument("--sft-cfg", default="cfg/search_sft.yaml")
    ap.add_argument("--start-cfg", default="cfg/search_start.yaml")
    ap.add_argument("--rl-cfg", default="cfg/search_cpu.yaml")
    ap.add_argument("--search-frac", type=float, default=0.3, help="share of the start's episodes that search")
    ap.add_argument("--output-dir", help="parent of the run directories (default: the configs' run.output_dir)")
    ap.add_argument("--skip-ablation", action="store_true", help="no search.retriever=none RL run")
    ap.add_argument("--orders", type=int, default=3, help="data orders stage 1 may try (its config's seed, then +1...)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rl_training.config.load import load_config

    t0 = time.time()
    stamp = time.strftime("%Y%m%d_%H%M%S")
    data = f"data/search{a.hops}"
    files = [f"data.train={data}/train.jsonl", f"data.eval={data}/heldout.jsonl", f"search.corpus={data}/corpus.jsonl"]
    if a.hops == 2:  # gold: 3 turns, up to 283 tokens after the prompt (topk 1); 256 cut the answer turn
        files += ["multiturn.max_turns=4", "multiturn.max_response_tokens=320"]
    out = [f"run.output_dir={a.output_dir}"] if a.output_dir else []
    # stage 1's skill gate checks valid.jsonl, never the held-out questions the table reports
    sft_over = [*out, *files, f"data.eval={data}/valid.jsonl", f"sft.gold_episodes={data}/gold_train.jsonl"]
    sft_cfg = load_config(REPO / a.sft_cfg, sft_over)
    if not (REPO / sft_cfg.model.name_or_path).exists():
        sh([sys.executable, "scripts/make_tiny_model.py", "--out", sft_cfg.model.name_or_path])
    # Written on every run (~2 s), so a copy left by an older generator is never used.
    topk, frac = str(sft_cfg.search.topk), str(a.search_frac)
    gen = [sys.executable, "scripts/make_search_data.py", "--out", data, "--hops", str(a.hops), "--topk", topk]
    sh([*gen, "--search-frac", frac, "--n-valid-keys", str(sft_cfg.eval.num_prompts)])
    cores = sorted(os.sched_getaffinity(0))
    orders = [data_order(sft_cfg.train.seed) + i for i in range(a.orders)]

    def run_dir(order: int) -> Path:
        return Path(sft_cfg.run.output_dir) / f"search_{stamp}_sft_order{order}"

    def launch(cfg: str, over: list[str]) -> int:
        return sft_on_one_core(cfg, over, cores[0], check=False)

    sft_dir, stage1 = gated_sft(launch, a.sft_cfg, sft_over, run_dir, orders)
    start_over = [f"run.name=search_{stamp}_start", *out, *files, f"model.name_or_path={sft_dir / 'final_model'}"]
    start_over += [f"sft.gold_episodes={data}/gold_train_mix.jsonl"]
    start_over += order_overrides(load_config(REPO / a.start_cfg, start_over))
    start_dir = Path(sft_cfg.run.output_dir) / f"search_{stamp}_start"
    sft_on_one_core(a.start_cfg, start_over, cores[0])
    t_sft = time.time()
    runs = {"bm25": f"search_{stamp}_rl"} | ({} if a.skip_ablation else {"none": f"search_{stamp}_none"})
    times, results, cfgs, overs = {"sft_s": t_sft - t0}, {}, {}, {}
    for retriever, name in runs.items():
        over = [f"run.name={name}", *out, *files, f"model.name_or_path={start_dir / 'final_model'}"]
        over += order_overrides(load_config(REPO / a.rl_cfg, over))
        overs[retriever] = [*over, f"search.retriever={retriever}", *a.overrides]
        cfgs[retriever] = load_config(REPO / a.rl_cfg, overs[retriever])
    times["rl_s"] = rl_runs(a.rl_cfg, overs)
    t = time.time()
    reader = heldout_em(REPO / sft_dir / "final_model", None, cfgs["bm25"], "bm25")
    for retriever, cfg in cfgs.items():
        run_dir = REPO / cfg.run.output_dir / cfg.run.name
        final = run_dir / "checkpoints" / f"step_{cfg.train.total_steps:06d}" / "adapter"
        results[retriever] = {
            "before": heldout_em(REPO / start_dir / "final_model", None, cfg, retriever),
            "after": heldout_em(REPO / start_dir / "final_model", final, cfg, retriever),
            "sampled": sampled_em(run_dir / "metrics.jsonl"),
        }
    times["eval_s"], times["total_s"] = time.time() - t, time.time() - t0
    cfg = cfgs["bm25"]
    print(f"\n== Search demo, {a.hops} hop(s): {cfg.eval.num_prompts} held-out questions, greedy episodes ==")
    print(
        f"stage 1 SFT (every gold episode searches): data order {stage1['order']}, its skill gate passed at step "
        f"{stage1['steps']} (EM {stage1['accuracy']:.2f} on {sft_cfg.eval.num_prompts} validation questions); "
        f"held-out EM {reader['em']:.3f}, {reader['searches']:.2f} searches"
    )
    head = (
        f"{'retriever':<10}{'EM start':>10}{'EM after RL':>13}{'change':>9}{'searches':>10}{'sampled EM, RL steps':>24}"
    )
    print(head)
    for retriever, r in results.items():
        b, f, smp = r["before"], r["after"], r["sampled"]
        print(
            f"{retriever:<10}{b['em']:>10.3f}{f['em']:>13.3f}{f['em'] - b['em']:>+9.3f}{f['searches']:>10.2f}"
            f"{smp['first']:>15.3f} -> {smp['last']:.3f}"
        )
    print(f"\nexample episode after RL (sampled text): {results['bm25']['after']['example']!r}")
    print("times: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    rl_dir = REPO / cfg.run.output_dir / cfg.run.name
    summary = {"hops": a.hops, "stage1": reader | {"gate": stage1}, "results": results, "times": times}
    (rl_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"summary: {rl_dir / 'demo_summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

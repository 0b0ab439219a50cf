"""The embedded CPU demo: tiny model -> SFT warm start -> Dr-GRPO -> before/after table on held-out prompts.

    make demo                      # sets up .venv first, then runs this
    make demo-code                 # the same for code rewards: scripts/demo.py --task code
    .venv/bin/python scripts/demo.py [--rl-cfg cfg/tiny_cpu.yaml] [--sft-cfg cfg/tiny_sft.yaml] [key=value ...]
    .venv/bin/python scripts/demo.py --output-dir /tmp/demo      # run directories there instead of runs/
    .venv/bin/python scripts/demo.py --server [--async 1]        # generation on a local vLLM server (K=1: async)

Everything is created locally (no downloads): the tiny Qwen2-architecture model (models/tiny-qwen2), the
task's data (--task reverse: string reversal, data/reverse; --task code: the synthetic program-synthesis
task, data/code_synth, programs graded in the bubblewrap sandbox on hidden inputs, docs/code.md), then
runs/demo_<time>_sft and runs/demo_<time>_rl. Both stages are launched with torchrun exactly as a user
would. Extra key=value arguments override the RL config. The held-out evaluation uses the eval pipeline's
code with the training grader (for code: the same sandbox pool settings, cfg.sandbox). The before/after
numbers and the times are written to runs/demo_<time>_rl/demo_summary.json. With --server the RL stage
generates on a vLLM OpenAI server the demo starts on 127.0.0.1 (rollout.backend=server, docs/server.md), and
--async K trains on batches sampled K policy versions back (rollout.max_async_level=K, truncated IS at 2).
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
# --task: (SFT config, RL config, data generator, the headline metric the acceptance test reads)
DEMOS = {
    "reverse": ("cfg/tiny_sft.yaml", "cfg/tiny_cpu.yaml", "scripts/make_synthetic_data.py", "greedy_reward"),
    "code": ("cfg/code_sft.yaml", "cfg/code_cpu.yaml", "scripts/make_code_data.py", "greedy_accuracy"),
}


def sh(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def data_order(seed: int) -> int:
    """A demo's data order (a train.seed) moved by $RL_DATA_ORDER (default 0): scripts/check_robustness.sh runs the
    demos under orders none of them was developed with."""
    return seed + int(os.environ.get("RL_DATA_ORDER", "0"))


def order_overrides(cfg) -> list[str]:
    """`train.seed` moved by $RL_DATA_ORDER for a run of `cfg` (a loaded config); none when it is unset."""
    return [f"train.seed={data_order(cfg.train.seed)}"] if data_order(0) else []


def torchrun_cmd(script: str, cfg: str, overrides: list[str], nproc: int = 1) -> list[str]:
    """torchrun of `nproc` ranks (default one) of rl_training/runners/<script>."""
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    return [*run, f"rl_training/runners/{script}", "--cfg", cfg, *overrides]


def pinned(cpus: set[int]) -> dict:
    """subprocess keyword arguments that run a child on `cpus` only, one torch thread per core."""
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus))}
    return {"env": env, "preexec_fn": lambda: os.sched_setaffinity(0, cpus)}


def torchrun(script: str, cfg: str, overrides: list[str], cpus: set[int] | None = None) -> None:
    """One rank of rl_training/runners/<script>; on `cpus` (one torch thread per core) when given."""
    cmd = torchrun_cmd(script, cfg, overrides)
    if not cpus:
        return sh(cmd)
    print(f"+ [cores {sorted(cpus)}]", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, **pinned(cpus))


def heldout_scores(model_path: Path, adapter: Path | None, cfg) -> dict:
    """Greedy and sampled (4 per prompt, the training temperature, seed 1234 for both models) scores with the
    eval pipeline's code: the training prompt template and grader (rl_training/evaluation/evaluate.py)."""
    import torch

    from rl_training.data.prompts import encode_prompts
    from rl_training.data.sources import load_examples
    from rl_training.evaluation.evaluate import EvalSettings, evaluate_policy
    from rl_training.evaluation.pass_at_k import summarize
    from rl_training.policy.models import load_base_model, load_tokenizer
    from rl_training.rollout.hf import HFBackend
    from rl_training.runtime.seeding import set_cpu_threads
    from rl_training.tasks.build import build_task, task_context

    set_cpu_threads()  # the runners' rule: RL_CPU_THREADS where set (make test-demos: 1), else the cores allowed
    task = build_task(cfg)  # the training run's task: its parsing, prompts, grader and sandbox pool settings
    tok = load_tokenizer(str(model_path))
    model_cfg = type(cfg.model)(**{**cfg.model.__dict__, "name_or_path": str(model_path)})
    model = load_base_model(model_cfg, torch.device("cpu"))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    examples = load_examples(cfg.data.eval, task.parse, limit=cfg.eval.num_prompts)
    prompts = encode_prompts(examples, cfg.data, tok, task)
    settings = EvalSettings(cfg.eval.max_new_tokens, 4, (1,), cfg.rollout.temperature, 1.0, 1234, cfg.reward.timeout_s)
    task.start(task_context(tokenizer=tok, cfg=cfg))
    try:
        records, _ = evaluate_policy(HFBackend(model.eval(), tok), prompts, examples, task, settings)
    finally:
        task.close()
    m = summarize(records, settings.ks)
    return {
        "greedy_reward": m["reward_mean"],
        "greedy_accuracy": m["accuracy"],
        "sampled_reward": m["sampled_reward_mean"],
        "sampled_accuracy": m["pass@1"],  # mean correctness of all samples
        "format_rate": m["format_rate"],
        "examples": [(r["question"], r["greedy"]["text"], r["reference"]) for r in records[:4]],
    }


def print_table(task: str, rl_cfg, before: dict, after: dict) -> None:
    """The held-out before/after table and a few greedy completions after RL."""
    rows = [
        ("held-out mean reward (greedy)", "greedy_reward"),
        ("held-out accuracy (greedy)", "greedy_accuracy"),
        (f"held-out mean reward (sampled, T={rl_cfg.rollout.temperature})", "sampled_reward"),
        ("held-out accuracy (sampled)", "sampled_accuracy"),
        ("format rate (greedy)", "format_rate"),
    ]
    if task == "code":  # the reward is the binary all-tests pass, so reward and accuracy are one number
        rows = [
            ("held-out pass rate (greedy)", "greedy_accuracy"),
            (f"held-out pass@1 (4 samples, T={rl_cfg.rollout.temperature})", "sampled_accuracy"),
            ("format rate (greedy)", "format_rate"),
        ]
    print(
        f"\n== Embedded demo: {rl_cfg.eval.num_prompts} held-out prompts never seen in training "
        f"(rollout backend: {rl_cfg.rollout.backend}, max_async_level {rl_cfg.rollout.max_async_level}) =="
    )
    print(f"{'metric':<44}{'SFT start':>11}{'after RL':>11}{'change':>10}")
    for label, key in rows:
        print(f"{label:<44}{before[key]:>11.3f}{after[key]:>11.3f}{after[key] - before[key]:>+10.3f}")
    print("\nexamples (question -> greedy completion after RL):")
    for q, c, ref in after["examples"]:
        shown_q = " ".join(q.split("\n")[1:-1]).replace("    # ", "") if task == "code" else q
        print(f"  {shown_q!r:>12} -> {c!r:<12}" + ("" if task == "code" else f" (reference {ref!r})"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(DEMOS), default="reverse", help="which demo (configs and data)")
    ap.add_argument("--sft-cfg", help="default: the task's (reverse: cfg/tiny_sft.yaml, code: cfg/code_sft.yaml)")
    ap.add_argument("--rl-cfg", help="default: the task's (reverse: cfg/tiny_cpu.yaml, code: cfg/code_cpu.yaml)")
    ap.add_argument("--output-dir", help="parent of both run directories (default: the configs' run.output_dir)")
    ap.add_argument("--server", action="store_true", help="RL generates on a local vLLM server (docs/server.md)")
    ap.add_argument("--async", dest="async_level", type=int, default=0, help="rollout.max_async_level (needs --server)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.async_level and not a.server:
        ap.error("--async needs --server: asynchronous rollouts run on the server backend")
    sft_default, rl_default, make_data, headline = DEMOS[a.task]
    a.sft_cfg, a.rl_cfg = a.sft_cfg or sft_default, a.rl_cfg or rl_default
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rl_training.config.load import load_config
    from rl_training.config.resolve import resolve_backend_name
    from rl_training.rollout.kinds import vllm_max_lora_rank

    t0 = time.time()
    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = [f"run.output_dir={a.output_dir}"] if a.output_dir else []
    sft_over = [f"run.name=demo_{stamp}_sft", *out]
    sft_cfg = load_config(REPO / a.sft_cfg, sft_over)
    sft_over += order_overrides(sft_cfg)
    if not Path(REPO / sft_cfg.model.name_or_path).exists():
        sh([sys.executable, "scripts/make_tiny_model.py", "--out", sft_cfg.model.name_or_path])
    # The code task's data is always rewritten (deterministic, under a second): a copy left by an older
    # generator (before the shown inputs' marker, rl_training/tasks/code/synthetic.py) would be a different task.
    if a.task == "code" or not Path(REPO / sft_cfg.data.train).exists():
        sh([sys.executable, make_data, "--out", str(Path(sft_cfg.data.train).parent)])

    sft_dir = Path(sft_cfg.run.output_dir) / sft_cfg.run.name
    torchrun("sft_runner.py", a.sft_cfg, sft_over)
    t_sft = time.time()
    rl_over = [f"run.name=demo_{stamp}_rl", *out, f"model.name_or_path={sft_dir / 'final_model'}"]
    rl_over += [*order_overrides(load_config(REPO / a.rl_cfg, rl_over)), *a.overrides]
    rl_cfg = load_config(REPO / a.rl_cfg, rl_over)
    server, rl_cpus = None, None
    if a.server:
        # The server gets a core of its own where there are two or more, the trainer the rest: sharing every core,
        # the engine's OpenMP threads and the trainer's slowed its update tenfold (0.17 -> 2 s a step; docs/server.md).
        cores = sorted(os.sched_getaffinity(0))
        server_cpus, rl_cpus = ({cores[-1]}, set(cores[:-1])) if len(cores) > 1 else (None, None)
        from rl_training.rollout.local_server import VLLMServer

        log = REPO / rl_cfg.run.output_dir / f"demo_{stamp}_server.log"
        server = VLLMServer(
            REPO / sft_dir / "final_model", log, max_lora_rank=vllm_max_lora_rank(rl_cfg.lora.r), cpus=server_cpus
        )
        server.start()
        print(f"vLLM server on {server.url} (log: {log})", flush=True)
        rl_over += ["rollout.backend=server", f"server.urls=[{server.url}]"]
        rl_over += [f"rollout.max_async_level={a.async_level}", "loss.tis_cap=2.0"] if a.async_level else []
        rl_cfg = load_config(REPO / a.rl_cfg, rl_over)
    rl_cfg.rollout.backend = resolve_backend_name(rl_cfg.rollout.backend)  # what the runner will use
    try:
        torchrun("rl_runner.py", a.rl_cfg, rl_over, rl_cpus)
    finally:
        if server is not None:
            server.stop()
    t_rl = time.time()

    rl_dir = REPO / rl_cfg.run.output_dir / rl_cfg.run.name
    final = rl_dir / "checkpoints" / f"step_{rl_cfg.train.total_steps:06d}" / "adapter"
    before = heldout_scores(REPO / sft_dir / "final_model", None, rl_cfg)
    after = heldout_scores(REPO / sft_dir / "final_model", final, rl_cfg)
    t_eval = time.time()

    print_table(a.task, rl_cfg, before, after)
    times = {"sft_s": t_sft - t0, "rl_s": t_rl - t_sft, "eval_s": t_eval - t_rl, "total_s": t_eval - t0}
    print("\ntimes: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    shown = rl_dir.relative_to(REPO) if rl_dir.is_relative_to(REPO) else rl_dir
    print(f"run directories: {sft_dir} and {shown}")
    print(f"curves: .venv/bin/tensorboard --logdir {shown}/tb")
    summary = {"task": a.task, "headline": headline, "before": before, "after": after, "times": times}
    summary["backend"] = rl_cfg.rollout.backend
    summary["max_async_level"] = rl_cfg.rollout.max_async_level
    (rl_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The reasoning-gym demo on CPU: a dataset the field already has, by name -> SFT on its generated answers ->
Dr-GRPO -> held-out reward before and after, against the same RL with its rewards shuffled between problems.

    make demo-reasoning-gym
    .venv/bin/python scripts/demo_reasoning_gym.py [--output-dir /tmp/demo] [--skip-ablation] [key=value ...]

Everything is local: the tiny model (models/tiny-qwen2) and reasoning-gym's spell_backward, its train, validation
and held-out splits generated from seeds, disjoint (no data files; docs/extending.md), then
- runs/spell_<time>_sft_o<order>: SFT of all weights of the random model on the train split's answers
  (cfg/spell_sft.yaml), gated: it stops when 128 validation problems are answered 0.7 accurately, and the next data
  order is tried (--orders) when sft.steps end first;
- runs/spell_<time>_rl: Dr-GRPO + LoRA from it with dynamic sampling, graded by the dataset's own score_answer
  (cfg/spell_cpu.yaml);
- runs/spell_<time>_shuffled, unless --skip-ablation: the same RL with every completion graded against another
  problem's answer (scripts/shuffled_reward.py): rewards of the same scale and spread, unrelated to the question.
Held-out greedy and sampled scores (scripts/demo.py's heldout_scores: the eval pipeline, the real grader) of the SFT
start and of each RL result; on two or more cores the two RL runs go side by side, one core each. Extra key=value
arguments override the RL config. Numbers and times go to runs/spell_<time>_rl/demo_summary.json.
scripts/survey_reasoning_gym.py runs the same protocol on other datasets.
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
from demo import data_order, heldout_scores, sh, torchrun, torchrun_cmd  # noqa: E402  (the single-turn demo's launch and eval helpers)
from demo_search import gated_sft, rl_runs  # noqa: E402

SFT_CFG, RL_CFG = "cfg/spell_sft.yaml", "cfg/spell_cpu.yaml"
SPLITS = {"size": 4000, "heldout_size": 128, "valid_size": 128, "answer_format": "plain"}  # the configs' splits
# The survey's protocol (scripts/survey_reasoning_gym.py, docs/extending.md): 600 SFT steps on a cosine schedule,
# ungated (a dataset the model does not learn is a row of the table, not a failure), and RL without refills.
SURVEY = [
    "sft.steps=600",
    "sft.stop_when=[]",
    "sft.eval_every=0",
    "sft.schedule=cosine",
    "rollout.dynamic_sampling=false",
]
METRICS = [
    ("held-out mean reward (greedy)", "greedy_reward"),
    ("held-out accuracy (greedy)", "greedy_accuracy"),
    ("held-out mean reward (sampled)", "sampled_reward"),
    ("held-out accuracy (sampled)", "sampled_accuracy"),
]


def task_overrides(dataset: str, settings: dict, new_tokens: int) -> list[str]:
    """The overrides that put another dataset (and its settings) into both configs."""
    args = json.dumps({**settings, **SPLITS})  # JSON is a YAML flow mapping
    tokens = [f"rollout.max_new_tokens={new_tokens}", f"eval.max_new_tokens={new_tokens}"]
    return [f"task.name=reasoning-gym/{dataset}", f"task.args={args}", *tokens]


def heldout(rl_cfg, model: Path, adapter: Path | None) -> dict:
    return {k: v for k, v in heldout_scores(model, adapter, rl_cfg).items() if k != "examples"}


def final_adapter(cfg) -> Path:
    return REPO / cfg.run.output_dir / cfg.run.name / "checkpoints" / f"step_{cfg.train.total_steps:06d}" / "adapter"


def sft(name: str, over: list[str], output_dir: str | None) -> Path:
    """The SFT stage as one rank, ungated (the survey's); its final model."""
    from rl_training.config.load import load_config

    sft_over = [f"run.name={name}_sft", *([f"run.output_dir={output_dir}"] if output_dir else []), *over]
    cfg = load_config(REPO / SFT_CFG, sft_over)
    make_model(cfg)
    torchrun("sft_runner.py", SFT_CFG, sft_over)
    return REPO / cfg.run.output_dir / cfg.run.name / "final_model"


def make_model(sft_cfg) -> None:
    if not (REPO / sft_cfg.model.name_or_path).exists():
        sh([sys.executable, "scripts/make_tiny_model.py", "--out", sft_cfg.model.name_or_path])


def gated(name: str, orders: list[int], output_dir: str | None) -> tuple[Path, dict]:
    """The demo's SFT stage: gated on the validation split, data order by data order (demo_search.gated_sft); the
    final model of the first order that passed, and the gate's record."""
    from rl_training.config.load import load_config

    out = [f"run.output_dir={output_dir}"] if output_dir else []
    cfg = load_config(REPO / SFT_CFG, out)
    make_model(cfg)

    def launch(cfg_path: str, over: list[str]) -> int:
        cmd = torchrun_cmd("sft_runner.py", cfg_path, over)
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=REPO).returncode

    run_dir = lambda order: REPO / cfg.run.output_dir / f"{name}_sft_o{order}"  # noqa: E731
    sft_dir, gate = gated_sft(launch, SFT_CFG, out, run_dir, orders)
    return sft_dir / "final_model", gate


def rl_overrides(name: str, model: Path, output_dir: str | None, over: list[str]) -> list[str]:
    out = [f"run.output_dir={output_dir}"] if output_dir else []
    return [f"run.name={name}", *out, f"model.name_or_path={model}", *over]


def sft_then_rl(name: str, over: list[str], output_dir: str | None) -> dict:
    """SFT, one RL run from it, and the held-out scores before and after RL (the survey's protocol)."""
    from rl_training.config.load import load_config

    t0 = time.time()
    over = [*SURVEY, *over]
    model = sft(name, over, output_dir)
    t_sft = time.time()
    rl_over = rl_overrides(f"{name}_rl", model, output_dir, over)
    torchrun("rl_runner.py", RL_CFG, rl_over)
    t_rl = time.time()
    cfg = load_config(REPO / RL_CFG, rl_over)
    before, after = heldout(cfg, model, None), heldout(cfg, model, final_adapter(cfg))
    times = {"sft_s": t_sft - t0, "rl_s": t_rl - t_sft, "eval_s": time.time() - t_rl, "total_s": time.time() - t0}
    return {"before": before, "after": after, "times": times}


def shuffled_overrides(cfg) -> list[str]:
    """The ablation's task: the demo's, its rewards shuffled between problems (scripts/shuffled_reward.py)."""
    inner = json.dumps({"task": cfg.task.name, "args": cfg.task.args})
    task = [f"task.name={REPO / 'scripts' / 'shuffled_reward.py'}:ShuffledReward", f"task.args={inner}"]
    return [*task, "data.train=task:train", "data.eval=task:heldout"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-dir", help="parent of the run directories (default: the configs' run.output_dir)")
    ap.add_argument(
        "--seed", type=int, default=data_order(0), help="train.seed of SFT and both RL runs ($RL_DATA_ORDER or 0)"
    )
    ap.add_argument("--orders", type=int, default=3, help="data orders the gated SFT may try (--seed, then +1...)")
    ap.add_argument("--skip-ablation", action="store_true", help="no shuffled-reward RL run")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rl_training.config.load import load_config

    t0 = time.time()
    stamp = time.strftime("%Y%m%d_%H%M%S")
    model, gate = gated(f"spell_{stamp}", [a.seed + i for i in range(a.orders)], a.output_dir)
    seed = [f"train.seed={gate['order']}"]  # RL on the data order whose SFT passed
    t_sft = time.time()
    runs = {"rl": f"spell_{stamp}_rl"} | ({} if a.skip_ablation else {"shuffled": f"spell_{stamp}_shuffled"})
    overs = {label: rl_overrides(name, model, a.output_dir, [*seed, *a.overrides]) for label, name in runs.items()}
    cfgs = {label: load_config(REPO / RL_CFG, over) for label, over in overs.items()}
    if "shuffled" in overs:
        overs["shuffled"] += shuffled_overrides(cfgs["rl"])
    rl_s = rl_runs(RL_CFG, overs)
    t = time.time()
    graded = cfgs["rl"]  # every model graded by the real task
    sft_cfg = load_config(REPO / SFT_CFG, [])
    scores = {"random": heldout(graded, REPO / sft_cfg.model.name_or_path, None), "sft": heldout(graded, model, None)}
    scores |= {label: heldout(graded, model, final_adapter(cfg)) for label, cfg in cfgs.items()}
    times = {"sft_s": t_sft - t0, "rl_s": rl_s, "eval_s": time.time() - t, "total_s": time.time() - t0}
    print_table(graded, scores)
    print("\ntimes: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    rl_dir = REPO / graded.run.output_dir / graded.run.name
    print(f"SFT gate: data order {gate['order']}, validation accuracy {gate['accuracy']:.3f} at step {gate['steps']}")
    summary = {"task": graded.task.name, "seed": gate["order"], "gate": gate, "scores": scores, "times": times}
    (rl_dir / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"summary: {rl_dir / 'demo_summary.json'}")
    return 0


def print_table(cfg, scores: dict) -> None:
    """Held-out scores of the random model, the SFT start and each RL result (change: against the SFT start)."""
    print(
        f"\n== reasoning-gym demo: {cfg.task.name}, {cfg.eval.num_prompts} held-out problems never trained on, "
        f"{cfg.train.total_steps} RL steps of {cfg.rollout.prompts_per_step} x {cfg.rollout.group_size} =="
    )
    cols = [("random model", "random"), ("SFT start", "sft"), ("after RL", "rl")]
    cols += [("shuffled-reward RL", "shuffled")] if "shuffled" in scores else []
    print(f"{'metric':<32}" + "".join(f"{name:>14}" for name, _ in cols[:3]) + f"{'change':>9}", end="")
    print(f"{cols[3][0]:>20}{'change':>9}" if len(cols) > 3 else "")
    for label, key in METRICS:
        sft, rl = scores["sft"][key], scores["rl"][key]
        line = f"{label:<32}{scores['random'][key]:>14.3f}{sft:>14.3f}{rl:>14.3f}{rl - sft:>+9.3f}"
        if "shuffled" in scores:
            line += f"{scores['shuffled'][key]:>20.3f}{scores['shuffled'][key] - sft:>+9.3f}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())

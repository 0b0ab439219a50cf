"""Which reasoning-gym dataset the real model (SmolLM2-135M-Instruct, Q4_1 dequantized) can gain on with RL in
minutes on CPU: the survey behind the real-model demo's task (docs/real_model.md).

    .venv/bin/python scripts/survey_real_model.py [--only letter_counting,gcd] [--rl 2] [--output-dir DIR]

Phase 1, every candidate: a LoRA SFT on the dataset's answer format (cfg/smollm2_sft.yaml with the dataset swapped
in, --sft-steps steps), then the SFT model on the held-out split (eval.num_prompts problems, greedy and 8 samples at
the training temperature, the eval pipeline with the colocated vLLM engine): greedy accuracy, sampled accuracy,
pass@8, and `mixed`, the share of problems whose 8 samples are neither all right nor all wrong (the groups that carry
a Dr-GRPO gradient). RL can gain where pass@8 is well above the sampled accuracy: the right answer is within reach
of the sampler but not its habit. `const`: the accuracy of always answering the split's most common answer.
Phase 2 (--rl N): the N candidates with the largest pass@8 - sampled accuracy get one RL run each
(cfg/smollm2_rl.yaml with the dataset swapped in, seed 0) and its in-loop eval at the last step.
Prints a markdown table; writes DIR/survey.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from demo import torchrun  # noqa: E402
from demo_real import RL_CFG, SFT_CFG, inloop_metrics  # noqa: E402

# (dataset, its settings, new tokens: the longest answer in tags + EOS, with room)
CANDIDATES = [
    ("spell_backward", {"min_word_len": 3, "max_word_len": 5}, 16),
    ("letter_counting", {"min_words": 3, "max_words": 5}, 12),
    ("gcd", {"min_value": 1, "max_value": 50}, 12),
    ("leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 3}, 12),
    ("products", {"min_digits": 1, "max_digits": 1}, 12),
    ("number_sorting", {"min_numbers": 3, "max_numbers": 3, "max_decimals": 0, "min_value": 0, "max_value": 99}, 24),
    (
        "basic_arithmetic",
        {
            "min_terms": 2,
            "max_terms": 2,
            "min_digits": 1,
            "max_digits": 2,
            "operators": ["+", "-"],
            "allow_parentheses": False,
            "allow_negation": False,
        },
        16,
    ),
]
SPLITS = {"size": 2000, "heldout_size": 128}


def task_overrides(dataset: str, settings: dict, new_tokens: int) -> list[str]:
    args = json.dumps({**settings, **SPLITS})  # JSON is a YAML flow mapping
    tokens = [f"rollout.max_new_tokens={new_tokens}", f"eval.max_new_tokens={new_tokens}"]
    return [f"task.name=reasoning-gym/{dataset}", f"task.args={args}", *tokens]


def model_scores(model: Path, over: list[str]) -> dict:
    """The held-out greedy accuracy, sampled accuracy (8 samples), pass@8 and mixed share of `model`."""
    from rl_training.base import dist
    from rl_training.config.load import load_config
    from rl_training.evaluation.evaluate import EvalSettings, evaluate_policy, load_eval_set
    from rl_training.evaluation.pass_at_k import summarize
    from rl_training.policy.models import build_policy, load_tokenizer
    from rl_training.rollout.factory import build_rollout
    from rl_training.tasks.build import build_task

    cfg = load_config(REPO / RL_CFG, [f"model.name_or_path={model}", *over, "eval.num_samples=8", "eval.ks=[1,8]"])
    info = dist.init_distributed()
    task = build_task(cfg)
    tokenizer = load_tokenizer(str(model))
    examples, prompts = load_eval_set(cfg, tokenizer, task)
    _, policy = build_policy(cfg, info.device)  # a fresh adapter: B = 0, exactly the model
    backend = build_rollout(cfg, policy, tokenizer, info, task)
    try:
        records, _ = evaluate_policy(backend, prompts, examples, task, EvalSettings.from_config(cfg))
    finally:
        backend.close()
    m = summarize(records, (1, 8))
    rates = [sum(s["correct"] for s in r["samples"]) / len(r["samples"]) for r in records]
    return {
        "greedy": m["accuracy"],
        "sampled": m["pass@1"],
        "pass@8": m["pass@8"],
        "mixed": sum(0 < p < 1 for p in rates) / len(rates),
        "format": m["format_rate"],
        "const": Counter(ex.reference for ex in examples).most_common(1)[0][1] / len(examples),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated dataset names (default: every candidate)")
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--rl", type=int, default=0, help="RL runs for the N most promising candidates")
    ap.add_argument("--output-dir", default="runs/survey_real_model")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    out = REPO / a.output_dir
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dataset, settings, new_tokens in CANDIDATES:
        if only and dataset not in only:
            continue
        t0 = time.time()
        over = task_overrides(dataset, settings, new_tokens)
        name = f"survey_{dataset}"
        torchrun("sft_runner.py", SFT_CFG, [f"run.output_dir={out}", f"run.name={name}", f"sft.steps={a.sft_steps}",
                                            "sft.overwrite=true", *over])  # fmt: skip
        scores = model_scores(out / name / "final_model", over)
        rows.append({"dataset": dataset, "settings": settings, **scores, "minutes": (time.time() - t0) / 60})
        print(f"survey: {json.dumps(rows[-1])}", flush=True)
        (out / "survey.json").write_text(json.dumps(rows, indent=2))
    for row in sorted(rows, key=lambda r: r["sampled"] - r["pass@8"])[: a.rl]:
        over = task_overrides(row["dataset"], row["settings"], 16)
        model = out / f"survey_{row['dataset']}" / "final_model"
        total = 30
        run = [f"run.output_dir={out}", f"run.name=survey_{row['dataset']}_rl", f"model.name_or_path={model}"]
        torchrun("rl_runner.py", RL_CFG, [*run, *over, f"train.total_steps={total}", f"eval.every={total}"])
        after = inloop_metrics(out / f"survey_{row['dataset']}_rl", total)
        row["after_rl"] = {"greedy": after["accuracy"], "sampled": after["pass@1"], "pass@8": after["pass@8"]}
        (out / "survey.json").write_text(json.dumps(rows, indent=2))
    print("\n| dataset | const | SFT: greedy / sampled / pass@8 | mixed | after RL: greedy / sampled | minutes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rl = r.get("after_rl")
        after = f"{rl['greedy']:.2f} / {rl['sampled']:.2f}" if rl else "-"
        print(
            f"| {r['dataset']} | {r['const']:.2f} | {r['greedy']:.2f} / {r['sampled']:.2f} / {r['pass@8']:.2f} | "
            f"{r['mixed']:.2f} | {after} | {r['minutes']:.1f} |"
        )
    print(f"\n{out / 'survey.json'}; protocol: {SFT_CFG} ({a.sft_steps} steps), then {RL_CFG} with the dataset swapped")
    return 0


if __name__ == "__main__":
    sys.exit(main())

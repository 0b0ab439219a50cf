"""`python -m rl_training.synthesize`: rejection sampling with the real engine, then SFT on what it wrote."""

from __future__ import annotations

import json

import pytest

from rl_training.data.sources import Example
from rl_training.runners import sft_runner, synthesize
from rl_training.tasks.build import make_task
from tests.helpers import REPO


def test_select_keeps_verified_distinct_samples_and_counts_pass_rates():
    exs = [Example("abc", "cba", "cba", "f:1"), Example("xy", "yx", "yx", "f:2")]
    # Problem 1: 3 of 4 verified, two of them the same up to spacing -> kept 2, pass rate 0.75.
    # Problem 2: none verified -> kept 0, pass rate 0.
    texts = ["cba", "c b a", "cba ", "cb", "xy", "y", "", "yxx"]
    correct = [True, True, True, False, False, False, False, False]
    kept, stats = synthesize.select(exs, texts, correct, k=4)
    assert [r["answer"] for r in kept] == ["cba", "c b a"]
    assert kept[0] == {"question": "abc", "answer": "cba", "reference": "cba", "source": "f:1", "synthesized": True}
    assert [(s["verified"], s["kept"], s["pass_rate"]) for s in stats] == [(3, 2, 0.75), (0, 0, 0.0)]
    assert "2 problems: 1 with >= 1 verified sample (50.0%), mean pass rate 0.375, 2 records kept" in (
        synthesize.summary(stats)
    )


@pytest.mark.slow
def test_synthesize_with_vllm_then_sft(tiny_model, reverse_data, tmp_path, capsys):
    pytest.importorskip("vllm")
    # Three-letter problems, and a model SFT'd on them long enough to reverse some exactly and not all (the
    # shared 40-step warm model reverses almost none of them exactly).
    problems = tmp_path / "short.jsonl"
    rows = [json.loads(x) for x in (reverse_data / "train.jsonl").read_text().splitlines()]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows if len(r["question"]) == 3))
    sft = [f"data.eval={reverse_data / 'heldout.jsonl'}", f"run.output_dir={tmp_path / 'runs'}", "sft.warmup_steps=5"]
    cfg = str(REPO / "cfg" / "tiny_sft.yaml")
    assert sft_runner.main(["--cfg", cfg, f"model.name_or_path={tiny_model}", f"data.train={problems}", *sft]) == 0
    model = tmp_path / "runs" / "tiny_sft" / "final_model"
    out = tmp_path / "synth" / "reverse.jsonl"
    args = [
        "--cfg",
        str(REPO / "cfg" / "tiny_cpu.yaml"),
        "--out",
        str(out),
        "--k",
        "8",
        "--max-problems",
        "24",
        f"model.name_or_path={model}",
        f"data.train={problems}",
        "rollout.backend=vllm",
    ]
    assert synthesize.main(args) == 0
    printed = capsys.readouterr().out
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    stats = [json.loads(x) for x in out.with_name(out.name + ".stats.jsonl").read_text().splitlines()]
    assert len(stats) == 24 and all(s["samples"] == 8 for s in stats)
    # The warm model solves some problems and not all (its greedy accuracy is well between 0 and 1).
    assert 0 < len(kept) < 24 * 8 and 0 < sum(s["verified"] for s in stats) < 24 * 8
    # Every kept record is verified by the training grader, and no problem keeps a duplicate.
    task = make_task("reverse")
    assert all(task.reward(r["answer"], Example(r["question"], r["reference"])) >= task.correct_threshold for r in kept)
    assert len({(r["question"], synthesize.canonical(r["answer"])) for r in kept}) == len(kept)
    assert sum(s["kept"] for s in stats) == len(kept)
    assert "SFT on it" in printed and f"data.train={out}" in printed
    # The output is SFT data as it is: the runner trains on it.
    rc = sft_runner.main(
        [
            "--cfg",
            cfg,
            f"model.name_or_path={model}",
            f"data.train={out}",
            "data.question_key=question",
            "data.answer_key=answer",
            *sft,
            "run.name=sft_on_synth",
            "sft.steps=3",
        ]
    )
    assert rc == 0 and (tmp_path / "runs" / "sft_on_synth" / "final_model" / "config.json").exists()


def test_bad_checkpoint_is_one_line_error(tmp_path, capsys, tiny_model):
    rc = synthesize.main(
        [
            "--cfg",
            str(REPO / "cfg" / "tiny_cpu.yaml"),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--checkpoint",
            str(tmp_path),
            f"model.name_or_path={tiny_model}",
            "rollout.backend=hf",
            "data.train=" + str(REPO / "tests" / "data" / "nonexistent.jsonl"),
        ]
    )
    assert rc == 2 and "error:" in capsys.readouterr().err and not (tmp_path / "o.jsonl").exists()

"""SFT warm start (full and LoRA-merged) feeding the RL runner, the GSM8K path, and offline model errors."""

from __future__ import annotations

import json

import pytest
import torch

from rl_training.runners import rl_runner, sft_runner
from tests.helpers import REPO, SFT_CFG, TESTCFG


def test_lora_sft_writes_a_merged_model_the_rl_runner_starts_from(tiny_model, reverse_data, tmp_path):
    from transformers import AutoModelForCausalLM

    data = [f"data.train={reverse_data / 'train.jsonl'}", f"data.eval={reverse_data / 'heldout.jsonl'}"]
    rc = sft_runner.main(
        [
            "--cfg",
            SFT_CFG,
            f"model.name_or_path={tiny_model}",
            *data,
            f"run.output_dir={tmp_path}",
            "run.name=lora_sft",
            "sft.steps=5",
            "sft.full_finetune=false",
            "sft.lr=1e-2",
        ]
    )
    assert rc == 0
    final = tmp_path / "lora_sft" / "final_model"
    assert (final / "config.json").exists() and (final / "tokenizer.json").exists()
    assert not (final / "adapter_config.json").exists()  # merged: a plain HF model
    merged = AutoModelForCausalLM.from_pretrained(final)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    ids = torch.tensor([[70, 71, 72, 63]])
    with torch.no_grad():
        assert (merged(input_ids=ids).logits - base(input_ids=ids).logits).abs().max() > 1e-4
    lines = (tmp_path / "lora_sft" / "metrics.jsonl").read_text().splitlines()
    sft_losses = [json.loads(x)["sft/loss"] for x in lines]
    assert len(sft_losses) == 5 and sft_losses[-1] < sft_losses[0]
    assert (
        rl_runner.main(
            [
                "--cfg",
                TESTCFG,
                f"model.name_or_path={final}",
                *data,
                f"run.output_dir={tmp_path}",
                "train.total_steps=1",
            ]
        )
        == 0
    )


def test_gsm8k_format_end_to_end(warm_model, tmp_path):
    # GSM8K-format records graded by math-verify; the tiny model writes nonsense, so rewards are 0 but
    # every stage (prompt template, generation, grading, logging) must run and log finite values.
    rows = [
        {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b:,}"}
        for a, b in [(1, 2), (30, 40), (500, 700), (1200, 34)]
    ]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = rl_runner.main(
        [
            "--cfg",
            TESTCFG,
            f"model.name_or_path={warm_model}",
            "task.name=gsm8k",
            f"data.train={path}",
            f"data.eval={path}",
            "data.prompt_template=Q: {question}\nA:",
            f"run.output_dir={tmp_path}",
            "train.total_steps=1",
        ]
    )
    assert rc == 0
    m = json.loads((tmp_path / "testconfig" / "metrics.jsonl").read_text().splitlines()[0])
    assert m["rollout/reward_mean"] == 0.0 and m["rollout/reward_fn_errors"] == 0


def test_offline_hub_id_without_cache_is_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))
    rc = rl_runner.main(["--cfg", TESTCFG, "model.name_or_path=Qwen/NotCachedHere-0.5B", f"run.output_dir={tmp_path}"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("error: model.name_or_path=Qwen/NotCachedHere-0.5B: cannot load tokenizer")
    assert "hub offline=1" in err[0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.prompts_per_step=3", "not divisible by train.micro_batch_groups=2"),
        ("data.train=/no/such.jsonl", "data file not found: /no/such.jsonl"),
    ],
)
def test_runner_input_errors(warm_model, tmp_path, capsys, override, message):
    assert (
        rl_runner.main(["--cfg", TESTCFG, f"model.name_or_path={warm_model}", f"run.output_dir={tmp_path}", override])
        == 2
    )
    assert message in capsys.readouterr().err
    assert not (tmp_path / "testconfig" / "checkpoints").exists()


def test_runner_data_load_errors_are_one_line(tiny_model, tmp_path, capsys):
    bad = tmp_path / "corrupt.parquet"
    bad.write_bytes(b"PAR1 cut off mid-write")
    for spec, start in [
        (str(bad), f"error: {bad}: unreadable parquet file (ArrowInvalid: "),
        ("gsm8kk@train", "error: data spec 'gsm8kk@train' is not a local .jsonl/.json/.parquet file"),
    ]:
        model, out = f"model.name_or_path={tiny_model}", f"run.output_dir={tmp_path}"
        assert rl_runner.main(["--cfg", TESTCFG, model, out, f"data.train={spec}"]) == 2
        err = capsys.readouterr().err.splitlines()  # the model loads first: its progress bar is on stderr too
        errors = [line for line in err if line.startswith("error:")]
        assert len(errors) == 1 and errors[0] == err[-1] and errors[0].startswith(start), err


def test_sft_refuses_to_replace_a_finished_run_unless_asked(tiny_model, reverse_data, tmp_path, capsys):
    base = [
        "--cfg",
        SFT_CFG,
        f"model.name_or_path={tiny_model}",
        f"data.train={reverse_data / 'train.jsonl'}",
        f"run.output_dir={tmp_path}",
        "run.name=sft",
        "sft.warmup_steps=0",
    ]
    run_dir = tmp_path / "sft"
    assert sft_runner.main([*base, "sft.steps=2"]) == 0
    weights = (run_dir / "final_model" / "model.safetensors").read_bytes()
    metrics = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()

    assert sft_runner.main([*base, "sft.steps=3"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {run_dir} already has a final_model; pass sft.overwrite=true to replace it (and its "
        "metrics.jsonl), or choose another run.name (nothing was changed)"
    ]
    assert (run_dir / "final_model" / "model.safetensors").read_bytes() == weights  # nothing lost
    assert (run_dir / "metrics.jsonl").read_text() == metrics

    assert sft_runner.main([*base, "sft.steps=3", "sft.overwrite=true"]) == 0  # asked for explicitly
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert (run_dir / "final_model" / "model.safetensors").read_bytes() != weights


@pytest.mark.parametrize(("schedule", "expected"), [("cosine", [1.0, 0.75, 0.25]), ("constant", [1.0, 1.0, 1.0])])
def test_sft_schedule(tiny_model, reverse_data, tmp_path, schedule, expected):
    """sft.schedule reaches the SFT optimizer. No warmup, 3 steps, peak 1e-3: cosine logs 0.5 * (1 + cos(pi * s / 3))
    at s = 0, 1, 2 (1, 0.75, 0.25 of the peak), constant the peak each step."""
    base = ["--cfg", SFT_CFG, f"model.name_or_path={tiny_model}", f"data.train={reverse_data / 'train.jsonl'}"]
    base += [f"run.output_dir={tmp_path}", "run.name=s", "sft.warmup_steps=0", "sft.steps=3", "sft.lr=1e-3"]
    assert sft_runner.main([*base, f"sft.schedule={schedule}"]) == 0
    lines = (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["sft/lr"] for x in lines] == pytest.approx([1e-3 * e for e in expected])


def test_sft_adamw_takes_the_optim_sections_betas_and_eps(tiny_model, reverse_data, tmp_path):
    """SFT's AdamW is RL's (optim.beta1/beta2/eps/weight_decay, clipping) with sft.lr and its schedule. After one
    step from zero moments, AdamW moves each weight by lr * g / (|g| + eps) (bias correction cancels the betas):
    with eps 1e-8 that is lr (1e-3) for every weight with a gradient; with optim.eps=1e3 and the gradient clipped
    to norm 1 (|g| <= 1) it is at most lr / 1e3 = 1e-6."""
    from safetensors.torch import load_file

    base = ["--cfg", SFT_CFG, f"model.name_or_path={tiny_model}", f"data.train={reverse_data / 'train.jsonl'}"]
    base += [f"run.output_dir={tmp_path}", "sft.warmup_steps=0", "sft.steps=1", "sft.lr=1e-3", "sft.schedule=constant"]
    assert sft_runner.main([*base, "run.name=default", "optim.weight_decay=0", "optim.max_grad_norm=1"]) == 0
    assert sft_runner.main([*base, "run.name=eps", "optim.eps=1e3", "optim.max_grad_norm=1"]) == 0
    start = load_file(tiny_model / "model.safetensors")

    def max_move(run: str) -> float:
        final = load_file(tmp_path / run / "final_model" / "model.safetensors")
        return max((final[k] - start[k]).abs().max().item() for k in start)

    assert max_move("default") == pytest.approx(1e-3, rel=1e-3)
    assert 0 < max_move("eps") <= 1e-6


def test_sft_warns_of_the_rl_learning_rate_keys_it_does_not_use(tiny_model, reverse_data, tmp_path, capsys):
    """optim.lr / warmup_steps / schedule are RL's (SFT's are sft.*): set away from their defaults, SFT names them
    in one warning line and trains (one YAML may serve both runners); at their defaults it says nothing."""
    base = ["--cfg", SFT_CFG, f"model.name_or_path={tiny_model}", f"data.train={reverse_data / 'train.jsonl'}"]
    base += [f"run.output_dir={tmp_path}", "sft.steps=1", "sft.lr=2e-3", "sft.warmup_steps=0", "sft.schedule=constant"]
    assert sft_runner.main([*base, "run.name=a", "optim.lr=1e-5", "optim.schedule=cosine"]) == 0
    warnings = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning:")]
    assert warnings == [
        "warning: SFT does not use optim.lr=1e-05 (SFT uses sft.lr=0.002), "
        "optim.schedule=cosine (SFT uses sft.schedule=constant)"
    ]
    assert sft_runner.main([*base, "run.name=b"]) == 0
    assert "warning:" not in capsys.readouterr().out


def test_sft_refuses_gold_episodes_past_the_configs_episode_limits(tiny_model, tmp_path, capsys):
    """The runner checks an environment's gold episodes against multiturn.*: the synthetic search episodes
    (search, read, answer: two turns) under multiturn.max_turns=1 stop the run with one line, before the model
    loads; with max_turns=2 it trains."""
    from rl_training.tasks.search.synthetic import write_search_data

    d = write_search_data(tmp_path / "s1", n_train_keys=20, n_heldout_keys=5, topk=1)
    base = ["--cfg", str(REPO / "cfg" / "search_sft.yaml"), f"model.name_or_path={tiny_model}", "sft.steps=1"]
    base += ["sft.eval_every=0", "sft.stop_when=[]"]  # the demo's skill gate off
    base += [
        f"data.train={d / 'train.jsonl'}",
        f"data.eval={d / 'heldout.jsonl'}",
        f"search.corpus={d / 'corpus.jsonl'}",
    ]
    base += [f"sft.gold_episodes={d / 'gold_train.jsonl'}", f"run.output_dir={tmp_path / 'runs'}"]
    assert sft_runner.main([*base, "run.name=one_turn", "multiturn.max_turns=1"]) == 2
    (err,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]  # one line, before the model loads
    assert (
        err.startswith(f"error: {d / 'gold_train.jsonl'}: ")
        and "(first, line 1: 2 turns > multiturn.max_turns=1)" in err
    )
    assert not (tmp_path / "runs" / "one_turn" / "metrics.jsonl").exists()
    assert sft_runner.main([*base, "run.name=two_turns", "multiturn.max_turns=2"]) == 0

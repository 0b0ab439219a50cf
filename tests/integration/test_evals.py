"""The eval pipeline: step 0 = the base model exactly, the in-loop eval, and `python -m evals.run` end to end
(pass@k / maj@k: test_eval_metrics.py; grading and the shared template: test_eval_grading.py)."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl_training.config.load import load_config
from rl_training.evaluation.evaluate import read_problems
from rl_training.evaluation.pass_at_k import summarize
from rl_training.runners import rl_runner
from rl_training.tasks.reverse import reverse_reward
from tests.helpers import (
    FIXTURES,
    REPO,
    RL_RUNNER,
    TESTCFG,
    maj_by_enumeration,
    pass_by_enumeration,
    read_metrics,
    torchrun_cmd,
)

GSM8K = FIXTURES / "gsm8k_test_sample.jsonl"
MATH500 = FIXTURES / "math500_sample.jsonl"


# ------------------------------------------------------------------------------------------ step 0 = base
def test_step0_is_exactly_the_base_model(run_overrides, warm_model):
    from transformers import AutoModelForCausalLM

    from evals.run import zero_adapter
    from rl_training.policy.models import build_policy
    from rl_training.rollout.base import SamplingSpec
    from rl_training.rollout.hf import HFBackend

    cfg = load_config(TESTCFG, run_overrides)
    tok, policy = build_policy(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter first, so zeroing has something to undo
        for n, p in policy.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    base = AutoModelForCausalLM.from_pretrained(warm_model).eval()
    ids = torch.tensor([tok("abcdefg=", add_special_tokens=False).input_ids])
    with torch.no_grad():
        assert not torch.equal(policy.eval()(input_ids=ids).logits, base(input_ids=ids).logits)
        zero_adapter(policy)
        assert torch.equal(policy(input_ids=ids).logits, base(input_ids=ids).logits)  # exactly, not approx
    prompts = [tok(q + "=", add_special_tokens=False).input_ids for q in ["abc", "hgfed", "jjiab", "cab"]]
    spec = SamplingSpec(n=1, max_new_tokens=8, greedy=True)
    assert HFBackend(policy, tok).generate(prompts, spec).texts == HFBackend(base, tok).generate(prompts, spec).texts


def test_load_adapter_rejects_what_does_not_fit(run_overrides, tmp_path):
    from safetensors.torch import save_file

    from rl_training.ckpt.store import CheckpointError, load_adapter
    from rl_training.policy.models import build_policy

    cfg = load_config(TESTCFG, run_overrides)
    _, policy = build_policy(cfg, torch.device("cpu"))
    (tmp_path / "adapter").mkdir()
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 2)}, tmp_path / ADAPTER)
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_adapter(policy, tmp_path)
    (tmp_path / ADAPTER).write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_adapter(policy, tmp_path)


ADAPTER = "adapter/adapter_model.safetensors"


# ------------------------------------------------------------------------------------------------ in loop
EVAL_KEYS = ["eval.num_samples=4", "eval.ks=[1,2,4]", "eval.max_new_tokens=8"]


@pytest.fixture(scope="module")
def trained_run(warm_model, reverse_data, tmp_path_factory) -> Path:
    """Two checkpoints (steps 1 and 2) of the real runner, with the in-loop eval on at every step."""
    out = tmp_path_factory.mktemp("evalrun")
    over = [
        f"model.name_or_path={warm_model}",
        f"data.train={reverse_data / 'train.jsonl'}",
        f"data.eval={reverse_data / 'heldout.jsonl'}",
        f"run.output_dir={out}",
        "train.total_steps=2",
        "ckpt.every=1",
        "eval.every=1",
        *EVAL_KEYS,
    ]
    assert rl_runner.main(["--cfg", TESTCFG, *over]) == 0
    return out / "testconfig"


def test_inloop_eval_logs_and_leaves_training_unchanged(trained_run, run_overrides, tmp_path, monkeypatch):
    with_eval = read_metrics(trained_run)
    assert [m["step"] for m in with_eval] == [1, 2]
    for m in with_eval:
        assert {"eval/accuracy", "eval/pass@4", "eval/maj@2", "eval/format_rate", "perf/eval_problems_per_s"} <= set(m)
        saved = json.loads((trained_run / "eval" / "inloop" / f"step_{m['step']:06d}.json").read_text())
        assert saved["metrics"]["pass@4"] == m["eval/pass@4"]
    # The same run without the eval: the training trajectory (sampling included) is identical.
    over = [*run_overrides, "train.total_steps=2", "ckpt.every=1", *EVAL_KEYS]
    assert rl_runner.main(["--cfg", TESTCFG, *over, "run.name=noeval"]) == 0
    without = read_metrics(tmp_path / "runs" / "noeval")
    for a, b in zip(with_eval, without, strict=True):
        for k, v in b.items():
            if k.startswith(("rollout/", "train/")):
                assert a[k] == v, (a["step"], k)
    assert not any(k.startswith("eval/") for k in without[0])


# ---------------------------------------------------------------------------------------------- evals.run
def recompute(problems: list[dict], ks: list[int]) -> dict[str, float]:
    """The metrics from the per-problem file by the definitions (enumeration, not rl_training.evaluation.pass_at_k)."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = {
        "accuracy": mean([p["greedy"]["correct"] for p in problems]),
        "format_rate": mean([p["greedy"]["formatted"] for p in problems]),
        "response_len_mean": mean([p["greedy"]["length"] for p in problems]),
        "truncation_rate": mean([p["greedy"]["truncated"] for p in problems]),
    }
    for k in ks:
        out[f"pass@{k}"] = mean([pass_by_enumeration([s["correct"] for s in p["samples"]], k) for p in problems])
        classes = lambda p: [s["text"].strip() or None for s in p["samples"]]  # noqa: E731 -- the reversal vote
        out[f"maj@{k}"] = mean(
            [maj_by_enumeration(classes(p), [s["correct"] for s in p["samples"]], k) for p in problems]
        )
    return out


def tb_scalars(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    """Every point of `tag` in the event files of tb_dir, repeats included (purging would hide them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), purge_orphaned_data=False)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def test_eval_tensorboard_is_rebuilt_in_the_training_log_not_appended(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from evals.report import write_tensorboard

    def results(acc):  # steps given out of order: the log is written in step order
        return [{"step": s, "metrics": {"accuracy": a}, "timing": {"problems_per_s": 10.0}} for s, a in acc]

    tb = tmp_path / "tb"
    with SummaryWriter(str(tb)) as training:  # the run's own log, with the in-loop eval's eval/accuracy
        training.add_scalar("eval/accuracy", 0.125, 5)
        training.add_scalar("rollout/reward_mean", 0.5, 5)
    write_tensorboard(results([(0, 0.375)]), tb, "x.eval_y")  # another name whose suffix ends like x's
    write_tensorboard(results([(5, 0.5), (0, 0.25)]), tb, "x")
    write_tensorboard(results([(10, 0.75), (0, 0.25), (5, 0.625)]), tb, "x")  # a --redo of 5, a new step 10
    assert tb_scalars(tb, "eval/x/accuracy") == [(0, 0.25), (5, 0.625), (10, 0.75)]  # once each, newest values
    assert tb_scalars(tb, "eval/x/problems_per_s") == [(0, 10.0), (5, 10.0), (10, 10.0)]
    assert tb_scalars(tb, "eval/x.eval_y/accuracy") == [(0, 0.375)]
    assert tb_scalars(tb, "eval/accuracy") == [(5, 0.125)] and tb_scalars(tb, "rollout/reward_mean") == [(5, 0.5)]
    names = sorted(p.name.rsplit(".", 1)[-1] for p in tb.iterdir())  # training's file ends in its uid
    assert len(names) == 3 and names[1:] == ["eval_x", "eval_y"] and names[0].isdigit()
    # The eval files sort before training's: TensorBoard's legacy loader follows only a directory's last file,
    # so a live run's training curves keep updating.
    last = sorted(p.name for p in tb.iterdir())[-1]
    assert last.rsplit(".", 1)[-1].isdigit() and ".eval_" not in last


def fake_checkpoint(run_dir: Path, step: int, config: str | bytes) -> None:
    """A complete checkpoint directory whose adapter is never read (the tests stop before loading weights)."""
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    (path / "adapter").mkdir(parents=True)
    (path / ADAPTER).write_bytes(b"")
    (path / "COMPLETE").write_text("ok\n")
    (path / "config.yaml").write_bytes(config if isinstance(config, bytes) else config.encode())


def test_odd_checkpoint_configs_are_skipped_not_fatal(tmp_path, capsys):
    from evals.run import usable_targets
    from rl_training.config.load import to_yaml

    a, b = (to_yaml(load_config(None, [f"model.name_or_path=/models/{m}", "rollout.backend=hf"])) for m in "ab")
    for step, text in [(1, b), (2, a), (3, a), (4, ""), (5, b"model:\n  name_or_path: caf\xe9\n")]:
        fake_checkpoint(tmp_path, step, text)
    over = ["ckpt.resume=none"]
    usable, skipped, cfg = usable_targets(tmp_path, "all", True, over)
    # Policy a (steps 2, 3: two votes) wins over b (step 1: one vote, though earlier); step 4's empty config
    # would be all defaults, step 5's is Latin-1 ('model:\n' 7 bytes + '  name_or_path: ' 16 + 'caf' 3 = 26).
    assert cfg.model.name_or_path == "/models/a" and [t.step for t in usable] == [0, 2, 3]
    ck = tmp_path / "checkpoints"
    assert skipped == [
        f"{ck}/step_000004: unusable config.yaml ({ck}/step_000004/config.yaml: the file is empty (no sections); "
        "it would silently train on every default)",
        f"{ck}/step_000005: unusable config.yaml ({ck}/step_000005/config.yaml: not UTF-8 text (byte 26: 0xe9))",
        f"{ck}/step_000001: config.yaml has another policy than most checkpoints (model.name_or_path="
        "'/models/b', not '/models/a'); evaluate it alone: --steps 1 --no-base --name OTHER",
    ]
    assert capsys.readouterr().err.splitlines() == [f"skip: {m}" for m in skipped]  # one line each
    # A tie goes to the earliest checkpoint: step 1 (b) against step 2 (a).
    usable, skipped, cfg = usable_targets(tmp_path, "1,2", False, over)
    assert cfg.model.name_or_path == "/models/b" and [t.step for t in usable] == [1]
    assert len(skipped) == 1 and skipped[0].startswith(f"{ck}/step_000002: config.yaml has another policy")
    # Step 0 alone: the base model of the policy most of the run's usable checkpoints share.
    usable, skipped, cfg = usable_targets(tmp_path, "0", True, over)
    assert cfg.model.name_or_path == "/models/a" and [t.step for t in usable] == [0] and skipped == []


def test_eval_name_cannot_be_a_path(tmp_path, capsys):
    from evals import run as evals_run

    # NAME names RUN/eval/NAME and the TensorBoard file RUN/tb/*.eval_NAME: '../..' would reach outside them.
    assert evals_run.main(["--run-dir", str(tmp_path), "--name", "../.."]) == 2
    assert (
        capsys.readouterr().err
        == "error: --name '../..': use letters, digits, '.', '_' and '-' (it names RUN/eval/NAME)\n"
    )
    assert evals_run.main(["--run-dir", str(tmp_path), "--name", "inloop"]) == 2  # the in-loop eval's folder
    assert capsys.readouterr().err == (
        "error: --name 'inloop' is the in-loop eval's folder RUN/eval/inloop; pass another --name\n"
    )


@pytest.mark.slow
def test_evals_run_end_to_end(trained_run, tmp_path, capsys):
    from evals import run as evals_run

    # The command as users type it, from a directory that is not the repo.
    cmd = [sys.executable, "-m", "evals.run", "--run-dir", str(trained_run), "--backend", "hf"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert r.returncode == 0, r.stderr[-3000:]
    out = trained_run / "eval" / "reverse_heldout"
    assert "problems/s" in r.stdout and "eval:" in r.stderr  # the table and the progress bar
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [int(x["step"]) for x in rows] == [0, 1, 2]
    for row in rows:
        step = int(row["step"])
        result = json.loads((out / f"step_{step:06d}.json").read_text())
        problems = read_problems(out / result["problems_file"])
        assert len(problems) == result["num_problems"] == 32 and len(problems[0]["samples"]) == 4
        for p in problems:  # the stored grades are the training grader's
            for c in [p["greedy"], *p["samples"]]:
                assert c["reward"] == reverse_reward(c["text"], p["reference"]) and c["correct"] == (c["reward"] >= 1)
        expected = recompute(problems, [1, 2, 4])
        for k, v in expected.items():
            assert result["metrics"][k] == pytest.approx(v, abs=1e-12), (step, k)
            assert float(row[k]) == pytest.approx(v, rel=1e-5, abs=1e-9), (step, k)
        assert result["timing"]["problems_per_s"] > 0 and result["backend"] == "hf" and result["dtype"] == "float32"
        assert (result["checkpoint"] is None) == (step == 0)
    assert any(p["num_correct"] for p in problems) and expected["pass@4"] > expected["pass@1"]  # not all-zero
    # The in-loop eval of step 2 (live policy) and evals.run on checkpoint 2 are the same code and numbers.
    inloop = {s: json.loads((trained_run / "eval" / "inloop" / f"step_{s:06d}.json").read_text()) for s in (1, 2)}
    assert inloop[2]["metrics"] == json.loads((out / "step_000002.json").read_text())["metrics"]
    inloop_pass4 = {s: r["metrics"]["pass@4"] for s, r in inloop.items()}
    # TensorBoard: the eval curves in the run's own log RUN/tb, beside training's and the in-loop eval's.
    tb = trained_run / "tb"
    assert [s for s, _ in tb_scalars(tb, "eval/reverse_heldout/pass@4")] == [0, 1, 2]
    assert [s for s, _ in tb_scalars(tb, "rollout/reward_mean")] == [1, 2]
    assert tb_scalars(tb, "eval/pass@4") == [(1, pytest.approx(inloop_pass4[1])), (2, pytest.approx(inloop_pass4[2]))]
    for png in ["overview.png", "pass_at_k.png", "maj_at_k.png", "accuracy.png", "truncation_rate.png"]:
        data = (out / "plots" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000

    # Re-running evaluates nothing; other settings are refused unless --redo.
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("step_*.json")}
    assert evals_run.main(["--run-dir", str(trained_run), "--backend", "hf"]) == 0
    assert capsys.readouterr().out.count("already evaluated") == 3
    assert before == {p.name: p.stat().st_mtime_ns for p in out.glob("step_*.json")}
    # --redo of step 2: the eval log is rebuilt from the step files, so every step is there exactly once.
    redo = ["--run-dir", str(trained_run), "--backend", "hf", "--redo", "--steps", "2", "--no-base"]
    assert evals_run.main(redo) == 0
    assert capsys.readouterr().out.count("already evaluated") == 0
    assert len(list(tb.glob("events.out.tfevents.*.eval_reverse_heldout"))) == 1
    for key in ["pass@4", "accuracy", "maj@2"]:
        points = tb_scalars(tb, f"eval/reverse_heldout/{key}")
        assert [s for s, _ in points] == [0, 1, 2]
        saved = [json.loads((out / f"step_{s:06d}.json").read_text())["metrics"][key] for s in (0, 1, 2)]
        assert [v for _, v in points] == pytest.approx(saved, abs=1e-6)  # TensorBoard stores float32
    assert [s for s, _ in tb_scalars(tb, "rollout/reward_mean")] == [1, 2]  # training's curves still there
    assert [s for s, _ in tb_scalars(tb, "eval/pass@4")] == [1, 2]
    assert evals_run.main(["--run-dir", str(trained_run), "--backend", "hf", "--k", "1,2"]) == 2
    assert "other settings" in capsys.readouterr().err

    # A checkpoint rewritten since it was evaluated (as step N is when a resume from an earlier step retrains
    # it; here step 2's adapter copied over step 1's) is evaluated again, the unchanged ones are not.
    rewritten = tmp_path / "rewritten"
    shutil.copytree(trained_run, rewritten)
    ck, out2 = rewritten / "checkpoints", rewritten / "eval" / "reverse_heldout"
    shutil.copy(ck / "step_000002" / ADAPTER, ck / "step_000001" / ADAPTER)
    before = {p.name: p.stat().st_mtime_ns for p in out2.glob("step_*.json")}
    assert evals_run.main(["--run-dir", str(rewritten), "--backend", "hf"]) == 0
    stdout = capsys.readouterr().out
    assert stdout.count("already evaluated") == 2 and "step_000001: the weights differ from those of" in stdout
    after = {p.name: p.stat().st_mtime_ns for p in out2.glob("step_*.json")}
    assert [n for n in before if before[n] != after[n]] == ["step_000001.json"]
    step1, step2 = (json.loads((out2 / f"step_{s:06d}.json").read_text()) for s in (1, 2))
    sha = hashlib.sha256((ck / "step_000002" / ADAPTER).read_bytes()).hexdigest()
    assert step1["weights_fingerprint"] == step2["weights_fingerprint"] == f"sha256:{sha}"
    assert step1["metrics"] == step2["metrics"]  # the same weights and seeds: the same numbers
    assert (
        json.loads((out2 / "step_000000.json").read_text())["weights_fingerprint"]
        == f"base:{step1['settings']['base_model']}"
    )
    # Broken checkpoints are reported in one line each and skipped; the rest is evaluated; exit status 3.
    broken = tmp_path / "broken"
    shutil.copytree(trained_run, broken)
    (broken / "checkpoints" / "step_000001" / "COMPLETE").unlink()
    shutil.copytree(broken / "checkpoints" / "step_000002", broken / "checkpoints" / "step_000003")
    odd = broken / "checkpoints" / "step_000003" / "config.yaml"
    odd.write_text(odd.read_text().replace("  r: 8\n", "  r: 4\n"))  # another policy: skipped, not fatal
    (broken / "checkpoints" / "step_000002" / ADAPTER).write_bytes(b"\x00" * 100)
    rc = evals_run.main(["--run-dir", str(broken), "--backend", "hf", "--redo", "--steps", "1,2,3,7"])
    err = capsys.readouterr().err
    assert rc == 3
    assert "step_000003: config.yaml has another policy than most checkpoints (lora.r=4, not 8)" in err
    assert "step_000001: incomplete checkpoint (no COMPLETE marker)" in err
    assert f"step_000002/{ADAPTER}: unreadable" in err and "step_000007: no such checkpoint" in err
    redone = json.loads((broken / "eval" / "reverse_heldout" / "step_000000.json").read_text())
    assert redone["created"] >= json.loads((out / "step_000000.json").read_text())["created"]
    assert redone["metrics"] == json.loads((out / "step_000000.json").read_text())["metrics"]  # seeded: same


@pytest.mark.slow
def test_evals_run_gsm8k_and_math500_formats(trained_run, capsys):
    from evals import run as evals_run

    common = ["--run-dir", str(trained_run), "--backend", "hf", "--n", "2", "--k", "1,2", "--max-new-tokens", "4"]
    extra = ["--steps", "2", "--no-base", "data.max_prompt_tokens=512"]
    assert evals_run.main([*common, "--dataset", str(GSM8K), "--format", "gsm8k", *extra]) == 0
    g = json.loads((trained_run / "eval" / "fixtures_gsm8k_test_sample" / "step_000002.json").read_text())
    assert g["settings"]["format"] == "gsm8k" and g["num_problems"] == 4
    math_args = ["--dataset", str(MATH500), "--format", "math", "--question-key", "problem", "--answer-key", "answer"]
    assert evals_run.main([*common, *math_args, "--name", "math500", *extra]) == 0
    problems = read_problems(trained_run / "eval" / "math500" / "step_000002.problems.jsonl")
    assert problems[1]["reference"] == r"\frac{14}{3}" and problems[1]["source"].endswith("math500_sample.jsonl:2")
    assert evals_run.main([*common, "--dataset", "/no/such.jsonl", *extra]) == 2
    assert capsys.readouterr().err.strip().endswith("error: data file not found: /no/such.jsonl")


@pytest.mark.slow
def test_evals_run_with_vllm_matches_hf_and_is_seeded(trained_run, monkeypatch):
    # No capsys here: vLLM's logger keeps the stream it first sees, and capsys closes its stream afterwards.
    from evals import run as evals_run
    from rl_training.rollout import factory

    built = []
    real_build = factory.build_backend
    monkeypatch.setattr(factory, "build_backend", lambda *a: built.append(real_build(*a)) or built[-1])
    args = ["--run-dir", str(trained_run), "--backend", "vllm", "--name", "vllm", "vllm.kv_cache_gb=0.1"]
    assert evals_run.main(args) == 0
    assert [b.name for b in built] == ["vllm"]  # one engine for the 3 evaluations (steps 0, 1, 2)
    assert [b.weight_version for b in built] == [4]  # its build-time sync + one sync per evaluation
    vl, hf = trained_run / "eval" / "vllm", trained_run / "eval" / "reverse_heldout"
    first = {s: json.loads((vl / f"step_{s:06d}.json").read_text())["metrics"] for s in (0, 1, 2)}
    assert evals_run.main(["--run-dir", str(trained_run), "--backend", "hf"]) == 0  # a no-op after the e2e test

    def greedy(d: Path, s: int) -> list[str]:
        return [p["greedy"]["text"] for p in read_problems(d / f"step_{s:06d}.problems.jsonl")]

    for s in (0, 1, 2):  # greedy decoding is backend-independent, step 0 (base model) included
        assert greedy(vl, s) == greedy(hf, s)
    assert evals_run.main([*args, "--redo"]) == 0
    for s in (0, 1, 2):  # seeded per problem: a re-run samples the same completions
        assert json.loads((vl / f"step_{s:06d}.json").read_text())["metrics"] == first[s]


@pytest.mark.slow
def test_inloop_eval_with_vllm_leaves_training_unchanged(run_overrides, tmp_path):
    vllm = ["rollout.backend=vllm", "vllm.kv_cache_gb=0.1", "train.total_steps=2", "ckpt.every=0", *EVAL_KEYS]
    for name, every in (("on", 1), ("off", 0)):
        assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, *vllm, f"eval.every={every}", f"run.name={name}"]) == 0
    on, off = read_metrics(tmp_path / "runs" / "on"), read_metrics(tmp_path / "runs" / "off")
    assert all("eval/pass@4" in m for m in on)
    for a, b in zip(on, off, strict=True):
        for k, v in b.items():
            if k.startswith(("rollout/", "train/")):
                assert a[k] == v, (a["step"], k)


@pytest.mark.slow
def test_inloop_eval_on_two_ranks(run_overrides, tmp_path):
    cmd = torchrun_cmd(
        2,
        RL_RUNNER,
        "--cfg",
        TESTCFG,
        *run_overrides,
        "train.total_steps=2",
        "eval.every=2",
        "eval.num_prompts=31",  # an odd count: rank 0 takes 16 problems, rank 1 takes 15
        *EVAL_KEYS,
    )
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ})
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "testconfig"
    problems = read_problems(run_dir / "eval" / "inloop" / "step_000002.problems.jsonl")
    assert [p["index"] for p in problems] == list(range(31))  # gathered from both ranks, in order
    last = read_metrics(run_dir)[-1]
    assert last["eval/accuracy"] == summarize(problems, [1, 2, 4])["accuracy"]


def test_saved_configs_hold_absolute_paths_for_evals_run_from_anywhere(tiny_model, reverse_data, tmp_path, monkeypatch):
    """The README workflow with relative paths: SFT, then RL from runs/x_sft/final_model, both started in
    the training directory; evals.run is then started elsewhere and still finds the model and the data."""
    import yaml

    from evals import run as evals_run
    from rl_training.runners import sft_runner

    train_dir, elsewhere = tmp_path / "train", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (train_dir / "models").mkdir(parents=True)
    (train_dir / "models" / "tiny").symlink_to(tiny_model)
    (train_dir / "data").symlink_to(reverse_data)
    monkeypatch.chdir(train_dir)
    data = ["data.train=data/train.jsonl", "data.eval=data/heldout.jsonl", "run.output_dir=runs"]
    sft = ["model.name_or_path=models/tiny", *data, "run.name=x_sft", "sft.steps=1", "sft.warmup_steps=0"]
    assert sft_runner.main(["--cfg", str(REPO / "cfg" / "tiny_sft.yaml"), *sft]) == 0
    rl = ["model.name_or_path=runs/x_sft/final_model", *data, "run.name=x", "train.total_steps=1", "ckpt.every=1"]
    assert rl_runner.main(["--cfg", TESTCFG, *rl]) == 0

    here, run_dir = Path.cwd(), train_dir / "runs" / "x"  # cwd: what a relative path meant during training
    final_model = f"{here}/runs/x_sft/final_model"
    for path, model in [
        (train_dir / "runs" / "x_sft" / "config.yaml", f"{here}/models/tiny"),
        (run_dir / "config.yaml", final_model),
        (run_dir / "checkpoints" / "step_000001" / "config.yaml", final_model),
    ]:
        cfg = yaml.safe_load(path.read_text())
        assert cfg["model"]["name_or_path"] == model, path
        assert cfg["data"]["eval"] == f"{here}/data/heldout.jsonl" and cfg["run"]["output_dir"] == f"{here}/runs"

    monkeypatch.chdir(elsewhere)
    args = ["--run-dir", str(run_dir), "--backend", "hf", "--n", "0", "--k", "", "--limit", "4"]
    assert evals_run.main(args) == 0  # before: exit 2, 'model.name_or_path=runs/x_sft/final_model: no such ...'
    result = json.loads((run_dir / "eval" / "data_heldout" / "step_000001.json").read_text())
    assert result["num_problems"] == 4 and result["settings"]["base_model"] == final_model

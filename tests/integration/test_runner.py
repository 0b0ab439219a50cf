"""The RL runner end to end on the tiny model: torchrun launch, checkpoints, resume, logs read back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rl_training.ckpt.store import COMPLETE, list_checkpoints
from rl_training.runners import rl_runner
from tests.helpers import RL_RUNNER, TESTCFG, Crash, crash_at, torchrun_cmd


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tb_steps(run_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = torchrun_cmd(1, RL_RUNNER, *args)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_torchrun_three_steps_then_resume(run_overrides, tmp_path):
    # Launched exactly as users do, from a directory that is not the repo (the package is installed).
    r = torchrun(["--cfg", TESTCFG, *run_overrides, "train.total_steps=3"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "testconfig"
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    # ckpt.every=2 -> step 2, plus the final step 3; keep_last=2 keeps both.
    assert [s for s, _ in list_checkpoints(run_dir)] == [2, 3]
    ck = run_dir / "checkpoints" / "step_000003"
    for name in (
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_rank0.pt",
        "trainer_state.json",
        "config.yaml",
        COMPLETE,
    ):
        assert (ck / name).exists(), name
    assert json.loads((ck / "trainer_state.json").read_text())["step"] == 3
    assert "total_steps: 3" in (run_dir / "config.yaml").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "total_steps: 3" in text and "group_size: 4" in text  # the resolved config, in TensorBoard
    m = read_metrics(run_dir)[-1]
    for key in (
        "rollout/reward_mean",
        "rollout/accuracy",
        "rollout/format_rate",
        "rollout/response_len_mean",
        "rollout/response_len_max",
        "rollout/truncation_rate",
        "rollout/zero_adv_group_frac",
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/clip_frac",
        "train/entropy",
        "perf/generate_s",
        "perf/score_s",
        "perf/train_s",
        "perf/sync_s",
        "perf/tokens_per_s",
        "mem/peak_rss_gb",
        "rollout/logp_diff_mean",
        "rollout/logp_diff_max",
    ):
        assert key in m and m[key] == m[key], key  # present and not NaN
    # The HF backend samples from the trainer's own weights: the canary must be at float32 noise level.
    assert m["rollout/logp_diff_mean"] < 1e-4
    # kl_coef = 0: the reference forward (train/kl) runs on steps 0, 10, ... (loss.kl_log_every = 10), so
    # train/kl is logged at step 1 (a real number: >= 0 for k3) and absent, not 0, at steps 2 and 3.
    kl = [r.get("train/kl") for r in read_metrics(run_dir)]
    assert kl[0] is not None and kl[0] >= 0 and kl[1:] == [None, None]

    # Resume to 5: the same run directory and TensorBoard log, trained up to total_steps, not 5 more.
    r = torchrun(["--cfg", TESTCFG, *run_overrides, "train.total_steps=5", "ckpt.resume=latest"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step_000003" in r.stdout
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert tb_steps(run_dir, "rollout/reward_mean") == [1, 2, 3, 4, 5]
    assert [s for s, _ in list_checkpoints(run_dir)] == [4, 5]  # every=2 -> 4, final 5; keep_last=2
    # (a finished run resumed trains nothing: test_resume_from_older_checkpoint_sets_later_ones_aside, in-process)


def test_interrupted_then_resumed_run_reproduces_metrics(run_overrides, tmp_path, monkeypatch):
    # Under a warm-up and a cosine decay the learning rate differs at every step: a resume that restarted the
    # schedule (scheduler state not restored) would train step 3 at the warm-up's lr and fail every later row.
    schedule = ["optim.warmup_steps=2", "optim.schedule=cosine"]
    base = [*run_overrides, "train.total_steps=5", "ckpt.every=2", "ckpt.keep_last=5", *schedule]
    assert rl_runner.main(["--cfg", TESTCFG, *base, "run.name=straight"]) == 0
    straight = read_metrics(tmp_path / "runs" / "straight")

    real_step = rl_runner.rl_step
    crash_at(monkeypatch, 3)  # 0-based: steps 1-3 are logged, checkpoint 2 exists, step 3's is not written
    with pytest.raises(Crash):
        rl_runner.main(["--cfg", TESTCFG, *base, "run.name=crashed"])
    monkeypatch.setattr(rl_runner, "rl_step", real_step)
    run_dir = tmp_path / "runs" / "crashed"
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert [s for s, _ in list_checkpoints(run_dir)] == [2]

    assert rl_runner.main(["--cfg", TESTCFG, *base, "run.name=crashed", "ckpt.resume=latest"]) == 0
    resumed = read_metrics(run_dir)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]  # step 3 was redone, not duplicated
    for a, b in zip(straight, resumed, strict=True):
        for k, v in a.items():
            if not k.startswith(("perf/", "mem/")):
                assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-9, nan_ok=True), (a["step"], k)
    assert any(m["train/grad_norm"] > 0 for m in straight)  # the compared run really trained
    # peak 1e-3 (cfg/testconfig.yaml): warm-up (s + 1) / 2 at s = 0, 1, then cosine over the 3 steps after it,
    # 0.5 (1 + cos(pi (s - 2) / 3)) at s = 2, 3, 4: 1, 0.75, 0.25
    assert [m["train/lr"] for m in straight] == pytest.approx([5e-4, 1e-3, 1e-3, 7.5e-4, 2.5e-4])


def test_resume_from_older_checkpoint_sets_later_ones_aside(run_overrides, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "testconfig"
    ckpts = run_dir / "checkpoints"
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=4", "ckpt.keep_last=3"]) == 0
    assert [s for s, _ in list_checkpoints(run_dir)] == [2, 4]  # ckpt.every=2
    step4 = (ckpts / "step_000004" / "adapter" / "adapter_model.safetensors").read_bytes()
    capsys.readouterr()

    # Branch off at step 2 and train to 3, keeping 1 checkpoint. Before the fix the stale step 4 stayed in
    # place: pruning by step number kept it and deleted the step 3 just written, and `latest` chose step 4.
    resume = ["train.total_steps=3", "ckpt.keep_last=1", f"ckpt.resume={ckpts / 'step_000002'}"]
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, *resume]) == 0
    out = capsys.readouterr().out
    (aside,) = ckpts.glob("abandoned_*")
    assert (
        f"note: resuming from step 2: moved the later checkpoints step_000004 and a copy of metrics.jsonl to {aside}"
        in out
    )
    assert [s for s, _ in list_checkpoints(run_dir)] == [3]  # the new history only
    assert (aside / "step_000004" / COMPLETE).exists()  # moved whole, not deleted
    assert (aside / "step_000004" / "adapter" / "adapter_model.safetensors").read_bytes() == step4
    assert [m["step"] for m in read_metrics(aside)] == [1, 2, 3, 4]  # the abandoned history's metrics
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]

    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=3", "ckpt.resume=latest"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step_000003" in out and "nothing to do" in out
    assert list(ckpts.glob("abandoned_*")) == [aside]  # nothing later than step 3 this time: nothing moved


def test_fresh_start_refuses_to_clobber_existing_run(run_overrides, tmp_path, capsys):
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=1"]) == 0
    before = list_checkpoints(tmp_path / "runs" / "testconfig")
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=1"]) == 2
    assert "already has checkpoints; pass ckpt.resume=latest" in capsys.readouterr().err
    assert list_checkpoints(tmp_path / "runs" / "testconfig") == before  # nothing lost


def test_fresh_start_sets_earlier_logs_aside(run_overrides, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "testconfig"
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=2"]) == 0
    first = (run_dir / "metrics.jsonl").read_text()
    shutil.rmtree(run_dir / "checkpoints")  # as if it had crashed before its first checkpoint
    capsys.readouterr()
    # `latest` finds nothing complete and starts afresh: the earlier logs are moved aside, not deleted, and
    # TensorBoard gets one history (steps 1, 2), not two interleaved ones (1, 1, 2, 2).
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=2", "ckpt.resume=latest"]) == 0
    (aside,) = run_dir.glob("abandoned_*")
    assert f"moved its earlier metrics.jsonl and tb to {aside}" in capsys.readouterr().out
    assert (aside / "metrics.jsonl").read_text() == first
    assert tb_steps(aside, "train/loss") == [1, 2]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
    assert tb_steps(run_dir, "train/loss") == [1, 2]


def test_resume_checks_the_saved_config(run_overrides, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "testconfig"
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=2"]) == 0
    saved = (run_dir / "checkpoints" / "step_000002" / "config.yaml").read_text()
    capsys.readouterr()
    # A different LoRA rank (shapes) or alpha (scale) would not continue the same adapter: one line, nothing moved.
    for bad in ("lora.r=4", "lora.alpha=3.0"):
        args = ["--cfg", TESTCFG, *run_overrides, "train.total_steps=3", "ckpt.resume=latest", bad]
        assert rl_runner.main(args) == 2
        err = capsys.readouterr().err.strip()
        key, new = bad.split("=")
        assert err.startswith(f"error: {run_dir / 'checkpoints' / 'step_000002'}: saved with {key}=")
        assert f", now {yaml.safe_load(new)!r}; the adapter would not mean the same" in err and "\n" not in err
    assert [s for s, _ in list_checkpoints(run_dir)] == [2]
    assert (run_dir / "checkpoints" / "step_000002" / "config.yaml").read_text() == saved
    # Other changes are allowed and named.
    args = ["--cfg", TESTCFG, *run_overrides, "train.total_steps=3", "ckpt.resume=latest", "optim.lr=0.0005"]
    assert rl_runner.main(args) == 0
    out = capsys.readouterr().out
    lr = yaml.safe_load(saved)["optim"]["lr"]
    assert f"with changed settings: optim.lr: {lr!r} -> 0.0005; train.total_steps: 2 -> 3" in out


def test_incomplete_checkpoint_is_rejected_and_skipped(run_overrides, tmp_path, capsys):
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=2", "ckpt.every=1"]) == 0
    run_dir = tmp_path / "runs" / "testconfig"
    (run_dir / "checkpoints" / "step_000002" / COMPLETE).unlink()  # as if the write had been cut off
    assert (
        rl_runner.main(
            [
                "--cfg",
                TESTCFG,
                *run_overrides,
                "train.total_steps=2",
                f"ckpt.resume={run_dir / 'checkpoints' / 'step_000002'}",
            ]
        )
        == 2
    )
    assert "incomplete checkpoint (no COMPLETE marker)" in capsys.readouterr().err
    # `latest` never picks it: it falls back to step 1 and retrains step 2.
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=2", "ckpt.resume=latest"]) == 0
    assert "step_000001" in capsys.readouterr().out


def test_missing_model_path_is_one_line_error(run_overrides, capsys):
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "model.name_or_path=./models/nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: model.name_or_path=./models/nope: no such model directory"


def test_adapter_checkpoint_loads_in_peft(run_overrides, tmp_path, warm_model):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl_training.config.load import load_config
    from rl_training.policy.models import build_policy

    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, "train.total_steps=2", "optim.lr=0.05"]) == 0
    ck = tmp_path / "runs" / "testconfig" / "checkpoints" / "step_000002"
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(warm_model), ck / "adapter").eval()
    # Rebuild the trained policy through the runner's own resume path and compare logits.
    cfg = load_config(TESTCFG, [*run_overrides])
    _, policy = build_policy(cfg, torch.device("cpu"))
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(policy, load_file(str(ck / "adapter" / "adapter_model.safetensors")))
    ids = torch.tensor([[70, 71, 72, 63]])
    with torch.no_grad():
        a, b = loaded(input_ids=ids).logits, policy.eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(warm_model)(input_ids=ids).logits
    torch.testing.assert_close(a, b)
    assert (a - base).abs().max() > 1e-4  # the adapter is not a no-op: training moved it

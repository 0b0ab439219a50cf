"""The RL runner under faults, in-process on the tiny model: a NaN reward that bypasses the scorer, too many
non-finite steps in a row, checkpoints corrupted after they were marked complete, a save that fails half-way."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_training.ckpt import store as checkpoint
from rl_training.ckpt.store import list_checkpoints, validate_checkpoint
from rl_training.runners import rl_batch, rl_runner
from tests.helpers import TESTCFG


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def nan_rewards_at(monkeypatch, steps: set[int]):
    """Make the scorer's output NaN on the given 1-based steps, as a reward function that bypassed the scorer's
    finiteness check would (score_completions itself turns a NaN into a counted 0)."""
    real, calls = rl_batch.score_completions, [0]

    def scores(*args, **kwargs):
        calls[0] += 1
        out = real(*args, **kwargs)
        if calls[0] in steps:
            out = dataclasses.replace(out, rewards=[float("nan")] * len(out.rewards))
        return out

    monkeypatch.setattr(rl_batch, "score_completions", scores)


def error_line(capsys) -> str:
    """The one `error:` line on stderr (model loading also writes progress bars there)."""
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


def ckpt_state(path: Path) -> tuple[dict, dict, dict]:
    return (
        load_file(str(path / "adapter" / "adapter_model.safetensors")),
        torch.load(path / "optimizer.pt", weights_only=False),
        torch.load(path / "scheduler.pt", weights_only=False),
    )


def test_nan_reward_skips_the_step_and_corrupt_checkpoints_are_refused(run_overrides, tmp_path, monkeypatch, capsys):
    base = [*run_overrides, "ckpt.every=1", "ckpt.keep_last=5", "optim.lr=0.01"]
    nan_rewards_at(monkeypatch, {2})
    assert rl_runner.main(["--cfg", TESTCFG, *base, "train.total_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "warning: step 2: non-finite reward; optimizer step skipped on every rank" in out
    run_dir = tmp_path / "runs" / "testconfig"
    m = read_metrics(run_dir)
    assert [x["train/skipped_steps"] for x in m] == [0, 1, 1]  # running total
    assert [x["train/nonfinite_reward"] for x in m] == [0, 1, 0]
    assert [x["train/nonfinite_loss"] + x["train/nonfinite_grad_norm"] for x in m] == [0, 0, 0]
    ck = dict(list_checkpoints(run_dir))
    (a1, o1, s1), (a2, o2, s2), (a3, _, s3) = (ckpt_state(ck[s]) for s in (1, 2, 3))
    assert all(torch.equal(a1[k], a2[k]) for k in a1)  # the adapter after step 2 is the one before it
    assert not all(torch.equal(a2[k], a3[k]) for k in a2)  # step 3 trained again
    for p in o1["state"]:  # AdamW moments and step count untouched by the skipped step
        assert all(torch.equal(o1["state"][p][k], o2["state"][p][k]) for k in o1["state"][p])
    assert (s1["last_epoch"], s2["last_epoch"], s3["last_epoch"]) == (1, 1, 2)  # no LR step for step 2
    assert json.loads((ck[2] / "trainer_state.json").read_text())["skips"] == {"total": 1, "consecutive": 1}

    # Truncated after it was marked complete: resume=<path> refuses it in one line naming the file.
    opt3 = ck[3] / "optimizer.pt"
    opt3.write_bytes(opt3.read_bytes()[:-10])
    monkeypatch.undo()
    assert rl_runner.main(["--cfg", TESTCFG, *base, "train.total_steps=4", f"ckpt.resume={ck[3]}"]) == 2
    err = error_line(capsys)
    assert err.startswith(f"error: corrupt checkpoint: {opt3}: ") and "bytes when it was saved" in err
    # Same size, one byte changed: caught by the sha256. `latest` passes over both with a note each.
    ad2 = ck[2] / "adapter" / "adapter_model.safetensors"
    raw = bytearray(ad2.read_bytes())
    raw[-1] ^= 0xFF
    ad2.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CheckpointError, match="sha256 differs"):
        validate_checkpoint(ck[2])
    assert rl_runner.main(["--cfg", TESTCFG, *base, "train.total_steps=4", "ckpt.resume=latest"]) == 0
    out = capsys.readouterr().out
    assert f"note: ckpt.resume=latest passes over step_000003: corrupt checkpoint: {opt3}" in out
    assert "passes over step_000002" in out and "resumed from" in out and "step_000001 at step 1" in out
    assert [x["step"] for x in read_metrics(run_dir)] == [1, 2, 3, 4]
    moved = sorted(p.name for p in (run_dir / "checkpoints").glob("abandoned_*/step_*"))
    assert moved == ["step_000002", "step_000003"]  # set aside, not deleted; the resumed run saved its own


def test_consecutive_skips_stop_the_run_and_the_last_checkpoint_resumes(run_overrides, tmp_path, monkeypatch, capsys):
    base = [*run_overrides, "ckpt.every=1", "ckpt.keep_last=5", "train.max_consecutive_skips=2"]
    nan_rewards_at(monkeypatch, {2, 3})
    assert rl_runner.main(["--cfg", TESTCFG, *base, "train.total_steps=5"]) == 2
    err = error_line(capsys)
    assert err.startswith("error: steps 2-3: 2 optimizer steps in a row skipped for non-finite values")
    assert "the checkpoint at step 2 is intact" in err
    run_dir = tmp_path / "runs" / "testconfig"
    assert [s for s, _ in list_checkpoints(run_dir)] == [1, 2]  # none written after the streak's end
    assert [x["step"] for x in read_metrics(run_dir)] == [1, 2, 3]
    monkeypatch.undo()
    assert rl_runner.main(["--cfg", TESTCFG, *base, "train.total_steps=5", "ckpt.resume=latest"]) == 0
    m = read_metrics(run_dir)
    assert [x["step"] for x in m] == [1, 2, 3, 4, 5]
    assert [x["train/skipped_steps"] for x in m] == [0, 1, 1, 1, 1]  # the total continues across the resume


def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint_and_metrics(
    run_overrides, tmp_path, monkeypatch, capsys
):
    real_save, calls = torch.save, [0]

    def disk_full_on_second_save(obj, f, *a, **k):
        calls[0] += Path(f).name == "optimizer.pt"
        if calls[0] == 2 and Path(f).name == "optimizer.pt":  # checkpoint 2's
            Path(f).write_bytes(b"\0" * 100)  # part of it reached the disk
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", disk_full_on_second_save)
    base = [*run_overrides, "ckpt.every=1", "train.total_steps=3"]
    assert rl_runner.main(["--cfg", TESTCFG, *base]) == 2
    err = error_line(capsys)
    assert err.startswith("error: checkpoint step_000002 not saved: [enforce fail")
    assert "the earlier checkpoints and metrics.jsonl are intact" in err
    run_dir = tmp_path / "runs" / "testconfig"
    assert [s for s, _ in list_checkpoints(run_dir)] == [1]
    validate_checkpoint(run_dir / "checkpoints" / "step_000001")  # sizes and sha256 as saved
    # the temp dir removed; `latest` still names the intact checkpoint
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert (run_dir / "checkpoints" / "latest").resolve() == run_dir / "checkpoints" / "step_000001"
    assert [x["step"] for x in read_metrics(run_dir)] == [1, 2]  # whole lines; step 2 awaits its checkpoint
    monkeypatch.undo()
    assert rl_runner.main(["--cfg", TESTCFG, *base, "ckpt.resume=latest"]) == 0
    assert [x["step"] for x in read_metrics(run_dir)] == [1, 2, 3]

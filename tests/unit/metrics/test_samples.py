"""Rollout samples: reproducible choice over all ranks' rows, rotating size-bounded files, resume trimming."""

from __future__ import annotations

import json

from rl_training.base.groups import Groups
from rl_training.metrics.samples import SampleWriter, choose, markdown, sample_record


def rec(step: int, row: int = 0, reward: float = 0.5, text: str = "x") -> dict:
    return sample_record(
        step=step,
        rank=0,
        row=row,
        groups=Groups.uniform(64, 4),
        prompt="abc=",
        completion=text,
        reward=reward,
        parts={},
        advantage=-0.25,
        length=len(text),
        truncated=False,
        policy_version=step - 1,
        logp_gap=1e-4,
    )


def test_choice_is_reproducible_distinct_and_spans_ranks():
    layout = [32, 32]  # 2 ranks x 32 rows
    a = choose(seed=0, step=7, rows_per_rank=layout, k=8)
    assert a == choose(seed=0, step=7, rows_per_rank=layout, k=8)  # a resumed run keeps the same samples
    assert len(set(a)) == 8 and all(0 <= row < 32 for _, row in a)
    assert a != choose(seed=0, step=8, rows_per_rank=layout, k=8)
    # Over many steps both ranks are drawn from, about equally: 8 x 200 picks, each rank ~800 (sd ~20).
    counts = [0, 0]
    for step in range(200):
        for rank, _ in choose(0, step, layout, 8):
            counts[rank] += 1
    assert abs(counts[0] - 800) < 100 and sum(counts) == 1600
    # Uneven ranks map back exactly: rows 0..2 are rank 0's, 3..4 rank 1's.
    assert sorted(choose(0, 0, [3, 2], 5)) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert choose(0, 0, [3, 2], 0) == [] and choose(0, 0, [0, 0], 4) == []


def test_record_fields():
    r = rec(5, row=6, text="cba")
    assert (r["group"], r["index"]) == (1, 2)  # row 6 with G = 4
    assert r["finish_reason"] == "stop" and r["length"] == 3 and r["policy_version"] == 4


def test_writer_rotates_trims_and_drops_resumed_steps(tmp_path):
    # A line is ~250 bytes: with 200-byte files every step opens a new file; 1100 bytes in all keeps 4 of them.
    w = SampleWriter(tmp_path, enabled=True, file_mb=200 / 2**20, max_mb=1100 / 2**20)
    for step in range(1, 11):
        w.write([rec(step, text="y" * 40)])
    files = sorted((tmp_path / "samples").glob("samples_*.jsonl"))
    total = sum(f.stat().st_size for f in files)
    assert len(files) == 4 and total <= 1100  # bounded: the oldest were deleted
    steps = [json.loads(ln)["step"] for f in files for ln in f.read_text().splitlines()]
    assert steps == [7, 8, 9, 10]
    assert files[0].name == f"samples_{steps[0]:06d}.jsonl"  # named by its first step
    w.drop_after(8)
    steps = [json.loads(ln)["step"] for f in sorted(w.dir.glob("*.jsonl")) for ln in f.read_text().splitlines()]
    assert steps == [7, 8]
    SampleWriter(tmp_path / "other", enabled=False).write([rec(1)])  # off rank 0: nothing
    assert not (tmp_path / "other").exists()


def test_markdown_keeps_text_literal():
    md = markdown([rec(3, text="**not bold** <b>")])
    assert "'**not bold** <b>'" in md and "reward 0.5" in md and "policy v2" in md

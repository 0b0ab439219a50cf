"""The benchmark scripts run end to end at tiny settings and write the JSON they promise (no timing asserts:
speed targets live in the scripts' output, never in tests)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from rl_training.probes.gns import Hysteresis, b_star, fit_step_time
from tests.helpers import REPO


def test_step_time_fit_and_b_star():
    # step = 2 + 0.5 B exactly at B = 4, 8, 16 -> t_f = 2, t_u = 0.5; B* = sqrt(B_s t_f / t_u) = sqrt(64*4) = 16.
    t_f, t_u = fit_step_time([4, 8, 16], [4.0, 6.0, 10.0])
    assert t_f == pytest.approx(2.0) and t_u == pytest.approx(0.5)
    assert b_star(64.0, t_f, t_u) == pytest.approx(16.0)
    # Progress per second B / ((B + B_s)(t_f + t_u B)) is maximal at B*: check against neighbours.
    rate = lambda b: b / ((b + 64.0) * (t_f + t_u * b))  # noqa: E731
    assert rate(16.0) > max(rate(15.0), rate(17.0))
    assert b_star(float("nan"), 2.0, 0.5) != b_star(float("nan"), 2.0, 0.5)  # NaN when B_simple is unknown
    assert b_star(64.0, 0.0, 0.5) != b_star(64.0, 0.0, 0.5)  # NaN when t_f is unknown (config default 0)
    with pytest.raises(ValueError):
        fit_step_time([8, 8], [1.0, 1.1])  # one batch size: t_f and t_u are not identifiable


def test_recommendation_hysteresis_holds_for_r_steps():
    h = Hysteresis(hold=3)
    # First advice is taken at once; a change is accepted only after 3 steps on the current value.
    assert [h(x) for x in (32.0, 48.0, 48.0, 48.0, 64.0)] == [32.0, 32.0, 32.0, 48.0, 48.0]
    assert h(float("nan")) != h(float("nan"))  # withdrawn advice (warming up / uncertain) shows as NaN
    assert h(16.0) == 16.0  # and new advice after a withdrawal is taken at once


@pytest.mark.slow
def test_bench_fits_step_time_over_batch_sizes(run_overrides, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "--cfg", str(REPO / "cfg" / "testconfig.yaml")]
    cmd += ["--backends", "hf", "--steps", "2", "--warmup", "0", "--batches", "2,4", "--out", str(out), *run_overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"hf@B2", "hf@B4"}
    # one process per run: vLLM's sleep mode (CuMem allocator) allows one engine per process
    assert len(set(data["worker_pids"].values())) == 2 and res.returncode == 0
    for r in data["results"].values():
        assert r["steps_measured"] == 2 and r["step_s"] > 0
        assert math.isfinite(r["completions_per_s"]) and math.isfinite(r["gen_tokens_per_s"])
    # The fit passes through both medians exactly (two points): t_f + t_u * B reproduces each step time.
    fit = data["step_time_model"]["hf"]
    for b in (2, 4):
        assert fit["t_fixed_s"] + fit["t_per_group_s"] * b == pytest.approx(data["results"][f"hf@B{b}"]["step_s"])
    assert "hf: step_s = " in res.stdout  # the overrides to pass, or a noise warning if a term is <= 0


def test_bench_trl_reports_the_median_and_spread_over_runs():
    # Issue 30 item 7: README's speed numbers come from >= 3 runs with their spread. Three synthetic runs:
    # TRL 1.0/1.2/0.9 s, ours 0.5/0.8/0.6 s -> ours median 0.6 [0.5-0.8]; vs TRL per run 2.0, 1.5, 1.5 -> 1.50
    # [1.50-2.00] (the ratio within each run, not the ratio of the medians 1.0 / 0.6 = 1.67).
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_trl

    def row(s):
        return {"s_per_step": s, "completions_per_s": 128 / s, "tokens_per_s": 10 / s, "peak_rss_gb": s}

    runs = [{"short": {"trl": row(t), "ours-hf": row(o)}} for t, o in ((1.0, 0.5), (1.2, 0.8), (0.9, 0.6))]
    for run, skipped in zip(runs, (0.25, 0.10, 0.20), strict=True):  # ours: the share drop_zero_adv_groups skipped
        run["short"]["ours-hf"]["phases_s"] = {"generate": 0.1, bench_trl.SKIPPED: skipped}
    out = bench_trl.combine(runs)["short"]
    assert out["ours-hf"]["s_per_step"] == 0.6 and out["ours-hf"]["s_per_step_runs"] == [0.5, 0.8, 0.6]
    assert out["ours-hf"]["vs_trl_runs"] == pytest.approx([2.0, 1.5, 1.5])
    assert out["ours-hf"]["peak_rss_gb"] == 0.8  # the largest of the runs
    text = bench_trl.table({"short": out}, 3)
    assert "0.600 [0.500-0.800]" in text and "1.50 [1.50-2.00]" in text and "Median over 3 runs" in text
    ours_line = next(line for line in text.splitlines() if line.startswith("ours-hf"))
    assert "0.20  generate 0.100" in ours_line  # the skipped share's median in its own column, not a phase


def test_profile_step_rows_name_functions_that_exist():
    """scripts/profile_step.py matches profile rows by file and function name; a row whose file or function moved
    reads 0 s and is silently left out (issue 39: rows of trainer.py and rewards.py did). Each of our rows must name a
    file (or folder) of the tree that still defines its function."""
    import ast

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import profile_step
    finally:
        sys.path.remove(str(REPO / "scripts"))
    ours = [(label, where, func) for label, where, func in profile_step.PIECES if where.startswith("rl_training/")]
    assert len(ours) >= 15  # the step's own pieces, not only the libraries'

    def defines(path, func) -> bool:
        tree = ast.parse(path.read_text())
        return any(isinstance(n, ast.FunctionDef) and n.name == func for n in ast.walk(tree))

    missing = []
    for label, where, func in ours:
        files = sorted((REPO / where).glob("*.py")) if where.endswith("/") else [REPO / where]
        if not any(f.exists() and defines(f, func) for f in files):
            missing.append(f"{label.strip()}: no `def {func}` in {where}")
    assert not missing, missing

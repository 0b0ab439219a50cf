"""scripts/bench_scaling.py: grid planning, the least-squares cost fits and the row summaries (pure functions,
exact values), rollout.min_new_tokens (completions reach the cap, what the T axis needs) with the real HF and
vLLM backends, and a 2-point hf grid end to end. No timing asserts: speed lives in the script's output."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.config.schema import ConfigError
from rl_training.runners import rl_runner
from tests.helpers import REPO, TESTCFG

sys.path.insert(0, str(REPO / "scripts"))
import bench_scaling as bs

BASE = bs.Point(8, 8, 16)


def test_plan_sweeps_one_factor_at_a_time_around_the_base():
    sweeps = bs.plan_sweeps(BASE, {"prompts": [16, 4, 4], "groups": [4, 16], "tokens": []})
    # prompts: {16, 4} plus the base's 8, sorted, the repeated 4 once; groups: {4, 16} plus 8; tokens: not swept
    assert sweeps == {
        "prompts": [bs.Point(4, 8, 16), bs.Point(8, 8, 16), bs.Point(16, 8, 16)],
        "groups": [bs.Point(8, 4, 16), bs.Point(8, 8, 16), bs.Point(8, 16, 16)],
    }
    # an axis whose only value is the base's is a sweep of one point (the base)
    assert bs.plan_sweeps(BASE, {"tokens": [16]}) == {"tokens": [BASE]}
    assert bs.plan_sweeps(BASE, {}) == {}


def test_micro_groups_and_point_overrides():
    assert bs.micro_groups(BASE, 0) == 8  # one micro-batch: all 8 groups on the one rank
    assert bs.micro_groups(BASE._replace(ranks=2), 0) == 4  # 8 / 2 ranks
    assert bs.micro_groups(BASE._replace(ranks=2), 2) == 2  # 2 micro-batches of 2 groups per rank
    with pytest.raises(ValueError, match="not divisible by 3 ranks"):
        bs.micro_groups(BASE._replace(ranks=3), 0)
    with pytest.raises(ValueError, match="--micro-groups 3"):
        bs.micro_groups(BASE, 3)
    over = bs.point_overrides(bs.Point(4, 2, 6), 0, total_steps=5)
    cfg = load_config(TESTCFG, over)  # the real config accepts the grid's overrides
    r = cfg.rollout
    assert (r.prompts_per_step, r.group_size, r.max_new_tokens, r.min_new_tokens) == (4, 2, 6, 6)
    assert (cfg.train.micro_batch_groups, cfg.train.total_steps, cfg.train.drop_zero_adv_groups) == (4, 5, False)
    assert bs.label("vllm", bs.Point(4, 2, 6, 2)) == "vllm P4 G2 T6 x2r"


def test_min_new_tokens_above_max_is_refused():
    with pytest.raises(ConfigError, match="rollout.min_new_tokens=9 > rollout.max_new_tokens=8"):
        load_config(TESTCFG, ["rollout.min_new_tokens=9"])  # testconfig: max_new_tokens 8


def test_fit_line_exact_and_noisy():
    # y = 0.5 + 0.002 x exactly -> fixed 0.5, per 0.002, R^2 1
    f = bs.fit_line([100, 200, 400], [0.7, 0.9, 1.3])
    assert f["fixed"] == pytest.approx(0.5) and f["per"] == pytest.approx(0.002) and f["r2"] == pytest.approx(1.0)
    # x = 0..3, y = 1,3,2,4: mean x 1.5, mean y 2.5; Sxy = 2.25 - 0.25 - 0.25 + 2.25 = 4, Sxx = 5 -> per 0.8,
    # fixed 2.5 - 0.8 * 1.5 = 1.3; fitted 1.3, 2.1, 2.9, 3.7, residuals -0.3, 0.9, -0.9, 0.3: SS_res 1.8,
    # SS_tot 2.25 + 0.25 + 0.25 + 2.25 = 5 -> R^2 = 1 - 1.8 / 5 = 0.64
    f = bs.fit_line([0, 1, 2, 3], [1, 3, 2, 4])
    assert (f["fixed"], f["per"], f["r2"]) == pytest.approx((1.3, 0.8, 0.64))
    assert math.isnan(bs.fit_line([1, 2], [3.0, 3.0])["r2"])  # flat y: R^2 undefined (slope 0 still fitted)
    with pytest.raises(ValueError):
        bs.fit_line([4, 4], [1.0, 2.0])  # one distinct x: not identifiable


def row(backend, ranks, gen_tokens, generate_s, train_tokens, train_s, sync_s, other_s=0.0):
    return dict(backend=backend, ranks=ranks, gen_tokens=gen_tokens, generate_s=generate_s, train_tokens=train_tokens,
                train_s=train_s, sync_s=sync_s, other_s=other_s)  # fmt: skip


def test_fit_costs_per_backend_over_one_rank_rows():
    rows = [
        # hf: generate 0.1 + 0.002/token (0.3 at 100, 0.5 at 200); train 0.2 + 0.001/token (0.4 at 200, 0.6 at 400)
        row("hf", 1, 100, 0.3, 200, 0.4, 0.0),
        row("hf", 1, 200, 0.5, 400, 0.6, 0.0),
        # vllm: generate 0.05 + 0.001/token; sync 0.02, 0.03, 0.04 -> median 0.03
        row("vllm", 1, 100, 0.15, 200, 0.4, 0.02, 0.01),
        row("vllm", 1, 200, 0.25, 400, 0.6, 0.04, 0.02),
        row("vllm", 1, 400, 0.45, 800, 1.0, 0.03, 0.0),
        row("vllm", 2, 100, 9.0, 200, 9.0, 9.0),  # a 2-rank row: not in the fit
    ]
    f = bs.fit_costs(rows)
    assert (f["hf"]["generate"]["fixed"], f["hf"]["generate"]["per"]) == pytest.approx((0.1, 0.002))
    assert (f["hf"]["train"]["fixed"], f["hf"]["train"]["per"]) == pytest.approx((0.2, 0.001))
    assert (f["vllm"]["generate"]["fixed"], f["vllm"]["generate"]["per"]) == pytest.approx((0.05, 0.001))
    assert f["vllm"]["generate"]["r2"] == pytest.approx(1.0) and f["vllm"]["rows"] == 3
    assert f["vllm"]["sync_fixed"] == pytest.approx(0.03) and f["hf"]["sync_fixed"] == 0.0
    assert f["vllm"]["other_fixed"] == pytest.approx(0.01)  # median of other_s 0.01, 0.02, 0.0


def test_step_model_and_crossover():
    f = {"generate": {"fixed": 0.1, "per": 0.002}, "train": {"fixed": 0.2, "per": 0.001}, "sync_fixed": 0.05,
         "other_fixed": 0.05}  # fmt: skip
    m = bs.step_model(f, prompt_tokens=8.0, tokens=16)
    # F = 0.1 + 0.2 + 0.05 + 0.05 = 0.4; c = 0.002 + 0.001 x (1 + 8/16) = 0.0035; 9 F / c = 3.6 / 0.0035
    assert (m["fixed_s"], m["per_gen_token_s"]) == pytest.approx((0.4, 0.0035))
    assert m["tokens_for_10pct_fixed"] == pytest.approx(3.6 / 0.0035)
    # hf F 0.4, c 0.0035; vllm F 0.6, c 0.0025 -> equal at N* = 0.2 / 0.001 = 200 generated tokens
    hf, vllm = m, {"fixed_s": 0.6, "per_gen_token_s": 0.0025}
    assert bs.crossover(hf, vllm) == pytest.approx(200.0)
    assert bs.crossover(hf, {"fixed_s": 0.3, "per_gen_token_s": 0.0025}) == 0.0  # cheaper in both: always faster
    assert bs.crossover(hf, {"fixed_s": 0.3, "per_gen_token_s": 0.0035}) == 0.0  # same c, cheaper F
    assert bs.crossover(hf, {"fixed_s": 0.6, "per_gen_token_s": 0.004}) == math.inf  # dearer in both: never


def test_summarize_medians_and_token_counts(tmp_path):
    steps = [
        {"perf/step_s": s, "perf/generate_s": g, "perf/train_s": 0.2, "perf/sync_s": 0.01, "perf/score_s": 0.003,
         "perf/probe_s": 0.002, "perf/tokens_per_s": 100.0, "rollout/response_len_mean": 6.0, "mem/peak_rss_gb": 1.0}
        for s, g in ((0.5, 0.2), (0.4, 0.1), (0.9, 0.6))
    ]  # fmt: skip
    r = bs.summarize("hf P4 G2 T6", "hf", bs.Point(4, 2, 6), steps, prompt_tokens=7.5, sweep="tokens")
    assert (r["step_s"], r["generate_s"]) == (0.5, 0.2)  # medians of (0.5, 0.4, 0.9) and (0.2, 0.1, 0.6)
    assert r["gen_tokens"] == 48.0  # 4 prompts x 2 completions x 6 tokens
    assert r["train_tokens"] == 108.0  # 8 sequences x (7.5 prompt + 6 completion tokens)
    assert r["other_s"] == pytest.approx(0.005)  # score 0.003 + probe 0.002
    assert (r["prompts"], r["groups"], r["tokens"], r["ranks"], r["steps_measured"]) == (4, 2, 6, 1, 3)
    assert r["peak_rss_gb"] == 1.0
    # metrics.jsonl of a torchrun layout run: steps logged 1-based; warm-up 1 drops step 1
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": i, **steps[0]}) + "\n" for i in (1, 2, 3)))
    assert [x["step"] for x in bs.read_metrics(p, warmup=1)] == [2, 3]
    # a metric logged on some steps only (train/kl every loss.kl_log_every) does not break the medians
    r = bs.summarize("x", "hf", bs.Point(4, 2, 6), [{**steps[0], "train/kl": 0.1}, steps[1]], 7.5, "ranks")
    assert r["step_s"] == pytest.approx(0.45)  # median of 0.5 and 0.4


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_min_new_tokens_makes_every_completion_reach_the_cap(backend, run_overrides):
    """The warm model ends its reversal with EOS well before 24 tokens (the control); with
    rollout.min_new_tokens=24 every completion of a real step's generation is exactly 24 tokens long."""
    extra = ["rollout.backend=vllm", "vllm.kv_cache_gb=0.1"] if backend == "vllm" else []
    lengths = {}
    for m in (0, 24):
        over = [*run_overrides, *extra, "rollout.max_new_tokens=24", f"rollout.min_new_tokens={m}"]
        run = rl_runner.setup(load_config(TESTCFG, over), dist.init_distributed())
        try:
            ro = rl_runner.generate_step(run, 0).rollouts
        finally:
            run.backend.close()
        lengths[m] = [len(c) for c in ro.completion_ids]
        assert len(lengths[m]) == 16  # testconfig: 4 prompts x 4
    assert min(lengths[0]) < 24  # without it the policy stops early (so the check below can fail)
    assert lengths[24] == [24] * 16


# 25 s on one shared core at load average ~7 (51 s at 14): under the ~30 s bar on an idle machine
def run_grid(tmp_path, run_overrides, prompts: str, ranks: str) -> tuple[dict, str]:
    """bench_scaling.py with hf only at base 2 x 2 x 4, 2 steps after 1 warm-up: (its JSON, its stdout)."""
    out = tmp_path / "scaling.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_scaling.py"), "--cfg", TESTCFG, "--backends", "hf"]
    cmd += ["--base", "2,2,4", "--prompts", prompts, "--groups", "", "--tokens", "", "--ranks", ranks]
    cmd += ["--steps", "2", "--warmup", "1", "--out", str(out), *run_overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text()), res.stdout


def test_two_point_hf_grid_end_to_end(run_overrides, tmp_path):
    data, stdout = run_grid(tmp_path, run_overrides, prompts="4", ranks="")
    rows = data["rows"]
    assert [(r["label"], r["steps_measured"]) for r in rows] == [("hf P2 G2 T4", 2), ("hf P4 G2 T4", 2)]
    # every completion reaches the cap: 2 x 2 x 4 and 4 x 2 x 4 generated tokens
    assert [r["gen_tokens"] for r in rows] == [16.0, 32.0]
    # two points: each line passes through both medians exactly (R^2 1)
    g = data["fits"]["hf"]["generate"]
    for r in rows:
        assert g["fixed"] + g["per"] * r["gen_tokens"] == pytest.approx(r["generate_s"])
    assert g["r2"] == pytest.approx(1.0)
    assert "hf: generate_s = " in stdout and "hf P4 G2 T4" in stdout


@pytest.mark.slow  # two torchrun launches (1 and 2 ranks)
def test_rank_layouts_read_back_from_torchrun_runs(run_overrides, tmp_path):
    data, _ = run_grid(tmp_path, run_overrides, prompts="", ranks="1,2")
    rows = data["rows"]
    assert [(r["label"], r["sweep"], r["steps_measured"]) for r in rows] == [
        ("hf P2 G2 T4", "ranks", 2),  # metrics.jsonl steps 2 and 3 (step 1 is the warm-up)
        ("hf P2 G2 T4 x2r", "ranks", 2),
    ]
    assert [r["gen_tokens"] for r in rows] == [16.0, 16.0]  # 2 x 2 x 4 in both layouts (global sums)
    assert data["fits"] == {}  # rank rows are never fitted

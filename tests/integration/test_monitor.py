"""`python -m rl_training.monitor`: state, curve summary, low-reward samples and plots, on a hand-made run
directory (exact numbers) and on a real run of the runner."""

from __future__ import annotations

import json
from pathlib import Path

from rl_training.runners import monitor, rl_runner
from tests.helpers import TESTCFG
from tests.helpers import wandb_history as history


def make_run(root: Path, steps: int = 10, total: int = 40) -> Path:
    run = root / "r1"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (run / "checkpoints" / "step_000010" / "COMPLETE").write_text("ok\n")
    (run / "checkpoints" / "step_000005").mkdir()  # no marker: not a checkpoint
    (run / "config.yaml").write_text(f"run:\n  name: demo\ntrain:\n  total_steps: {total}\n")
    lines = [
        json.dumps(
            {
                "step": s,
                "rollout/reward_mean": s / 10,  # 0.1 .. 1.0
                "perf/step_s": 2.0 if s % 2 else 4.0,  # median 3.0 over an even count of each
                "perf/tokens_per_s": 100.0,
                "train/kl": 0.01,
                "probe/alert/batch": 1.0 if s == steps else 0.0,
                "sync/last_uploaded_step": 5,
                "sync/ckpt_pending": 1,
                "sync/ckpt_upload_failures": 0,
            }
        )
        for s in range(1, steps + 1)
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 11, "rollout/rew')  # torn last line
    (run / "samples").mkdir()
    samples = [
        {"step": 9, "reward": 0.0, "prompt": "p", "completion": "old step"},
        {"step": 10, "reward": 0.5, "prompt": "abc", "completion": "mid", "advantage": 0.1, "length": 3},
        {"step": 10, "reward": 0.0, "prompt": "abc", "completion": "worst one", "advantage": -0.4, "length": 2},
        {"step": 10, "reward": 1.0, "prompt": "abc", "completion": "best", "advantage": 0.5, "length": 4},
    ]
    (run / "samples" / "samples_000001.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (run / "eval" / "inloop").mkdir(parents=True)
    (run / "eval" / "inloop" / "step_000010.json").write_text(
        json.dumps({"step": 10, "metrics": {"accuracy": 0.25, "reward_mean": 0.5}})
    )
    return run


def test_summary_of_a_hand_made_run(tmp_path):
    run = monitor.load_run(make_run(tmp_path))
    assert run.name == "demo" and run.total_steps == 40 and run.step == 10 and run.torn_lines == 1
    assert run.checkpoints == [10]  # the unmarked step_000005 is not a checkpoint
    text = monitor.report([run], last=10, samples=2)
    # ETA: median step time of the last 10 steps = 3.0 s (five 2.0, five 4.0), 30 steps left -> 90 s = 1m30s.
    assert "step 10/40, ETA 1m30s at the median 3 s/step of the last 10" in text
    assert "last checkpoint: step 10 (1 kept); uploaded up to step 5, 1 pending, 0 failed" in text
    assert "probe alerts on: batch" in text
    assert "1 unreadable line(s) in metrics.jsonl skipped" in text
    # reward over the last 4 steps (7..10): mean (0.7+0.8+0.9+1.0)/4 = 0.85, change 1.0 - 0.7 = +0.3.
    row = next(ln for ln in monitor.report([run], last=4, samples=0).splitlines() if ln.startswith("reward "))
    assert "0.85 / +0.3" in row
    assert "eval inloop accuracy" in text and "0.25 at step 10" in text
    # The lowest-reward samples of the latest step (10), lowest first; step 9's is not shown.
    lows = text.split("lowest-reward samples of step 10")[1].splitlines()[1:3]
    assert "'worst one'" in lows[0] and "'mid'" in lows[1] and "old step" not in text


def test_side_by_side_and_plots(tmp_path):
    a = monitor.load_run(make_run(tmp_path / "a"))
    b = monitor.load_run(make_run(tmp_path / "b", steps=4))
    table = monitor.curve_table([a, b], last=4)
    assert table[0].count("mean (last 4) / change") == 2
    reward = next(ln for ln in table if ln.startswith("reward "))
    # run b: steps 1..4 -> mean 0.25, change +0.3
    assert "0.85 / +0.3" in reward and "0.25 / +0.3" in reward
    pngs = monitor.save_plots([a, b], tmp_path / "plots")
    names = {p.name for p in pngs}
    assert {"reward.png", "eval_inloop.png"} <= names and "gns.png" not in names  # no GNS keys in these runs
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_monitor_reads_a_real_run(run_overrides, tmp_path, capsys):
    over = [
        "train.total_steps=2",
        "ckpt.every=1",
        "run.samples_per_step=3",
        "run.wandb.project=p",
        "run.progress_bar=true",
    ]
    assert rl_runner.main(["--cfg", TESTCFG, *run_overrides, *over, "run.wandb.mode=offline"]) == 0
    err = capsys.readouterr().err
    # No terminal: whole progress lines, no carriage-return bar (the last step always gets one).
    assert "[rl] step 2/2 (100%)  reward " in err and "rl: " not in err  # (transformers' load bar is its own)
    run_dir = tmp_path / "runs" / "testconfig"
    # Samples: 3 per step (testconfig: 4 prompts x 4 = 16 rollouts), every field, the sampler's policy version,
    # and the per-sequence canary (fresh weights, float32 HF: the gap is round-off), absent (null) for a sample
    # of a zero-advantage group, which train.drop_zero_adv_groups (on by default) never forwarded.
    samples = [json.loads(x) for f in sorted((run_dir / "samples").glob("*.jsonl")) for x in f.read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2]
    assert [s["policy_version"] for s in samples] == [0, 0, 0, 1, 1, 1]
    gap = [s["logp_gap"] for s in samples]
    assert all(0 <= g < 1e-3 if g is not None else s["advantage"] == 0 for g, s in zip(gap, samples, strict=True))
    assert all(s["finish_reason"] in ("stop", "length") for s in samples)
    assert all(0 <= s["group"] < 4 and 0 <= s["index"] < 4 and s["prompt"].endswith("=") for s in samples)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # W&B offline: the same scalars as metrics.jsonl, and the samples as a table per step.
    rows = [r for r in history(run_dir) if "rollout/reward_mean" in r]
    assert [(r["_step"], r["rollout/reward_mean"]) for r in rows] == [
        (m["step"], m["rollout/reward_mean"]) for m in metrics
    ]
    assert [r["samples/nrows"] for r in history(run_dir) if r.get("samples/_type") == "table-file"] == [3, 3]
    assert monitor.main([str(run_dir), "--save-dir", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "step 2/2 (finished)" in out and "last checkpoint: step 2 (2 kept)" in out
    assert "reward " in out and "KL " in out and "3 lowest-reward samples of step 2" in out
    assert (tmp_path / "plots" / "reward.png").exists() and (tmp_path / "plots" / "loss.png").exists()


def test_lora_health_curves_and_alert_from_the_steps_that_logged_it(tmp_path):
    # LoRA health every 5 steps: the monitor reads lora/* from the rows that have them, and reports the
    # rank-collapse alert of the latest such row (step 10), though the last row (11) has none.
    run_dir = make_run(tmp_path, steps=11)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]  # without the torn line
    rows = [json.loads(x) for x in lines]
    for r in rows:
        if r["step"] % 5 == 0:  # steps 5 and 10: stable ranks 3.0 then 1.1 (median), the alert on at 10
            r.update({"lora/stable_rank/median": 3.0 if r["step"] == 5 else 1.1, "lora/stable_rank/min": 1.0,
                      "lora/alert/rank_collapse": float(r["step"] == 10)})  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = monitor.load_run(run_dir)
    text = monitor.report([run], last=11, samples=0)
    assert "rank_collapse (LoRA, step 10)" in text
    # median over its two logged values (3.0 + 1.1) / 2 = 2.05, change 1.1 - 3.0 = -1.9
    row = next(ln for ln in text.splitlines() if ln.startswith("LoRA stable rank median"))
    assert "2.05 / -1.9" in row
    assert "lora.png" in {p.name for p in monitor.save_plots([run], tmp_path / "plots")}


def test_the_rollout_advice_line_and_its_alert_from_the_steps_that_logged_it(tmp_path):
    # probe.advisor logs every probe.unit_every steps: here steps 4 and 8. The monitor prints the latest advice
    # (step 8) though the last row (10) has none, and the rollout_split alert of that row.
    run_dir = make_run(tmp_path, steps=10)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]
    rows = [json.loads(x) for x in lines]
    for r in rows:
        r["probe/gns/batch_units"] = 8.0
        if r["step"] % 4 == 0:
            r.update({"probe/advisor/k_star": 6.0 if r["step"] == 8 else 3.0, "probe/advisor/k_lo": 4.0,
                      "probe/advisor/k_hi": 9.0, "probe/advisor/b_star": 10.0, "probe/advisor/k_current": 32.0,
                      "probe/advisor/efficiency": 0.54, "probe/advisor/critical_rollouts": 143.0,
                      "probe/advisor/trusted": 1.0, "probe/alert/rollout_split": float(r["step"] == 8)})  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = monitor.report([monitor.load_run(run_dir)], last=10, samples=0)
    # the budget: K 32 x B 8 = 256 completions per step
    assert (
        "rollout budget (step 8, trusted): K* 6 [4-9], B* 10 for 256 completions/step (now K 32, B 8); "
        "efficiency of the current split 0.54, critical rollouts/step 143"
    ) in text
    assert "probe alerts on: batch, rollout_split (step 8)" in text
    # the curve row: mean of the two logged K* (3 + 6) / 2 = 4.5, change +3
    assert "4.5 / +3" in next(ln for ln in text.splitlines() if ln.startswith("advisor K*"))

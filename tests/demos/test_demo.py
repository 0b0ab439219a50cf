"""The embedded demos' acceptance criteria (issue 2, item 10; issue 18, item 7 for --task code; issue 49, item 4):
`scripts/demo.py` end to end (tiny model and data created if missing, SFT warm start, Dr-GRPO, held-out
before/after) raises the held-out reward of the sampled policy, the quantity Dr-GRPO maximises, and does not lower
the greedy one.

The bars come from the spread over data orders (`RL_DATA_ORDER`, docs/usage.md "Robustness"), not from one lucky
order. On this tiny model RL's greedy gain is bimodal: within 200 steps a run either finds the whole reversal (a
jump of the training reward, from about 0.77 to 0.91 at step 160 with order 0) or settles on a partial one (about
0.65-0.75 with the entropy down to 0.2-0.3). Measured on one core (AMD EPYC), the reverse demo's held-out gains
at orders 0, 100, 200, 300 and 400:
    sampled reward  +0.368 +0.225 +0.126 +0.178 +0.088   (the bar: +0.05, about half the least)
    greedy reward   +0.311 +0.150 +0.028 +0.142 +0.038   (the bar: no loss beyond -0.03)
A flipped advantage or a reward that ignores the question loses sampled reward: those fail. The old bar, greedy
+0.15, failed at 2 of these 5 orders.
A few minutes of compute: it runs with the slow tests. Each demo's time is printed, and bounded only by
run_demo_script's timeout (issue 49: a test asserts a duration only where time is the behaviour)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import clears, read_metrics, run_demo_script

pytestmark = pytest.mark.slow


def run_demo(tmp_path, task: str, *args: str):
    r, wall = run_demo_script("demo.py", "--task", task, "--output-dir", str(tmp_path), *args)
    (summary_file,) = tmp_path.glob("demo_*_rl/demo_summary.json")  # the runs went to --output-dir
    assert len(list(tmp_path.glob("demo_*_sft/final_model/config.json"))) == 1
    return r, wall, json.loads(summary_file.read_text())


@pytest.mark.one_core
def test_demo_meets_its_acceptance_criteria(tmp_path):
    r, wall, summary = run_demo(tmp_path, "reverse")
    gain = {k: summary["after"][k] - summary["before"][k] for k in ("sampled_reward", "greedy_reward")}
    print(f"demo: held-out gains {gain}, wall {wall:.0f} s", summary["times"])
    assert clears("reverse: held-out sampled reward gain", gain["sampled_reward"], 0.05), summary
    assert clears("reverse: held-out greedy reward gain", gain["greedy_reward"], -0.03), summary
    assert "Embedded demo" in r.stdout and "SFT start" in r.stdout  # the before/after table is printed


@pytest.mark.one_core
def test_code_demo_meets_its_acceptance_criteria(tmp_path):
    """Issue 18, item 7: on the synthetic program-synthesis task, graded in the sandbox on hidden inputs, RL raises
    the sampled policy's held-out pass rate and does not lower the greedy one. Measured on one core (AMD EPYC) at
    data orders 0, 100 and 200 (SFT starts 0.641, 0.781, 0.734 greedy):
        sampled pass@1  +0.330 +0.145 +0.064   (the bar: +0.03, about half the least)
        greedy          +0.273 +0.023 +0.016   (the bar: no loss beyond -0.03)
    The old bar, greedy +0.15 (docs/code.md's order-0 run: 0.641 -> 0.914), failed at both other orders."""
    from tests.helpers import require_debian_packages

    require_debian_packages({"bwrap": "bubblewrap"})
    r, wall, summary = run_demo(tmp_path, "code")
    gain = {k: summary["after"][k] - summary["before"][k] for k in ("sampled_accuracy", "greedy_accuracy")}
    print(f"code demo: held-out pass-rate gains {gain}, wall {wall:.0f} s", summary["times"])
    assert summary["headline"] == "greedy_accuracy" and summary["task"] == "code"
    assert clears("code: held-out sampled pass-rate gain", gain["sampled_accuracy"], 0.03), summary
    assert clears("code: held-out greedy pass-rate gain", gain["greedy_accuracy"], -0.03), summary
    assert "held-out pass rate (greedy)" in r.stdout


def test_demo_learns_asynchronously_on_a_vllm_server(tmp_path):
    """Issue 19, item 5: the same demo with generation on a local vLLM server and max_async_level 1 (every
    batch after the first sampled by the policy one update behind, corrected by truncated IS) meets the reverse
    demo's bars (its docstring above: the same task, model, data orders and bimodal outcome)."""
    r, wall, summary = run_demo(tmp_path, "reverse", "--server", "--async", "1")
    gain = {k: summary["after"][k] - summary["before"][k] for k in ("sampled_reward", "greedy_reward")}
    print(f"async demo: held-out gains {gain}, wall {wall:.0f} s")
    assert summary["backend"] == "server" and summary["max_async_level"] == 1
    assert clears("async server: held-out sampled reward gain", gain["sampled_reward"], 0.05), summary
    assert clears("async server: held-out greedy reward gain", gain["greedy_reward"], -0.03), summary
    (rl_dir,) = tmp_path.glob("demo_*_rl")
    metrics = read_metrics(rl_dir)
    assert [m["rollout/staleness_max"] for m in metrics[:3]] == [0, 1, 1]  # batch t from version t-1
    assert "max_async_level 1" in r.stdout

"""The embedded demos' acceptance criteria (issue 2, item 10; issue 18, item 7 for --task code):
`scripts/demo.py` end to end (tiny model and
data created if missing, SFT warm start, Dr-GRPO, held-out before/after) raises the held-out greedy mean reward by
at least 0.15 over the SFT starting point. A few minutes of compute: it runs with the slow tests. Each demo's time
is printed, and bounded only by run_demo_script's timeout (issue 49: a test asserts a duration only where time is
the behaviour)."""

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
    before, after = summary["before"]["greedy_reward"], summary["after"]["greedy_reward"]
    print(
        f"demo: greedy reward {before:.3f} -> {after:.3f} ({after - before:+.3f}), wall {wall:.0f} s", summary["times"]
    )
    assert clears("reverse: held-out greedy reward gain", after - before, 0.15), summary
    assert "Embedded demo" in r.stdout and "SFT start" in r.stdout  # the before/after table is printed


@pytest.mark.one_core
def test_code_demo_meets_its_acceptance_criteria(tmp_path):
    """Issue 18, item 7: on the synthetic program-synthesis task, graded in the sandbox on hidden inputs,
    RL raises the held-out greedy pass rate by at least 0.15 over the SFT start within 15 minutes.
    Measured on one busy core: 0.641 -> 0.914 (+0.273), 414 s (docs/code.md)."""
    from tests.helpers import require_debian_packages

    require_debian_packages({"bwrap": "bubblewrap"})
    r, wall, summary = run_demo(tmp_path, "code")
    before, after = summary["before"]["greedy_accuracy"], summary["after"]["greedy_accuracy"]
    print(
        f"code demo: pass rate {before:.3f} -> {after:.3f} ({after - before:+.3f}), wall {wall:.0f} s", summary["times"]
    )
    assert summary["headline"] == "greedy_accuracy" and summary["task"] == "code"
    assert clears("code: held-out greedy pass-rate gain", after - before, 0.15), summary
    assert "held-out pass rate (greedy)" in r.stdout


def test_demo_learns_asynchronously_on_a_vllm_server(tmp_path):
    """Issue 19, item 5: the same demo with generation on a local vLLM server and max_async_level 1 (every
    batch after the first sampled by the policy one update behind, corrected by truncated IS) meets the
    demo's own bar: held-out greedy reward +0.15 over the SFT start within 15 minutes."""
    r, wall, summary = run_demo(tmp_path, "reverse", "--server", "--async", "1")
    before, after = summary["before"]["greedy_reward"], summary["after"]["greedy_reward"]
    print(f"async demo: greedy reward {before:.3f} -> {after:.3f} ({after - before:+.3f}), wall {wall:.0f} s")
    assert summary["backend"] == "server" and summary["max_async_level"] == 1
    assert clears("async server: held-out greedy reward gain", after - before, 0.15), summary
    (rl_dir,) = tmp_path.glob("demo_*_rl")
    metrics = read_metrics(rl_dir)
    assert [m["rollout/staleness_max"] for m in metrics[:3]] == [0, 1, 1]  # batch t from version t-1
    assert "max_async_level 1" in r.stdout

"""scripts/bench_probes.py: one short run of the real runner cycling the three conditions."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO, TESTCFG

sys.path.insert(0, str(REPO / "scripts"))
import bench_probes as bp


def test_one_run_cycles_off_probes_and_lora_health(run_overrides):
    r = bp.one_run(TESTCFG, [*run_overrides, "ckpt.every=0"], steps=3, warmup=0)
    res = r["results"]
    assert [res[c]["steps"] for c in bp.CONDITIONS] == [1, 1, 1]
    # off: no probe phase at all; LoRA health only on the step whose condition asks for it
    assert res["off"]["probe_s"] == 0.0 and res["probes"]["probe_s"] > 0
    assert r["lora_logged"] == {"off": 0, "probes": 0, "probes+lora": 1}
    # all at the default cadence = GNS + ESS overhead + one LoRA call per lora_health_every (10) steps
    off = res["off"]["step_s"]
    expected = res["probes"]["step_s"] / off - 1 + r["lora_call_s"] / 10 / off
    assert r["lora_health_every"] == 10 and r["all_default_overhead"] == pytest.approx(expected, rel=1e-12)

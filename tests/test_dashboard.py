"""The probes' TensorBoard custom-scalar layout, read back from the event files, and the alert rules."""

from __future__ import annotations

import math
from pathlib import Path

from rl_training.probes.dashboard import LAYOUT, alerts
from rl_training.runners import rl_runner

REPO = Path(__file__).resolve().parents[1]


def test_layout_written_and_its_charts_have_data(run_overrides, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    # 2 micro-batches per step so the unit and micro levels are both identifiable (rank needs 2 ranks).
    assert (
        rl_runner.main(
            [
                "--cfg",
                str(REPO / "cfg" / "testconfig.yaml"),
                *run_overrides,
                "train.total_steps=3",
                "train.micro_batch_groups=2",
                "ckpt.every=0",
                "probe.gns_levels=[unit,micro]",
            ]
        )
        == 0
    )
    acc = EventAccumulator(str(tmp_path / "runs" / "testconfig" / "tb"))
    acc.Reload()
    raw = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout.FromString(raw)
    titles = [c.title for c in layout.category]
    assert titles == list(LAYOUT)
    scalars = set(acc.Tags()["scalars"])
    charted = {t for cat in LAYOUT.values() for _, tags in cat.values() for t in tags}
    missing = {t for t in charted - scalars if not t.endswith("@rank")}  # one rank: no rank level
    assert not missing, missing
    assert len(acc.Scalars("probe/gns/trace_sigma_est@micro")) == 3


def test_alert_rules():
    ok = {
        "probe/ess/token": 0.99,
        "probe/gns/b_simple_rel_se": 0.1,
        "probe/gns/batch_ratio": 1.0,
        "probe/gns/n_eff": 20.0,
        "probe/gns/trace_sigma_est@unit": 1.0,
        "probe/gns/trace_sigma_est@micro": 1.2,
    }
    assert set(alerts(ok, 0).values()) == {0.0}
    assert alerts({**ok, "probe/ess/token": 0.9}, 0)["probe/alert/ess_token"] == 1.0
    assert alerts({**ok, "probe/ess/token": 0.5}, 0)["probe/alert/ess_token"] == 2.0
    assert alerts({**ok, "probe/gns/batch_ratio": 0.1}, 0)["probe/alert/batch"] == -1.0
    assert alerts({**ok, "probe/gns/batch_ratio": 5.0}, 0)["probe/alert/batch"] == 1.0
    # An uncertain B_simple never raises the batch alert.
    assert (
        alerts({**ok, "probe/gns/batch_ratio": 0.1, "probe/gns/b_simple_rel_se": math.nan}, 0)["probe/alert/batch"]
        == 0.0
    )
    assert alerts(ok, 25)["probe/alert/gns_invalid"] == 1.0
    assert alerts({**ok, "probe/gns/trace_sigma_est@micro": 2.0}, 0)["probe/alert/levels_disagree"] == 1.0

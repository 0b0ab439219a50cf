"""The probes' TensorBoard custom-scalar layout, read back from the event files, and the alert rules."""

from __future__ import annotations

import math
import re

import pytest

from rl_training.probes.dashboard import LAYOUT, alerts
from rl_training.runners import rl_runner
from tests.helpers import REPO, read_metrics


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
                "train.total_steps=4",
                "train.micro_batch_groups=2",
                "ckpt.every=0",
                "eval.every=1",  # with probe.forecast_from=4: the forecast charts (4 evals, the fit's minimum)
                "eval.num_prompts=8",
                "probe.forecast_from=4",
                "probe.gns_levels=[unit,micro]",
                "probe.step_time_fixed_s=1.0",
                "probe.step_time_per_group_s=0.1",
                "loss.correction=token_mask",  # its counts fill the correction chart
                "probe.lora_health_every=2",  # the LoRA health charts: steps 2 and 4
                "probe.advisor=true",  # the rollout-budget charts: step 1 (unit_every 4: steps 0, 4, ... measure)
            ]
        )
        == 0
    )
    # LoRA health on the steps after 2, 4, ... updates only (here steps 2 and 4), with every key of docs/probes.md 8
    rows = read_metrics(tmp_path / "runs" / "testconfig")
    assert [m["step"] for m in rows if "lora/stable_rank/median" in m] == [2, 4]
    assert [m["step"] for m in rows if "probe/forecast/final_reward" in m] == [4]
    lora = {k: v for k, v in rows[1].items() if k.startswith("lora/")}
    # testconfig adapts every linear of the 4-layer model: q/k/v/o/gate/up/down x bands early (layers 0, 1),
    # middle (2), late (3) = 21 cells x 3 quantities + 6 overall keys
    assert len(lora) == 7 * 3 * 3 + 6 and lora["lora/alert/rank_collapse"] == 0.0
    assert 1.0 <= lora["lora/stable_rank/min"] <= lora["lora/stable_rank/median"] <= lora["lora/rank"]
    acc = EventAccumulator(str(tmp_path / "runs" / "testconfig" / "tb"))
    acc.Reload()
    raw = acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout.FromString(raw)
    titles = [c.title for c in layout.category]
    assert titles == list(LAYOUT)
    scalars = set(acc.Tags()["scalars"])
    charted = {t for cat in LAYOUT.values() for _, tags in cat.values() for t in tags}
    # a chart's tags are regexes (TensorBoard's custom scalars): each must match a logged scalar
    missing = {t for t in charted if not t.endswith("@rank") and not any(re.fullmatch(t, s) for s in scalars)}
    assert not missing, missing
    # Every chart, as TensorBoard reads it back, selects exactly its intended tags among all the run's scalars
    # (TensorBoard treats each Multiline entry as a regex: unanchored, 'probe/gns/b_simple' drew 13 series),
    # and holds at most 3 series (one run's series differ only by marker, not colour).
    for cat in layout.category:
        for chart in cat.chart:
            kind = chart.WhichOneof("content")
            intended = LAYOUT[cat.title][chart.title][1]
            if kind == "multiline":
                drawn = {t for t in scalars if any(re.search(rx, t) for rx in chart.multiline.tag)}
                assert drawn == set(intended) & scalars, (chart.title, drawn)
            else:
                s0 = chart.margin.series[0]
                assert [s0.value, s0.lower, s0.upper] == intended
            assert len(intended) <= 3, chart.title
    assert len(acc.Scalars("probe/gns/trace_sigma_est@micro")) == 4
    assert [e.step for e in acc.Scalars("lora/stable_rank/median")] == [2, 4]
    # B* = sqrt(B_simple t_f / t_u) = sqrt(10 B_simple) wherever B_simple is defined
    for bs, star in zip(acc.Scalars("probe/gns/b_simple"), acc.Scalars("probe/gns/b_star"), strict=True):
        if math.isfinite(bs.value):  # (it is on all 4 steps of this run: ~25-200 groups)
            assert star.value == pytest.approx(math.sqrt(10 * bs.value), rel=1e-5)
        else:
            assert math.isnan(star.value)


def test_alert_printed_when_it_switches_on_and_kept_on_steps_without_it(capsys):
    # LoRA health is logged every probe.lora_health_every steps: a step without lora/alert/rank_collapse says
    # nothing about it, so the alert, on at step 10, is not printed again at step 20 (absent at 11..19).
    from types import SimpleNamespace

    run = SimpleNamespace(alerts={})
    printed = []
    for step in (10, 11, 20, 30, 40):
        metrics = {"lora/alert/rank_collapse": {10: 1.0, 20: 1.0, 30: 0.0, 40: 1.0}[step]} if step != 11 else {}
        rl_runner.report_alerts(run, metrics, step)
        printed += [ln for ln in capsys.readouterr().out.splitlines() if "lora/alert/rank_collapse" in ln]
    assert [ln.split("]")[0] for ln in printed] == ["[step 10", "[step 40"]
    assert "LoRA rank collapse" in printed[0]


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
    # Batch alert: the band must lie wholly on one side of B (B = 32 here) and the point ratio beyond 1/4 or 4.
    band = {"probe/gns/batch_units": 32.0, "probe/gns/b_simple_lo": 200.0, "probe/gns/b_simple_hi": 400.0}
    assert alerts({**ok, **band, "probe/gns/batch_ratio": 0.1}, 0)["probe/alert/batch"] == -1.0
    assert alerts({**ok, **band, "probe/gns/batch_ratio": math.nan}, 0)["probe/alert/batch"] == -1.0  # |G|^2 <= 0
    assert alerts({**ok, **band, "probe/gns/batch_ratio": 0.3}, 0)["probe/alert/batch"] == 0.0  # not below 1/4
    low = {**band, "probe/gns/b_simple_lo": 4.0, "probe/gns/b_simple_hi": 7.0}
    assert alerts({**ok, **low, "probe/gns/batch_ratio": 5.0}, 0)["probe/alert/batch"] == 1.0
    # A band that contains B (B_simple not known to be above or below it) never raises the batch alert,
    # whatever the point estimate says; nor does the warm-up (band NaN).
    wide = {**band, "probe/gns/b_simple_lo": 20.0, "probe/gns/b_simple_hi": math.inf}
    assert alerts({**ok, **wide, "probe/gns/batch_ratio": 0.1}, 0)["probe/alert/batch"] == 0.0
    assert alerts({**ok, "probe/gns/batch_ratio": 0.1}, 0)["probe/alert/batch"] == 0.0
    assert alerts(ok, 25)["probe/alert/gns_invalid"] == 1.0
    assert alerts({**ok, "probe/gns/trace_sigma_est@micro": 2.0}, 0)["probe/alert/levels_disagree"] == 1.0


def test_ess_alert_watches_raw_ratios_without_tis_and_sudden_drops():
    ok = {"probe/ess/token": 1.0, "probe/ess/token_raw": 0.99}
    # Without TIS the weights used are all 1 (ess/token = 1): the raw-ratio ESS carries the mismatch.
    assert alerts({**ok, "probe/ess/token_raw": 0.9}, 0)["probe/alert/ess_token"] == 1.0
    assert alerts({**ok, "probe/ess/token_raw": 0.7}, 0)["probe/alert/ess_token"] == 2.0
    # Drop rule: history mean 0.99, sample sd of [0.985, 0.995] x 5 = 0.005 * sqrt(10/9) = 0.00527; 3 sd =
    # 0.0158. 0.97 is 0.02 below the mean (> 0.0158): alert, though above 0.95. 0.98 (0.01 below): none.
    hist = [0.985, 0.995] * 5
    assert alerts({**ok, "probe/ess/token_raw": 0.97}, 0, hist)["probe/alert/ess_token"] == 1.0
    assert alerts({**ok, "probe/ess/token_raw": 0.98}, 0, hist)["probe/alert/ess_token"] == 0.0
    # Too little history: no drop rule. A flat history: the 0.005 floor, so 0.99 -> 0.987 is no alert.
    assert alerts({**ok, "probe/ess/token_raw": 0.97}, 0, hist[:9])["probe/alert/ess_token"] == 0.0
    assert alerts({**ok, "probe/ess/token_raw": 0.987}, 0, [0.99] * 10)["probe/alert/ess_token"] == 0.0
    assert alerts({**ok, "probe/ess/token_raw": 0.984}, 0, [0.99] * 10)["probe/alert/ess_token"] == 1.0
    # No token weighted this step (every group dropped): ESS 0 with ess/defined = 0 is no alert, not "critical".
    undefined = {"probe/ess/token": 0.0, "probe/ess/token_raw": 0.0, "probe/ess/defined": 0.0}
    assert alerts(undefined, 0, [0.99] * 10)["probe/alert/ess_token"] == 0.0
    assert alerts({**undefined, "probe/ess/defined": 1.0}, 0)["probe/alert/ess_token"] == 2.0


def test_gns_levels_keep_only_identifiable_ones(capsys):
    from rl_training.runners.rl_runner import gns_levels

    default = ["micro", "rank"]
    assert gns_levels(default, False, accum_steps=2, world=1) == ["micro"]  # one rank: no rank level
    assert gns_levels(default, False, accum_steps=1, world=2) == ["micro", "rank"]  # 1 micro x 2 ranks = 2
    assert gns_levels(["unit", "micro"], True, accum_steps=2, world=1) == ["micro"]  # checkpointing: no unit
    assert capsys.readouterr().out == ""
    # One micro-batch on one rank: neither default level is identifiable -> the unit level, with a note.
    assert gns_levels(default, False, accum_steps=1, world=1) == ["unit"]
    assert "using the unit level" in capsys.readouterr().out
    assert gns_levels(default, True, accum_steps=1, world=1) == []  # nothing identifiable at all

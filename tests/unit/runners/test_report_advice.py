"""The advisor's advice in the training log (issue 52, item 3): rl_runner.report_advice prints the monitor's advice
line on the step the advice is first trusted, and again only when K* has moved by 1 or more since it was printed."""

from __future__ import annotations

import math
from types import SimpleNamespace

from rl_training.runners.rl_runner import report_advice


def advice(k_star: float, trusted: bool) -> dict[str, float]:
    return {
        "probe/advisor/k_star": k_star,
        "probe/advisor/trusted": float(trusted),
        "probe/advisor/k_lo": k_star - 1,
        "probe/advisor/k_hi": k_star + 1,
        "probe/advisor/k_current": 8.0,
        "probe/gns/batch_units": 16.0,
    }


def test_the_advice_is_printed_when_trusted_and_when_k_star_moves(capsys):
    run = SimpleNamespace(advised_k_star=None)
    steps = [
        (4, {}),  # a step the unit level did not measure: no advice keys
        (8, advice(5.0, trusted=False)),  # not trusted yet: silent
        (12, advice(math.nan, trusted=True)),  # no K* (tr S_b not positive): silent
        (16, advice(5.0, trusted=True)),  # first trusted advice: printed
        (20, advice(5.6, trusted=True)),  # moved by 0.6 < 1: silent
        (24, advice(6.0, trusted=True)),  # moved by 1 from the printed 5: printed
        (28, advice(3.0, trusted=False)),  # trust lost: silent, and the printed K* stays 6
        (32, advice(6.5, trusted=True)),  # 0.5 from the printed 6: silent
    ]
    for step, metrics in steps:
        report_advice(run, metrics, step)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("]")[0] for line in lines] == ["[step 16", "[step 24"]
    assert "rollout budget (step 16, trusted): K* 5 [4-6]" in lines[0]
    assert "K* 6 [5-7]" in lines[1] and "for 128 completions/step (now K 8, B 16)" in lines[1]

"""ckpt.keep_best (issue 30, item 6): the choice of metric, the strict improvement rule, and keep-last pruning
that never deletes the best checkpoint, with checkpoints/best and checkpoints/latest naming them."""

from __future__ import annotations

import math
import os

import pytest
import torch

from rl_training.ckpt import store as ck
from rl_training.ckpt.best import BestCheckpoint
from rl_training.config.load import load_config, to_yaml
from rl_training.config.rules import parse_keep_best
from rl_training.config.schema import ConfigError
from rl_training.policy.models import build_policy, trainable_parameters
from rl_training.train.optimizer import build_optimizer
from tests.helpers import REPO


@pytest.mark.parametrize(
    "value, every, expected",
    [
        ("auto", 5, ("eval/accuracy", "max")),
        ("auto", 0, ("", "")),  # no in-loop eval: nothing to judge by
        ("none", 5, ("", "")),
        ("eval/pass@4", 5, ("eval/pass@4", "max")),
        ("rollout/reward_mean:max", 0, ("rollout/reward_mean", "max")),
        ("eval/response_len_mean:min", 2, ("eval/response_len_mean", "min")),
    ],
)
def test_parse_keep_best(value, every, expected):
    assert parse_keep_best(value, every) == expected


@pytest.mark.parametrize(
    "override, message",
    [
        ("ckpt.keep_best=accuracy", "expected auto, none or <metric>[:max|:min]"),
        ("ckpt.keep_best=eval/accuracy:best", "expected auto, none or <metric>[:max|:min]"),
        ("ckpt.keep_best=eval/accuracy", "needs the in-loop eval: set eval.every > 0 (and data.eval)"),
    ],
)
def test_bad_keep_best_is_one_line_at_load(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert f"ckpt.keep_best={override.split('=')[1]!r}" in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_observe_keeps_the_strictly_best_finite_value():
    b = BestCheckpoint("eval/accuracy", "max")
    seen = [
        b.observe(s, m)
        for s, m in [
            (1, {"rollout/reward_mean": 1.0}),  # no eval at this step: no judgement
            (2, {"eval/accuracy": 0.25}),  # the first value is the best so far
            (3, {"eval/accuracy": 0.5}),
            (4, {"eval/accuracy": 0.5}),  # a tie keeps the earlier step
            (5, {"eval/accuracy": math.nan}),  # NaN is never best
            (6, {"eval/accuracy": 0.125}),  # the collapse after the peak
        ]
    ]
    assert seen == [False, True, True, False, False, False]
    assert (b.step, b.value, b.protected) == (3, 0.5, 3)
    low = BestCheckpoint("eval/response_len_mean", "min")
    assert [low.observe(s, {"eval/response_len_mean": v}) for s, v in [(1, 9.0), (2, 4.0), (3, 6.0)]] == [
        True,
        True,
        False,
    ]
    off = BestCheckpoint("")
    assert not off.observe(1, {"eval/accuracy": 1.0}) and off.protected is None


def test_state_resumes_and_resets_when_the_choice_changed():
    cfg = load_config(None, ["eval.every=2"])
    b = BestCheckpoint.from_config(cfg)
    b.observe(4, {"eval/accuracy": 0.75})
    again = BestCheckpoint.from_config(cfg, b.state_dict())
    assert (again.step, again.value) == (4, 0.75) and not again.observe(6, {"eval/accuracy": 0.5})
    other = BestCheckpoint.from_config(load_config(None, ["ckpt.keep_best=rollout/reward_mean"]), b.state_dict())
    assert (other.metric, other.step, other.value) == ("rollout/reward_mean", 0, None)  # not eval/accuracy's best


def test_pruning_keeps_the_best_and_links_name_best_and_latest(tiny_model, tmp_path):
    cfg = load_config(str(REPO / "cfg" / "testconfig.yaml"), [f"model.name_or_path={tiny_model}"])
    _, model = build_policy(cfg, torch.device("cpu"))
    opt, sched = build_optimizer(trainable_parameters(model), cfg.optim, 10)
    root = tmp_path / "checkpoints"

    def save(step, best):
        ck.save_checkpoint(tmp_path, step, model, opt, sched, to_yaml(cfg), {}, keep_last=2, best=best)
        return [s for s, _ in ck.list_checkpoints(tmp_path)]

    assert save(1, None) == [1] and not (root / "best").is_symlink()
    assert save(2, 2) == [1, 2]
    assert save(3, 2) == [2, 3]
    assert save(4, 2) == [2, 3, 4]  # keep_last=2 would have deleted step 2: the best stays
    assert save(5, 2) == [2, 4, 5]
    assert os.readlink(root / "best") == "step_000002" and os.readlink(root / "latest") == "step_000005"
    assert (root / "best" / "adapter").is_dir()  # a path a researcher can load
    assert save(6, 6) == [5, 6]  # a new best: the old one is pruned like any other
    assert os.readlink(root / "best") == "step_000006" and os.readlink(root / "latest") == "step_000006"
    # Resuming from step 5 sets step 6 aside: latest names 5 and the dangling best goes until the next save.
    ck.set_aside_later(tmp_path, 5)
    assert os.readlink(root / "latest") == "step_000005" and not (root / "best").is_symlink()
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [5]

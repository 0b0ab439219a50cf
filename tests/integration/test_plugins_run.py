"""The runner builds what loss.type, loss.correction and rollout.backend name and trains with it: a user's
objective or correction that zeroes the loss leaves a zero gradient where the built-in on the same seed does
not, and a backend without the versioned protocol is refused at setup when rollout.max_async_level > 0."""

from __future__ import annotations

import json
import textwrap

import pytest

from rl_training.runners import rl_runner
from tests.helpers import TESTCFG, scripted_reward

PLUGINS = """
from rl_training.algs.corrections import Correction, CorrectionOut
from rl_training.algs.objectives import OBJECTIVES, Objective
from rl_training.rollout.factory import hf_backend

DR = OBJECTIVES["dr_grpo"]


def zero_surrogate(logp, old_logp, adv, mask, clip_low, clip_high):
    s = DR.surrogate(logp, old_logp, adv, mask, clip_low, clip_high)
    return s._replace(per_token=0.0 * s.per_token)


ZERO = Objective("zero", "-", DR.baseline, DR.scale, zero_surrogate, DR.aggregate, 0.2, 0.2)


class ZeroAll(Correction):
    counts = {"is/zeroed_frac": "tokens"}

    def __call__(self, logp, rollout_logp, mask):
        return CorrectionOut(0.0 * mask, {"is/zeroed_frac": mask.sum()})


def plain_hf(ctx):
    return hf_backend(ctx)
"""


@pytest.fixture
def plugins(tmp_path):
    path = tmp_path / "plugins.py"
    path.write_text(textwrap.dedent(PLUGINS))
    return path


def one_step(run_overrides, tmp_path, name: str, *extra: str) -> dict:
    """One step on the Alternating reward (tests/helpers.py): every group 0, 1, 0, 1, so the built-in objective's
    gradient is non-zero by construction, whatever the model samples."""
    task = scripted_reward(tmp_path, "Alternating")
    args = ["--cfg", TESTCFG, *run_overrides, task, f"run.name={name}", "train.total_steps=1", "ckpt.every=0", *extra]
    assert rl_runner.main(args) == 0
    (row,) = [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return row


@pytest.mark.slow  # three one-step runs of the tiny model (~40 s)
def test_the_runner_trains_with_the_named_loss_and_correction(run_overrides, tmp_path, plugins):
    builtin = one_step(run_overrides, tmp_path, "builtin", "loss.type=dr_grpo")
    assert builtin["train/grad_norm"] > 0 and builtin["rollout/zero_adv_group_frac"] == 0
    zero_loss = one_step(run_overrides, tmp_path, "zero_loss", f"loss.type={plugins}:ZERO")
    assert zero_loss["train/grad_norm"] == 0.0 and zero_loss["train/pg_loss"] == 0.0
    # same seed, same rollouts: only the objective differs (the reward is 0.5 whatever is sampled; the lengths are not)
    for key in ("rollout/response_len_mean", "rollout/response_len_max"):
        assert zero_loss[key] == builtin[key], key
    zeroed = one_step(run_overrides, tmp_path, "zeroed", f"loss.correction={plugins}:ZeroAll")
    assert zeroed["train/grad_norm"] == 0.0 and zeroed["is/zeroed_frac"] == 1.0
    assert "is/zeroed_frac" not in builtin and "is/trunc_frac" not in builtin  # no correction, no count


def test_async_refuses_a_backend_without_versions_at_setup(run_overrides, tmp_path, plugins, capsys):
    args = ["--cfg", TESTCFG, *run_overrides, f"rollout.backend={plugins}:plain_hf", "loss.tis_cap=2.0",
            "rollout.max_async_level=1", "train.total_steps=1"]  # fmt: skip
    assert rl_runner.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "rollout.max_async_level=1 needs a versioned backend" in err[-1], err
    assert "has no pinned, republish, version_dirs" in err[-1]

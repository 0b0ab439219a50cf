"""rollout.group_size_auto's switch in the runner (rl_runner.switch_split, apply_split): what follows a new split of
the step's completions. The run is a namespace of the real parts the switch touches."""

from __future__ import annotations

from types import SimpleNamespace

from rl_training.config.load import load_config
from rl_training.config.schema import derive
from rl_training.data.prompts import PromptSampler
from rl_training.probes.forecast import RunForecast
from rl_training.probes.group_size import GroupSizeAuto
from rl_training.runners.rl_batch import apply_split, switch_split

AUTO = ["rollout.group_size_auto=true", "probe.advisor=true", "model.gradient_checkpointing=false"]


class Probes:
    def __init__(self):
        self.calls = []

    def regroup(self, units, group_size, restart):
        self.calls.append((units, group_size, restart))


def a_run(world: int = 1):
    # B 16 x K 8 = 128 completions a step, 2 groups a micro-batch
    cfg = load_config(
        None, [*AUTO, "rollout.prompts_per_step=16", "rollout.group_size=8", "train.micro_batch_groups=2"]
    )
    return SimpleNamespace(
        cfg=cfg,
        derived=derive(cfg, world),
        sampler=PromptSampler(1000, 16, 8, world, 0),
        learner=SimpleNamespace(seqs_per_rank=128 // world),
        probes=Probes(),
        forecast=RunForecast(0, 100, 128),
        auto=GroupSizeAuto.from_config(cfg, world, 1000, None),
    )


def test_a_switch_moves_the_normaliser_the_probes_and_the_forecast(capsys):
    run = a_run(world=2)
    run.auto.observe({"probe/advisor/k_star": 3.2, "probe/advisor/k_lo": 2.6, "probe/advisor/k_hi": 4.1,
                      "probe/advisor/trusted": 1.0})  # fmt: skip
    switch_split(run, 10)
    # K 3; B = 128 // 3 = 42, a multiple of 2 ranks x 2 groups -> 40: 120 completions, 60 per rank
    assert run.sampler.segments == ((10, 40, 3),) and run.sampler.split(9) == (16, 8)
    assert run.learner.seqs_per_rank == 60 and run.forecast.per_step == 120
    assert (run.derived.groups_per_rank, run.derived.accum_steps, run.derived.micro_batch_seqs) == (20, 10, 6)
    assert run.probes.calls == [(40, 3, True)]  # the GNS restarts
    assert "[step 10] rollout.group_size_auto: group size 8 -> 3, prompts per step 16 -> 40" in capsys.readouterr().out


def test_no_switch_inside_the_band_and_a_resume_applies_the_saved_split():
    run = a_run()
    run.auto.observe({"probe/advisor/k_star": 6.0, "probe/advisor/k_lo": 5.0, "probe/advisor/k_hi": 8.4,
                      "probe/advisor/trusted": 1.0})  # fmt: skip
    switch_split(run, 10)  # K 8 is inside [5, 8]: nothing moves
    assert run.sampler.segments == () and run.probes.calls == [] and run.learner.seqs_per_rank == 128
    # a resumed run's sampler holds the saved split: apply_split alone sets the geometry, without a GNS restart
    run.sampler = run.sampler.switched(4, 32, 4)
    apply_split(run, 12)
    assert run.learner.seqs_per_rank == 128 and run.derived.accum_steps == 16 and run.forecast.per_step == 128
    assert run.probes.calls == [(32, 4, False)]

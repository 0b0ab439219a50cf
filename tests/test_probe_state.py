"""The probes' resume state: a state_dict round trip (through JSON, as in trainer_state.json) continues a run
with exactly the outputs of an uninterrupted one, and a changed gns_ema_beta restarts the EMAs."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch

from rl_training.probes.dashboard import ESS_WARN
from rl_training.probes.probe import StepProbes

G, U, D, T = 2, 8, 16, 3  # completions per group, groups per step, gradient dimension, tokens per completion


def make_probes(beta: float = 0.9) -> tuple[StepProbes, torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.zeros(D, dtype=torch.float64))
    probes = StepProbes(
        None,
        [p],
        levels=["micro"],
        ema_beta=beta,
        units_per_step=U,
        world_size=1,
        micro_batch_groups=2,
        device=torch.device("cpu"),
    )
    return probes, p


def synthetic_step(probes: StepProbes, p: torch.nn.Parameter, step: int) -> dict[str, float]:
    """One probe step without a model: 8 groups in 4 micro-batches, unit gradients u_j ~ N(mu, I_16) with
    |mu|^2 = 2.5 (B_simple ~ 6.4: the recommendation moves between multiples of 2, so its hysteresis matters),
    read through the real parameter hooks; mismatch log-ratios of sd 0.03, and 0.12 every 11th step (ness
    ~0.986: above the 0.95 warning, so only the drop rule, i.e. the history, can flag it)."""
    gen = torch.Generator().manual_seed(1000 + step)
    u = math.sqrt(2.5 / D) + torch.randn(U, D, generator=gen, dtype=torch.float64)
    adv = torch.randn(U * G, generator=gen, dtype=torch.float64)
    sd = 0.12 if step % 11 == 10 else 0.03
    old_logp = sd * torch.randn(U * G, T, generator=gen, dtype=torch.float64)
    probes.begin_step(G, adv, [T] * (U * G))
    p.grad = None
    for groups in ([0, 1], [2, 3], [4, 5], [6, 7]):
        rows = [g * G + i for g in groups for i in range(G)]
        mb = SimpleNamespace(
            group_ids=groups,
            n_units=2,
            mask=torch.ones(len(rows), T),
            rollout_logp=torch.zeros(len(rows), T),
            advantages=adv[rows],
        )
        with probes.micro(mb):
            (-(u[groups].sum(0) @ p) / U).backward()
        probes.observe_rollout(mb, old_logp[rows], None)
    probes.before_allreduce()
    probes.after_allreduce()
    return probes.metrics()


def same(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # exact, NaN-aware


def test_state_dict_round_trip_reproduces_later_outputs_exactly():
    probes, p = make_probes()
    straight = [synthetic_step(probes, p, s) for s in range(70)]
    # What follows the resume at step 35 must depend on the saved state, or this test could not fail: the
    # recommendation changes (6 -> 8 -> 6 groups, held by the hysteresis) and the ESS drop rule fires above
    # the 0.95 warning line (it needs 10 steps of history).
    later = straight[35:]
    assert len({m["probe/gns/recommended_batch"] for m in later}) > 1
    assert any(m["probe/alert/ess_token"] and m["probe/ess/token_raw"] > ESS_WARN for m in later)

    first, p1 = make_probes()
    for s in range(35):
        synthetic_step(first, p1, s)
    saved = json.loads(json.dumps(first.state_dict()))  # what the checkpoint's trainer_state.json holds
    resumed, p2 = make_probes()
    resumed.load_state_dict(saved)
    for s in range(35, 70):
        assert same(synthetic_step(resumed, p2, s), straight[s]), s

    # Resuming with only the GNS EMAs (the old checkpoint content) does not reproduce the run.
    partial, p3 = make_probes()
    partial.tracker.load_state_dict(saved["gns"])
    assert not all(same(synthetic_step(partial, p3, s), straight[s]) for s in range(35, 70))


def test_changed_beta_keeps_the_configured_beta_and_restarts_the_ema(capsys):
    probes, p = make_probes(beta=0.8)
    for s in range(5):
        synthetic_step(probes, p, s)
    saved = json.loads(json.dumps(probes.state_dict()))
    other, _ = make_probes(beta=0.9)
    other.load_state_dict(saved)
    assert "keeping the configured beta" in capsys.readouterr().out
    st = other.tracker.levels["micro"]
    assert other.tracker.beta == st.beta == 0.9 and st.t == 0 and st.valid_steps == 0
    same_beta, _ = make_probes(beta=0.8)
    same_beta.load_state_dict(saved)
    assert capsys.readouterr().out == "" and same_beta.tracker.levels["micro"].t == 5


def test_old_gns_only_state_restores_the_emas():
    # Checkpoints written before the probe state held more than the GNS EMAs have {"gns": ...} only: those
    # EMAs are restored (the same level state as the full load), the rest starts fresh.
    probes, p = make_probes()
    for s in range(5):
        synthetic_step(probes, p, s)
    saved = json.loads(json.dumps(probes.state_dict()))
    old, _ = make_probes()
    old.load_state_dict({"gns": saved["gns"]})
    assert vars(old.tracker.levels["micro"]) == vars(probes.tracker.levels["micro"])
    assert list(old.ess_history) == [] and old.invalid_streak == 0

"""The probes' state: a state_dict round trip (through JSON, as in trainer_state.json) continues a run with
exactly the outputs of an uninterrupted one, and a changed gns_ema_beta restarts the EMAs. And their failure
containment (docs/probes.md 5): an exception in probe code, hooks included, is counted and reported once while
the training step goes on, on 1 rank and on 2 ranks where only one rank fails (no rank waits in a collective)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from rl_training.base import dist
from rl_training.probes.dashboard import ESS_WARN
from rl_training.probes.probe import StepProbes

G, U, D, T = 2, 8, 16, 3  # completions per group, groups per step, gradient dimension, tokens per completion


def make_probes(beta: float = 0.9, levels=("micro",), world: int = 1) -> tuple[StepProbes, torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.zeros(D, dtype=torch.float64))
    probes = StepProbes(
        None,
        [p],
        levels=list(levels),
        ema_beta=beta,
        units_per_step=U,
        world_size=world,
        micro_batch_groups=2,
        device=torch.device("cpu"),
    )
    return probes, p


def synthetic_step(probes: StepProbes, p: torch.nn.Parameter, step: int, rank: int = 0, world: int = 1, spike=None):
    """One probe step without a model: 8 groups in 4 micro-batches, unit gradients u_j ~ N(mu, I_16) with
    |mu|^2 = 2.5 (B_simple ~ 6.4: the recommendation moves between multiples of 2, so its hysteresis matters),
    read through the real parameter hooks; mismatch log-ratios of sd 0.03, and 0.12 every 11th step (ness
    ~0.986: above the 0.95 warning, so only the drop rule, i.e. the history, can flag it). With `world` ranks,
    rank r takes the r-th share of the groups and the gradients are averaged as the trainer averages them."""
    gen = torch.Generator().manual_seed(1000 + step)
    u = math.sqrt(2.5 / D) + torch.randn(U, D, generator=gen, dtype=torch.float64)
    adv = torch.randn(U * G, generator=gen, dtype=torch.float64)
    sd = 0.12 if step % 11 == 10 else 0.03
    old_logp = sd * torch.randn(U * G, T, generator=gen, dtype=torch.float64)
    if spike is not None:  # one token's log ratio (a corrupted log-prob)
        old_logp[0, 1] = spike
    mine = [g for g in range(U) if g * world // U == rank]
    rows_mine = [g * G + i for g in mine for i in range(G)]
    probes.begin_step(G, adv[rows_mine], [T] * len(rows_mine))
    p.grad = None
    for groups in [mine[i : i + 2] for i in range(0, len(mine), 2)]:
        rows = [g * G + i for g in groups for i in range(G)]
        mb = SimpleNamespace(
            group_ids=groups,
            n_units=2,
            mask=torch.ones(len(rows), T),
            rollout_logp=torch.zeros(len(rows), T),
            advantages=adv[rows],
        )
        with probes.micro(mb):
            (-(u[groups].sum(0) @ p) * world / U).backward()
        probes.observe_rollout(mb, old_logp[rows], None)
    probes.before_allreduce()
    dist.average_gradients_([p])
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


# ------------------------------------------------------------------------------ corrupted log-probs
@pytest.mark.parametrize("spike", [400.0, 800.0, 1000.0, -1000.0, math.inf, -math.inf, math.nan])
def test_a_corrupted_log_ratio_gives_a_defined_reading_and_never_an_exception(spike, capsys):
    # 48 tokens, one with log ratio `spike`. Finite +400..+1000: that token dominates, ESS -> 1 of 48 tokens
    # (ness 1/48, critical). -1000 or -inf: a weight of ~0, so ness ~ 47/48 (>= 0.95 warn line: no alert).
    # +inf or NaN: the defined critical reading 0, counted in probe/ess/nonfinite. (Raw weights raised
    # OverflowError at 400 and gave NaN, which left the alert off, at 800.)
    probes, p = make_probes()
    for s in range(3):
        synthetic_step(probes, p, s)
    m = synthetic_step(probes, p, 3, spike=spike)
    assert probes.guard.failures == 0 and capsys.readouterr().out == ""
    tok = m["probe/ess/token_raw"]
    if spike == math.inf or math.isnan(spike):
        assert (tok, m["probe/ess/nonfinite"], m["probe/alert/ess_token"]) == (0.0, 1.0, 2.0)
        assert m["probe/ess/seq"] == 0.0 and m["probe/ess/group_min"] == 0.0  # its sequence and group
    elif spike > 0:
        assert tok == pytest.approx(1 / 48, rel=1e-9) and m["probe/alert/ess_token"] == 2.0
        assert m["probe/ess/defined"] == 1.0 and m["probe/ess/nonfinite"] == 0.0
    else:
        assert 0.95 < tok < 47 / 48 * 1.01 and m["probe/ess/nonfinite"] == 0.0
    assert m["probe/ess/defined"] == 1.0 and m["probe/ess/token"] == 1.0  # no TIS: the weights used are 1
    synthetic_step(probes, p, 4)  # and the next step is normal again
    assert probes.guard.failures == 0


# ------------------------------------------------------------------------------------ failures
def _raise(*args, **kwargs):
    raise ValueError("injected probe bug")


def test_a_probe_exception_is_counted_reported_once_and_the_step_goes_on(capsys, monkeypatch):
    # Step 1 fails inside the ESS code and step 2 inside the metric formatting; the gradient every step is
    # exactly the one of a run without failures, the GNS update of a failed step is skipped (counted), and
    # the first failure alone is printed, with its last traceback line.
    clean, pc = make_probes()
    faulty, pf = make_probes()
    for step in range(4):
        if step == 1:
            monkeypatch.setattr(faulty, "_observe_rollout", _raise)
        if step == 2:
            monkeypatch.undo()
            monkeypatch.setattr(faulty, "_ess_format", _raise)
        if step == 3:
            monkeypatch.undo()
        m_clean, m = synthetic_step(clean, pc, step), synthetic_step(faulty, pf, step)
        assert torch.equal(pf.grad, pc.grad)  # the training gradient never depends on the probes
        # once per micro-batch (4) at step 1; step 2's failure comes after its payload, so shows at step 3
        assert m["probe/failures"] == {0: 0, 1: 4, 2: 4, 3: 5}[step]
        assert m["probe/step_failed"] == float(step in (1, 2))
    out = capsys.readouterr().out
    assert out.count("probe failure") == 1
    assert "in observe_rollout" in out and "ValueError: injected probe bug" in out and "test_probe_state.py" in out
    # step 1's update was skipped; step 2's happened (its failure came after the GNS update)
    assert faulty.tracker.levels["micro"].skipped == 1 and faulty.tracker.levels["micro"].t == 3
    assert m["probe/gns/trace_sigma_est"] != m_clean["probe/gns/trace_sigma_est"]  # it did miss one step
    assert faulty.state_dict()["failures"] == 5


def test_an_exception_inside_a_gradient_hook_does_not_abort_the_backward(monkeypatch, capsys):
    # A hook that raised would abort loss.backward() in the training step: the capture keeps the error.
    clean, pc = make_probes()
    faulty, pf = make_probes()
    cap = faulty.micro_cap
    arm = cap.arm
    monkeypatch.setattr(cap, "arm", lambda: (arm(), setattr(cap, "_acc", None)))  # the hook's add then fails
    synthetic_step(clean, pc, 0)
    m = synthetic_step(faulty, pf, 0)
    assert torch.equal(pf.grad, pc.grad)
    assert m["probe/failures"] == 4 and m["probe/step_failed"] == 1.0  # once per micro-batch
    assert faulty.tracker.levels["micro"].skipped == 1
    assert "TypeError" in capsys.readouterr().out


def failing_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    """4 steps on `world` ranks; rank 1 fails at step 1 in its ESS code, at step 2 in a gradient hook, at step
    3 in metrics() between its collectives."""
    from tests.workers.ddp_worker import _init

    _init(rank, world, port)
    probes, p = make_probes(levels=("micro", "rank"), world=world)
    res = []
    for step in range(4):
        if rank == 1 and step == 3:  # inside metrics(), between its collectives
            del probes.micro_cap.arm  # the class's arm again
            probes._local_maxima = _raise
        if rank == 1 and step == 1:
            probes._observe_rollout = _raise
        if rank == 1 and step == 2:
            del probes._observe_rollout
            cap, arm = probes.micro_cap, probes.micro_cap.arm
            cap.arm = lambda cap=cap, arm=arm: (arm(), setattr(cap, "_acc", None))  # the hook's add fails
        m = synthetic_step(probes, p, step, rank, world)
        st = probes.tracker.levels
        res.append({**{k: m[k] for k in ("probe/failures", "probe/step_failed")}, "grad": p.grad.tolist()})
        res[-1]["gns"] = {lv: (s.t, s.skipped) for lv, s in st.items()}
        res[-1]["ess"] = m["probe/ess/token_raw"]
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.cleanup()


@pytest.mark.slow
def test_one_rank_failing_leaves_no_rank_waiting_and_both_agree(tmp_path):
    from tests.helpers import free_port

    ctx = mp.spawn(failing_rank_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:  # a rank stuck in a collective the other skipped
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("a rank hung in a probe collective")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for a, b in zip(r0, r1, strict=True):
        assert a["grad"] == b["grad"]  # training's all-reduce ran in step on both ranks
        assert (a["probe/step_failed"], a["gns"]) == (b["probe/step_failed"], b["gns"])  # they agree
    # rank 1 holds 2 micro-batches: 2 failures at step 1 (ESS code), 2 more at step 2 (hooks), 1 at step 3
    assert [s["probe/step_failed"] for s in r0] == [0.0, 1.0, 1.0, 1.0]
    assert [s["probe/failures"] for s in r0] == [0.0, 2.0, 4.0, 5.0]
    assert r0[2]["gns"] == {"micro": [1, 2], "rank": [1, 2]}  # steps 1, 2 skipped at every level, on both ranks
    assert r0[3]["gns"] == {"micro": [2, 2], "rank": [2, 2]}  # step 3 failed after its GNS update
    assert r0[0]["ess"] == r1[0]["ess"] > 0.9

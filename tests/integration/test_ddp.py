"""Two ranks over gloo on CPU (torch.multiprocessing.spawn): the GNS probe's per-step raw estimates match
the single-process computation on the same partition (T3), and the real runner keeps ranks on disjoint
prompts with identical adapters and identical reduced metrics."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.multiprocessing as mp

from rl_training.policy.models import trainable_parameters
from tests.helpers import backward, flat_grad, free_port, lora_policy, one_micro_batch, scripted_reward
from tests.workers import ddp_worker

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("drop", [False, True])
def test_t3_two_rank_raw_estimates_match_single_process(tiny_model, tmp_path, drop):
    # Group 5 (rank 1's second) has zero advantages, so its gradient is exactly 0 (no KL term): skipping it
    # (drop=True) leaves every level's estimate unchanged, while rank 1 then holds 3 groups against rank 0's 4.
    mp.spawn(ddp_worker.probes_worker, args=(2, free_port(), str(tmp_path), str(tiny_model), drop), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    m, m1 = r0.pop("metrics"), r1.pop("metrics")
    assert r0 == r1  # every rank holds the same global estimate ...
    assert json.dumps(m) == json.dumps(m1)  # ... and the same reduced metrics (NaN-aware comparison)
    assert 0 < m["probe/ess/group_min"] <= m["probe/ess/group_median"] <= 1

    # Single process, same weights, same partition: rank r holds groups 4r..4r+3 in micro-batches of 2.
    from rl_training.algs.objectives import StepNorm

    model = lora_policy(tiny_model, seed=1)
    params = trainable_parameters(model)
    ro, adv = ddp_worker.ddp_batch()
    norm = StepNorm(seqs=8, tokens=1.0, max_new_tokens=8)
    h = []
    for j in range(8):
        model.zero_grad(set_to_none=True)
        backward(model, one_micro_batch(ro, adv, [j]), norm)
        h.append(flat_grad(params))
    sq = lambda x: x.double().pow(2).sum().item()  # noqa: E731
    U, W = 8, 2
    grads = [sum(h[0:4]), sum(h[4:8])]
    q = sq((grads[0] + grads[1]) / W)
    micro = [h[0] + h[1], h[2] + h[3], h[4] + h[5], h[6] + h[7]]
    expect = {
        # unit: gamma_j = (U/W) h_j, b = 1, c = 1/U
        "unit": (sum(sq(U / W * x) for x in h) / 8, 1.0, 8 / U**2),
        # micro: g = (U/W) h_mb / 2, b = 2, c = 2/U
        "micro": (sum(sq(U / W * m / 2) for m in micro) / 4, 1 / 2, 4 * (2 / U) ** 2 / 2),
        # rank: g = (U/W) grad_r / 4, b = 4, c = 4/U
        "rank": (sum(sq(U / W * g / 4) for g in grads) / 2, 1 / 4, 2 * (4 / U) ** 2 / 4),
    }
    # The spec's form of T3: a single-process run over the same partition (micro-batches [0,1] [2,3] [4,5]
    # [6,7], the same padding) gives the same raw estimates to 1e-10 at the levels it can see.
    single = single_process_probes(model, ro, adv)
    for level in ("unit", "micro"):
        for field in ("s_bar", "q", "a", "beta", "trace_sigma", "grad_sq_norm"):
            assert r0[level][field] == pytest.approx(getattr(single[level], field), rel=1e-10), (level, field)
    # And against per-group brute-force backwards (1e-9: float32 RMSNorm inside the float64 model makes
    # a 1-group backward differ from a 2-group one in the last float32 bits).
    for level, (s_bar, a, beta) in expect.items():
        got = r0[level]
        assert got["q"] == pytest.approx(q, rel=1e-9)
        assert got["s_bar"] == pytest.approx(s_bar, rel=1e-9), level
        assert got["a"] == pytest.approx(a, rel=1e-12) and got["beta"] == pytest.approx(beta, rel=1e-12)
        assert got["trace_sigma"] == pytest.approx((s_bar - q) / (a - beta), rel=1e-9)
        assert got["grad_sq_norm"] == pytest.approx((a * q - beta * s_bar) / (a - beta), rel=1e-9)


def single_process_probes(model, ro, adv):
    from rl_training.algs.objectives import StepNorm
    from rl_training.probes.probe import StepProbes
    from rl_training.train.batches import make_micro_batches
    from rl_training.train.learner import UpdateHParams, train_on_rollouts
    from tests.helpers import G

    params = trainable_parameters(model)
    probes = StepProbes(
        model,
        params,
        levels=["unit", "micro"],
        ema_beta=0.9,
        units_per_step=8,
        world_size=1,
        micro_batch_groups=2,
        device=torch.device("cpu"),
    )
    opt = torch.optim.SGD(params, lr=0.0)
    probes.begin_step(G, adv, [len(c) for c in ro.completion_ids])
    train_on_rollouts(
        model,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        params,
        make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu")),
        UpdateHParams(max_grad_norm=0.0),
        StepNorm(seqs=8 * G, tokens=1.0, max_new_tokens=8),
        probes,
    )
    probes.remove_hooks()
    return probes.tracker.last


def test_two_rank_runner_disjoint_prompts_identical_adapters_and_metrics(run_overrides, tmp_path):
    overrides = [*run_overrides, "rollout.prompts_per_step=8", "train.micro_batch_groups=2", "optim.lr=0.01"]
    overrides.append(scripted_reward(tmp_path, "Alternating"))  # every group informative: a gradient every step
    mp.spawn(ddp_worker.train_worker, args=(2, free_port(), str(tmp_path), overrides), nprocs=2)
    s0, s1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for a, b in zip(s0, s1, strict=True):
        assert len(a["indices"]) == 4 and not set(a["indices"]) & set(b["indices"])  # disjoint shards
        for k, v in a["metrics"].items():  # reduced before logging: identical on every rank
            if not k.startswith(("perf/", "mem/")):
                w = b["metrics"][k]
                assert (math.isnan(v) and math.isnan(w)) or v == pytest.approx(w, rel=1e-12, abs=1e-15), k
    p0, p1 = torch.load(tmp_path / "params0.pt"), torch.load(tmp_path / "params1.pt")
    assert torch.equal(p0, p1)  # the adapters stayed identical after three all-reduced steps
    last = s0[-1]["metrics"]
    assert last["train/grad_norm"] > 0 and "probe/gns/trace_sigma_est@rank" in last

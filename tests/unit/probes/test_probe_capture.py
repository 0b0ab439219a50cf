"""T1: the hooks against brute force on the real tiny model with LoRA (float64), and the probes' unit
accounting through the trainer (T4 loss scale, P2 measured before clipping, P6 hooks only on training
backwards)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rl_training.policy.models import trainable_parameters
from rl_training.probes import ess as ess_math
from rl_training.probes import probe as probe_module
from rl_training.probes.capture import LoraUnitCapture, MicroGradCapture
from rl_training.probes.gns import SmallBatchSums, two_batch_estimate
from rl_training.probes.probe import StepProbes
from rl_training.train.batches import make_micro_batches
from rl_training.train.learner import UpdateHParams, train_on_rollouts
from tests.helpers import G, backward, flat_grad, one_micro_batch, probe_step

N_GROUPS = 4


@pytest.fixture(scope="module")
def setup(tiny_model):
    return probe_step(tiny_model, N_GROUPS, 1, 7, [0.7, -0.7, 0.2, -0.2, 1.0, -1.0, -0.4, 0.4])


def test_t1_hooks_match_brute_force_per_group_gradients(setup):
    model, ro, adv, norm = setup
    params = trainable_parameters(model)
    h = []  # brute force: each group's gradient from its own backward
    for j in range(N_GROUPS):
        model.zero_grad(set_to_none=True)
        backward(model, one_micro_batch(ro, adv, [j]), norm)
        h.append(flat_grad(params))
    micro, units = MicroGradCapture(params), LoraUnitCapture(model)
    try:
        model.zero_grad(set_to_none=True)
        sizes, got_micro, got_units = [[0], [1, 2, 3]], [], []  # unequal micro-batches
        for groups in sizes:
            with micro.capture(), units.capture(len(groups)):
                backward(model, one_micro_batch(ro, adv, groups), norm)
            assert micro.calls == len(params)  # (d) one hook call per trainable tensor per backward
            got_micro.append(micro.sq_norm.item())
            got_units += units.unit_sq_norms.tolist()
        # (a) exact per-unit norms; (b) per-micro norms of the summed gradients; (c) .grad is the sum
        for j in range(N_GROUPS):
            assert got_units[j] == pytest.approx(h[j].pow(2).sum().item(), rel=1e-9)
        assert got_micro[0] == pytest.approx(h[0].pow(2).sum().item(), rel=1e-9)
        assert got_micro[1] == pytest.approx((h[1] + h[2] + h[3]).pow(2).sum().item(), rel=1e-9)
        torch.testing.assert_close(flat_grad(params), sum(h), rtol=1e-10, atol=1e-14)
        assert min(got_units) > 0
    finally:
        micro.remove()
        units.remove()


def unit_and_micro_probes(model, params, groups_per_micro: int) -> StepProbes:
    return StepProbes(
        model,
        params,
        levels=["unit", "micro"],
        ema_beta=0.9,
        units_per_step=N_GROUPS,
        world_size=1,
        micro_batch_groups=groups_per_micro,
        device=torch.device("cpu"),
    )


def run_step_with_probes(model, ro, adv, norm, groups_per_micro, max_grad_norm=0.0, kl_coef=0.0, drop=False):
    params = trainable_parameters(model)
    probes = unit_and_micro_probes(model, params, groups_per_micro)
    try:
        opt = torch.optim.SGD(params, lr=0.0)
        mbs = make_micro_batches(ro, adv, G, groups_per_micro, 0, torch.device("cpu"), drop_zero_adv_groups=drop)
        probes.begin_step(G, adv, [len(c) for c in ro.completion_ids])
        train_on_rollouts(
            model,
            opt,
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
            params,
            mbs,
            UpdateHParams(max_grad_norm=max_grad_norm, kl_coef=kl_coef),
            norm,
            probes,
        )
        return probes
    finally:
        probes.remove_hooks()


def test_probe_unit_accounting_matches_the_estimator_on_brute_force_units(setup):
    model, ro, adv, norm = setup
    params = trainable_parameters(model)
    h = []
    for j in range(N_GROUPS):
        model.zero_grad(set_to_none=True)
        backward(model, one_micro_batch(ro, adv, [j]), norm)
        h.append(flat_grad(params))
    # One rank, U = 4 units: gamma_j = U h_j, G_B = sum_j h_j = mean_j gamma_j; b = 1, c = 1/U.
    gamma = [N_GROUPS * x for x in h]
    q = sum(h).pow(2).sum().item()
    expect_unit = two_batch_estimate(SmallBatchSums(sum(g.pow(2).sum().item() for g in gamma), 4, 4.0, 4 / 16), q)
    # micro-batches of 2 groups: g_k = mean of its gammas, b = 2, c = 2/4
    micro_means = [(gamma[0] + gamma[1]) / 2, (gamma[2] + gamma[3]) / 2]
    expect_micro = two_batch_estimate(
        SmallBatchSums(sum(m.pow(2).sum().item() for m in micro_means), 2, 1.0, 2 * 0.25 / 2), q
    )
    probes = run_step_with_probes(model, ro, adv, norm, groups_per_micro=2)
    for level, expect in (("unit", expect_unit), ("micro", expect_micro)):
        got = probes.tracker.last[level]
        for field in ("trace_sigma", "grad_sq_norm", "s_bar", "q", "a", "beta"):
            assert getattr(got, field) == pytest.approx(getattr(expect, field), rel=1e-9), (level, field)
    assert probes.hook_errors == 0


def test_loss_scale_and_clipping_leave_b_simple_unchanged(setup):
    model, ro, adv, norm = setup
    base = run_step_with_probes(model, ro, adv, norm, 2).tracker.last["unit"]
    scaled = run_step_with_probes(model, ro, 3 * adv, norm, 2).tracker.last["unit"]  # Dr-GRPO: loss x 3
    # 1e-6, not 1e-12: Qwen2RMSNorm computes in float32 even in a float64 model, so backward is float32-exact.
    assert scaled.trace_sigma == pytest.approx(9 * base.trace_sigma, rel=1e-6)
    assert scaled.grad_sq_norm == pytest.approx(9 * base.grad_sq_norm, rel=1e-6)
    clipped = run_step_with_probes(model, ro, adv, norm, 2, max_grad_norm=1e-6).tracker.last["unit"]
    assert clipped.q == pytest.approx(base.q, rel=1e-12)  # measured before clip_grad_norm_ rescales .grad


def test_hooks_ignore_the_reference_forward(setup):
    model, ro, adv, norm = setup
    probes = run_step_with_probes(model, ro, adv, norm, 2, kl_coef=0.1)  # adds the adapter-disabled forward
    assert probes.hook_errors == 0 and probes.tracker.last["unit"] is not None


def zeroed(adv: torch.Tensor, zero_groups: list[int]) -> torch.Tensor:
    adv = adv.clone()
    for g in zero_groups:
        adv[g * G : (g + 1) * G] = 0.0
    return adv


def steps_with_and_without_dropping(setup, zero_groups):
    """The same step with the zero-advantage groups trained on (kept) and skipped (dropped)."""
    model, ro, adv, norm = setup
    adv = zeroed(adv, zero_groups)
    return tuple(run_step_with_probes(model, ro, adv, norm, 2, drop=drop) for drop in (False, True))


@pytest.mark.parametrize("zero_groups", [[1], [0, 1]])
def test_dropping_zero_advantage_groups_leaves_every_level_unchanged(setup, zero_groups):
    # A zero-advantage group's gradient is exactly 0 (no KL term), so the step gradient and every small
    # gradient are the same whether its forward runs or is skipped. Micro-batches of 2 groups: [0,1], [2,3].
    # zero_groups=[1]: block [0,1] keeps group 0, its micro mean is still (gamma_0 + 0)/2 with b = 2.
    # zero_groups=[0,1]: block [0,1] is skipped entirely and enters as one zero small gradient with b = 2.
    # (The old re-packing of kept groups into new blocks would have made the micro partition depend on the
    # advantages and biased the micro level: docs/probes.md 1.3 needs blocks chosen independently of the units.)
    kept, dropped = steps_with_and_without_dropping(setup, zero_groups)
    for level in ("unit", "micro"):
        a, b = kept.tracker.last[level], dropped.tracker.last[level]
        for field in ("trace_sigma", "grad_sq_norm", "s_bar", "q", "a", "beta", "k"):
            assert getattr(b, field) == pytest.approx(getattr(a, field), rel=1e-9, abs=1e-300), (level, field)
    assert dropped.tracker.last["micro"].k == 2 and dropped.tracker.last["unit"].k == N_GROUPS
    assert dropped.hook_errors == 0


def test_hook_miscount_skips_that_levels_step(setup):
    # Pitfall P6: a micro-batch whose hooks fired a wrong number of times must not feed the estimate.
    model, ro, adv, norm = setup
    probes = run_step_with_probes(model, ro, adv, norm, 2)
    assert probes.tracker.levels["micro"].skipped == 0
    probes.begin_step(G, adv, [len(c) for c in ro.completion_ids])
    mbs = make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu"))
    probes.install_hooks()
    try:
        for mb in mbs:
            with probes.micro(mb):
                backward(model, mb, norm)
                backward(model, mb, norm)  # a second backward inside one capture: 2 hook calls per parameter
        probes.before_allreduce()
        probes.after_allreduce()
    finally:
        probes.remove_hooks()
    assert probes.hook_errors == 2 * 2  # both micro-batches, both levels
    assert probes.tracker.levels["micro"].skipped == 1 and probes.tracker.levels["unit"].skipped == 1


def hook_count(model, params) -> int:
    """Tensor hooks on the trainable parameters plus forward hooks on every module."""
    return sum(len(p._backward_hooks or {}) for p in params) + sum(len(m._forward_hooks) for m in model.modules())


def test_install_hooks_is_idempotent_and_remove_leaves_none(setup):
    # The overhead benchmark alternates install/remove: "on" steps must carry exactly one set of hooks (the
    # constructor's set must not stay under a second one) and "off" steps none at all.
    model, _, _, _ = setup
    params = trainable_parameters(model)
    before = hook_count(model, params)
    probes = unit_and_micro_probes(model, params, 2)
    one_set = hook_count(model, params) - before
    assert one_set == len(params) + 2 * len(probes.unit_cap.pairs)  # a hook per tensor, per lora_A/lora_B
    for _ in range(3):
        probes.install_hooks()
        assert hook_count(model, params) - before == one_set
        probes.remove_hooks()
        assert hook_count(model, params) == before
        probes.remove_hooks()  # removing twice is harmless
        assert hook_count(model, params) == before


ADV_ESS = ("probe/ess/adv_seq", "probe/ess/adv_token", "probe/gns/degenerate_group_frac")


@pytest.mark.parametrize("zero_groups", [[1], [0, 1]])
def test_dropping_zero_advantage_groups_leaves_the_advantage_ess_unchanged(setup, zero_groups):
    # E6: degenerate groups count with weight 0, in N (sequences) and in the token total sum_i T_i alike.
    # Skipped groups never reach observe_rollout, so their lengths come from begin_step; without them
    # ess/adv_token came out larger with dropping. (The mismatch ESS, ess/token etc., covers the tokens the
    # loss actually sees, so it legitimately differs when groups are skipped.)
    kept, dropped = (probes.metrics() for probes in steps_with_and_without_dropping(setup, zero_groups))
    for key in ADV_ESS:
        assert dropped[key] == pytest.approx(kept[key], rel=1e-12, abs=0), key
    assert kept["probe/gns/degenerate_group_frac"] == len(zero_groups) / N_GROUPS
    # worked value: (sum_i T_i |A_i|)^2 / (sum_i T_i A_i^2) / sum_i T_i over all 8 sequences, zeros included
    _, ro, adv, _ = setup
    T = torch.tensor([len(c) for c in ro.completion_ids], dtype=torch.float64)
    a = zeroed(adv, zero_groups).abs()
    expect = ((T * a).sum() ** 2 / (T * a * a).sum() / T.sum()).item()
    assert dropped["probe/ess/adv_token"] == pytest.approx(expect, rel=1e-12)


def test_step_with_nothing_observed_raises_no_ess_alert_and_keeps_the_history(setup):
    # A step whose probes observed no micro-batch (a rank without rollouts; a step whose groups are all skipped
    # keeps one for the canary, train/batches.py make_micro_batches, so that is rarer now): nothing was weighted, token
    # ESS undefined (ess/defined = 0, ESS 0 by the E3 convention). That is no "critical" mismatch, and no 0 may
    # enter the drop rule's history.
    model, ro, adv, norm = setup
    probes = run_step_with_probes(model, ro, adv, norm, 2)
    first = probes.metrics()
    assert first["probe/ess/defined"] == 1.0 and len(probes.ess_history) == 1
    zero = torch.zeros_like(adv)
    probes.install_hooks()
    try:
        model.zero_grad(set_to_none=True)  # no backward runs in this step
        probes.begin_step(G, zero, [len(c) for c in ro.completion_ids])
        probes.before_allreduce()  # no micro-batch observed
        probes.after_allreduce()
        m = probes.metrics()
    finally:
        probes.remove_hooks()
    assert m["probe/ess/defined"] == 0.0 and m["probe/ess/token"] == 0.0
    assert m["probe/alert/ess_token"] == 0.0
    assert list(probes.ess_history) == [first["probe/ess/token_raw"]]
    assert m["probe/gns/degenerate_group_frac"] == 1.0


# ------------------------------------------------------------------------ device placement (issue: CUDA)
class _OneLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


def _probe_step_on(meta: torch.device):
    """One probe step at every GNS level (a peft LoRA linear for the unit level: the tiny Qwen2 cannot run on
    meta, transformers reads its mask with .item()), with the ESS, PPO ratios and metrics, all on `meta`."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_OneLinear(), LoraConfig(r=2, target_modules=["proj"], init_lora_weights=False))
    model = model.double().to(meta)
    probes = StepProbes(
        model,
        trainable_parameters(model),
        levels=["unit", "micro", "rank"],
        ema_beta=0.9,
        units_per_step=4,
        world_size=1,
        micro_batch_groups=2,
        device=meta,
    )
    n_seq, T = 2 * G, 3  # a micro-batch: 2 groups of G sequences of T tokens
    probes.begin_step(G, torch.zeros(4 * G, dtype=torch.float64, device=meta), [T] * (4 * G))
    for groups in ([0, 1], [2, 3]):
        mb = SimpleNamespace(
            group_ids=groups,
            n_units=2,
            mask=torch.ones(n_seq, T, device=meta),
            rollout_logp=torch.zeros(n_seq, T, device=meta),
            advantages=torch.zeros(n_seq, dtype=torch.float64, device=meta),
        )
        with probes.micro(mb):
            model(torch.ones(n_seq, T, 8, dtype=torch.float64, device=meta)).sum().backward()
        old = torch.zeros(n_seq, T, dtype=torch.float64, device=meta)
        probes.observe_rollout(mb, old, torch.ones(n_seq, T, device=meta))
        probes.observe_ppo(mb, old, old)
    probes.before_allreduce()
    probes.after_allreduce()
    m = probes.metrics()
    probes.remove_hooks()
    return probes, m


def test_probe_tensor_code_keeps_to_the_training_device(monkeypatch):
    """Every probe entry point on the "meta" device: a tensor made on the CPU and mixed with the step's
    tensors (a torch.cat with a CPU pad was the first GPU run's crash) raises here as it would on CUDA. The
    guard would swallow that as a counted failure, so the test asserts none was counted, and that the two
    host transfers receive meta tensors (they are the one place that may leave the device; on meta they
    cannot be read, so a stand-in returns NaNs of the same length). Any other host sync (.item(), .tolist(),
    a data-dependent shape) cannot run on meta either, so it would be counted as a failure too."""
    meta = torch.device("meta")
    moved = []

    def to_host(t):
        moved.append(t.device)
        return [math.nan] * t.numel()

    monkeypatch.setattr(probe_module, "_to_host", to_host)
    # No fx_config.meta_nonzero_assume_all_nonzero here: meta refuses data-dependent shapes (boolean-mask
    # indexing, nonzero), which on CUDA would each cost a host sync; the probes select with `where`.
    probes, m = _probe_step_on(meta)
    assert probes.guard.failures == 0, "failures"
    assert probes.hook_errors == 0
    assert moved == [meta, meta]  # one transfer per call, of tensors that never left the device
    assert m["probe/step_failed"] == 0.0


def test_the_meta_guard_catches_a_cpu_tensor(monkeypatch):
    # The guard test above can fail: the old CPU pad of the group-ESS gather is counted as a failure on meta.
    def old_group_ness(self, n):
        g = ess_math.group_ness(torch.cat(self.seq_log_w), self.G)
        return torch.cat([g, torch.full((n - g.numel(),), math.nan, dtype=torch.float64)])

    monkeypatch.setattr(StepProbes, "_local_group_ness", old_group_ness)
    with pytest.raises(AssertionError, match="failures"):
        test_probe_tensor_code_keeps_to_the_training_device(monkeypatch)


def test_unit_level_measures_every_unit_every_steps_only(setup):
    """unit_every = 2: steps 0 and 2 update the unit level's EMA (t counts its updates), step 1 neither updates
    it nor counts it as skipped, and its raw values are absent; the micro level updates on all three steps."""
    model, ro, adv, norm = setup
    params = trainable_parameters(model)
    probes = StepProbes(
        model,
        params,
        levels=["unit", "micro"],
        ema_beta=0.9,
        units_per_step=N_GROUPS,
        world_size=1,
        micro_batch_groups=2,
        device=torch.device("cpu"),
        unit_every=2,
    )
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    seen = []
    try:
        for step in range(3):
            mbs = make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu"))
            probes.begin_step(G, adv, [len(c) for c in ro.completion_ids], step)
            train_on_rollouts(model, opt, sched, params, mbs, UpdateHParams(max_grad_norm=0.0), norm, probes)
            m = probes.metrics()
            lv = probes.tracker.levels
            seen.append((lv["unit"].t, lv["unit"].skipped, lv["micro"].t, probes.tracker.last["unit"] is None))
            assert m["probe/gns/hook_errors"] == 0
    finally:
        probes.remove_hooks()
    assert seen == [(1, 0, 1, False), (1, 0, 2, True), (2, 0, 3, False)]

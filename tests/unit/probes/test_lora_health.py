"""LoRA health (docs/probes.md 8): the QR route's singular values against the dense product, the rank measures on
worked spectra, the collapse alert on constructed spectra, bands and types of a real peft model."""

from __future__ import annotations

import math

import pytest
import torch

from rl_training.probes.lora_health import (
    LoraFactors,
    collapse_alert,
    entropy_rank,
    health_metrics,
    lora_factors,
    lora_health,
    module_type_and_band,
    spectra,
    spectra_flops,
    stable_rank,
)
from tests.helpers import lora_policy

D = torch.float64


def test_rank_measures_worked_values():
    # sigma = (2, 1, 1, 0): stable rank (4 + 1 + 1)/4 = 1.5; p = (1/2, 1/4, 1/4, 0),
    # H = 0.5 ln 2 + 2 (0.25 ln 4) = 1.5 ln 2, exp(H) = 2^1.5 = 2.828.
    assert stable_rank([2.0, 1.0, 1.0, 0.0]) == pytest.approx(1.5, rel=1e-15)
    assert entropy_rank([2.0, 1.0, 1.0, 0.0]) == pytest.approx(2**1.5, rel=1e-14)
    # k equal values: both measures are k; one non-zero value: both 1; a zero update: NaN (not an alert).
    assert stable_rank([3.0] * 5) == pytest.approx(5.0) and entropy_rank([3.0] * 5) == pytest.approx(5.0)
    assert stable_rank([7.0, 0.0, 0.0]) == 1.0 and entropy_rank([7.0, 0.0, 0.0]) == 1.0
    assert math.isnan(stable_rank([0.0, 0.0])) and math.isnan(entropy_rank([0.0, 0.0]))


def test_qr_route_matches_dense_svd():
    # Unequal shapes (a k_proj-like 64 x 128 and a down_proj-like 128 x 384, r = 8), float64 and float32, a
    # module narrower than r (6 x 40: QR's R is 6 x 8, six values), and a scaling of 2.5: sigma(s B A) from the
    # r x r route equals svdvals of the dense product.
    g = torch.Generator().manual_seed(0)
    facs = []
    shapes = [(64, 128, D), (64, 128, D), (128, 384, D), (96, 40, torch.float32), (6, 40, D)]
    for i, (out_f, in_f, dt) in enumerate(shapes):
        a = torch.randn(8, in_f, generator=g, dtype=D).to(dt)
        b = torch.randn(out_f, 8, generator=g, dtype=D).to(dt)
        facs.append(LoraFactors(f"m{i}", a, b, 2.5))
    for f, s in zip(facs, spectra(facs), strict=True):
        assert len(s) == min(f.b.shape[0], f.a.shape[1], 8)
        dense = torch.linalg.svdvals(f.scaling * f.b.double() @ f.a.double())[: len(s)]
        tol = 1e-10 if f.a.dtype == D else 1e-4
        assert torch.allclose(torch.tensor(s, dtype=D), dense, rtol=tol, atol=tol * dense[0].item())


def test_bands_and_types():
    # 28 layers: 3 l // 28 -> early for l <= 9, middle for 10..18, late for 19..27
    assert module_type_and_band("x.layers.9.self_attn.q_proj", 28) == ("q_proj", "early")
    assert module_type_and_band("x.layers.10.mlp.down_proj", 28) == ("down_proj", "middle")
    assert module_type_and_band("x.layers.19.self_attn.v_proj", 28) == ("v_proj", "late")
    assert module_type_and_band("x.layers.27.self_attn.v_proj", 28) == ("v_proj", "late")
    assert module_type_and_band("base_model.model.lm_head", 28) == ("lm_head", "other")
    # 4 layers (the tiny model): 0, 1 early; 2 middle; 3 late
    assert [module_type_and_band(f"m.layers.{i}.q", 4)[1] for i in range(4)] == ["early", "early", "middle", "late"]


def spread_spectrum(r: int) -> list[float]:
    return [1.0 / math.sqrt(i) for i in range(1, r + 1)]  # stable rank = H_r (2.72 at r = 8, 3.38 at 16)


def one_direction(r: int, eps: float = 0.05) -> list[float]:
    return [1.0] + [eps] * (r - 1)  # stable rank 1 + (r - 1) eps^2 = 1.0375 at r = 16


def test_collapse_alert_on_constructed_spectra():
    r = 16
    assert stable_rank(spread_spectrum(r)) == pytest.approx(sum(1 / i for i in range(1, 17)), rel=1e-12)
    healthy = [stable_rank(spread_spectrum(r))] * 10
    collapsed = [stable_rank(one_direction(r))] * 10
    assert not collapse_alert(healthy, r)
    assert collapse_alert(collapsed, r)
    # the rule needs a majority: 5 of 10 collapsed does not alert, 6 of 10 does
    assert not collapse_alert(healthy[:5] + collapsed[:5], r)
    assert collapse_alert(healthy[:4] + collapsed[:6], r)
    # r < 4 never alerts (a rank-2 adapter cannot be told from a collapsed one); zero updates do not count
    assert not collapse_alert([1.0, 1.0], 2)
    assert not collapse_alert([math.nan] * 4, r)
    assert collapse_alert([math.nan] * 4 + collapsed[:1], r)


def test_health_metrics_keys_and_values():
    # two q_proj modules in the early band (spread, one-direction), one v_proj late (spread), 6 layers
    names = ["m.layers.0.self_attn.q_proj", "m.layers.1.self_attn.q_proj", "m.layers.5.self_attn.v_proj"]
    sig = [spread_spectrum(8), one_direction(8), spread_spectrum(8)]
    out = health_metrics(names, sig, n_layers=6)
    h8 = sum(1 / i for i in range(1, 9))  # 2.7179
    one = 1 + 7 * 0.05**2  # 1.0175
    assert out["lora/stable_rank/q_proj/early"] == pytest.approx((h8 + one) / 2, rel=1e-12)
    assert out["lora/stable_rank/v_proj/late"] == pytest.approx(h8, rel=1e-12)
    assert out["lora/update_norm/v_proj/late"] == pytest.approx(math.sqrt(h8), rel=1e-12)  # |s|^2 = H_8
    assert out["lora/stable_rank/min"] == pytest.approx(one, rel=1e-12)
    assert out["lora/collapsed_frac"] == pytest.approx(1 / 3)
    assert out["lora/rank"] == 8.0 and out["lora/alert/rank_collapse"] == 0.0
    assert "lora/stable_rank/q_proj/middle" not in out  # only the bands that hold modules
    collapsed = health_metrics(names, [one_direction(8)] * 3, n_layers=6)
    assert collapsed["lora/alert/rank_collapse"] == 1.0


def test_flop_count_worked_value():
    # one 1536 x 1536 module at r = 32: 2 (3072)(1024) - (4/3) 32768 + 2 (32768) + (8/3) 32768
    # = 6291456 - 43690.67 + 65536 + 87381.33 = 6400682.67
    assert spectra_flops([(1536, 1536, 32)]) == pytest.approx(6400682.6667, rel=1e-9)


@pytest.fixture(scope="module")
def peft_model(tiny_model):
    return lora_policy(tiny_model, seed=3)  # r = 4, alpha = 8 (scaling 2), random B so the update is non-zero


def test_peft_model_spectra_match_dense_and_metrics_cover_every_module(peft_model):
    facs = lora_factors(peft_model)
    n_layers = peft_model.config.num_hidden_layers
    # every linear of every layer is adapted (all-linear): 7 per layer
    assert len(facs) == 7 * n_layers and all(f.scaling == 2.0 for f in facs)
    for f, s in zip(facs, spectra(facs), strict=True):
        dense = torch.linalg.svdvals(f.scaling * f.b @ f.a)[: len(s)]  # the float64 update of the model
        assert torch.allclose(torch.tensor(s, dtype=D), dense, rtol=1e-10, atol=1e-12)
    out = lora_health(peft_model)
    for kind in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        for band in ("early", "middle", "late"):
            assert 1.0 <= out[f"lora/stable_rank/{kind}/{band}"] <= 4.0
            assert 1.0 <= out[f"lora/entropy_rank/{kind}/{band}"] <= 4.0
    assert out["lora/rank"] == 4.0 and out["lora/alert/rank_collapse"] == 0.0


def test_peft_model_collapse_is_detected(peft_model):
    # Make every module's B rank one (each column a multiple of the first): the update is one direction, so
    # every stable rank is 1 (up to round-off) and the alert fires; restored afterwards for other tests.
    saved = {}
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                saved[n] = p.clone()
                p.copy_(p[:, :1] * torch.arange(1, p.shape[1] + 1, dtype=p.dtype))
    try:
        out = lora_health(peft_model)
        assert out["lora/stable_rank/min"] == pytest.approx(1.0, abs=1e-9)
        assert out["lora/alert/rank_collapse"] == 1.0
    finally:
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])


def test_a_failing_lora_health_is_a_counted_probe_failure_not_a_stopped_run(tiny_model, monkeypatch, capsys):
    """Issue 50: LoRA health runs on rank 0 after the step's reductions, inside the probes' guard."""
    from rl_training.policy.models import trainable_parameters
    from rl_training.probes import probe as probe_module
    from rl_training.probes.probe import StepProbes

    model = lora_policy(tiny_model)
    probes = StepProbes(
        model, trainable_parameters(model), levels=["micro"], ema_beta=0.9, units_per_step=4, world_size=1,
        micro_batch_groups=2, device=torch.device("cpu"),
    )  # fmt: skip
    assert probes.lora_health(model)["lora/stable_rank/min"] >= 1  # the real thing, through the guard
    monkeypatch.setattr(probe_module, "lora_health", lambda m: 1 / 0)
    assert probes.lora_health(model) == {} and probes.guard.failures == 1
    assert "probe failure in lora_health, training continues" in capsys.readouterr().out

"""Cost of the LoRA health probe (rl_training/probes/lora_health.py): time on the tiny model, FLOPs (table + JSON).

    .venv/bin/python scripts/bench_lora_health.py [--repeats 50] [--qwen-timing] [--out bench_results/lora_health.json]

Rows: the tiny test model (4 layers, hidden 128, every linear adapted, r = 16 as cfg/tiny_cpu.yaml), timed
end to end (lora_health: factor lookup, batched QR + SVD, one host transfer, the summaries), median of
`repeats`; and a Qwen2.5-1.5B-shaped adapter (28 layers, hidden 1536, intermediate 8960, 12 q heads and
2 kv heads of 128, every linear, r = 32), whose FLOPs are counted (spectra_flops) and, with --qwen-timing,
its core (spectra) timed on random factors of those shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def qwen15b_shapes(r: int = 32) -> list[tuple[str, int, int, int]]:
    """(type, out, in, r) of every adapted linear of a Qwen2.5-1.5B-shaped model."""
    h, inter, kv = 1536, 8960, 2 * 128
    per_layer = [
        ("q_proj", h, h),
        ("k_proj", kv, h),
        ("v_proj", kv, h),
        ("o_proj", h, h),
        ("gate_proj", inter, h),
        ("up_proj", inter, h),
        ("down_proj", h, inter),
    ]
    return [(f"model.layers.{i}.x.{t}", o, n, r) for i in range(28) for t, o, n in per_layer]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--qwen-timing", action="store_true", help="also time spectra() on 1.5B-shaped factors")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "lora_health.json"))
    a = ap.parse_args()
    from rl_training.config.schema import LoraCfg
    from rl_training.policy.models import apply_lora
    from rl_training.policy.tiny_model import make_tiny_model
    from rl_training.probes.lora_health import LoraFactors, lora_factors, lora_health, spectra, spectra_flops

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoModelForCausalLM

        path = make_tiny_model(Path(tmp) / "tiny", seed=0)
        model = apply_lora(AutoModelForCausalLM.from_pretrained(path), LoraCfg(r=16, alpha=32)).to(a.device)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        facs = lora_factors(model)
        shapes = [(f.b.shape[0], f.a.shape[1], f.a.shape[0]) for f in facs]
        t = timed(lambda: lora_health(model), a.repeats)
        rows.append({"model": "tiny (4 x 128, r=16)", "modules": len(facs), "flops": spectra_flops(shapes), "s": t})

    q = qwen15b_shapes()
    row = {"model": "Qwen2.5-1.5B-shaped, r=32", "modules": len(q), "flops": spectra_flops([s[1:] for s in q])}
    if a.qwen_timing:
        g = torch.Generator().manual_seed(0)
        dev = a.device
        qf = [
            LoraFactors(n, torch.randn(r, i, generator=g).to(dev), torch.randn(o, r, generator=g).to(dev), 2.0)
            for n, o, i, r in q
        ]
        row["s"] = timed(lambda: spectra(qf), max(3, a.repeats // 10))
    rows.append(row)

    print(f"{'model':<28} {'modules':>8} {'GFLOP':>10} {'time (ms)':>10}   device={a.device}")
    for r in rows:
        ms = f"{1000 * r['s']:.2f}" if "s" in r else "-"
        print(f"{r['model']:<28} {r['modules']:>8} {r['flops'] / 1e9:>10.4f} {ms:>10}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": a.device, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

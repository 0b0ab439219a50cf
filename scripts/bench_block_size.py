"""vLLM's KV-cache block size on the CPU and its prefix cache (vllm.block_size): the same generation at vLLM's CPU
default of 128 tokens a block and at ours, 32, alternated, on one core.

    .venv/bin/python scripts/bench_block_size.py [--model models/smollm2-135m-instruct] [--runs 3]

The work is the real-model demo's held-out eval (docs/real_model.md): the first --prompts held-out problems of
cfg/smollm2_rl.yaml's task, rendered as training renders them (the model's chat template, 52-55 tokens), each
with one greedy and 8 sampled completions of at most 16 tokens, one request per completion as
VLLMBackend.generate sends them, float32. The prefix cache shares only full blocks, so at 128 a
prompt is prefilled again for every completion, at 32 all but its last partial block is shared. Prints a table
(median [min-max] seconds over the runs, the ratio) and, with --json, writes it; checks that both block sizes
give the same tokens and the same log-probs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = (128, 32)  # vLLM 0.32's CPU default, ours (rl_training/rollout/kinds.py CPU_BLOCK_SIZE)


def prompts(model: str, n: int) -> list[list[int]]:
    """The demo's first `n` held-out prompts, with the eval pipeline's own loading and rendering."""
    from transformers import AutoTokenizer

    from rl_training.config.load import load_config
    from rl_training.evaluation.evaluate import load_eval_set
    from rl_training.tasks.build import build_task

    cfg = load_config(REPO / "cfg" / "smollm2_rl.yaml", [f"model.name_or_path={model}", f"eval.num_prompts={n}"])
    return load_eval_set(cfg, AutoTokenizer.from_pretrained(model), build_task(cfg))[1]


def run(model: str, block_size: int, ids: list[list[int]], samples: int) -> tuple[float, list, list]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=160,
        enforce_eager=True,
        seed=0,
        logprobs_mode="processed_logprobs",
        enable_chunked_prefill=False,
        kv_cache_memory_bytes=int(0.5 * 2**30),
        block_size=block_size,
    )
    per = samples + 1  # one greedy, then the samples at temperature 1, each its own seeded request
    requests = [{"prompt_token_ids": p} for p in ids for _ in range(per)]
    params = [
        SamplingParams(max_tokens=16, temperature=1.0 if i % per else 0.0, logprobs=0, seed=1000 + i)
        for i in range(len(requests))
    ]
    t0 = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    del llm
    return seconds, [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].cumulative_logprob for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--json", help="write the table here")
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    ids = prompts(a.model, a.prompts)
    times: dict[int, list[float]] = {s: [] for s in SIZES}
    outputs: dict[int, tuple[list, list]] = {}
    for r in range(a.runs):
        for size in SIZES if r % 2 == 0 else SIZES[::-1]:  # alternated: neither always runs first
            seconds, toks, lps = run(a.model, size, ids, a.samples)
            times[size].append(seconds)
            outputs.setdefault(size, (toks, lps))
    same_tokens = outputs[SIZES[0]][0] == outputs[SIZES[1]][0]
    max_lp_diff = max(abs(x - y) for x, y in zip(outputs[SIZES[0]][1], outputs[SIZES[1]][1], strict=True))
    ratios = [x / y for x, y in zip(times[SIZES[0]], times[SIZES[1]], strict=True)]
    n_tok = sum(len(t) for t in outputs[SIZES[1]][0])
    print(f"{a.prompts} prompts x {a.samples + 1} completions ({n_tok} tokens generated), {a.runs} alternated runs")
    print(f"{'block size':>10} {'median s':>9} {'min-max':>13} {'tokens/s':>9}")
    for size in SIZES:
        t, mid = times[size], statistics.median(times[size])
        print(f"{size:>10} {mid:>9.1f} {min(t):>6.1f}-{max(t):<6.1f} {n_tok / mid:>9.0f}")
    print(f"speed-up 128 -> 32: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]")
    print(f"same tokens: {same_tokens}; largest cumulative log-prob difference: {max_lp_diff:.3g}")
    table = {"times": {str(k): v for k, v in times.items()}, "ratios": ratios, "tokens": n_tok}
    table |= {"same_tokens": same_tokens, "max_logprob_diff": max_lp_diff}
    if a.json:
        Path(a.json).write_text(json.dumps(table, indent=2))
    return 0 if same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())

"""First run on a new GPU machine: verify the stack and a short real run, then print one verdict table.

    make gpu-check                                   # = .venv/bin/python scripts/gpu_check.py
    .venv/bin/python scripts/gpu_check.py [--skip-tests] [--keep DIR] [--run-on-cpu]

About 5 minutes on one Hopper GPU: the CUDA torch build, the NVIDIA driver against what torch's CUDA needs, vLLM's
compiled ops (`import vllm._C`), a Triton kernel compiled and run, the gpu-marked tests, then a few bf16 RL
steps of the tiny model (built here, with a short SFT warm start) with CUDA graphs on, sleep/wake and a weight
sync every step and a high learning rate, so stale weights in the engine would show in the canary
rollout/logp_diff_*; a checkpoint and a resume; NCCL all-reduce over 2 GPUs when there are 2. The exit status
is 1 if any row FAILs, else 0. On a machine without a GPU the CUDA rows say SKIP; `--run-on-cpu` runs the RL
rows there anyway (float32, the CPU vLLM), which tests this script itself. Where vLLM is not installed (a site
image or container with a CUDA torch and no package index) nothing is installed: the RL rows run on the HF
rollout backend, and what needs vLLM (its compiled ops, the gpu-marked tests, the weight-sync and sleep rows)
says SKIP with the reason. See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PASS, FAIL, SKIP, WARN = "PASS", "FAIL", "SKIP", "WARN"
NO_GPU = "(no GPU)"
NO_VLLM = "(vLLM not installed: the RL rows use the HF backend)"
# Canary bounds on the mean |trainer - vLLM| log-prob per token: float32 on CPU agrees to ~1e-5 (the tests'
# 1e-3 bound); bf16 kernels differ by ~1e-3-1e-2. Weights one step stale at lr 1e-2 are off by far more.
CANARY_MEAN_MAX = {"bfloat16": 2e-2, "float32": 1e-3}
RL_STEPS, RESUME_STEPS = 4, 6
# What each check expects on a GPU, also shown on its SKIP rows. The RL rows in the order rl_rows reports them.
EXPECTED = {
    "torch CUDA build": "torch.version.cuda set",
    "NVIDIA driver": ">= what torch's CUDA needs",
    "GPUs": ">= 1",
    "vllm._C": "imports",
    "Triton kernel": "compiles, runs, exact",
    "gpu-marked tests": "all pass",
    "RL steps (bfloat16, CUDA graphs)": f"exit 0, steps 1..{RL_STEPS}",
    "canary logp_diff_mean (bfloat16)": f"< {CANARY_MEAN_MAX['bfloat16']:.3g}",
    "weights synced every step": "+1 per step, updates > 0",
    "vLLM sleep frees memory": "> 0.2 x GPU memory",
    "vLLM wake restores KV cache": "> 0.1 GiB",
    "checkpoint + resume": f"resumed at {RL_STEPS}, steps 1..{RESUME_STEPS}",
    "NCCL all-reduce, 2 GPUs": "sum 3.0 on both ranks",
}
RL_ROWS = list(EXPECTED)[6:12]


def skipped(check: str, why: str) -> Row:
    return Row(check, SKIP, why, EXPECTED[check])


@dataclass
class Row:
    check: str
    result: str  # PASS / FAIL / SKIP / WARN
    value: str
    expected: str


def render(rows: list[Row]) -> str:
    head = Row("check", "result", "value", "expected")
    widths = [max(len(getattr(r, f)) for r in [head, *rows]) for f in ("check", "result", "value", "expected")]
    line = lambda r: "  ".join(  # noqa: E731
        getattr(r, f).ljust(w) for f, w in zip(("check", "result", "value", "expected"), widths)
    ).rstrip()
    rule = "  ".join("-" * w for w in widths)
    failed = [r.check for r in rows if r.result == FAIL]
    counts = ", ".join(f"{sum(r.result == k for r in rows)} {k}" for k in (PASS, FAIL, WARN, SKIP))
    verdict = f"verdict: FAIL ({', '.join(failed)})" if failed else "verdict: PASS"
    return "\n".join([line(head), rule, *map(line, rows), rule, f"{verdict}  [{counts}]"])


def exit_status(rows: list[Row]) -> int:
    """1 when a check failed; SKIP (no GPU, one GPU) and WARN do not fail the verdict."""
    return int(any(r.result == FAIL for r in rows))


def bound_row(check: str, value: float | None, limit: float, below: bool = True, unit: str = "") -> Row:
    """PASS when value < limit (below) or value > limit (not below); FAIL otherwise or when it is missing."""
    expected = f"{'<' if below else '>'} {limit:.3g}{unit}"
    if value is None or value != value:
        return Row(check, FAIL, "missing", expected)
    ok = value < limit if below else value > limit
    return Row(check, PASS if ok else FAIL, f"{value:.3g}{unit}", expected)


# ------------------------------------------------------------------------------------------------ the stack
def pins(requirements: Path = REPO / "requirements-gpu.txt") -> dict[str, str]:
    """name -> version of every `name==version` line of a requirements file and of the files it includes (`-r`);
    names as PyPI normalizes them (lower case, `-`)."""
    out: dict[str, str] = {}
    if not requirements.exists():
        return out
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            out = {**pins(requirements.parent / line[3:].strip()), **out}
        elif m := re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line):
            out[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    return out


def pinned_vllm(requirements: Path = REPO / "requirements-gpu.txt") -> str:
    return pins(requirements).get("vllm", "?")


def vllm_line(version: str | None, pinned: str) -> str:
    """The one startup line about vLLM (here and in scripts/devcheck): `version` None = not importable."""
    if version is None:
        return "vllm: not installed: the HF-only path (the vLLM rows are skipped)"
    if version != pinned:
        why = f"is not the pinned {pinned} (requirements-gpu.txt)"
        return f"vllm: site vLLM {version} {why}: the vLLM rows test {version}"
    return f"vllm: {version} (the pinned version)"


def vllm_missing() -> str:
    """'' when vLLM imports, else why not (the reason its rows SKIP)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"{NO_VLLM[:-1]}; {type(e).__name__}: {str(e).splitlines()[0][:60] if str(e) else ''})"
    return ""


def stack_rows(cuda: bool, no_vllm: str = "") -> list[Row]:
    import torch

    from rl_training.runtime.platform_check import cuda_problem, min_driver, probe

    p = probe()
    problem = cuda_problem(p)
    plat = "gpu" if (p.gpus_listed or p.venv_platform == "gpu") else "cpu"
    value = problem or f"{plat} machine, venv built for {p.venv_platform}"
    rows = [Row("platform", FAIL if problem else PASS, value, "CUDA works on a GPU machine")]
    if not cuda:
        names = ("torch CUDA build", "NVIDIA driver", "GPUs", "vllm._C", "Triton kernel")
        return [*rows, *(skipped(n, skip_reason(problem)) for n in names)]
    need = min_driver(p.torch_cuda)
    driver_ok = need is None or int(str(p.driver or "0").split(".")[0]) >= need
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    rows += [
        Row("torch CUDA build", PASS, f"{p.torch_version} (CUDA {p.torch_cuda})", "torch.version.cuda set"),
        Row("NVIDIA driver", PASS if driver_ok else FAIL, str(p.driver), f">= R{need}" if need else "any"),
        Row("GPUs", PASS, f"{len(gpus)} x {gpus[0]}", ">= 1"),
        skipped("vllm._C", no_vllm) if no_vllm else guarded("vllm._C", check_vllm_ops, "imports"),
        guarded("Triton kernel", check_triton, "compiles, runs, exact"),
    ]
    return rows


def skip_reason(problem: str | None) -> str:
    return "(CUDA unusable: see platform)" if problem else NO_GPU


def guarded(check: str, fn, expected: str) -> Row:
    """Run one check; any exception is that check's FAIL row (the table must still print)."""
    try:
        return Row(check, PASS, fn(), expected)
    except Exception as e:  # noqa: BLE001 - a check harness reports every failure as a row
        return Row(check, FAIL, f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}", expected)


def check_vllm_ops() -> str:
    import vllm
    import vllm._C  # the compiled CUDA ops: a wheel built for another torch or CUDA fails to import here

    return f"vllm {vllm.__version__}"


def check_triton(device: str = "cuda") -> str:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=mask) + tl.load(y_ptr + i, mask=mask), mask=mask)

    x = torch.arange(1000, device=device, dtype=torch.float32)
    out = torch.empty_like(x)
    add[(4,)](x, x, out, x.numel(), BLOCK=256)
    if not torch.equal(out, 2 * x):
        raise RuntimeError("kernel output differs from 2 * x")
    return f"triton {triton.__version__}"


# ------------------------------------------------------------------------------------------ gpu tests, NCCL
def gpu_tests_row(cuda: bool, skip_tests: bool, skip: str, no_vllm: str = "") -> Row:
    if not cuda or skip_tests or no_vllm:
        return skipped("gpu-marked tests", skip if not cuda else "(--skip-tests)" if skip_tests else no_vllm)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", str(REPO / "tests")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    summary = (r.stdout.strip().splitlines() or ["no output"])[-1].strip("= ")
    if r.returncode:
        print(r.stdout[-4000:], r.stderr[-2000:], sep="\n", file=sys.stderr)
    return Row("gpu-marked tests", PASS if r.returncode == 0 else FAIL, summary[:80], "all pass")


def nccl_row(n_gpus: int, skip: str) -> Row:
    if n_gpus < 2:
        return skipped("NCCL all-reduce, 2 GPUs", skip if not n_gpus else "(1 GPU)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    r = subprocess.run([*cmd, __file__, "--nccl-worker"], capture_output=True, text=True, timeout=600)
    sums = sorted(line.split()[-1] for line in r.stdout.splitlines() if line.startswith("nccl-sum"))
    ok = r.returncode == 0 and sums == ["3.0", "3.0"]
    if not ok:
        print(r.stderr[-3000:], file=sys.stderr)
    return Row("NCCL all-reduce, 2 GPUs", PASS if ok else FAIL, f"sums {sums}", "sum 3.0 on both ranks")


def nccl_worker() -> int:
    import torch
    import torch.distributed as tdist

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl")
    t = torch.tensor([rank + 1.0], device="cuda")  # 1 + 2 = 3 after the sum
    tdist.all_reduce(t)
    print(f"nccl-sum rank {rank} {t.item()}", flush=True)
    tdist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------- RL steps and resume
def run_module(module: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800
    )
    if r.returncode:
        print(f"--- {module} {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}", file=sys.stderr)
    return r


def prepare(work: Path) -> list[str]:
    """Tiny model, reverse data and a short SFT warm start (rewards > 0, so RL updates happen) in `work`."""
    from rl_training.policy.tiny_model import make_tiny_model
    from rl_training.tasks.reverse import write_reverse_data

    model = make_tiny_model(work / "tiny-qwen2", seed=0)
    data = write_reverse_data(work / "data", n_train=200, n_heldout=32)
    base = [f"data.train={data / 'train.jsonl'}", f"data.eval={data / 'heldout.jsonl'}", f"run.output_dir={work}"]
    args = ["--cfg", str(REPO / "cfg" / "tiny_sft.yaml"), f"model.name_or_path={model}", *base]
    r = run_module(
        "rl_training.runners.sft_runner", [*args, "run.name=sft", "sft.steps=40", "sft.warmup_steps=5"], work
    )
    if r.returncode:
        raise RuntimeError(f"SFT warm start failed (exit {r.returncode}, output above)")
    return [f"model.name_or_path={work / 'sft' / 'final_model'}", *base]


def rl_rows(work: Path, cuda: bool, no_vllm: str = "") -> list[Row]:
    dtype = "bfloat16" if cuda else "float32"
    backend = "hf" if no_vllm else "vllm"
    try:
        base = prepare(work)
    except RuntimeError as e:
        return [Row("RL steps", FAIL, str(e), "")]
    overrides = [
        *base,
        "run.name=check",
        f"rollout.backend={backend}",
        f"model.dtype={dtype}",
        # CUDA graphs on, as the recipes run; on CPU (--run-on-cpu) eager: vLLM's CPU compile path is not what a GPU
        # runs, and it cost 11 s or more at each of the two engine starts
        f"vllm.enforce_eager={str(not cuda).lower()}",
        "vllm.sleep=true",
        "vllm.memory_fraction=0.3" if cuda else "vllm.memory_fraction=0.1",
        "optim.lr=1e-2",  # large steps: an engine left with old weights would miss the canary bound by far
        "optim.warmup_steps=0",
        "ckpt.every=2",
    ]
    args = ["--cfg", str(REPO / "cfg" / "testconfig.yaml"), *overrides]
    t0 = time.time()
    r = run_module("rl_training.runners.rl_runner", [*args, f"train.total_steps={RL_STEPS}"], work)
    took = time.time() - t0
    metrics = read_metrics(work / "check" / "metrics.jsonl")
    steps = [m["step"] for m in metrics]
    where = ("HF backend, " if no_vllm else "") + ("CPU" if not cuda else "CUDA" if no_vllm else "CUDA graphs")
    rows = [
        Row(
            f"RL steps ({dtype}, {where})",
            PASS if r.returncode == 0 and steps == list(range(1, RL_STEPS + 1)) else FAIL,
            f"exit {r.returncode}, steps {steps}, {took:.0f} s",
            f"exit 0, steps 1..{RL_STEPS}",
        )
    ]
    rows += canary_rows(metrics, dtype, no_vllm)
    rows += [skipped(n, no_vllm) for n in RL_ROWS[3:5]] if no_vllm else sleep_rows(metrics, cuda)
    r2 = run_module(
        "rl_training.runners.rl_runner", [*args, f"train.total_steps={RESUME_STEPS}", "ckpt.resume=latest"], work
    )
    steps = [m["step"] for m in read_metrics(work / "check" / "metrics.jsonl")]
    resumed = f"resumed from {work / 'check' / 'checkpoints' / f'step_{RL_STEPS:06d}'}" in r2.stdout
    ok = r2.returncode == 0 and resumed and steps == list(range(1, RESUME_STEPS + 1))
    rows.append(
        Row(
            "checkpoint + resume",
            PASS if ok else FAIL,
            f"exit {r2.returncode}, {'resumed' if resumed else 'not resumed'} at {RL_STEPS}, steps {steps}",
            f"resumed at {RL_STEPS}, steps 1..{RESUME_STEPS}",
        )
    )
    return rows


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def canary_rows(metrics: list[dict], dtype: str, no_vllm: str = "") -> list[Row]:
    worst = max((m.get("rollout/logp_diff_mean", float("nan")) for m in metrics), default=None)
    versions = [m.get("rollout/weight_version") for m in metrics]
    updated = sum(m.get("train/grad_norm", 0.0) > 0 for m in metrics)
    canary = bound_row(f"canary logp_diff_mean ({dtype})", worst, CANARY_MEAN_MAX[dtype])
    if no_vllm:  # HF generates with the trained model itself: there is no engine to sync
        return [canary, skipped("weights synced every step", no_vllm)]
    synced = bool(versions) and all(b == a + 1 for a, b in itertools.pairwise(versions))
    return [
        canary,
        Row(
            "weights synced every step",
            PASS if synced and updated else (WARN if synced else FAIL),
            f"versions {versions}, {updated} steps with updates",
            "+1 per step, updates > 0",
        ),
    ]


def sleep_rows(metrics: list[dict], cuda: bool) -> list[Row]:
    if not cuda:
        return [skipped(n, NO_GPU) for n in RL_ROWS[3:5]]
    import torch

    total = torch.cuda.mem_get_info()[1] / 2**30
    freed = min((m.get("mem/vllm_sleep_freed_gb", float("nan")) for m in metrics), default=None)
    woke = min((m.get("mem/vllm_wake_kv_cache_gb", float("nan")) for m in metrics), default=None)
    # Level 1 drops the KV cache and moves the weights to host: most of the 0.3 x GPU the engine reserved
    # (the tiny model's weights are a few MB). Every step's figure counts: the smallest one is checked.
    return [
        bound_row("vLLM sleep frees memory", freed, 0.2 * total, below=False, unit=" GiB"),
        bound_row("vLLM wake restores KV cache", woke, 0.1, below=False, unit=" GiB"),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-tests", action="store_true", help="do not run the gpu-marked tests")
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temp dir, removed)")
    ap.add_argument("--run-on-cpu", action="store_true", help="run the RL rows without a GPU (checks this script)")
    ap.add_argument("--nccl-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.nccl_worker:
        return nccl_worker()
    import torch

    cuda = torch.cuda.is_available()
    no_vllm = vllm_missing()
    print(f"gpu-check: {vllm_line(None if no_vllm else importlib.import_module('vllm').__version__, pinned_vllm())}")
    rows = stack_rows(cuda, no_vllm)
    for r in rows:
        print(f"gpu-check: {r.check}: {r.result} {r.value}", flush=True)
    platform_ok = rows[0].result == PASS
    skip = NO_GPU if platform_ok else skip_reason("see platform")
    rows.append(gpu_tests_row(cuda and platform_ok, a.skip_tests, skip, no_vllm))
    if (cuda and platform_ok) or a.run_on_cpu:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(a.keep or tmp).resolve()  # the runner prints absolute checkpoint paths
            work.mkdir(parents=True, exist_ok=True)
            rows += rl_rows(work, cuda, no_vllm)
    else:
        rows += [skipped(n, skip) for n in RL_ROWS]
    rows.append(nccl_row(torch.cuda.device_count() if cuda and platform_ok else 0, skip))
    print("\n" + render(rows), flush=True)
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())

"""Two-rank runs back to back under CPU load, every rank's exit status counted: a run whose work is done must
exit 0 on every rank, with no "terminate called" (a native abort at teardown) and no Traceback on stderr.

    python scripts/stress_exits.py [--runs 20] [--burners 2] [--steps 1] [--work /tmp/stress_exits]

Each run is the real RL runner under torchrun (HF backend, the tiny model after a short SFT warm start,
train.total_steps=--steps, no eval, no periodic checkpoint) while `--burners` busy-loop processes keep every
core loaded, so that teardown interleavings that are rare on an idle machine come up. Prints one line per
run and a summary table; exit status 1 if any run was not clean. tests/integration/test_clean_exits.py runs
the same loop (docs/reliability.md, "A finished run exits 0 on every rank").
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RL_RUNNER = REPO / "rl_training" / "runners" / "rl_runner.py"
TESTCFG = REPO / "cfg" / "testconfig.yaml"
# torchrun's failure report, one block per failed worker: "rank : 1 (local_rank: 1)" then "exitcode : -6 (pid: ..)"
_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


@dataclass
class Outcome:
    statuses: list[int]  # per rank: 0, an exit status, or -signal (-6: SIGABRT)
    launcher_status: int  # torchrun's own
    terminated: bool  # "terminate called" (C++ std::terminate) on stderr
    traceback: bool  # a Python Traceback on stderr
    seconds: float
    stderr: str

    @property
    def clean(self) -> bool:
        return self.launcher_status == 0 and not any(self.statuses) and not self.terminated and not self.traceback


def rank_statuses(launcher_status: int, stderr: str, nproc: int) -> list[int]:
    """Each rank's exit status from torchrun's failure report (a rank it does not list exited 0)."""
    statuses = [0] * nproc
    if launcher_status != 0:
        for rank, code in _FAILED_RANK.findall(stderr):
            statuses[int(rank)] = int(code)
    return statuses


@contextlib.contextmanager
def burning(n: int):
    """`n` busy-loop processes for the duration (each holds one core), ended by their own pids."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _core_dumps_on() -> None:
    """In each launched process: a core file where a rank aborts, for gdb (no effect where the hard limit is 0)."""
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


def run_command(overrides: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(RL_RUNNER), "--cfg", str(TESTCFG), *overrides]  # fmt: skip


def run_once(cmd: list[str], cwd: Path, nproc: int = 2, timeout: float = 600) -> Outcome:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                       preexec_fn=_core_dumps_on)  # fmt: skip
    seconds = time.perf_counter() - t0
    return Outcome(
        statuses=rank_statuses(r.returncode, r.stderr, nproc),
        launcher_status=r.returncode,
        terminated="terminate called" in r.stderr,
        traceback="Traceback" in r.stderr,
        seconds=seconds,
        stderr=r.stderr,
    )


def small_run_overrides(model: Path, data: Path, out: Path, steps: int = 1) -> list[str]:
    """As small as a run gets: `steps` steps, no eval, no periodic checkpoint (the final one is still written)."""
    return [f"model.name_or_path={model}", f"data.train={data / 'train.jsonl'}", f"data.eval={data / 'heldout.jsonl'}",
            f"run.output_dir={out}", f"train.total_steps={steps}", "ckpt.every=0", "eval.every=0"]  # fmt: skip


def prepare(work: Path) -> tuple[Path, Path]:
    """The tiny model after a short SFT warm start (what the tests' warm_model fixture builds) and reverse data."""
    from rl_training.policy.tiny_model import make_tiny_model
    from rl_training.runners import sft_runner
    from rl_training.tasks.reverse import write_reverse_data

    warm = work / "sft" / "warm" / "final_model"
    data = write_reverse_data(work / "data" / "reverse", n_train=200, n_heldout=32)
    if not warm.exists():
        tiny = make_tiny_model(work / "models" / "tiny-qwen2", seed=0)
        sft = ["--cfg", str(REPO / "cfg" / "tiny_sft.yaml"), f"model.name_or_path={tiny}",
               f"data.train={data / 'train.jsonl'}", f"data.eval={data / 'heldout.jsonl'}",
               f"run.output_dir={work / 'sft'}", "run.name=warm", "sft.steps=40", "sft.warmup_steps=5"]  # fmt: skip
        if sft_runner.main(sft) != 0:
            raise SystemExit("the SFT warm start failed")
    return warm, data


def stress(model: Path, data: Path, work: Path, runs: int, burners: int, steps: int, report=print) -> list[Outcome]:
    outcomes = []
    with burning(burners):
        for i in range(runs):
            cwd = work / f"run{i:03d}"
            shutil.rmtree(cwd, ignore_errors=True)  # a fresh run directory: a kept one would refuse a new run
            cwd.mkdir(parents=True)
            o = run_once(run_command(small_run_overrides(model, data, cwd / "runs", steps)), cwd)
            outcomes.append(o)
            report(f"run {i + 1:3d}/{runs}: ranks {o.statuses} launcher {o.launcher_status} "
                   f"terminate={o.terminated} traceback={o.traceback} {o.seconds:5.1f} s")  # fmt: skip
            if not o.clean:
                (cwd / "stderr.txt").write_text(o.stderr)
                report(f"  stderr kept in {cwd / 'stderr.txt'}; last lines:\n" + "\n".join(o.stderr.splitlines()[-15:]))
    return outcomes


def summary(outcomes: list[Outcome]) -> str:
    by_status = collections.Counter(s for o in outcomes for s in o.statuses)
    total = sum(o.seconds for o in outcomes)
    rows = [
        ("runs", len(outcomes)),
        ("clean runs", sum(o.clean for o in outcomes)),
        ("rank exit statuses", dict(sorted(by_status.items()))),
        ("'terminate called'", sum(o.terminated for o in outcomes)),
        ("Traceback", sum(o.traceback for o in outcomes)),
        ("seconds (total, mean)", f"{total:.0f}, {total / max(len(outcomes), 1):.1f}"),
    ]
    return "\n".join(f"{k:<24}{v}" for k, v in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="busy loops (default: one a core)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/stress_exits"))
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    model, data = prepare(a.work)
    outcomes = stress(model, data, a.work / "runs", a.runs, a.burners, a.steps, report=lambda s: print(s, flush=True))
    print(summary(outcomes))
    return 0 if all(o.clean for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

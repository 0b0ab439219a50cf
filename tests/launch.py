"""The one way tests launch torchrun: `torchrun_cmd(nproc, script, *args)`, a standalone (single-node) launch of
`script` with `nproc` workers, as `python -m torch.distributed.run` of this interpreter (no PATH lookup)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RL_RUNNER = str(REPO / "rl_training" / "runners" / "rl_runner.py")


def torchrun_cmd(nproc: int, script: str | Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]


# Reading a launched run back
def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir)]


def training_started(run_dir: Path) -> bool:
    """A complete first line in metrics.jsonl (polled while the run writes it)."""
    p = run_dir / "metrics.jsonl"
    return p.exists() and "\n" in p.read_text()


def trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())

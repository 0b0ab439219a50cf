"""The one way tests launch torchrun: `torchrun_cmd(nproc, script, *args)`, a standalone (single-node) launch of
`script` with `nproc` workers, as `python -m torch.distributed.run` of this interpreter (no PATH lookup)."""

from __future__ import annotations

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

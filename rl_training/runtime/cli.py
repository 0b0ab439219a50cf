"""What every runner's entry point shares: `--cfg FILE key=value ...`, process-group lifetime, and the
one-line error (exit status 2) for bad user input. A runner body may return its own exit status (the RL
runner returns 75 when a stop signal ended it early)."""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from collections.abc import Callable

from rl_training.base import dist
from rl_training.base.errors import UserError
from rl_training.base.exit_codes import USER_ERROR_EXIT_CODE
from rl_training.config.load import load_config
from rl_training.config.schema import Config, ConfigError


def run_cli(doc: str, body: Callable[[Config, dist.DistInfo], int | None], argv=None) -> int:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cfg", required=True, help="YAML config (see cfg/)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.total_steps=10")
    args = ap.parse_args(argv)
    if not faulthandler.is_enabled():  # a native crash (SIGSEGV, SIGABRT) in a rank prints every thread's stack
        faulthandler.enable(all_threads=True)

    def run() -> int | None:
        cfg = load_config(args.cfg, args.overrides)
        info = dist.init_distributed(cfg.run.dist_timeout_s)  # the process group's timeout is a config value
        return body(cfg, info)

    return exit_status_of(run)


def exit_status_of(run: Callable[[], int | None]) -> int:
    """`run()`'s exit status (None: 0); a UserError becomes one line on stderr and its `exit_status`
    (USER_ERROR_EXIT_CODE unless the class names its own, as the weight-state guard's does). The process group
    is destroyed afterwards either way (runners, evals.run, synthesize)."""
    try:
        return run() or 0
    except UserError as e:
        if not said_by_another_rank(e):
            print(f"error: {e}", file=sys.stderr, flush=True)
        return getattr(e, "exit_status", USER_ERROR_EXIT_CODE)
    finally:
        dist.cleanup()


def said_by_another_rank(e: UserError) -> bool:
    """A ConfigError is met alike by every rank (they read the same config and task file, and the project raises
    none on one rank alone): the first rank of each node prints it, the others exit with its status in silence.
    Per node, not rank 0 alone: a file missing on one node's disk is that node's error. Any other UserError may be
    one rank's own (its checkpoint, its GPU, its server) and is printed by every rank that meets it."""
    return isinstance(e, ConfigError) and int(os.environ.get("LOCAL_RANK", "0")) != 0

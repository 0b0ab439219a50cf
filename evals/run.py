"""`python -m evals.run`, kept for existing command lines: the eval command lives in rl_training/runners/eval_runner.py
(`python -m rl_training.runners.eval_runner` is the same command)."""

import sys

from rl_training.runners.eval_runner import *  # noqa: F403 -- the names scripts and tests import from here
from rl_training.runners.eval_runner import main

if __name__ == "__main__":
    sys.exit(main())

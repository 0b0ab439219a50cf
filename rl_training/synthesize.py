"""`python -m rl_training.synthesize`, kept for existing command lines (rl_training/runners/synthesize.py)."""

import sys

from rl_training.runners.synthesize import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m rl_training.monitor`, kept for existing command lines (rl_training/runners/monitor.py)."""

import sys

from rl_training.runners.monitor import main

if __name__ == "__main__":
    sys.exit(main())

"""Shims for the eval command's old names: `python -m evals.run` runs rl_training/runners/eval_runner.py, whose reports
are rl_training/evaluation/report.py. May import: every package of rl_training. Owns: nothing (eval runs' files
are the eval runner's); nothing in rl_training imports it."""

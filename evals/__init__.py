"""The eval command, `python -m evals.run`, with its reports and plots (report.py). May import: every package of
rl_training (it sits above them all). Owns: eval runs' files; nothing in rl_training imports it."""

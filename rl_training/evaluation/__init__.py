"""The eval library: one policy on held-out problems, graded by the training grader, pass@k and maj@k. May import:
base, config, data, ckpt, tasks, rollout. Owns: the eval/* numbers; the command is `python -m evals.run`."""

"""The eval library: one policy on held-out problems, graded by the training grader, pass@k and maj@k, and the
reports of an eval run (summary.csv, plots, TensorBoard). May import: base, config, data, ckpt, tasks, rollout.
Owns: the eval/* numbers; the command is rl_training/runners/eval_runner.py (`python -m evals.run`)."""

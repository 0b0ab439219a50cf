"""Kept for existing imports: the eval reports and plots live in rl_training/evaluation/report.py."""

from rl_training.evaluation.report import *  # noqa: F403

"""RL (the GRPO family) and SFT for LLMs, one package per job. LAYERS is the package order: a package imports only
the packages before it (tests/unit/test_import_graph.py holds the code to it, tests/unit/test_readme.py the README's
table). The top-level modules monitor.py and synthesize.py only forward old command lines to rl_training/runners/."""

# The packages of rl_training, lowest first; each one's __init__.py says its job, what it may import and what it owns.
# Above them all: evals/ (`python -m evals.run`), which nothing here imports.
LAYERS = (
    "base",
    "algs",
    "config",
    "runtime",
    "data",
    "policy",
    "ckpt",
    "sandbox",
    "retrieval",
    "cluster",
    "tasks",
    "probes",
    "rollout",
    "train",
    "metrics",
    "evaluation",
    "runners",
)

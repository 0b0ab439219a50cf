"""The commands: rl_runner (RL), sft_runner (SFT), synthesize, monitor, sandbox_check, each opening with its launch
lines; `python -m evals.run` sits above, in evals/; programs other processes start stay in their package
(PROCESS_ENTRIES, tests/unit/test_import_graph.py). May import: every package. Owns: the main loops."""

"""The commands: rl_runner (RL), sft_runner (SFT), eval_runner (`python -m evals.run`), synthesize, monitor,
sandbox_check, each opening with its launch lines; programs other processes start stay in their package
(PROCESS_ENTRIES, tests/unit/test_import_graph.py). May import: every package. Owns: the main loops."""

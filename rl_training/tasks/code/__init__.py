"""Code rewards: model-written programs run in a sandbox pool (rl_training/sandbox/) against tests judged in the
trusted process (docs/code.md). Modules: harness (tests and verdicts), extract (code from completions), task (data
formats, CodeTask, which owns its pool), synthetic (the demo's task). The node check is `python -m
rl_training.runners.sandbox_check`.

This file holds only the names other packages need without importing the sandbox."""

CODE_FORMATS = ("humaneval", "mbpp", "stdio")
FAILURE_CLASSES = ("sandbox_error", "timeout", "memory", "syntax", "runtime_error", "wrong_answer")
PART_NAMES = ("pass_frac",)  # per completion: the fraction of test units passed (reward/pass_frac_mean)
# per batch: programs per failure class, completions without code, programs run in the weak (no-namespace) mode
COUNT_NAMES = (*(f"fail_{c}" for c in FAILURE_CLASSES), "no_code", "sandbox_weak")

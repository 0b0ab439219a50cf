"""The exit statuses a run or tool ends with, for launchers and shell scripts (scripts/slurm/rl_train.sbatch tests
75 and 2). A leaf: slurm_launch reads them without importing torch."""

USER_ERROR_EXIT_CODE = 2  # bad input or environment (rl_training.base.errors.UserError), one line on stderr
STOPPED_EXIT_CODE = 75  # stopped on run.stop_signal after a checkpoint; resume with ckpt.resume=latest (EX_TEMPFAIL)
# the weight-state guard stopped the run after a checkpoint (train/weight_guard.py); EX_SOFTWARE: a sync failed
WEIGHT_STATE_EXIT_CODE = 70
# the length-drift guard stopped the run after a checkpoint: held-out accuracy fell while responses ran into the
# token budget (train/drift_guard.py); EX_DATAERR: the run's own results say it is failing
DRIFT_EXIT_CODE = 65
# an SFT run's skill gate (sft.stop_when) was never passed: final_model is written, but it did not learn what
# the gate checks (runners/sft_runner.py); EX_DATAERR, as the drift guard's: the run's own results say it failed
UNLEARNED_EXIT_CODE = 65

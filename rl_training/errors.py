"""The errors a user's input (or the run's environment) can cause; runners print them as one line and exit with
status 2."""

from rl_training.checkpoint import CheckpointError
from rl_training.config import ConfigError
from rl_training.data.sources import DataError
from rl_training.metrics import MetricsWriteError
from rl_training.models import ModelLoadError
from rl_training.rollout.server import ServerError
from rl_training.run_lock import RunLockError
from rl_training.step_guard import NonFiniteError

# ServerError: a vLLM server that stays unreachable after the retries, or refuses the policy adapter
USER_ERRORS = (
    ConfigError,
    DataError,
    ModelLoadError,
    CheckpointError,
    ServerError,
    RunLockError,
    NonFiniteError,
    MetricsWriteError,
)

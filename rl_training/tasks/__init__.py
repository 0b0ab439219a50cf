"""Tasks: what the trainer, SFT, the evals and synthesize learn and grade: the Task / Environment interface, its
builder and the families (math, reverse, search/, code/, tools, python_tool, reasoning_gym; verifiers_env/,
verifiers v1 environments: an optional extra imported only when named). May import: base, config, data, sandbox,
retrieval. Owns: the interface; a task owns its resources (a sandbox pool, a tools' process, a retriever), started
in `start`.

A user's task is one file anywhere, named in the config (docs/extending.md):

    from rl_training.tasks import Example, Task

    class Exact(Task):
        def reward(self, completion: str, example: Example) -> float:
            return float(completion.strip() == example.reference)

The interface is defined in base.py; build.py turns task.name + task.args into the object.
"""

from rl_training.data.sources import DataError, Example
from rl_training.tasks.base import Environment, Scores, Step, Task, TaskContext, Turn

__all__ = ["DataError", "Environment", "Example", "Scores", "Step", "Task", "TaskContext", "Turn"]

"""verifiers v1 environments (PRIME-RL's environment standard) as built-in tasks; docs/verifiers.md has the mapping.

    task: {name: verifiers/<env-id>, args: {taskset: {...its config}, heldout_size: 50}}    # an installed package
    task: {name: verifiers, args: {env: my_env.py:MyTaskset}}                              # a Taskset in a file
    task: {name: verifiers, args: {env: my_env.py:MyEnv, taskset: {id: my_env.py:MyTaskset}}}  # an Env and its tasks
    data: {train: "task:train", eval: "task:heldout"}                                       # the taskset's own tasks

Token-exact by construction: this trainer samples every token (its engine, its log-probs) and the environment only
supplies text: its tasks' prompts, the user turns an Env's `run` writes between turns, and the grade of the
conversation (its @vf.reward functions on a v1 Trace of exactly what was sampled). What in v1 owns sampling or a
box (a harness's agent program, tools behind MCP, a second seat, a plugged judge's model, a container) is refused
when the task is built, in one line naming it (NotRunnable).

The one seat plays v1's tool-less `null` chat loop, and this trainer's episode engine is that loop. A plain
taskset (v1's SingleAgentEnv: one reply per task) is a single-turn Task. An Env subclass is an Environment: its
`run(task, agents)` runs on an event loop of the sampling thread, suspended at each `interaction.turn(...)` until
the engine has sampled that turn (_Episode); the messages it passes are the next observation, the chat template's
user turn (data/chat_turns.py). The grade is v1's `Task.score` (then the Env's `finalize`) on the episode's trace, found
by the completion text the trainer grades (_Traces); a completion without one (an SFT target, a sample read back)
is graded as one reply to the prompt and counted (its count `untraced`).

Modules: load (the environment by id or from a file, the refusals, the factory `verifiers_task`), task (prompts,
traces and grading: VerifiersTask), episode (an Env's `run` driven turn by turn: VerifiersEnvironment). May import:
base, config, data (chat_turns), tasks.base; `verifiers` itself only inside functions (an optional extra,
imported when a config names it).
"""

FAMILY = "verifiers"
SPLITS = ("train", "heldout")
SEAT_HARNESS = "null"  # v1's tool-less chat loop: the only harness whose every model call is one plain chat turn


class NotRunnable(ValueError):
    """A verifiers environment this trainer cannot load or run token-exactly; the message is one line."""

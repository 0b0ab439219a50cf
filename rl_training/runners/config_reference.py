"""`make config-ref`: the config reference, docs/config.md, generated from the schema (config/reference.py) with the
names each registry holds added to its key's help, so that no help string restates a registry:

    python -m rl_training.runners.config_reference --write docs/config.md   # or print the table
"""

from __future__ import annotations

import sys

from rl_training.algs.corrections import CORRECTIONS
from rl_training.algs.objectives import OBJECTIVES
from rl_training.config.reference import CONFIG_DOC, reference, write_reference
from rl_training.rollout.kinds import KINDS
from rl_training.tasks.build import BUILTIN, FAMILIES


def registered() -> dict[str, str]:
    """Dotted key -> the sentence naming what its registry holds."""
    backends = "; ".join(f"{name} ({kind.what})" if kind.what else name for name, kind in KINDS.items())
    return {
        "task.name": f"Built in: {', '.join(BUILTIN)}; families: {', '.join(f'{f}/<member>' for f in FAMILIES)}.",
        "loss.type": f"Built in: {', '.join(OBJECTIVES)}.",
        "loss.correction": f"Built in: {', '.join(CORRECTIONS)}.",
        "rollout.backend": f"Built in: {backends}.",
    }


def table() -> str:
    return reference(names=registered())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write_reference(sys.argv[2] if len(sys.argv) > 2 else CONFIG_DOC, table())
    else:
        print(table())

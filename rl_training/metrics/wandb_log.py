"""Weights & Biases, an optional extra: the same scalars as TensorBoard, the resolved config, rollout samples
as tables. Only rank 0 logs. Nothing here runs unless `run.wandb.project` is set, and `wandb` is imported only
then, so a machine without it loses nothing.

Credentials: W&B reads WANDB_API_KEY from the environment itself; this module never reads, passes or logs it,
the config it sends is the redacted one (secret fields '***'), and console capture is off so nothing printed
by the run is uploaded. On nodes without internet use `run.wandb.mode=offline`; the run is written under
run_dir/wandb/ and uploaded later from a machine with access: `wandb sync run_dir/wandb/offline-run-*`.
A resumed run continues the same W&B run: its id is kept in run_dir/wandb_id.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path


class NullWandb:
    """No W&B: every call is a no-op (off rank 0, or `run.wandb.project` unset)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def samples(self, step: int, records: Sequence[dict]) -> None: ...

    def summary(self, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class WandbRun(NullWandb):
    def __init__(self, wcfg, run_dir: Path, run_name: str, config: dict):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError(
                "run.wandb.project is set but the wandb package is not installed: "
                "pip install -r requirements-extras.txt, or unset run.wandb.project"
            ) from e
        self._wandb = wandb
        id_file = Path(run_dir) / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]  # W&B ids: [a-z0-9]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=wcfg.project,
            entity=wcfg.entity or None,
            group=wcfg.group or None,
            tags=list(wcfg.tags) or None,
            name=run_name,
            id=run_id,
            resume="allow",
            mode=wcfg.mode,
            dir=str(run_dir),
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )
        self._columns: list[str] | None = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def samples(self, step: int, records: Sequence[dict]) -> None:
        if not records:
            return
        if self._columns is None:
            self._columns = [k for k in records[0] if k != "parts"] + ["parts"]
        table = self._wandb.Table(columns=self._columns)
        for r in records:
            table.add_data(*(str(r.get(c)) if c == "parts" else r.get(c) for c in self._columns))
        self.run.log({"samples": table}, step=step)

    def summary(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish()


def make_wandb(wcfg, run_dir: Path, run_name: str, config: dict, is_main: bool) -> NullWandb:
    """A live W&B run on rank 0 when `run.wandb.project` is set, else the null object."""
    if not is_main or not wcfg.project:
        return NullWandb()
    return WandbRun(wcfg, run_dir, run_name, config)

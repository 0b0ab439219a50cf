"""W&B (optional extra) in offline mode, read back from the files it wrote; and nothing breaks without it."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl_training.metrics.wandb_log import NullWandb, make_wandb
from tests.helpers import wandb_config
from tests.helpers import wandb_history as history

SECRET = "wandb-key-that-must-never-be-written-0123456789"


def wcfg(**kw):
    return SimpleNamespace(**{"project": "p", "entity": "", "group": "g", "tags": ["a"], "mode": "offline", **kw})


def test_offline_round_trip_and_no_credentials(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # an optional extra: requirements-extras.txt (the test setup installs it)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = {"run": {"name": "r"}, "sync": {"remote": "s3", "secret_access_key": "***"}}
    w = make_wandb(wcfg(), tmp_path, "r", cfg, is_main=True)
    for step in (1, 2, 3):
        w.log(step, {"rollout/reward_mean": step / 10, "train/kl": 0.5 * step})
    w.samples(3, [{"step": 3, "completion": "cba", "reward": 1.0, "parts": {"em": 1.0}}])
    w.summary({"sync/final_ckpts_ok": 2.0})
    w.close()
    rows = history(tmp_path)
    scalars = [(r["_step"], r["rollout/reward_mean"], r["train/kl"]) for r in rows if "train/kl" in r]
    assert scalars == [(1, 0.1, 0.5), (2, 0.2, 1.0), (3, 0.3, 1.5)]
    table_rows = [r for r in rows if r.get("samples/_type") == "table-file"]
    assert len(table_rows) == 1 and table_rows[0]["samples/nrows"] == 1
    table = json.loads(next(tmp_path.glob("wandb/offline-run-*/files/media/table/samples_*.table.json")).read_text())
    assert table["columns"] == ["step", "completion", "reward", "parts"]
    assert table["data"] == [[3, "cba", 1.0, "{'em': 1.0}"]]
    assert wandb_config(tmp_path)["sync"] == {"remote": "s3", "secret_access_key": "***"}
    # The key in the environment reaches no file the run wrote (W&B's own logs included).
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f
    # A resumed run reuses the same W&B run id.
    run_id = (tmp_path / "wandb_id").read_text().strip()
    w2 = make_wandb(wcfg(), tmp_path, "r", cfg, is_main=True)
    assert w2.run.id == run_id
    w2.close()


def test_off_rank0_or_unset_is_a_null_object_and_missing_package_is_one_clear_error(tmp_path, monkeypatch):
    assert type(make_wandb(wcfg(), tmp_path, "r", {}, is_main=False)) is NullWandb
    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError("No module named 'wandb'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    assert type(make_wandb(wcfg(project=""), tmp_path, "r", {}, is_main=True)) is NullWandb  # never imports it
    with pytest.raises(RuntimeError, match="wandb package is not installed"):
        make_wandb(wcfg(), tmp_path, "r", {}, is_main=True)
    assert not list(Path(tmp_path).glob("wandb*"))

"""Checkpoints across device layouts (issue 12, items 8-9): files written on a GPU node (tensors tagged
cuda:0, one RNG state per visible GPU) load on a CPU machine, and optimizer state lands on the params' device."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.serialization

from rl_training.ckpt import store as ck
from rl_training.ckpt.marker import file_records
from rl_training.config.load import load_config, to_yaml
from rl_training.policy.models import build_policy, trainable_parameters
from rl_training.train.optimizer import build_optimizer
from tests.helpers import REPO

# torch.load of a cuda-tagged file only fails where CUDA is missing: what these tests stage.
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="stages a GPU checkpoint read without CUDA")


def save_as_cuda(monkeypatch, obj, path: Path) -> None:
    """torch.save with every storage tagged cuda:0, as on a GPU node: torch.load without map_location then
    needs CUDA, exactly as for a real GPU checkpoint (checked below)."""
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    torch.save(obj, path)
    monkeypatch.undo()


@no_cuda
def test_gpu_tagged_file_needs_map_location(tmp_path, monkeypatch):
    save_as_cuda(monkeypatch, {"exp_avg": torch.ones(3)}, tmp_path / "x.pt")
    with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
        torch.load(tmp_path / "x.pt", weights_only=False)  # what ckpt/store.py did before
    assert ck.load_cpu(tmp_path / "x.pt")["exp_avg"].tolist() == [1.0, 1.0, 1.0]


def test_optimizer_state_is_rehomed_to_the_param_device(tmp_path):
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.full((4,), 0.5)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    q = torch.nn.Parameter(torch.ones(4, device="meta"))  # a device other than the CPU the file loads to
    opt2 = torch.optim.AdamW([q], lr=0.1)
    opt2.load_state_dict(ck.load_cpu(tmp_path / "optimizer.pt"))
    assert opt2.state[q]["exp_avg"].device.type == "meta" and opt2.state[q]["exp_avg_sq"].device.type == "meta"


@no_cuda
def test_rng_state_with_more_gpus_than_the_loader_has_restores_the_cpu_streams():
    state = ck.rng_state()
    assert "cuda" not in state  # this CPU machine
    expected = (random.random(), np.random.rand(), torch.rand(2).tolist())
    ck.set_rng_state({**state, "cuda": torch.zeros(16, dtype=torch.uint8)})  # saved on a GPU, loaded without one
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == expected


def test_rank_restores_its_own_device_state(monkeypatch):
    """On a GPU the rank's current device gets the state the rank saved (its own device's only)."""
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: restored.append(int(s[0])))
    base = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    ck.set_rng_state({**base, "cuda": torch.full((16,), 3, dtype=torch.uint8)})
    assert restored == [3]


@no_cuda
def test_checkpoint_written_on_gpu_node_resumes_on_cpu(tiny_model, tmp_path, monkeypatch):
    cfg = load_config(str(REPO / "cfg" / "testconfig.yaml"), [f"model.name_or_path={tiny_model}"])
    _, model = build_policy(cfg, torch.device("cpu"))
    params = trainable_parameters(model)
    opt, sched = build_optimizer(params, cfg.optim, 10)
    for p in params:
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    sched.step()
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    path = ck.save_checkpoint(tmp_path, 1, model, opt, sched, to_yaml(cfg), {}, keep_last=2)
    rng = {**ck.rng_state(), "cuda": torch.zeros(16, dtype=torch.uint8)}  # saved by a rank on a GPU node
    save_as_cuda(monkeypatch, rng, path / "rng_rank0.pt")
    marker = json.loads((path / ck.COMPLETE).read_text())  # the marker records the GPU node's file as saved there
    marker["files"]["rng_rank0.pt"] = file_records(path)["rng_rank0.pt"]
    (path / ck.COMPLETE).write_text(json.dumps(marker))
    with pytest.raises(RuntimeError, match="CUDA device"):
        torch.load(path / "optimizer.pt", weights_only=False)  # the files really are GPU-tagged
    opt2, sched2 = build_optimizer(params, cfg.optim, 10)
    restored = ck.load_checkpoint(path, model, opt2, sched2, rank=0, world_size=1)
    assert restored.step == 1 and sched2.last_epoch == 1
    for p in params:  # AdamW's first step: exp_avg = (1 - beta1) * grad
        assert torch.allclose(opt2.state[p]["exp_avg"], (1 - cfg.optim.beta1) * torch.full_like(p, 0.01))

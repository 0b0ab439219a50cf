"""Shared fixtures: the tiny model and the synthetic data, built once per session in a temp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rl_training.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)


@pytest.fixture(scope="session")
def reverse_data(tmp_path_factory) -> Path:
    from rl_training.data.synthetic import write_reverse_data

    return write_reverse_data(tmp_path_factory.mktemp("data") / "reverse", n_train=200, n_heldout=32)


def data_overrides(reverse_data: Path) -> list[str]:
    return [f"data.train={reverse_data / 'train.jsonl'}", f"data.eval={reverse_data / 'heldout.jsonl'}"]


@pytest.fixture(scope="session")
def warm_model(tiny_model, reverse_data, tmp_path_factory) -> Path:
    """The tiny model after a short SFT warm start (the real sft_runner): it earns partial rewards, so RL
    steps have non-zero advantages. 40 steps take a few seconds."""
    from rl_training.runners import sft_runner

    out = tmp_path_factory.mktemp("sft")
    rc = sft_runner.main(
        [
            "--cfg",
            str(REPO / "cfg" / "tiny_sft.yaml"),
            f"model.name_or_path={tiny_model}",
            *data_overrides(reverse_data),
            f"run.output_dir={out}",
            "run.name=warm",
            "sft.steps=40",
            "sft.warmup_steps=5",
        ]
    )
    assert rc == 0
    return out / "warm" / "final_model"


@pytest.fixture
def run_overrides(warm_model, reverse_data, tmp_path) -> list[str]:
    """Overrides that point cfg/testconfig.yaml at the warm model, the test data and a fresh output dir."""
    return [f"model.name_or_path={warm_model}", *data_overrides(reverse_data), f"run.output_dir={tmp_path / 'runs'}"]


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; on CPU machines (development, CI) they are collected and skipped."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

"""Shared fixtures: the tiny model and the synthetic data, built once per session in a temp dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]

# What an in-process vLLM engine writes into os.environ for its own workers (vllm/platforms/cpu.py: LD_PRELOAD of
# torch's libgomp, LOCAL_WORLD_SIZE=tp size, VLLM_* and TORCHINDUCTOR_* settings). Left there, every later
# subprocess of the session (torchrun and its ranks) would inherit it, so a test's children would depend on
# which tests ran before it. Restored after each test: the engine that set them has already spawned its workers.
_LEAKED_PREFIXES = ("VLLM_", "TORCHINDUCTOR_")
_LEAKED_KEYS = ("LD_PRELOAD", "LOCAL_WORLD_SIZE", "NUMEXPR_MAX_THREADS")
_ENV_AT_START = {k: v for k, v in os.environ.items() if k in _LEAKED_KEYS or k.startswith(_LEAKED_PREFIXES)}


@pytest.fixture(autouse=True)
def _no_engine_env_leaks():
    yield
    for k in [k for k in os.environ if k in _LEAKED_KEYS or k.startswith(_LEAKED_PREFIXES)]:
        if k not in _ENV_AT_START:
            del os.environ[k]
    os.environ.update(_ENV_AT_START)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rl_training.policy.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)


@pytest.fixture(scope="session")
def reverse_data(tmp_path_factory) -> Path:
    from rl_training.tasks.reverse import write_reverse_data

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


# Test layers (the unit / integration / cluster markers of pyproject.toml), by file: cluster tests need a real
# Slurm, rclone or the cluster shell scripts; integration tests run the real runner, torchrun, vLLM or a server;
# everything else is a unit test of pure functions and small components. `pytest -m unit` is the fast loop.
CLUSTER = {"test_slurm", "test_ckpt_sync", "test_lambda_scripts", "test_search_slurm", "test_setup_script"}
INTEGRATION = {
    "test_runner", "test_ddp", "test_evals", "test_vllm_backend", "test_vllm_lora", "test_server_backend",
    "test_server_gpu", "test_reliability_runs", "test_reliability_faults", "test_demo", "test_gpu", "test_gpu_check",
    "test_bench", "test_stop_signal", "test_code_humaneval", "test_code_evals", "test_sft_and_tasks", "test_grading",
}  # fmt: skip


def layer_of(module_name: str) -> str:
    name = module_name.rpartition(".")[2]
    return "cluster" if name in CLUSTER else "integration" if name in INTEGRATION else "unit"


def pytest_collection_modifyitems(config, items):
    """Each test gets its layer marker; `gpu` tests need CUDA: on CPU machines (development, CI) they are
    collected and skipped."""
    import torch

    for item in items:
        item.add_marker(getattr(pytest.mark, layer_of(item.module.__name__)))

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

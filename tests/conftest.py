"""Fixtures every tier shares: the tiny model, the synthetic data and the warm (SFT) model, built once per session
in a temp dir; a sandbox pool; and the tier marker of each test (its folder)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Nothing in the tests may reach a model hub (set before the helpers import transformers, which reads it once).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Every run a test starts stays on the CPU, also on a GPU machine: in this process and in every process it launches
# (torchrun, scripts, servers), whichever way it launches them (issue 50). The tests are written for the CPU, and a
# 2-rank test's rank 1 would stop on a 1-GPU box (base/dist.py use_cuda). The gpu-marked tests take the GPU back
# explicitly (tests/integration/test_gpu.py removes it for its runs and their torchrun workers); RL_DEVICE=cuda set
# by the caller keeps the in-process runs on the GPU (the device check's pytest stage).
os.environ.setdefault("RL_DEVICE", "cpu")

from hypothesis import HealthCheck, settings

from tests.helpers import REPO, data_overrides, require_debian_packages

# Property-based tests (Hypothesis) of every function that reads model-written text. The suite's profile is
# derandomized (the same examples every run: a CI failure reproduces) with a budget per test that keeps them all
# under a minute; `make fuzz` (HYPOTHESIS_PROFILE=fuzz) runs them with fresh random examples, many more per test,
# and Hypothesis' example database, for a long run CI does not make.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=150,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "20000")),
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

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


@pytest.fixture(scope="module")
def pool():
    """A 2-worker sandbox pool (bubblewrap: skipped without it, failed under RL_REQUIRE_CLUSTER_TESTS=1)."""
    require_debian_packages({"bwrap": "bubblewrap"})
    from rl_training.sandbox.confinement import PoolSettings
    from rl_training.sandbox.pool import Pool

    p = Pool(PoolSettings(workers=2))
    yield p
    p.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rl_training.policy.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)


@pytest.fixture(scope="session")
def reverse_data(tmp_path_factory) -> Path:
    from rl_training.tasks.reverse import write_reverse_data

    return write_reverse_data(tmp_path_factory.mktemp("data") / "reverse", n_train=200, n_heldout=32)


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


# Test tiers are folders: tests/unit/<package>/ (pure functions and small components), tests/integration/ (the
# real runner, torchrun, vLLM or a server, small), tests/real_model/ (the same paths on the one real pretrained
# model, SmolLM2-135M-Instruct from `make real-model`), tests/cluster/ (a real Slurm, rclone or the cluster shell
# scripts), tests/stress/ (many repeated runs under load), tests/demos/ (the learning demos). Each test gets its
# folder's marker (`pytest -m unit` is the fast loop; `make test-fast` is unit + integration without the slow ones).
TIERS = ("unit", "integration", "real_model", "cluster", "stress", "demos")


def tier_of(path: Path) -> str:
    rel = path.resolve().relative_to(Path(__file__).resolve().parent)
    if rel.parts[0] not in TIERS:
        raise pytest.UsageError(f"{rel}: a test module lives in one of tests/{{{','.join(TIERS)}}}/")
    return rel.parts[0]


def pytest_collection_modifyitems(config, items):
    """Each test gets its layer marker; `gpu` tests need CUDA: on CPU machines (development, CI) they are
    collected and skipped."""
    import torch

    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item.path)))

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# What CI's summary reads (.ci/run, scripts/ci_summary.py): with RL_TIERS set, each pytest session appends its
# tiers, outcome counts, exit status and seconds; with RL_SKIPS set, each skipped test and its reason. A lane's own
# name (RL_TEST_LANE) tells the integration tier's two halves apart.
_session: dict = {}


def pytest_sessionstart(session):
    import time

    if os.environ.get("RL_RECORDING_SESSION"):  # a pytest a test started: its sessions are that test's business
        for var in ("RL_TIERS", "RL_SKIPS"):
            os.environ.pop(var, None)
    os.environ["RL_RECORDING_SESSION"] = "1"  # seen by every process this session starts
    _session.update(start=time.monotonic(), counts={})


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":  # a setup error or skip is the test's only report
        counts = _session.setdefault("counts", {})
        counts[report.outcome] = counts.get(report.outcome, 0) + 1
    if report.skipped and os.environ.get("RL_SKIPS"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _append(os.environ["RL_SKIPS"], {"test": report.nodeid, "reason": reason.removeprefix("Skipped: ")})


def pytest_sessionfinish(session, exitstatus):
    import time

    if not os.environ.get("RL_TIERS") or "start" not in _session:
        return
    tiers = sorted({tier_of(item.path) for item in session.items}) or ["(none collected)"]
    lane = os.environ.get("RL_TEST_LANE", "")
    seconds = round(time.monotonic() - _session["start"])
    marks = session.config.option.markexpr  # the demos' two lanes: one_core and not
    row = {"tiers": tiers, "lane": lane, "marks": marks, "exit": int(exitstatus), "seconds": seconds}
    _append(os.environ["RL_TIERS"], row | {"counts": _session.get("counts", {})})


def _append(path: str, row: dict) -> None:
    import json

    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")

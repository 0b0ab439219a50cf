"""The real-model tier: SmolLM2-135M-Instruct (Q4_1 dequantized; `make real-model` converts it into
models/smollm2-135m-instruct) through the paths the tiny model tests: the chat template, the two engines' log-probs,
the weight sync, resume, SFT, evals and synthesize. Skipped without the model, failed instead when
RL_REQUIRE_REAL_MODEL=1 (CI converts it first: .ci/run)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.helpers import REPO

REQUIRE_ENV = "RL_REQUIRE_REAL_MODEL"


def _get_real_model():
    spec = importlib.util.spec_from_file_location("get_real_model", REPO / "scripts" / "get_real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def real_model() -> Path:
    grm = _get_real_model()
    path = Path(os.environ.get("RL_REAL_MODEL", REPO / grm.DEFAULT_OUT))
    if not grm.complete(path):
        reason = f"no converted real model at {path}: run `make real-model`"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} [{REQUIRE_ENV}=1: this tier must run, not be skipped]", pytrace=False)
        pytest.skip(reason)
    return path

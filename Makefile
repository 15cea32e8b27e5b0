# The two set-up-and-go commands: `make run` and `make test`.
# Both create .venv when it is missing and install the exact versions CI tested (requirements.lock).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lock clean-venv

# torch goes in first, through pip: on this pin pip takes the wheel the machine has (CPU here, CUDA on a
# GPU box); a looser request would pull a multi-GB CUDA build. uv installs the rest (the locked uv, from
# PyPI or UV_INDEX_URL): it resolves and unpacks the ~200 locked packages in seconds where pip takes
# minutes. Everything goes in compiled to bytecode: where PYTHONDONTWRITEBYTECODE is set (this machine's
# image sets it) Python never caches what it compiles, and every process (each Ray rank, each CLI) would
# compile torch, diffusers and transformers again: ~17 s of CPU per process instead of ~7 (BENCHMARKS.md).
# Installers compile only what they install: a .venv made before this needs `make clean-venv` once.
# `make INSTALLER=pip ...` installs the rest with pip instead (for an index only pip.conf knows).
INSTALLER ?= uv
ifeq ($(INSTALLER),pip)
INSTALL_REST := $(PY) -m pip install --quiet
else
INSTALL_REST := $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY)
endif

$(STAMP): pyproject.toml requirements.lock Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c requirements.lock torch==2.13.0 uv
	$(INSTALL_REST) -c requirements.lock -e '.[test]'
	touch $(STAMP)

# The CLI keeps Prefect's local server quiet (warnings only, no telemetry) unless the environment says otherwise.
run: $(STAMP)
	$(PY) -m flows.cli run

test: $(STAMP)
	$(PY) -m pytest -q

# Refresh the lock after changing dependencies (then run `make test` on a clean clone).
lock: $(STAMP)
	$(PY) -m pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' > requirements.lock

clean-venv:
	rm -rf $(VENV)

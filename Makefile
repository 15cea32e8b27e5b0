# The two set-up-and-go commands: `make run` and `make test`.
# Both create .venv when it is missing and install the exact versions CI tested (requirements.lock).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lock clean-venv

# torch is pinned (torch==2.13.0): a looser request would pull a multi-GB CUDA build where the machine has a CPU
# wheel on disk. pip finds such a wheel through its find-links (pip.conf, PIP_FIND_LINKS); uv reads no pip
# configuration, so the folders pip would search are handed to it (FIND_LINKS), and on a machine with none it takes
# the pin from PyPI (the CUDA build on Linux), as pip would. pip installs only uv (the locked one); uv installs
# torch and the ~200 locked packages in one resolve, unpacking in parallel (~25 s less than pip's torch alone).
# Everything goes in compiled to bytecode: where PYTHONDONTWRITEBYTECODE is set (this machine's image sets it)
# Python never caches what it compiles, and every process (each Ray rank, each CLI) would compile torch,
# diffusers and transformers again: ~17 s of CPU per process instead of ~7 (BENCHMARKS.md).
# Installers compile only what they install: a .venv made before this needs `make clean-venv` once.
# `make INSTALLER=pip ...` installs everything with pip instead (for an index only pip.conf knows).
INSTALLER ?= uv
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
ifeq ($(INSTALLER),pip)
INSTALL = $(PY) -m pip install --quiet
else
INSTALL = $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) \
	$(foreach folder,$(FIND_LINKS),--find-links $(folder))
endif

$(STAMP): pyproject.toml requirements.lock Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c requirements.lock uv
	$(INSTALL) -c requirements.lock torch==2.13.0 -e '.[test]'
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

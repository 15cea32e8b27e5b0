# The two set-up-and-go commands: `make run` and `make test`.
# Both create .venv when it is missing and install the exact versions CI tested (requirements.lock).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test lock clean-venv

# torch goes in first and alone: on this pin pip takes the wheel the machine has (CPU here, CUDA on a
# GPU box); a looser request would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c requirements.lock -e '.[test]'
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

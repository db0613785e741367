# Two entry points (see README): `make quickstart` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: quickstart test install lint clean

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $$(scripts/find_python312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(PY) -m experiments.quickstart --config=configs/quickstart.py --workdir=workdir/quickstart

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# A crashed xdist worker ends the run (a restarted worker can leave loadgroup scheduling stalled),
# and the whole run is bounded so a stall fails in minutes, not at CI's limit.
test: $(STAMP) lint
	timeout --kill-after=60 1500 $(PY) -m pytest -q -n 2 --dist loadgroup --max-worker-restart=0 tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

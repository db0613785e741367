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

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

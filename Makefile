# The two commands: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck chaos bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/workpool demo

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

typecheck: $(STAMP)
	$(BIN)/mypy

bench:
	@test -x bench/.venv/bin/python || $(PYTHON) -m venv bench/.venv
	@if [ ! -f bench/.venv/.installed ] || [ bench/requirements.txt -nt bench/.venv/.installed ] \
	    || [ pyproject.toml -nt bench/.venv/.installed ]; then \
	  bench/.venv/bin/pip install --quiet --upgrade pip && \
	  bench/.venv/bin/pip install --quiet -r bench/requirements.txt -e . && \
	  touch bench/.venv/.installed; fi
	bench/.venv/bin/python bench/run.py $(BENCH_ARGS)

# The chaos run on both stores (docs/reliability.md): CHAOS_SECONDS of SIGKILLs per store,
# plus connection cuts and two server restarts on PostgreSQL; CHAOS_ARGS go to both runs.
CHAOS_SECONDS ?= 240
CHAOS_PG_URL ?= postgresql://postgres@127.0.0.1:5432/test

chaos: $(STAMP)
	@status=0; \
	$(BIN)/python -m chaos.run --store sqlite --seconds $(CHAOS_SECONDS) $(CHAOS_ARGS) || status=1; \
	$(BIN)/python -m chaos.run --store postgres --url '$(CHAOS_PG_URL)' --seconds $(CHAOS_SECONDS) \
	    --restart-server $(CHAOS_ARGS) || status=1; \
	exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

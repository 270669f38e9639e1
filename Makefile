# The two commands of the quick start: `make demo` and `make test`. Each builds its own
# virtual environment (.venv) from nothing on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: all venv test test-unit test-integration test-contract proto demo bench clean

all: test

$(STAMP): pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,demo]'
	touch $(STAMP)

venv: $(STAMP)

## Regenerate protos/ps/v1/*_pb2*.py from the .proto files (the only way to change them).
proto: $(STAMP)
	$(PY) protos/generate.py

## The whole suite: unit, integration (real shard processes on port 0), contract (against
## freshly started shards), end-to-end.
test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: $(STAMP)
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

## The protocol contract suite; against running shards: make test-contract PS_ADDRESS=host:port
test-contract: $(STAMP)
	$(PY) -m pytest tests/contract $(if $(PS_ADDRESS),--ps-address $(PS_ADDRESS)) $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/ps-bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

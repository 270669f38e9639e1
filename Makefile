# The two commands of the quick start: `make demo` and `make test`. Each builds its own
# virtual environment (.venv) from nothing on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: all venv test test-unit test-integration test-contract test-faults proto demo bench clean

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
## freshly started shards), end-to-end, and the fault tests (about 2 minutes of it).
test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-integration: $(STAMP)
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

## The fault tests alone (also part of `make test`): whole jobs of real processes with workers
## and shards killed, paused and restarted, and corrupt checkpoints; docs/faults.md.
test-faults: $(STAMP)
	$(PY) -m pytest tests/faults $(PYTEST_ARGS)

## The protocol contract suite; against running shards: make test-contract PS_ADDRESS=host:port
test-contract: $(STAMP)
	$(PY) -m pytest tests/contract $(if $(PS_ADDRESS),--ps-address $(PS_ADDRESS)) $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/ps-bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

## The quick-start demo: the bundled MLP trained on digits by 2 shards and 2 workers in sync
## mode, each a separate process (ps-launch). Shows one progress bar, prints the test accuracy
## (fails below 0.95), writes runs/demo/plot.png, runs/demo/run.json and TensorBoard scalars in
## runs/demo/tensorboard; the last line is the run's JSON summary. --verbose shows every process.
demo: $(STAMP)
	@$(PY) -m ps_models.build --model mlp --out runs/demo/mlp.onnx
	@$(PY) -m ps_tools.launch --mode sync --shards 2 --workers 2 --optimizer momentum --lr 0.05 \
		--model runs/demo/mlp.onnx --data digits --batch-size 32 --steps 500 --eval-every 25 \
		--min-accuracy 0.95 --record runs/demo --tensorboard runs/demo/tensorboard

## Containers: lint the Dockerfiles, validate compose and the Kubernetes manifests, build the
## image and train in containers (compose, the Kubernetes pods, the TFJob replicas). As root
## on a fresh machine it installs podman and builds the stand-in base image first
## (deploy/containers/setup-engine.sh; cache in /var/cache/onnx-ps). Without an engine the
## engine tests skip with the reason, except under CI=true, where they fail.
.PHONY: test-containers
test-containers: $(STAMP)
	-deploy/containers/setup-engine.sh
	PS_CONTAINER_TESTS=1 $(PY) -m pytest tests/containers -rs $(PYTEST_ARGS)

# nonomad: `make up` runs a local cluster serving a demo app, `make test` runs every check.
SHELL := /bin/bash
.DEFAULT_GOAL := help
UV_VERSION := 0.13.9
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
BUF := node_modules/.bin/buf
PROTOS := $(shell find protos -name '*.proto' | sort)

.PHONY: help env system gen check-gen lint typecheck unit sim test test-under-load up bench clean base-image

help:
	@echo "make up     start a local cluster serving a demo app (Ctrl-C stops it)"
	@echo "make test   lint, type-check, check generated code, run the tests"
	@echo "make sim    run SIM_SEEDS (500) simulated schedules of the whole cluster"
	@echo "make test-under-load  the process-level tests 3 times beside a CPU hog on every core"
	@echo "make gen    regenerate gRPC code from protos/"
	@echo "make bench  run the benchmarks and print tables"
	@echo "make base-image  build a small Debian base for directory images (mmdebstrap)"

# The environment comes from the project's own files: uv.lock for Python,
# package-lock.json for buf (it lists every platform's optional buf binary, so `npm ci` installs
# exactly the lock and never rewrites it).
env: $(VENV)/.synced $(BUF) system

# Debian packages the OCI driver runs (crun, tini), installed when missing.
system:
	@.ci/system-packages

$(VENV)/.synced: pyproject.toml uv.lock
	@command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet "uv==$(UV_VERSION)"
	uv sync --frozen
	@touch $@

$(BUF): package.json package-lock.json
	npm ci --no-fund --no-audit --loglevel=error
	@touch $@

gen: env
	$(PY) -m grpc_tools.protoc -Iprotos \
	  --python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. $(PROTOS)

# Generated code is committed; CI fails when it differs from what `make gen` writes.
check-gen: env
	@tmp=$$(mktemp -d) && trap 'rm -rf $$tmp' EXIT && \
	$(PY) -m grpc_tools.protoc -Iprotos \
	  --python_out=$$tmp --grpc_python_out=$$tmp --mypy_out=$$tmp --mypy_grpc_out=$$tmp $(PROTOS) && \
	for f in $$(cd $$tmp && find . -type f | sort); do \
	  cmp -s $$tmp/$$f $$f || { echo "stale generated code: $$f (run make gen)"; exit 1; }; \
	done && \
	for f in $$(find flyd/v1 flaps/v1 proxy/v1 registry/v1 -name '*_pb2*' | sort); do \
	  [ -f $$tmp/$$f ] || { echo "generated file without a proto: $$f"; exit 1; }; \
	done && echo "generated code is fresh"

# buf breaking against each commit .ci/breaking-against prints, from a git archive of it
# (buf's own ".git#ref=" clones the repository each time: three times slower).
lint: env
	$(BUF) lint
	$(BUF) format --exit-code --diff
	@bases=$$(.ci/breaking-against) && tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	for base in $$bases; do \
	  echo "buf breaking against $$base"; mkdir "$$tmp/$$base"; \
	  git archive "$$base" buf.yaml protos | tar -x -C "$$tmp/$$base" && \
	  $(BUF) breaking --against "$$tmp/$$base" || exit 1; \
	done
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: env
	$(VENV)/bin/mypy

# The tests on TEST_WORKERS pytest-xdist workers (two: this is a 2-core machine, as CI's is;
# 0 runs them in this one process), each with host ports of its own (tests/host_ports.py); the
# tests that share a module's fixture stay on one worker (tests/xdist_groups.py). The 20
# slowest are listed at the end.
TEST_WORKERS ?= 2
unit: env
	$(VENV)/bin/pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup) --durations=20

# The simulator (sim/): SIM_SEEDS whole-cluster schedules under drawn faults, from a first
# seed derived from the commit (each commit runs others; a rerun of one, the same); exits 1
# when one broke an invariant, naming its replay (`python -m sim --seed N`). Part of `make test`.
SIM_SEEDS ?= 500
sim: env
	$(PY) -m sim --seeds $(SIM_SEEDS) --jobs 2

test: lint check-gen typecheck unit sim

# The tests that wait on real processes (end-to-end, *_process.py, the CLI's, the README's),
# RUNS times in a row beside a busy process on every core (tests/under_load.py).
RUNS ?= 3
test-under-load: env
	$(PY) -m tests.under_load --runs $(RUNS) --workers $(TEST_WORKERS)

# A small Debian (bookworm, minbase, python3-minimal) as a rootfs tar, built from Debian's
# packages by mmdebstrap (installed with apt-get when missing and root; no device nodes, which
# images may not hold): a base for directory images (`nonomad image build DIR --base
# $(BASE_IMAGE)`). Built once; `make base-image BASE_IMAGE=path` puts it elsewhere.
BASE_IMAGE ?= .nonomad/base/debian.tar
base-image: $(BASE_IMAGE)

$(BASE_IMAGE):
	@command -v mmdebstrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing mmdebstrap with apt-get" >&2; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap \
	      >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      mmdebstrap >/dev/null; }; \
	  else echo "mmdebstrap is missing (Debian package mmdebstrap)" >&2; exit 1; fi; }
	@mkdir -p "$(dir $@)"
	mmdebstrap --quiet --variant=minbase --include=python3-minimal --format=tar --skip=output/dev \
	  bookworm "$@.part"
	@mv "$@.part" "$@"

up: env
	$(VENV)/bin/nonomad up --demo

bench: env
	$(PY) -m bench

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache

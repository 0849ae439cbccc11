# jaxcomm: `make train` and `make test` create .venv on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: train convergence test test-newest bench bench-lr bench-defaults bench-network bench-sharded bench-time-to-target docs docs-site lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[train,test]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py

# Two workers (pytest-xdist, work stealing): each simulates 8 CPU devices and
# they share a persistent XLA compilation cache (.cache/jax-<jaxlib>);
# tests/conftest.py sets XLA flags that compile the suite's small programs
# fast. On 2 cores the suite (2,079 tests) ran in 6 min 21 s from an empty
# cache (15 min 8 s without those flags).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal tests

# The newest leg: the same suite on the newest Python pyenv has (JAX 0.11+
# needs 3.12+) with the newest jax, jaxlib and libtpu pip resolves, in
# .venv-newest (its compilation cache apart: tests/conftest.py keeps one
# per jaxlib). NEWEST_PYTHON=/path/to/python3.13 picks another interpreter.
NEWEST_VENV   := .venv-newest
NEWEST_PY     := $(NEWEST_VENV)/bin/python
NEWEST_STAMP  := $(NEWEST_VENV)/.installed
NEWEST_PYTHON ?= $(shell for v in 3.13 3.12; do \
  p=$$(pyenv prefix $$v 2>/dev/null) && echo "$$p/bin/python" && exit 0; \
  command -v python$$v && exit 0; done)

$(NEWEST_STAMP): pyproject.toml
	@test -x "$(NEWEST_PY)" || test -n "$(NEWEST_PYTHON)" || { echo \
	  "test-newest: no Python 3.13 or 3.12 (pyenv install 3.13, or set" \
	  "NEWEST_PYTHON=/path/to/python3.13)" >&2; exit 1; }
	test -x $(NEWEST_PY) || $(NEWEST_PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install --quiet --upgrade pip
	$(NEWEST_PY) -m pip install --quiet -e ".[train,test]"
	touch $(NEWEST_STAMP)

test-newest: $(NEWEST_STAMP)
	$(NEWEST_PY) -m pytest -q -n 2 --dist worksteal tests

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

convergence: $(STAMP)
	$(PY) -m benchmarks.convergence

# The README's method tables, from jaxcomm.registry (a test fails when stale).
docs: $(STAMP)
	$(PY) -m benchmarks.readme_tables

# The API reference site, offline (Sphinx, MathJax from a package): built
# from scratch into docs/_build/html with warnings as errors, nitpicky, so
# every warning shows; tests/test_docs_site.py opens it in headless Chromium.
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs-site: $(DOCS_STAMP)
	rm -rf docs/_build/html docs/_build/doctrees
	$(PY) -m sphinx -b html -W --keep-going -n -q docs docs/_build/html

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) $(NEWEST_VENV) build *.egg-info .pytest_cache .cache

# The learning rate each compressor wants (digits MLP, ~20 min); ARGS
# e.g. --write-lr to record it in docs/benchmarks/lr.json.
bench-lr: $(STAMP)
	$(PY) -m benchmarks.lr_sweep $(ARGS)

# Every compressor at its registry defaults and lr.json's rate on three
# tasks against dense (~1 h on 2 cores): docs/benchmarks/defaults.md.
bench-defaults: $(STAMP)
	$(PY) -m benchmarks.defaults $(ARGS)

# Measured step times in a rate-limited network namespace (needs root);
# e.g. make bench-network ARGS=--quick
bench-network: $(STAMP)
	$(PY) -m benchmarks.network $(ARGS)

# The sharded transformer LM (--mesh dcn=2,fsdp=4): eval loss per method
# across slices (~40 min on 2 cores), and PowerSGD per shard against the
# whole-matrix low rank (~30 min); tables in runs/bench/.
bench-sharded: $(STAMP)
	mkdir -p runs/bench
	$(PY) -m benchmarks.sharded_convergence --out runs/bench/sharded_convergence.md
	$(PY) -m benchmarks.powersgd_sharding --out runs/bench/powersgd_sharding.md

# Time to a target loss on a bandwidth-bound wide MLP in a rate-limited
# network namespace (needs root), against the free-communication bound, at
# the rates docs/benchmarks/time_to_target_tuning.json holds (ARGS="--tune"
# reruns the tuning); e.g. make bench-time-to-target ARGS="--rates 1"
bench-time-to-target: $(STAMP)
	$(PY) -m benchmarks.time_to_target $(ARGS)

# jaxcomm: `make train` and `make test` create .venv on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: train convergence test bench bench-lr bench-network bench-sharded bench-time-to-target docs lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[train,test]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py

# Two workers (pytest-xdist, work stealing): each simulates 8 CPU devices and
# they share a persistent XLA compilation cache (.cache/jax); tests/conftest.py
# sets XLA flags that compile the suite's small programs fast. On 2 cores the
# suite (2,079 tests) ran in 6 min 21 s from an empty cache (15 min 8 s
# without those flags).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal tests

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

convergence: $(STAMP)
	$(PY) -m benchmarks.convergence

# The README's method tables, from jaxcomm.registry (a test fails when stale).
docs: $(STAMP)
	$(PY) -m benchmarks.readme_tables

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .cache

# Measured step times in a rate-limited network namespace (needs root);
# The learning rate each compressor wants (digits MLP, ~5 min).
bench-lr: $(STAMP)
	$(PY) -m benchmarks.lr_sweep $(ARGS)

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

# Time to a target loss of real char-LM training in a rate-limited network
# namespace (needs root); e.g. make bench-time-to-target ARGS="--rates 1"
bench-time-to-target: $(STAMP)
	$(PY) -m benchmarks.time_to_target $(ARGS)

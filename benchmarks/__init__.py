"""Benchmark scripts for jaxcomm (run with python -m benchmarks.<name>)."""

"""Benchmark scripts, and the attention comparison (benchmarks.attention)."""

"""Benchmark scripts: speed figures (the attention comparison is in studies.attention)."""

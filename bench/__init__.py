"""Measurement only: benchmarks, profilers and the helpers they share; nothing outside bench/ but the
benchmark commands imports it (tests/test_layers.py). Results live in bench/<name>/ with their commands."""

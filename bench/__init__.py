"""Measurement, not the product: benchmarks (MT-Bench decoding speed, batch throughput, step scaling, load
memory), profilers (op times, step pieces), memory plans (with the model presets they plan for and the HLO
collective counts), and the helpers they share (MT-Bench prompts, report files). Nothing outside bench/ but the
benchmark commands imports this one (tests/test_layers.py). Results live in the subfolders (bench/medusa,
bench/sampling, bench/batch, bench/scaling, bench/loading, bench/refill, bench/heads...), each with the command
that made it; the entry points are scripts/benchmark.py, scripts/benchmark_batch.py, scripts/benchmark_loading.py
and scripts/plan.py.
"""

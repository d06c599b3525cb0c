"""Measurement and tooling, not the product: benchmarks (MT-Bench decoding speed, batch throughput, step
scaling, load memory), profilers (op times, step pieces), the oracle proposer that bounds what a tree can
accept, tree building (build_tree), memory plans (with the model presets they plan for and the HLO collective
counts), the demo model's GGUF conversion (`demo_model`), and the helpers they share (model and prompt
loading, machine description, report files). The decoding package (`medusa_jax.inference`) never imports this
one. Results live in the subfolders (bench/medusa, bench/sampling, bench/batch, bench/scaling, bench/loading,
bench/refill, bench/heads...), each with the command that made it; the entry points are scripts/benchmark.py,
scripts/benchmark_batch.py, scripts/benchmark_loading.py, scripts/build_tree.py and scripts/plan.py.
"""

"""Measurement code, not the product: benchmarks, profilers, oracles and the tree-timing code that sizes the
Medusa tree (`step_cost` times the decode loops' own `plain_step` / `medusa_step`). It installs as
`medusa_jax.bench`; nothing in medusa_jax, inference or training imports it. Results of the runs (tables,
JSON, plots) live in the subfolders beside this file (bench/medusa, bench/scaling, ...).
"""

"""The command lines, installed as `medusa_jax.scripts` (console commands in pyproject.toml's [project.scripts]);
each file also runs as `python scripts/NAME.py`. Thin: argument parsing and error lines around library calls."""

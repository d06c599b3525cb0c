"""The command lines, installed as `medusa_jax.scripts` (console commands in pyproject.toml's [project.scripts]);
each command file also runs as `python scripts/NAME.py`. Thin: argument parsing and error lines around library
calls. `cli_args` (argument value parsers) and `distributed` (multi-host start-up) are their shared helpers."""

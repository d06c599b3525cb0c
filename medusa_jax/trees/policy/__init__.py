"""Which tree to decode with (one `choose_tree`, in `choose`): the greedy tree by expected accepted length, the step
costs measured here and the first-use calibration. The inference layer (see medusa_jax/trees/__init__.py)."""

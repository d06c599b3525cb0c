"""Which tree to decode with: one `choose_tree` (`choose`); see medusa_jax/trees/__init__.py."""

"""How trees.json is made (build_tree's search); see medusa_jax/trees/__init__.py."""

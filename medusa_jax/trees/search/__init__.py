"""How trees.json is made: the tree search of build_tree, the heads' held-out accuracy, the planted oracle
proposers. The training layer (see medusa_jax/trees/__init__.py)."""

"""Candidate trees, one package on three floors of tests/test_layers.py: trees/ (the structures the heads draft into:
`tree`, `dynamic_tree`, `trees_file`), trees/policy/ (which tree to decode with, `choose_tree`; with inference)
and trees/search/ (how trees.json is made; with training). The picture: docs/architecture.md."""

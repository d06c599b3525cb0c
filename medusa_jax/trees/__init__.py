"""Candidate trees, in one package on three floors (each subfolder is one layer of tests/test_layers.py):

    medusa_jax/trees/          the structures, below the heads (they draft into them): static tree buffers and the
                               dynamic tree spec (`tree`), dynamic trees grown per step on device (`dynamic_tree`),
                               a heads folder's trees.json (`trees_file`). NumPy and JAX only.
    medusa_jax/trees/policy/   which tree to decode with, beside the decoders (the inference layer): THE
                               `choose_tree` (`policy.choose`), the greedy tree by expected accepted length
                               (`tree_choice`), the step costs of this machine, timed on the decode loop's own
                               step (`step_cost`), and the first-use calibration that combines the two
                               (`calibration`). The front-end (inference/api.py) asks it for a tree or plain.
    medusa_jax/trees/search/   how a heads folder's trees.json is made, beside training (it reads the training
                               data's held-out end and writes an artefact next to the heads): the tree search
                               (`tree_builder`, what scripts/build_tree.py runs), the heads' held-out accuracy
                               (`head_accuracy`) and the planted oracle proposers that bound what a tree can
                               accept (`oracle`, for tests and benchmarks).

Why three floors and not one: the structures are what the heads draft into, so they sit under the heads; the
policy times the decode step itself, so it sits with the decoders; the search decodes, scores and reads
conversations, so it sits with training. Each floor imports only its own floor and the ones below.
"""

"""Candidate trees, one package on three floors of tests/test_layers.py (a floor imports only its own and lower ones):
  trees/          the structures the heads draft into, so below the heads: static buffers and the dynamic tree spec
                  (`tree`), dynamic trees grown on device (`dynamic_tree`), a heads folder's trees.json (`trees_file`);
  trees/policy/   which tree to decode with, THE `choose_tree` (`choose`): it times the decode step itself
                  (`step_cost`, `calibration`, `tree_choice`), so it sits with inference, whose front-end asks it;
  trees/search/   how trees.json is made (`tree_builder`, `head_accuracy`; `oracle` bounds what a tree can accept): it
                  decodes, scores and reads the training data's held-out end, so it sits with training.
"""

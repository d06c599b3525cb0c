"""Draft heads and their trees: the config, Medusa and Hydra heads, fresh heads by head type (`init`, the one
table of head types), the native folder format (`folder`), loading any known layout (`load`), the PyTorch
serving layouts (`export`, `layouts`), the static tree buffers and the dynamic tree spec (`tree`), dynamic trees
grown per step on device (`dynamic_tree`, and `eagle_dynamic` for the EAGLE drafter) and a heads folder's
trees.json (`trees_file`). Imports the model and hf packages."""

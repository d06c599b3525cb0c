"""Draft heads and their trees: the config, Medusa and Hydra heads, fresh heads by head type (`init`, the one
table of head types), the native folder format (`folder`), loading any known layout (`load`), the PyTorch
serving layouts (`export`, `layouts`), the static tree buffers (`tree`) and a heads folder's trees.json
(`trees_file`). Imports the model and hf packages."""

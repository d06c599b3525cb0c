"""Draft heads: the config, Medusa and Hydra heads and the EAGLE-style drafter, fresh heads by head type (`init`,
the one table of head types), the native folder format (`folder`), loading any known layout (`load`), the
PyTorch serving layouts (`export`, `layouts`) and the EAGLE drafter's dynamic-tree expansion (`eagle_dynamic`).
Their trees live in medusa_jax/trees. Imports the model, hf and trees packages."""

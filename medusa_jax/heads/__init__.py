"""Drafters: the config, the drafter kinds registered by name (`kinds`: Medusa heads, Hydra heads, the EAGLE-style
drafter), fresh heads of any kind (`init`), the native folder format (`folder`), loading any known layout
(`load`), the PyTorch serving layouts (`export`, `layouts`, `eagle_layout`) and the EAGLE drafter's dynamic-tree
expansion (`eagle_dynamic`). Their trees live in medusa_jax/trees. Imports the model, hf and trees packages."""

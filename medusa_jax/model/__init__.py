"""The backbone: its config, the Flax NNX decoder (attention, RoPE), the static KV cache, the partition rules
of a device mesh, and the parameter paths they share. Imports nothing above the core's root modules."""

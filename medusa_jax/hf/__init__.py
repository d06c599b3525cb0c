"""Hugging Face folders: load a backbone from one (`load`), write it back (`save`), and the tensor files both
read and write (`tensor_files`: safetensors, sharded indexes, PyTorch bins). Imports the model package."""

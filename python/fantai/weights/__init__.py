"""Weights room: readers that turn checkpoint files into Hugging Face-named numpy tensors."""

from fantai.weights.gguf_loader import GGUFModel, load_gguf

__all__ = ["GGUFModel", "load_gguf"]

"""The transformers (PyTorch) backend: serial generation with forward hooks."""

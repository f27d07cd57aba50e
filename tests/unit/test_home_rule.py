"""No model artifact may be placed under /home, whoever writes it: the library functions that
write artifacts (``slice_model``, ``write_manifest``, ``gguf.split_gguf``, ``gguf.write_gguf``)
refuse such a destination themselves with ``StorageLocationError`` (57), saying where to put it
instead, before reading the model or writing a byte. The command line and the registry check
the same rule (tests/unit/test_models.py); here the library is called directly, once with
``store.FORBIDDEN_ROOT`` moved to a temporary directory and once with a real ``/home/...`` path
that must be refused before anything is created (nothing under the real /home is touched)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from dgr import errors
from dgr.artifacts import gguf as gguf_io
from dgr.artifacts import identity, store
from dgr.artifacts.manifest import build_manifest, write_manifest
from dgr.artifacts.slice import slice_model
from dgr.artifacts.storage import COUNTERS


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """The identity cache goes to this test's directory."""
    monkeypatch.setattr(identity, "_cache_file", lambda: tmp_path / "cache" / "identity.json")


@pytest.fixture
def fake_home(tmp_path, monkeypatch) -> Path:
    """``store.FORBIDDEN_ROOT`` moved to ``tmp_path/home`` (holding an empty ``user``)."""
    home = tmp_path / "home"
    (home / "user").mkdir(parents=True)
    monkeypatch.setattr(store, "FORBIDDEN_ROOT", home)
    return home


@pytest.fixture
def tiny(tmp_path, tiny_llama) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    return Path(shutil.copy(tiny_llama, d / "tiny.gguf"))


def _refused(ei, home: Path) -> None:
    """The error is the /home rule's, and says where to put the artifact instead."""
    err = ei.value
    assert type(err) is errors.StorageLocationError and err.code == 57
    assert isinstance(err, ValueError)
    msg = str(err)
    assert f"no model artifact may live under {home}" in msg
    assert "mounted drive" in msg and "--store /mnt/models" in msg and "DGR_STORE" in msg


def _nothing_under(home: Path) -> None:
    assert sorted(home.rglob("*")) == [home / "user"]


def test_slice_model_refuses_out_under_home_before_reading(tiny, fake_home):
    before = COUNTERS["bytes_read"]
    with pytest.raises(errors.StorageLocationError) as ei:
        slice_model(tiny, (0, 2), fake_home / "user" / "slice.gguf")
    _refused(ei, fake_home)
    assert "a slice" in str(ei.value)
    assert COUNTERS["bytes_read"] == before       # the model was not read
    _nothing_under(fake_home)


def test_slice_model_refuses_a_link_into_home(tiny, tmp_path, fake_home):
    link = tmp_path / "mnt-looking"
    link.symlink_to(fake_home / "user")
    with pytest.raises(errors.StorageLocationError) as ei:
        slice_model(tiny, (0, 2), link / "slice.gguf")
    _refused(ei, fake_home)
    _nothing_under(fake_home)


def test_slice_model_outside_home_still_writes(tiny, tmp_path, fake_home):
    info = slice_model(tiny, (0, 2), tmp_path / "slice.gguf")
    assert Path(info["path"]).stat().st_size == info["size"] > 0


def test_write_manifest_refuses_out_under_home(tiny, tmp_path, fake_home):
    data = build_manifest(tiny)
    with pytest.raises(errors.StorageLocationError) as ei:
        write_manifest(data, fake_home / "user" / "tiny.manifest.json")
    _refused(ei, fake_home)
    assert "a manifest" in str(ei.value)
    _nothing_under(fake_home)
    text = write_manifest(data, None)            # no file: nothing to refuse
    assert write_manifest(data, tmp_path / "m.json") == text
    assert (tmp_path / "m.json").read_text() == text


def test_split_gguf_refuses_out_dir_under_home(tiny, tmp_path, fake_home):
    before = COUNTERS["bytes_read"]
    with pytest.raises(errors.StorageLocationError) as ei:
        gguf_io.split_gguf(tiny, 3, fake_home / "user", "tiny")
    _refused(ei, fake_home)
    assert "tiny-00001-of-00003.gguf" in str(ei.value)
    assert COUNTERS["bytes_read"] == before
    _nothing_under(fake_home)
    # a source under /home with no out_dir writes next to it: refused too
    src = fake_home / "user" / "tiny.gguf"
    with pytest.raises(errors.StorageLocationError):
        gguf_io.split_gguf(src, 2)
    _nothing_under(fake_home)
    assert len(gguf_io.split_gguf(tiny, 2, tmp_path, "ok")) == 2


def test_write_gguf_refuses_out_under_home(tiny, tmp_path, fake_home):
    h = gguf_io.read_header(tiny)
    kw = dict(version=h.version, kv_pairs=list(h.kv_raw.values()),
              tensors=[(t, tiny) for t in h.tensors[:2]], alignment=h.alignment)
    with pytest.raises(errors.StorageLocationError) as ei:
        gguf_io.write_gguf(fake_home / "user" / "copy.gguf", **kw)
    _refused(ei, fake_home)
    _nothing_under(fake_home)
    size = gguf_io.write_gguf(tmp_path / "copy.gguf", **kw)
    assert size == (tmp_path / "copy.gguf").stat().st_size


def test_a_real_home_path_is_refused_before_anything_exists(tmp_path):
    """With the rule's own ``/home``: the slicer and the splitter refuse a path under a fresh
    name in /home before they open their input (a model that does not exist, so without the
    rule they would fail on reading it, still writing nothing): nothing is created there.
    (``write_manifest`` and ``write_gguf`` would write if the rule were gone, so they are
    checked only against the moved root above.)"""
    assert store.FORBIDDEN_ROOT == Path("/home")
    top = Path("/home") / f"dgr-test-{uuid.uuid4().hex}"
    missing = tmp_path / "no-such-model.gguf"
    calls = [
        lambda: slice_model(missing, (0, 1), top / "slice.gguf"),
        lambda: gguf_io.split_gguf(missing, 2, top, "m"),
    ]
    for call in calls:
        with pytest.raises(errors.StorageLocationError) as ei:
            call()
        _refused(ei, Path("/home"))
        assert not top.exists()

"""Artifacts with the real engine: split GGUFs load, slices compute bit-identically to the full
file, a chain of slices generates the whole model's tokens; SmolLM2 round trips (slow)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.artifacts import gguf as gguf_io
from dgr.artifacts import identity
from dgr.artifacts import journal as artifact_journal
from dgr.artifacts.manifest import Manifest, build_manifest, write_manifest
from dgr.artifacts.slice import slice_model
from dgr.artifacts.verify import precheck, verify, verify_for_worker
from dgr.core.local import generate_local
from dgr.protocol.ranges import split_layers

needs_ranges = pytest.mark.skipif(
    not HAS_LAYER_RANGES,
    reason="the built llama.cpp carries no layer-range patches: slices load only in range engines")

TINY = dict(n_ctx=256, n_threads=1, n_ubatch=8, flash_attn=True)
SMOL = dict(n_ctx=1024, n_threads=1, n_ubatch=64, flash_attn=True)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(identity, "_cache_file", lambda: cache / "identity-cache.json")
    monkeypatch.setattr(artifact_journal, "_cache_dir", lambda: cache / "artifacts")


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class SliceChain:
    """Range engines over one slice file each, run in order (LocalChain takes one model path)."""

    def __init__(self, paths, ranges, **settings):
        self.stages = [dgr.Engine(p, layers=r, **settings) for p, r in zip(paths, ranges)]
        self.first, self.last = self.stages[0], self.stages[-1]

    def release(self, slot):
        for s in self.stages:
            s.release(slot)

    def is_eog(self, tok):
        return self.first.is_eog(tok)

    def forward(self, slot, positions, tokens, *, logits="last", out=None):
        tok = np.ascontiguousarray(tokens, dtype=np.int32)
        x = self.first.forward(slot, positions, tok)
        for st in self.stages[1:]:
            kw = {"logits": logits} if st is self.last else {}
            x = st.forward(slot, positions, tok if st.needs_token_ids else None, boundary=x, **kw)
        return x


def _slices(model, ranges, out_dir, manifest=None):
    return [slice_model(model, r, Path(out_dir) / f"s{a}-{b}.gguf",
                                  manifest=manifest)["path"] for r in ranges for a, b in [r]]


# ---- split GGUFs in the engine ----------------------------------------------------------------


def test_engine_loads_a_split_model(tiny_llama, tmp_path):
    parts = gguf_io.split_gguf(tiny_llama, 3, tmp_path, "tiny")
    whole = dgr.Engine(tiny_llama, **TINY)
    split = dgr.Engine(parts[0], **TINY)
    toks = (np.arange(19, dtype=np.int32) * 5) % 128
    assert split.forward(0, 0, toks).tobytes() == whole.forward(0, 0, toks).tobytes()
    text = "".join(_sha(p) + "\n" for p in parts)
    assert split.describe()["identity"] == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    assert split.describe()["identity"] == build_manifest(parts[1])["identity"]


def test_engine_names_a_missing_split(tiny_llama, tmp_path):
    parts = gguf_io.split_gguf(tiny_llama, 3, tmp_path, "tiny")
    parts[2].unlink()
    with pytest.raises(errors.ArtifactMissing, match="tiny-00003-of-00003.gguf"):
        precheck(parts[0])
    with pytest.raises(errors.DgrError):  # the engine fails cleanly too (no abort)
        dgr.Engine(parts[0], **TINY)


# ---- slices in the engine -------------------------------------------------------------------


def test_full_range_slice_loads_and_computes_like_the_model(tiny_llama, tmp_path):
    """The slice writer's GGUF is one llama.cpp loads (no range engine needed for [0, n))."""
    s = slice_model(tiny_llama, (0, 4), tmp_path / "s.gguf")["path"]
    whole, sl = dgr.Engine(tiny_llama, **TINY), dgr.Engine(s, **TINY)
    toks = (np.arange(30, dtype=np.int32) * 3) % 128
    assert sl.forward(0, 0, toks, logits="all").tobytes() == whole.forward(
        0, 0, toks, logits="all").tobytes()
    assert sl.describe()["identity"] == whole.describe()["identity"]


def test_engine_refuses_a_whole_model_load_of_a_slice(tiny_llama, tmp_path):
    s = slice_model(tiny_llama, (1, 3), tmp_path / "s.gguf")["path"]
    with pytest.raises(errors.InvalidLayerRange, match=r"\[1, 3\)"):
        dgr.Engine(s, **TINY)


@needs_ranges
@pytest.mark.parametrize("layers", [(0, 2), (2, 4), (0, 1), (3, 4)])
def test_engine_refuses_layers_a_slice_does_not_hold(tiny_llama, tmp_path, layers):
    s = slice_model(tiny_llama, (1, 3), tmp_path / "s.gguf")["path"]
    with pytest.raises(errors.InvalidLayerRange, match=r"\[1, 3\)"):
        dgr.Engine(s, layers=layers, **TINY)


@needs_ranges
@pytest.mark.parametrize("tied", [True, False])
def test_slice_logits_bit_identical_to_full_file(tmp_path, tied):
    from dgr.testing.fixtures import TinyLlama, write_tiny_llama

    model = write_tiny_llama(tmp_path / "m.gguf", TinyLlama(tied=tied))
    ranges = [(0, 1), (1, 3), (3, 4)]
    paths = _slices(model, ranges, tmp_path)
    toks = (np.arange(21, dtype=np.int32) * 7) % 128
    x_full = x_slice = None
    for p, r in zip(paths, ranges):
        full = dgr.Engine(model, layers=r, **TINY)
        sl = dgr.Engine(p, layers=r, **TINY)
        assert sl.describe()["identity"] == full.describe()["identity"]
        kw = {"logits": "all"} if r[1] == 4 else {}
        if r[0] == 0:
            x_full, x_slice = full.forward(0, 0, toks), sl.forward(0, 0, toks)
        else:
            x_full = full.forward(0, 0, boundary=x_full, **kw)
            x_slice = sl.forward(0, 0, boundary=x_slice, **kw)
        assert x_slice.tobytes() == x_full.tobytes(), r
        if r[0] > 0:
            assert sl.describe()["weight_bytes"] <= full.describe()["weight_bytes"]


@needs_ranges
def test_three_slices_generate_the_whole_models_tokens(tiny_llama, tmp_path):
    ranges = [(0, 2), (2, 3), (3, 4)]
    chain = SliceChain(_slices(tiny_llama, ranges, tmp_path), ranges, **TINY)
    whole = dgr.Engine(tiny_llama, **TINY)
    prompt = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], dtype=np.int32)
    want = generate_local(whole, prompt, max_tokens=24, stop_on_eog=False)[0]
    assert generate_local(chain, prompt, max_tokens=24, stop_on_eog=False)[0] == want


@needs_ranges
def test_deepseek4_slices_with_mtp_chain_to_the_whole_models_tokens(tmp_path):
    from dgr.testing import fixtures

    if not hasattr(fixtures, "write_tiny_deepseek4"):
        pytest.skip("no tiny DeepSeek V4 fixture in this checkout")
    model = fixtures.write_tiny_deepseek4(tmp_path / "ds4.gguf", fixtures.TinyDeepseek4(mtp=True))
    m = build_manifest(model)
    assert m["model"]["block_count"] == 7 and m["model"]["n_layer"] == 6
    ranges = [(0, 2), (2, 4), (4, 6)]
    paths = _slices(model, ranges, tmp_path)
    last = {t.name for t in gguf_io.read_header(paths[-1], decode_arrays=False).tensors}
    assert any(n.startswith("blk.6.") for n in last)          # the MTP block rides with the head
    assert "token_embd.weight" in last                        # which embeds the drafts with it
    assert not any(n.startswith("blk.6.") for p in paths[:-1]
                   for n in (t.name for t in gguf_io.read_header(p).tensors))
    mpath = tmp_path / "ds4.json"
    write_manifest(m, mpath)
    for p, r in zip(paths, ranges):
        assert verify_for_worker(mpath, p, r, journal=False) == m["identity"]
    whole = dgr.Engine(model, **TINY)
    chain = SliceChain(paths, ranges, **TINY)
    prompt = np.array([7, 3, 9, 1, 2, 8, 5], dtype=np.int32)
    assert (generate_local(chain, prompt, max_tokens=12, stop_on_eog=False)[0]
            == generate_local(whole, prompt, max_tokens=12, stop_on_eog=False)[0])


# ---- SmolLM2 round trips (slow) ---------------------------------------------------------------


@pytest.fixture(scope="module", params=["dgr", "upstream"])
def smol_split(request, smollm2, tmp_path_factory):
    """SmolLM2 split into 3 files by dgr's writer and by upstream llama-gguf-split."""
    d = tmp_path_factory.mktemp(f"smol-split-{request.param}")
    if request.param == "dgr":
        parts = gguf_io.split_gguf(smollm2, 3, d, "smol")
    else:
        tool = request.getfixturevalue("llama_tool")("llama-gguf-split")
        n = len(gguf_io.read_header(smollm2, decode_arrays=False).tensors)
        subprocess.run([str(tool), "--split", "--split-max-tensors", str(-(-n // 3)),
                        str(smollm2), str(d / "smol")], check=True, capture_output=True)
        parts = sorted(d.glob("smol-*-of-*.gguf"))
    assert [p.name for p in parts] == [f"smol-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return parts


@pytest.mark.slow
def test_smollm2_manifest_verify_resume(smollm2, tmp_path):
    cs = 4 << 20
    mpath = tmp_path / "smol.json"
    data = build_manifest(smollm2, chunk_size=cs)
    write_manifest(data, mpath)
    assert data["identity"] == "sha256:" + _sha(smollm2)
    assert data["identity"] == dgr.Engine(smollm2, **SMOL).describe()["identity"]
    assert data["model"]["n_layer"] == 30 and data["model"]["tied_embeddings"]
    size = smollm2.stat().st_size
    r = verify(mpath, dir=smollm2.parent, journal=False)
    assert r.ok and r.bytes_read == size
    # a range reads the header and its own chunks only
    r = verify(mpath, dir=smollm2.parent, layers=(10, 20), journal=False)
    assert r.ok and r.bytes_read < 0.45 * size
    # killed after 12 of 24 chunks, the rerun hashes the other 12
    j = tmp_path / "j.json"
    env = {**os.environ, "DGR_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "dgr.testing.kill_after", "12", "verify",
                           str(mpath), "--dir", str(smollm2.parent), "--journal", str(j),
                           "--threads", "1", "--quiet"], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    r = verify(mpath, dir=smollm2.parent, journal=j, threads=1)
    assert r.ok and r.bytes_journal == 12 * cs and r.bytes_read == size - 12 * cs


@pytest.mark.slow
def test_smollm2_full_range_slice_is_the_model(smollm2, tmp_path):
    info = slice_model(smollm2, (0, 30), tmp_path / "s.gguf")
    assert info["tensor_bytes"] == sum(
        t.nbytes for t in gguf_io.read_header(smollm2, decode_arrays=False).tensors)
    whole, sl = dgr.Engine(smollm2, **SMOL), dgr.Engine(info["path"], **SMOL)
    prompt = whole.tokenize("The capital of France is")
    assert sl.forward(0, 0, prompt).tobytes() == whole.forward(0, 0, prompt).tobytes()


@pytest.mark.slow
def test_smollm2_flipped_byte_truncation(smollm2, tmp_path):
    model = Path(shutil.copy(smollm2, tmp_path / "smol.gguf"))
    mpath = tmp_path / "smol.json"
    write_manifest(build_manifest(model), mpath)
    t = gguf_io.read_header(model, decode_arrays=False).by_name["blk.17.ffn_up.weight"]
    with open(model, "r+b") as f:
        f.seek(t.offset + 1000)
        b = f.read(1)
        f.seek(t.offset + 1000)
        f.write(bytes([b[0] ^ 0x80]))
    with pytest.raises(errors.ArtifactMismatch, match="tensor blk.17.ffn_up.weight") as ei:
        verify_for_worker(mpath, model, (15, 30), journal=False)
    assert [p.what for p in ei.value.problems] == ["tensor blk.17.ffn_up.weight"]
    verify_for_worker(mpath, model, (0, 15), journal=False)   # that range does not hold it
    with open(model, "r+b") as f:
        f.truncate(t.offset)
    with pytest.raises(errors.ArtifactTruncated, match="from blk.17.ffn_up.weight"):
        verify_for_worker(mpath, model, (0, 15), journal=False)


@pytest.mark.slow
def test_smollm2_split_round_trip(smollm2, smol_split, tmp_path):
    mpath = smol_split[0].parent / "smol-split.json"
    data = build_manifest(smol_split[2], chunk_size=8 << 20)
    write_manifest(data, mpath)
    text = "".join(_sha(p) + "\n" for p in smol_split)
    assert data["identity"] == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    single = build_manifest(smollm2, chunk_size=8 << 20)
    assert ({t["name"]: t["hash"] for t in data["tensors"]}
            == {t["name"]: t["hash"] for t in single["tensors"]})
    assert data["model"] == single["model"]   # same metadata once the split.* keys are aside
    assert verify_for_worker(mpath, smol_split[0], (0, 30), journal=False) == data["identity"]
    eng = dgr.Engine(smol_split[0], **SMOL)
    whole = dgr.Engine(smollm2, **SMOL)
    assert eng.describe()["identity"] == data["identity"]
    prompt = whole.tokenize("The capital of France is")
    assert eng.forward(0, 0, prompt).tobytes() == whole.forward(0, 0, prompt).tobytes()
    moved = smol_split[1].rename(tmp_path / "away.gguf")
    try:
        with pytest.raises(errors.ArtifactMissing, match="smol-00002-of-00003.gguf: missing"):
            verify_for_worker(mpath, smol_split[0], (0, 30), journal=False)
    finally:
        moved.rename(smol_split[1])


def _owned_bytes(m: Manifest, a: int, b: int) -> int:
    return sum(m.tensors_by_name[n]["size"] for n in m.needed((a, b)))


@pytest.mark.slow
def test_smollm2_slices(smollm2, tmp_path):
    _check_slices(smollm2, tmp_path)


@pytest.mark.slow
def test_smollm2_slices_of_a_split_model(smol_split, tmp_path):
    _check_slices(smol_split[0], tmp_path)


def _check_slices(model, tmp_path):
    mpath = tmp_path / "m.json"
    write_manifest(build_manifest(model), mpath)
    m = Manifest.load(mpath)
    ranges = split_layers(30, 3)
    total = sum(f["size"] for f in m.files)
    for r in ranges:
        info = slice_model(model, r, tmp_path / f"s{r[0]}.gguf", manifest=mpath)
        assert info["tensor_bytes"] == _owned_bytes(m, *r)
        # within a few percent of what the range needs (its tensors plus the metadata)
        assert info["needed_bytes"] <= info["size"] <= 1.02 * info["needed_bytes"], info
        assert info["size"] < 0.6 * total
        assert verify_for_worker(mpath, info["path"], r, journal=False) == m.identity
        assert identity.model_identity(info["path"]) == m.identity


@needs_ranges
@pytest.mark.slow
def test_smollm2_three_slices_generate_the_whole_models_tokens(smollm2, tmp_path):
    ranges = split_layers(30, 3)
    paths = _slices(smollm2, ranges, tmp_path)
    whole = dgr.Engine(smollm2, **SMOL)
    prompt = whole.tokenize("<|im_start|>user\nWhy is the sky blue?<|im_end|>\n"
                            "<|im_start|>assistant\n", True, True)
    want = generate_local(whole, prompt, max_tokens=32)[0]
    chain = SliceChain(paths, ranges, **SMOL)
    assert generate_local(chain, prompt, max_tokens=32)[0] == want
    for p, r, st in zip(paths, ranges, chain.stages):
        full = dgr.Engine(smollm2, layers=r, **SMOL).describe()
        assert st.describe()["weight_bytes"] == full["weight_bytes"]
        assert st.describe()["identity"] == full["identity"]

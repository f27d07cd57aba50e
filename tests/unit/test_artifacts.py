"""dgr.artifacts and dgr.artifacts.gguf on tiny generated GGUFs (no engine): manifests, verification
and its journal, precise failure reports, split models, slices, identity."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dgr import errors
from dgr.artifacts import cli, identity
from dgr.artifacts import gguf as gguf_io
from dgr.artifacts import journal as artifact_journal
from dgr.artifacts.journal import JOURNAL_SCHEMA
from dgr.artifacts.manifest import (
    SCHEMA,
    Manifest,
    build_manifest,
    needed_tensor_names,
    tensor_role,
    write_manifest,
)
from dgr.artifacts.slice import slice_model
from dgr.artifacts.storage import COUNTERS
from dgr.artifacts.verify import precheck, verify, verify_for_worker
from dgr.testing.fixtures import TinyLlama, write_tiny_llama
from dgr.testing.waits import read_until

CS = 16 << 10  # 16 KiB chunks: the 616 KiB tiny model has 39 of them


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Journals and the identity cache go to a per-test directory (the vendor tree stays)."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(identity, "_cache_file", lambda: cache / "identity-cache.json")
    monkeypatch.setattr(artifact_journal, "_cache_dir", lambda: cache / "artifacts")
    return cache


def _env(**kw) -> dict:
    """Environment of a child verifier: its caches in this test's directory too."""
    return {**os.environ, **kw}


@pytest.fixture
def tiny(tmp_path, tiny_llama) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    return Path(shutil.copy(tiny_llama, d / "tiny.gguf"))


@pytest.fixture
def tiny_manifest(tiny) -> Path:
    out = tiny.parent / "tiny.manifest.json"
    write_manifest(build_manifest(tiny, chunk_size=CS), out)
    return out


@pytest.fixture
def split3(tiny) -> list[Path]:
    return gguf_io.split_gguf(tiny, 3, tiny.parent, "tiny")


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _flip(path, offset) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


# ---- gguf_io -------------------------------------------------------------------------------


def test_type_table_matches_pinned_gguf_py():
    gguf = gguf_io.gguf_module()
    theirs = {int(t): (t.name, *gguf.GGML_QUANT_SIZES[t]) for t in gguf.GGMLQuantizationType}
    assert gguf_io.GGML_TYPES == theirs


def test_read_header_agrees_with_gguf_py(tiny):
    gguf = gguf_io.gguf_module()
    r = gguf.GGUFReader(str(tiny))
    h = gguf_io.read_header(tiny)
    assert [t.name for t in h.tensors] == [t.name for t in r.tensors]
    for a, b in zip(h.tensors, r.tensors):
        assert (a.offset, a.nbytes, a.shape) == (int(b.data_offset), int(b.n_bytes),
                                                tuple(int(x) for x in b.shape))
    assert h.kv["general.architecture"] == "llama" and h.kv["llama.block_count"] == 4
    assert h.kv["tokenizer.ggml.tokens"][:2] == ["tok_0", "tok_1"]
    assert set(h.kv) == set(r.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    fast = gguf_io.read_header(tiny, decode_arrays=False)
    assert isinstance(fast.kv["tokenizer.ggml.tokens"], gguf_io.SkippedArray)
    assert fast.kv_raw == h.kv_raw and fast.tensors == h.tensors


def test_read_header_rejects_bad_files(tmp_path, tiny):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(errors.InvalidModel, match="bad magic"):
        gguf_io.read_header(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:3000])
    with pytest.raises(errors.InvalidModel, match="truncated"):
        gguf_io.read_header(cut)
    with pytest.raises(errors.ModelNotFound):
        gguf_io.read_header(tmp_path / "nope.gguf")


def test_split_gguf_layout_and_discovery(tiny, split3):
    assert [p.name for p in split3] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    heads = [gguf_io.read_header(p) for p in split3]
    assert [h.split_no for h in heads] == [0, 1, 2] and {h.split_count for h in heads} == {3}
    assert "general.architecture" in heads[0].kv and "general.architecture" not in heads[1].kv
    src = gguf_io.read_header(tiny)
    assert [t.name for h in heads for t in h.tensors] == [t.name for t in src.tensors]
    data = tiny.read_bytes()
    for h, p in zip(heads, split3):
        raw = p.read_bytes()
        for t in h.tensors:
            s = src.by_name[t.name]
            assert raw[t.offset:t.offset + t.nbytes] == data[s.offset:s.offset + s.nbytes]
    for p in split3:  # any split finds all of them
        assert gguf_io.model_files(p) == split3
    gguf = gguf_io.gguf_module()  # an independent reader accepts every split
    assert sum(len(gguf.GGUFReader(str(p)).tensors) for p in split3) == len(src.tensors)


# ---- roles and needed tensors --------------------------------------------------------------


def test_tensor_roles():
    assert tensor_role("blk.12.attn_q.weight") == (12, "layer")
    assert tensor_role("token_embd.weight") == (None, "input")
    assert tensor_role("token_embd_norm.weight") == (None, "input")
    assert tensor_role("output.weight") == (None, "output")
    assert tensor_role("output_norm.bias") == (None, "output")
    assert tensor_role("rope_freqs.weight") == (None, "shared")


def test_needed_tensors_by_stage():
    names = ["token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight",
             *[f"blk.{i}.w" for i in range(5)]]   # blk.4 is an MTP layer past n_layer = 4
    ts = [(n, *tensor_role(n)) for n in names]
    need = lambda a, b, tied=False: needed_tensor_names(ts, a, b, 4, tied)  # noqa: E731
    assert need(0, 1) == {"token_embd.weight", "rope_freqs.weight", "blk.0.w"}
    assert need(1, 3) == {"rope_freqs.weight", "blk.1.w", "blk.2.w"}
    # the last stage: the head, the MTP layer, and token_embd, which the NextN block embeds with
    assert need(3, 4) == {"output_norm.weight", "output.weight", "rope_freqs.weight",
                          "blk.3.w", "blk.4.w", "token_embd.weight"}
    assert "token_embd.weight" in need(3, 4, tied=True)
    assert need(0, 4) == set(names)
    no_mtp = [t for t in ts if t[0] != "blk.4.w"]
    assert needed_tensor_names(no_mtp, 3, 4, 4, False) == {
        "output_norm.weight", "output.weight", "rope_freqs.weight", "blk.3.w"}
    assert "token_embd.weight" in needed_tensor_names(no_mtp, 3, 4, 4, True)


# ---- manifests ------------------------------------------------------------------------------


def test_manifest_fields(tiny):
    m = build_manifest(tiny, chunk_size=CS)
    raw = tiny.read_bytes()
    assert m["schema"] == SCHEMA
    assert m["identity"] == "sha256:" + _sha(tiny) and m["identity_rule"] == "file-sha256"
    (f,) = m["files"]
    assert f["name"] == "tiny.gguf" and f["size"] == len(raw) and f["sha256"] == _sha(tiny)
    assert len(f["chunks"]) == -(-len(raw) // CS)
    assert f["chunks"][1] == hashlib.sha256(raw[CS:2 * CS]).hexdigest()
    assert f["chunks"][-1] == hashlib.sha256(raw[(len(f["chunks"]) - 1) * CS:]).hexdigest()
    assert f["header_sha256"] == hashlib.sha256(raw[:f["data_offset"]]).hexdigest()
    assert m["model"] | {"metadata_sha256": None} == {
        "arch": "llama", "block_count": 4, "n_layer": 4, "tied_embeddings": True,
        "n_tensors": 38, "gguf_version": 3, "metadata_sha256": None}
    by = {t["name"]: t for t in m["tensors"]}
    q = by["blk.2.attn_q.weight"]
    assert (q["layer"], q["role"], q["type"], q["shape"], q["file"]) == (
        2, "layer", "F32", [64, 64], "tiny.gguf")
    assert q["hash"] == hashlib.sha256(raw[q["offset"]:q["offset"] + q["size"]]).hexdigest()
    assert by["token_embd.weight"]["role"] == "input" and by["token_embd.weight"]["layer"] is None
    # deterministic: same bytes, same manifest text
    assert write_manifest(m, None) == write_manifest(build_manifest(tiny, chunk_size=CS), None)


def test_manifest_xxh3_tensor_hashes(tiny):
    import xxhash

    m = build_manifest(tiny, chunk_size=CS, tensor_hash="xxh3_128")
    raw = tiny.read_bytes()
    t = m["tensors"][5]
    assert m["hashes"]["tensor"] == "xxh3_128"
    assert t["hash"] == xxhash.xxh3_128(raw[t["offset"]:t["offset"] + t["size"]]).hexdigest()


def test_split_manifest_is_one_model(tiny, split3):
    m = build_manifest(split3[1], chunk_size=CS)      # any split finds the others
    assert m == build_manifest(split3, chunk_size=CS)  # as does giving them all
    assert [f["name"] for f in m["files"]] == [p.name for p in split3]
    assert [f["split"] for f in m["files"]] == [0, 1, 2]
    text = "".join(_sha(p) + "\n" for p in split3)    # sha256sum ... | cut -c1-64 | sha256sum
    assert m["identity"] == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    assert m["identity_rule"] == "split-file-sha256s"
    single = build_manifest(tiny, chunk_size=CS)
    assert m["model"] == single["model"]              # same metadata, same tensors
    assert ({t["name"]: t["hash"] for t in m["tensors"]}
            == {t["name"]: t["hash"] for t in single["tensors"]})


def test_manifest_names_a_missing_split(split3):
    split3[2].unlink()
    with pytest.raises(errors.ArtifactMissing, match="tiny-00003-of-00003.gguf"):
        build_manifest(split3[0], chunk_size=CS)


def test_manifest_rejects_files_of_different_models(tiny, split3, tmp_path):
    other = write_tiny_llama(tmp_path / "other-00002-of-00003.gguf")
    with pytest.raises(errors.InvalidModel):
        build_manifest([split3[0], other], chunk_size=CS)


def test_invalid_manifests(tmp_path, tiny_manifest):
    p = tmp_path / "m.json"
    p.write_text("{not json")
    with pytest.raises(errors.InvalidManifest, match="not JSON"):
        Manifest.load(p)
    p.write_text(json.dumps({"schema": "something/9"}))
    with pytest.raises(errors.InvalidManifest, match="schema"):
        Manifest.load(p)
    data = json.loads(tiny_manifest.read_text())
    data["files"][0]["chunks"].pop()
    p.write_text(json.dumps(data))
    with pytest.raises(errors.InvalidManifest, match="chunk hashes"):
        Manifest.load(p)
    with pytest.raises(errors.InvalidManifest, match="cannot read"):
        Manifest.load(tmp_path / "absent.json")


# ---- verification ---------------------------------------------------------------------------


def test_verify_ok_then_journal_makes_it_free(tiny, tiny_manifest, tmp_path):
    j = tmp_path / "j.json"
    r = verify(tiny_manifest, journal=j)
    assert r.ok and r.bytes_read == r.bytes_planned == tiny.stat().st_size
    assert r.bytes_journal == 0
    r2 = verify(tiny_manifest, journal=j)
    assert r2.ok and r2.bytes_read == 0 and r2.bytes_journal == r2.bytes_planned
    r3 = verify(tiny_manifest, journal=j, fresh=True)
    assert r3.ok and r3.bytes_read == r3.bytes_planned


def test_a_verification_that_raises_closes_its_files(tiny, tiny_manifest, tmp_path,
                                                      monkeypatch):
    """A read that fails mid-way raises, and leaves no file descriptor open."""
    from dgr.artifacts import verify as verify_mod

    def fail(self, fd, start, end, alg="sha256"):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(verify_mod._Reader, "hash_range", fail)
    before = len(os.listdir("/proc/self/fd"))
    for threads in (1, 2):
        with pytest.raises(OSError):
            verify(tiny_manifest, journal=tmp_path / f"j{threads}.json", threads=threads)
    assert len(os.listdir("/proc/self/fd")) == before


def test_verify_threads_and_default_journal(tiny, tiny_manifest):
    r = verify(tiny_manifest, threads=4)
    assert r.ok and r.bytes_read == tiny.stat().st_size
    assert Path(r.journal).parent == artifact_journal._cache_dir()
    assert verify(tiny_manifest, threads=4).bytes_read == 0


def test_range_verify_reads_headers_and_the_range_chunks_only(tiny, tiny_manifest):
    m = Manifest.load(tiny_manifest)
    r = verify(m, layers=(1, 2), journal=False)
    assert r.ok
    f = m.files[0]
    want = set(range((f["data_offset"] - 1) // CS + 1))
    for name in m.needed((1, 2)):
        t = m.tensors_by_name[name]
        want |= set(range(t["offset"] // CS, (t["offset"] + t["size"] - 1) // CS + 1))
    expect = sum(min(CS, f["size"] - k * CS) for k in want)
    assert r.bytes_read == r.bytes_planned == expect < f["size"] // 2
    assert m.needed((1, 2)) == {n for n in m.tensors_by_name if n.startswith("blk.1.")}
    # the last stage of a tied model also checks token_embd (its head)
    assert {"token_embd.weight", "output_norm.weight"} <= m.needed((3, 4))
    with pytest.raises(errors.InvalidLayerRange):
        verify(m, layers=(2, 9), journal=False)


def test_flipped_byte_names_the_tensor(tiny, tiny_manifest):
    m = Manifest.load(tiny_manifest)
    t = m.tensors_by_name["blk.2.ffn_up.weight"]
    _flip(tiny, t["offset"] + t["size"] // 2)
    r = verify(tiny_manifest, journal=False)
    assert not r.ok
    assert [(p.kind, p.file, p.what) for p in r.problems] == [
        ("different", "tiny.gguf", "tensor blk.2.ffn_up.weight")]
    assert "layer 2" in str(r.problems[0])
    # a range that does not hold the tensor does not see it; one that does, does
    assert verify(tiny_manifest, layers=(0, 1), journal=False).ok
    assert not verify(tiny_manifest, layers=(2, 3), journal=False).ok


def test_range_check_ignores_differences_outside_the_range_in_a_shared_chunk(tiny, tmp_path):
    mpath = tiny.parent / "one-chunk.json"
    write_manifest(build_manifest(tiny, chunk_size=1 << 20), mpath)   # the file is one chunk
    t = Manifest.load(mpath).tensors_by_name["blk.3.attn_q.weight"]
    _flip(tiny, t["offset"])
    assert verify(mpath, layers=(0, 2), journal=False).ok     # its tensors match their hashes
    r = verify(mpath, layers=(2, 4), journal=False)
    assert [p.what for p in r.problems] == ["tensor blk.3.attn_q.weight"]
    assert [p.what for p in verify(mpath, journal=False).problems] == [
        "tensor blk.3.attn_q.weight"]


def test_flipped_header_byte_is_reported_as_header(tiny, tiny_manifest):
    _flip(tiny, 200)  # inside the metadata
    r = verify(tiny_manifest, layers=(1, 2), journal=False)  # headers are checked for any range
    assert [(p.kind, p.what) for p in r.problems] == [("different", "header")]


def test_flipped_padding_byte_is_reported_as_padding(tmp_path):
    import numpy as np

    gguf = gguf_io.gguf_module()
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("blk.0.a.weight", np.ones(5, dtype=np.float32))   # 20 bytes + 12 of padding
    w.add_tensor("blk.0.b.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mpath = tmp_path / "odd.json"
    write_manifest(build_manifest(path, chunk_size=CS), mpath)
    a = gguf_io.read_header(path).by_name["blk.0.a.weight"]
    _flip(path, a.offset + a.nbytes + 3)
    r = verify(mpath, journal=False)
    assert [(p.kind, p.what) for p in r.problems] == [("different", "chunk 0")]
    assert "outside any tensor (padding)" in r.problems[0].detail


def test_truncated_file_is_reported_with_the_first_tensor_cut(tiny, tiny_manifest):
    m = Manifest.load(tiny_manifest)
    t = m.tensors_by_name["blk.3.ffn_gate.weight"]
    with open(tiny, "r+b") as f:
        f.truncate(t["offset"] + 10)
    r = verify(tiny_manifest, journal=False)
    (p,) = r.problems
    assert (p.kind, p.file) == ("truncated", "tiny.gguf")
    assert f"{t['offset'] + 10} of {m.files[0]['size']} bytes" in p.detail
    assert "from blk.3.ffn_gate.weight" in p.detail
    with pytest.raises(errors.ArtifactTruncated, match="blk.3.ffn_gate.weight") as ei:
        verify_for_worker(tiny_manifest, tiny, (0, 4), journal=False)
    assert ei.value.problems == r.problems


def test_a_file_cut_short_is_refused_by_every_writer(tiny, tmp_path):
    """A prefix of a GGUF whose header is whole (tensors ending past its last byte): the
    manifest, the slicer and the splitter refuse it with ``ArtifactTruncated`` naming the first
    tensor cut, and write nothing."""
    h = gguf_io.read_header(tiny)
    assert gguf_io.check_data_in_file(h) is h
    t = h.by_name["blk.2.attn_q.weight"]
    with open(tiny, "r+b") as f:
        f.truncate(t.offset + 5)
    cut = gguf_io.read_header(tiny)
    assert cut.file_size == t.offset + 5 < cut.data_end == h.data_end
    out = tmp_path / "out"
    out.mkdir()
    for call in (lambda: gguf_io.check_data_in_file(cut),
                 lambda: build_manifest(tiny),
                 lambda: slice_model(tiny, (0, 2), out / "s.gguf"),
                 lambda: gguf_io.split_gguf(tiny, 2, out, "cut")):
        with pytest.raises(errors.ArtifactTruncated) as ei:
            call()
        msg = str(ei.value)
        assert f"tiny.gguf is truncated: {t.offset + 5} bytes, its tensors end at " \
               f"{h.data_end}" in msg
        assert "tensor data past the end of the file" in msg and "from blk.2.attn_q.weight" in msg
    assert list(out.iterdir()) == []


def test_oversized_file(tiny, tiny_manifest):
    with open(tiny, "ab") as f:
        f.write(b"x")
    r = verify(tiny_manifest, journal=False)
    assert [p.kind for p in r.problems] == ["oversized"]


def test_split_model_verify_and_a_missing_split(tiny, split3, tmp_path):
    mpath = tmp_path / "split.manifest.json"
    write_manifest(build_manifest(split3[0], chunk_size=CS), mpath)
    j = tmp_path / "j.json"
    assert verify(mpath, dir=tiny.parent, journal=j).ok
    split3[1].rename(tmp_path / "elsewhere.gguf")
    r = verify(mpath, dir=tiny.parent, journal=j)
    assert [(p.kind, p.file) for p in r.problems] == [("missing", "tiny-00002-of-00003.gguf")]
    with pytest.raises(errors.ArtifactMissing, match="tiny-00002-of-00003.gguf: missing"):
        verify_for_worker(mpath, split3[0], (0, 4), journal=j)
    # flip a tensor byte in the third split: named by file and tensor
    (tmp_path / "elsewhere.gguf").rename(split3[1])
    h = gguf_io.read_header(split3[2])
    t = h.tensors[1]
    _flip(split3[2], t.offset)
    r = verify(mpath, dir=tiny.parent, journal=j)
    assert [(p.kind, p.file, p.what) for p in r.problems] == [
        ("different", "tiny-00003-of-00003.gguf", f"tensor {t.name}")]


def test_modified_file_loses_its_journal_entry(tiny, tiny_manifest, tmp_path):
    j = tmp_path / "j.json"
    assert verify(tiny_manifest, journal=j).ok
    m = Manifest.load(tiny_manifest)
    t = m.tensors_by_name["blk.0.attn_k.weight"]
    _flip(tiny, t["offset"])
    r = verify(tiny_manifest, journal=j)   # stat changed: everything is hashed again
    assert r.bytes_journal == 0 and [p.what for p in r.problems] == ["tensor blk.0.attn_k.weight"]


def test_corrupt_journal_is_ignored(tiny, tiny_manifest, tmp_path):
    j = tmp_path / "j.json"
    j.write_text("{garbage")
    r = verify(tiny_manifest, journal=j)
    assert r.ok and r.bytes_read == r.bytes_planned
    assert json.loads(j.read_text())["schema"] == JOURNAL_SCHEMA


def _verify_cmd(manifest, journal, *extra, kill_after: int | None = None):
    """A child verifier; ``kill_after``: one that SIGKILLs itself right after its journal
    records that many chunks (or tensors), through ``dgr.testing.kill_after``."""
    head = ([sys.executable, "-m", "dgr.artifacts"] if kill_after is None else
            [sys.executable, "-m", "dgr.testing.kill_after", str(kill_after)])
    return head + ["verify", str(manifest), "--journal", str(journal), "--threads", "1",
                   "--quiet", *extra]


def test_killed_verification_resumes_with_what_is_left(tiny, tiny_manifest, tmp_path):
    j = tmp_path / "j.json"
    env = _env(DGR_CACHE=str(tmp_path / "cache"))
    # the child SIGKILLs itself right after chunk 7 is journaled
    proc = subprocess.run(_verify_cmd(tiny_manifest, j, kill_after=7), env=env,
                          capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    entry = next(iter(json.loads(j.read_text())["files"].values()))
    assert entry["chunks"] == "0-6"
    size = tiny.stat().st_size
    before = COUNTERS["bytes_read"]
    r = verify(tiny_manifest, journal=j, threads=1)
    assert r.ok
    assert r.bytes_journal == 7 * CS
    assert r.bytes_read == size - 7 * CS == COUNTERS["bytes_read"] - before
    # the fault injector wants a count of units first
    from dgr.testing.kill_after import main as kill_after

    assert kill_after([]) == 2 and kill_after(["seven", "verify"]) == 2
    assert kill_after(["0", "verify"]) == 2


# A verifier (``python -m dgr.artifacts verify ...``) that stops in the hashing of the chunk
# at byte offset argv[1]: every chunk before it is verified and journaled, that one is in
# flight. It says GATED and waits there until it is killed (stdin closed: exit 3).
_GATED_VERIFY = r"""
import os, sys
from dgr.artifacts import cli, verify

at = int(sys.argv[1])
hash_range = verify._Reader.hash_range

def gated(self, fd, start, end, alg="sha256"):
    if start == at:
        print("GATED", flush=True)
        sys.stdin.read()
        os._exit(3)
    return hash_range(self, fd, start, end, alg)

verify._Reader.hash_range = gated
sys.exit(cli.main(sys.argv[2:]))
"""


def _line_within(stream, timeout: float) -> bytes:
    """One line from a pipe within ``timeout`` seconds (a failure, not a hang, otherwise)."""
    return read_until(stream, lambda got: b"\n" in got, timeout, "a line")


def test_verification_killed_from_outside_resumes(tiny, tiny_manifest, tmp_path):
    """SIGKILLed from outside while it hashes chunk 5: the journal keeps chunks 0-4 (each
    journaled as it was verified), never the chunk in flight, and the next run reads only
    the rest. The child waits at chunk 5 for the kill, so where the kill lands does not
    depend on how fast either process runs."""
    j = tmp_path / "j.json"
    env = _env(DGR_CACHE=str(tmp_path / "cache"))
    args = _verify_cmd(tiny_manifest, j)[3:]  # verify MANIFEST --journal J ...
    proc = subprocess.Popen([sys.executable, "-c", _GATED_VERIFY, str(5 * CS), *args],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert _line_within(proc.stdout, 120) == b"GATED\n"
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    entry = next(iter(json.loads(j.read_text())["files"].values()))
    assert entry["chunks"] == "0-4"
    n = len(json.loads(tiny_manifest.read_text())["files"][0]["chunks"])
    assert n > 5
    r = verify(tiny_manifest, journal=j, threads=1)
    assert r.ok and r.bytes_journal == 5 * CS
    assert r.bytes_read == tiny.stat().st_size - 5 * CS


def test_cli_verify_reports_and_exit_codes(tiny, tiny_manifest, tmp_path, capsys):
    assert cli.main(["verify", str(tiny_manifest), "--no-journal", "--json",
                           "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["bytes_read"] == tiny.stat().st_size
    t = Manifest.load(tiny_manifest).tensors_by_name["blk.1.attn_v.weight"]
    _flip(tiny, t["offset"] + 3)
    assert cli.main(["verify", str(tiny_manifest), "--no-journal", "--range", "0:2"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "tiny.gguf: tensor blk.1.attn_v.weight different" in err
    assert cli.main(["verify", str(tmp_path / "none.json")]) == 2


def test_cli_manifest_and_registration(tiny, tmp_path, capsys):
    out = tmp_path / "m.json"
    assert cli.main(["manifest", str(tiny), "--out", str(out), "--chunk-size", "16KiB",
                           "--quiet"]) == 0
    assert Manifest.load(out).chunk_size == CS
    assert cli.main(["manifest", str(tiny), "--tensor-hash", "xxh3_128", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["hashes"]["tensor"] == "xxh3_128"
    # the two lines dgr/cli/ uses to register the command
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dgr")
    sub = ap.add_subparsers(dest="cmd", required=True)
    cli.add_subparser(sub)
    args = ap.parse_args(["artifacts", "verify", str(out), "--dir", str(tiny.parent),
                          "--no-journal", "--quiet"])
    assert args.func(args) == 0



_PROGRESS_LINE = re.compile(r"^\[(\w+)\] +([\d.]+)/([\d.]+) MiB +([\d.]+)% +[\d.?]+ MiB/s, (\S+)$")


def test_progress_on_a_pipe_is_a_line_per_tenth(tiny, tiny_manifest, capsys):
    """Not a terminal: the byte progress is one stderr line each tenth (MiB done/total,
    percentage, rate, file); stdout keeps only the output; --quiet prints none."""
    mib = f"{tiny.stat().st_size / 2**20:.1f}"
    assert cli.main(["manifest", str(tiny), "--chunk-size", "16KiB"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["files"][0]["size"] == tiny.stat().st_size
    assert cli.main(["verify", str(tiny_manifest), "--no-journal", "--threads", "1"]) == 0
    err2 = capsys.readouterr().err
    for what, text in (("manifest", err), ("verify", err2)):
        lines = [m.groups() for m in map(_PROGRESS_LINE.match, text.splitlines()) if m]
        assert lines and {x[0] for x in lines} == {what} and {x[4] for x in lines} == {"tiny.gguf"}
        assert {x[2] for x in lines} == {mib}
        tenths = [int(float(x[3]) // 10) for x in lines]
        assert tenths == sorted(set(tenths)) and tenths[-1] == 10, text  # a line per new tenth
        assert lines[-1][1] == mib
    assert cli.main(["verify", str(tiny_manifest), "--no-journal", "--quiet"]) == 0
    err3 = capsys.readouterr().err
    assert err3.startswith("ok: ") and "MiB/s" not in err3


def test_progress_on_a_terminal_is_redrawn_in_place(tiny, tiny_manifest, monkeypatch):
    """On a terminal the bar is redrawn on one line (carriage returns, one newline at the end):
    first at 0, last with every byte done."""
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    verify(tiny_manifest, journal=False, threads=1, progress=True)
    text = term.getvalue()
    mib = f"{tiny.stat().st_size / 2**20:.1f}"
    assert text.startswith("\r[verify] |") and text.endswith("\n") and text.count("\n") == 1
    draws = [d.rstrip() for d in text[1:-1].split("\r")]
    assert f" 0.0/{mib} MiB   0.0% " in draws[0]
    assert f" {mib}/{mib} MiB 100.0% " in draws[-1]
    assert draws[-1].endswith(", tiny.gguf") and " MiB/s" in draws[-1]

# ---- worker contract and identity -----------------------------------------------------------


def test_verify_for_worker_contract(tiny, tiny_manifest, monkeypatch):
    ident = verify_for_worker(tiny_manifest, tiny, (1, 3))
    assert ident == "sha256:" + _sha(tiny)
    # the worker then reports the identity without hashing the model
    monkeypatch.setattr(identity, "sha256_file", lambda p: pytest.fail("rehashed"))
    assert identity.model_identity(tiny) == ident
    with pytest.raises(errors.InvalidLayerRange):
        verify_for_worker(tiny_manifest, tiny, (3, 7))
    other = write_tiny_llama(tiny.parent / "other.gguf", TinyLlama(seed=5))
    with pytest.raises(errors.ArtifactMismatch, match="not a file of the manifest"):
        verify_for_worker(tiny_manifest, other, (0, 4))


def test_model_identity_definitions(tiny, split3, tmp_path):
    assert identity.model_identity(tiny) == "sha256:" + _sha(tiny)
    text = "".join(_sha(p) + "\n" for p in split3)
    want = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    for p in split3:
        assert identity.model_identity(p) == want
    s = slice_model(tiny, (1, 3), tmp_path / "s.gguf")
    assert identity.model_identity(s["path"]) == "sha256:" + _sha(tiny)
    split3[2].unlink()
    with pytest.raises(errors.ArtifactMissing, match="tiny-00003-of-00003.gguf"):
        identity.model_identity(split3[0])


def test_model_identity_from_a_manifest(tiny, tiny_manifest, monkeypatch):
    assert verify_for_worker(tiny_manifest, tiny, None) == "sha256:" + _sha(tiny)
    monkeypatch.setattr(identity, "sha256_file", lambda p: pytest.fail("rehashed"))
    assert identity.model_identity(tiny) == "sha256:" + _sha(tiny)  # remembered as verified
    _flip(tiny, 100)
    with pytest.raises(errors.ArtifactMismatch, match="header"):
        verify_for_worker(tiny_manifest, tiny, None)


def test_precheck(tiny, split3, tmp_path):
    s = Path(slice_model(tiny, (1, 3), tmp_path / "s.gguf")["path"])
    assert precheck(s, (1, 3))["slice"] == (1, 3)
    assert precheck(s, (2, 3))["layers"] == (2, 3)
    for bad in [(0, 3), (1, 4), None]:
        with pytest.raises(errors.InvalidLayerRange, match=r"holding layers \[1, 3\)"):
            precheck(s, bad)
    info = precheck(split3[2], (0, 4))
    assert info["load_path"] == split3[0] and info["files"] == split3 and info["slice"] is None
    split3[1].unlink()
    with pytest.raises(errors.ArtifactMissing, match="tiny-00002-of-00003.gguf"):
        precheck(split3[0])


# ---- slices -------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [(0, 1), (1, 3), (3, 4), (0, 4)])
@pytest.mark.parametrize("tied", [True, False])
def test_slice_contents(tmp_path, layers, tied):
    src = write_tiny_llama(tmp_path / "m.gguf", TinyLlama(tied=tied))
    out = tmp_path / "s.gguf"
    info = slice_model(src, layers, out)
    h, s = gguf_io.read_header(src), gguf_io.read_header(out)
    a, b = layers
    names = [t.name for t in s.tensors]
    want = [t.name for t in h.tensors
            if (t.name.startswith("blk.") and a <= int(t.name.split(".")[1]) < b)
            or (t.name == "token_embd.weight" and (a == 0 or (b == 4 and tied)))
            or (t.name.startswith("output") and b == 4)]
    assert names == want                                  # source order, names unchanged
    src_raw, out_raw = src.read_bytes(), out.read_bytes()
    for t in s.tensors:
        o = h.by_name[t.name]
        assert (t.shape, t.ggml_type) == (o.shape, o.ggml_type)
        assert out_raw[t.offset:t.offset + t.nbytes] == src_raw[o.offset:o.offset + o.nbytes]
    # full metadata, byte for byte, plus the range and the source
    assert {k: v for k, v in s.kv_raw.items() if not k.startswith("dgr.slice.")} == h.kv_raw
    assert s.kv["llama.block_count"] == 4 and s.slice_range == (a, b)
    assert s.kv_types["dgr.slice.layer_start"] == gguf_io.T_U32
    assert s.kv["dgr.slice.source_identity"] == "sha256:" + _sha(src)
    assert info["size"] == out.stat().st_size and info["tensors"] == len(want)
    assert info["needed_bytes"] <= info["size"] <= info["needed_bytes"] * 1.03
    gguf = gguf_io.gguf_module()   # an independent reader agrees
    r = gguf.GGUFReader(str(out))
    assert [t.name for t in r.tensors] == names
    assert int(r.fields["dgr.slice.layer_end"].parts[-1][0]) == b


def test_slice_of_split_model_and_of_a_slice(tiny, split3, tmp_path):
    whole = gguf_io.read_header(slice_model(tiny, (1, 3), tmp_path / "a.gguf")["path"])
    part = gguf_io.read_header(
        slice_model(split3[1], (1, 3), tmp_path / "b.gguf")["path"])
    assert [t.info_bytes for t in part.tensors] == [t.info_bytes for t in whole.tensors]
    assert not any(k.startswith("split.") for k in part.kv)
    assert part.kv["dgr.slice.source_identity"] == identity.model_identity(split3[0])
    assert ((tmp_path / "a.gguf").read_bytes()[whole.data_offset:]
            == (tmp_path / "b.gguf").read_bytes()[part.data_offset:])
    again = slice_model(tmp_path / "a.gguf", (2, 3), tmp_path / "c.gguf")
    c = gguf_io.read_header(again["path"])
    assert c.slice_range == (2, 3) and c.kv["dgr.slice.source_identity"] == "sha256:" + _sha(tiny)
    with pytest.raises(errors.InvalidLayerRange):
        slice_model(tmp_path / "a.gguf", (0, 2), tmp_path / "d.gguf")
    with pytest.raises(errors.InvalidLayerRange):
        slice_model(tiny, (3, 3), tmp_path / "d.gguf")


def test_slice_checked_against_a_manifest(tiny, tiny_manifest, tmp_path):
    info = slice_model(tiny, (0, 2), tmp_path / "s.gguf", manifest=tiny_manifest)
    assert info["source"] == Manifest.load(tiny_manifest).identity
    t = gguf_io.read_header(tiny).by_name["blk.1.ffn_down.weight"]
    _flip(tiny, t.offset + 1)
    out = tmp_path / "bad.gguf"
    with pytest.raises(errors.ArtifactMismatch, match="blk.1.ffn_down.weight"):
        slice_model(tiny, (0, 2), out, manifest=tiny_manifest)
    assert not out.exists() and not list(tmp_path.glob(".bad.gguf*"))


def test_verify_a_slice(tiny, tiny_manifest, tmp_path):
    s = Path(slice_model(tiny, (1, 3), tmp_path / "s.gguf")["path"])
    j = tmp_path / "j.json"
    r = verify(tiny_manifest, model=s, journal=j)
    assert r.ok and r.mode == "slice" and r.bytes_read == r.bytes_planned > 0
    assert verify(tiny_manifest, model=s, journal=j).bytes_read == 0
    assert verify_for_worker(tiny_manifest, s, (2, 3), journal=j) == "sha256:" + _sha(tiny)
    with pytest.raises(errors.InvalidLayerRange, match=r"holds layers \[1, 3\)"):
        verify_for_worker(tiny_manifest, s, (0, 2), journal=j)
    t = gguf_io.read_header(s).by_name["blk.2.attn_output.weight"]
    _flip(s, t.offset + 7)
    r = verify(tiny_manifest, model=s, journal=j, layers=(2, 3))
    assert [(p.kind, p.what) for p in r.problems] == [
        ("different", "tensor blk.2.attn_output.weight")]
    assert verify(tiny_manifest, model=s, journal=j, layers=(1, 2)).ok   # not in that range
    other = write_tiny_llama(tmp_path / "o.gguf", TinyLlama(seed=3))
    so = slice_model(other, (1, 3), tmp_path / "so.gguf")["path"]
    with pytest.raises(errors.ArtifactMismatch, match="a slice of sha256:"):
        verify_for_worker(tiny_manifest, so, (1, 3), journal=j)


def test_killed_slice_verification_resumes_per_tensor(tiny, tiny_manifest, tmp_path):
    s = slice_model(tiny, (0, 2), tmp_path / "s.gguf")["path"]
    j = tmp_path / "j.json"
    env = _env(DGR_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(_verify_cmd(tiny_manifest, j, "--model", s, kill_after=4), env=env,
                          capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    r = verify(tiny_manifest, model=s, journal=j)
    done = next(iter(json.loads(j.read_text())["files"].values()))["tensors"]
    assert r.ok and len(done) == len(gguf_io.read_header(s).tensors)
    assert 0 < r.bytes_journal and r.bytes_read == r.bytes_planned - r.bytes_journal

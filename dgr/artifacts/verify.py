"""Verification of model artifacts against a manifest (``docs/artifacts.md``): whole files or
what one layer range loads, a dgr slice tensor by tensor, resumable through the journal, with
every missing, truncated or different file, header or tensor named; the worker's contract
(``verify_for_worker``) and the header-only check before an engine loads a model (``precheck``).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dgr.artifacts import gguf as gguf_io
from dgr.artifacts.journal import Journal, default_journal_path, stat_sig
from dgr.artifacts.manifest import Manifest, check_range, metadata_sha256, n_layer_of
from dgr.artifacts.progress import Progress
from dgr.artifacts.storage import BLOCK, count_read, hasher
from dgr.errors import (
    ArtifactError,
    ArtifactMismatch,
    ArtifactMissing,
    ArtifactTruncated,
    DgrError,
    InvalidLayerRange,
    InvalidModel,
)

__all__ = ["Problem", "VerifyReport", "verify", "raise_for", "verify_for_worker", "precheck"]

#: called with the journal each time it records a verified chunk (or tensor); None: nothing.
#: A seam for fault injection: ``python -m dgr.testing.kill_after`` stops the process there,
#: as a crash would, to test that a rerun resumes
on_unit_done: Callable[[Journal], None] | None = None


@dataclass(frozen=True)
class Problem:
    """One finding: ``kind`` is missing, truncated, oversized, different, changed, range,
    foreign or unreadable; ``what`` names the tensor or region (empty for a whole file)."""

    kind: str
    file: str
    what: str = ""
    detail: str = ""

    def __str__(self) -> str:
        s = f"{self.file}: " + (f"{self.what} " if self.what else "") + self.kind
        return s + (f" ({self.detail})" if self.detail else "")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "file": self.file, "what": self.what, "detail": self.detail}


@dataclass
class VerifyReport:
    """The outcome of ``verify``: ``ok`` and the problems found, and what it cost."""

    manifest: str
    identity: str
    mode: str                       # "files" or "slice"
    layers: tuple[int, int] | None
    problems: list[Problem] = field(default_factory=list)
    bytes_planned: int = 0          # bytes the verification covers
    bytes_journal: int = 0          # of those, skipped as verified by an earlier run
    bytes_read: int = 0             # read by this run (hashing, and narrowing down failures)
    seconds: float = 0.0
    journal: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, "manifest": self.manifest, "identity": self.identity,
                "mode": self.mode, "layers": list(self.layers) if self.layers else None,
                "problems": [p.to_dict() for p in self.problems],
                "bytes_planned": self.bytes_planned, "bytes_journal": self.bytes_journal,
                "bytes_read": self.bytes_read, "seconds": round(self.seconds, 4),
                "mib_per_s": round(self.bytes_read / 2**20 / max(self.seconds, 1e-9), 1),
                "journal": self.journal}


class _Reader:
    """pread-based block hashing of file ranges (thread-safe; counts bytes)."""

    def __init__(self):
        self.local = threading.local()
        self.bytes = 0
        self.lock = threading.Lock()

    def hash_range(self, fd: int, start: int, end: int, alg: str = "sha256") -> str:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = bytearray(BLOCK)
        h = hasher(alg)
        pos = start
        while pos < end:
            view = memoryview(buf)[:min(BLOCK, end - pos)]
            got = os.preadv(fd, [view], pos)
            if got <= 0:
                break  # short file: the hash will not match
            h.update(view[:got])
            pos += got
        n = pos - start
        count_read(n)
        with self.lock:
            self.bytes += n
        return h.hexdigest()


def verify(manifest: "str | os.PathLike | Manifest", *, dir: str | os.PathLike | None = None,
           model: str | os.PathLike | None = None, layers: tuple[int, int] | None = None,
           journal: str | os.PathLike | None | bool = None, fresh: bool = False,
           threads: int | None = None, flush_bytes: int | None = None,
           progress: bool = False) -> VerifyReport:
    """Check model artifacts against a manifest, resuming from the journal of earlier runs.

    Parameters
    ----------
    manifest : path or Manifest
    dir : path, optional
        Directory holding the manifest's files (default: the manifest's own directory).
    model : path, optional
        The artifact to check instead: a file of the manifest's model (its directory is then
        ``dir``), or a dgr slice of that model (checked tensor by tensor).
    layers : (int, int), optional
        Check only what a stage owning ``[a, b)`` loads: the chunks holding its tensors plus
        every file's header (all chunks / all of a slice's tensors when None).
    journal : path, False or None
        Where progress is recorded (default ``$DGR_CACHE/artifacts/journal-<manifest>.json``);
        False keeps no journal.
    fresh : bool
        Ignore what the journal says was verified (it is still written).
    threads : int, optional
        Chunks hashed in parallel (default min(4, CPUs)).
    flush_bytes : int, optional
        Write the journal after at least this many newly verified bytes (default: the chunk
        size, i.e. after every chunk).

    Returns
    -------
    VerifyReport
        ``ok`` is True when nothing differs; ``problems`` names every file, header or tensor
        that is missing, truncated or different.

    Raises
    ------
    dgr.errors.InvalidManifest
        The manifest cannot be read.
    dgr.errors.InvalidLayerRange
        ``layers`` is not a range of the manifest's model.
    """
    t0 = time.perf_counter()
    m = Manifest.load(manifest)
    if layers is not None:
        layers = check_range(layers, m.n_layer, f"the manifest's model {m.identity}")
    jpath = None if journal is False else (Path(journal) if journal else default_journal_path(m))
    jr = Journal(jpath, m.sha256)
    if fresh:
        jr.files = {}
    rep = VerifyReport(str(m.path or "<manifest>"), m.identity, "files", layers,
                       journal=str(jpath) if jpath else None)
    flush_bytes = flush_bytes or m.chunk_size
    threads = threads or min(4, os.cpu_count() or 1)
    if model is not None:
        mp = Path(model)
        head = None
        try:
            head = gguf_io.read_header(mp, decode_arrays=False)
        except DgrError:
            pass
        if head is not None and head.slice_range is not None:
            rep.mode = "slice"
            _verify_slice(m, mp, head, layers, jr, rep, flush_bytes, progress)
            rep.seconds = time.perf_counter() - t0
            return rep
        names = [f["name"] for f in m.files]
        if mp.name not in names:
            rep.problems.append(Problem("foreign", mp.name, detail=(
                f"not a file of the manifest's model {m.identity} (it lists "
                f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) nor a slice of it")))
            rep.seconds = time.perf_counter() - t0
            return rep
        dir = mp.parent
    base = Path(dir) if dir is not None else (m.path.parent if m.path else Path("."))
    _verify_files(m, base, layers, jr, rep, threads, flush_bytes, progress)
    rep.seconds = time.perf_counter() - t0
    if rep.ok:
        from dgr.artifacts.identity import remember_verified

        remember_verified([base / f["name"] for f in m.files], m.identity)
    return rep


def _planned_chunks(m: Manifest, layers) -> dict[str, set[int]]:
    cs = m.chunk_size
    plan: dict[str, set[int]] = {}
    for f in m.files:
        n = len(f["chunks"])
        if layers is None:
            plan[f["name"]] = set(range(n))
        else:  # the header (metadata and every tensor info) of every file
            plan[f["name"]] = set(range(0, (max(f["data_offset"], 1) - 1) // cs + 1))
    if layers is not None:
        for name in m.needed(layers):
            t = m.tensors_by_name[name]
            if t["size"]:
                plan[t["file"]].update(range(t["offset"] // cs,
                                             (t["offset"] + t["size"] - 1) // cs + 1))
    return plan


def _verify_files(m: Manifest, base: Path, layers, jr: Journal, rep: VerifyReport,
                  threads: int, flush_bytes: int, progress: bool) -> None:
    cs = m.chunk_size
    plan = _planned_chunks(m, layers)
    reader = _Reader()

    def chunk_len(f: dict, k: int) -> int:
        return min(cs, f["size"] - k * cs)

    open_files: dict[str, int] = {}  # closed however this ends, a raise included
    try:
        # what is there, and what is left to hash
        todo: list[tuple[dict, Path, dict, int]] = []
        sigs: dict[str, list[int]] = {}
        for f in m.files:
            p = base / f["name"]
            want = plan[f["name"]]
            rep.bytes_planned += sum(chunk_len(f, k) for k in want)
            sig = stat_sig(p)
            if sig is None:
                jr.drop(p)
                rep.problems.append(Problem("missing", f["name"], detail=f"not found in {base}"))
                continue
            size = sig[0]
            if size < f["size"]:
                jr.drop(p)
                cut = sorted((t for t in m.tensors if t["file"] == f["name"]
                              and t["offset"] + t["size"] > size), key=lambda t: t["offset"])
                more = (f"; {len(cut)} tensors cut off, from {cut[0]['name']}" if cut
                        else "; only padding is cut off")
                rep.problems.append(Problem("truncated", f["name"],
                                            detail=f"{size} of {f['size']} bytes{more}"))
                continue
            if size > f["size"]:
                jr.drop(p)
                rep.problems.append(Problem("oversized", f["name"], detail=(
                    f"{size} bytes, the manifest says {f['size']}: not the manifest's file")))
                continue
            entry = jr.entry(p, sig)
            done = entry["chunks"] & want
            rep.bytes_journal += sum(chunk_len(f, k) for k in done)
            sigs[f["name"]] = sig
            try:
                open_files[f["name"]] = os.open(p, os.O_RDONLY)
            except OSError as e:
                rep.problems.append(Problem("unreadable", f["name"], detail=e.strerror or str(e)))
                continue
            for k in sorted(want - done):
                todo.append((f, p, entry, k))

        bar = Progress(sum(chunk_len(f, k) for f, _, _, k in todo), "verify", progress)
        bad: dict[str, list[int]] = {}
        pending = 0

        def job(item):
            f, _p, _e, k = item
            start = k * cs
            return item, reader.hash_range(open_files[f["name"]], start, start + chunk_len(f, k))

        def results():
            if threads <= 1:
                for item in todo:
                    yield job(item)
            else:
                with ThreadPoolExecutor(threads) as pool:
                    # bounded look-ahead keeps memory and wasted work (on a kill) small
                    it = iter(todo)
                    futs = [pool.submit(job, x) for _, x in zip(range(threads * 2), it)]
                    while futs:
                        res = futs.pop(0).result()
                        nxt = next(it, None)
                        if nxt is not None:
                            futs.append(pool.submit(job, nxt))
                        yield res

        n_results = 0
        try:
            for (f, p, entry, k), digest in results():
                n_results += 1
                n = chunk_len(f, k)
                bar.update(n, f["name"])
                if digest == f["chunks"][k]:
                    entry["chunks"].add(k)
                    pending += n
                    if pending >= flush_bytes:
                        jr.flush()
                        pending = 0
                    if on_unit_done is not None:
                        on_unit_done(jr)
                else:
                    bad.setdefault(f["name"], []).append(k)
        finally:
            bar.close()
            if pending:
                jr.flush()
        rep.bytes_read = reader.bytes
        if n_results != len(todo):  # never report success for chunks nobody hashed
            raise ArtifactError(f"internal error: {n_results} of {len(todo)} chunks were hashed")

        # a file that changed while it was read: nothing it gave can be trusted
        for f in m.files:
            if f["name"] in sigs and stat_sig(base / f["name"]) != sigs[f["name"]]:
                jr.drop(base / f["name"])
                rep.problems.append(Problem("changed", f["name"],
                                            detail="modified while being verified; run again"))
                bad.pop(f["name"], None)
        needed = m.needed(layers) if layers is not None else None
        for name, ks in bad.items():
            _localise(m, name, sorted(ks), open_files[name], reader, rep, needed)
        rep.bytes_read = reader.bytes
        jr.flush()
    finally:
        for fd in open_files.values():
            os.close(fd)


def _localise(m: Manifest, name: str, ks: list[int], fd: int, reader: _Reader,
              rep: VerifyReport, needed: set[str] | None) -> None:
    """Name what mismatching chunks hold that differs: the header, tensors, or padding.

    With ``needed`` (a range check) only the header and the range's tensors count: a chunk
    that also holds other tensors may differ there without touching what the range loads
    (the range's tensors are then accepted on their own tensor hashes).
    """
    cs = m.chunk_size
    f = next(x for x in m.files if x["name"] == name)
    alg = m.data["hashes"]["tensor"]
    tensors = sorted((t for t in m.tensors if t["file"] == name
                      and (needed is None or t["name"] in needed)), key=lambda t: t["offset"])
    differs: dict[str, bool] = {}

    def header_differs() -> bool:
        if "<header>" not in differs:
            differs["<header>"] = bad = (reader.hash_range(fd, 0, f["data_offset"])
                                         != f["header_sha256"])
            if bad:
                rep.problems.append(Problem("different", name, "header", (
                    f"metadata or tensor infos in bytes 0..{f['data_offset']} differ")))
        return differs["<header>"]

    def tensor_differs(t: dict) -> bool:
        if t["name"] not in differs:
            lo, hi = t["offset"], t["offset"] + t["size"]
            differs[t["name"]] = bad = reader.hash_range(fd, lo, hi, alg) != t["hash"]
            if bad:
                where = f"layer {t['layer']}" if t["layer"] is not None else t["role"]
                rep.problems.append(Problem("different", name, f"tensor {t['name']}",
                                            f"bytes {lo}..{hi}, {where}"))
        return differs[t["name"]]

    for k in ks:
        lo, hi = k * cs, min((k + 1) * cs, f["size"])
        found = [header_differs()] if lo < f["data_offset"] else []
        found += [tensor_differs(t) for t in tensors
                  if t["offset"] < hi and t["offset"] + t["size"] > lo]
        if not any(found) and needed is None:
            rep.problems.append(Problem("different", name, f"chunk {k}",
                                        f"bytes {lo}..{hi} differ outside any tensor (padding)"))


def _verify_slice(m: Manifest, path: Path, head: gguf_io.GGUFHeader, layers,
                  jr: Journal, rep: VerifyReport, flush_bytes: int, progress: bool) -> None:
    name = path.name
    s, e = head.slice_range
    src = head.kv.get("dgr.slice.source_identity")
    if src != m.identity:
        rep.problems.append(Problem("foreign", name, detail=(
            f"a slice of {src}, the manifest is of {m.identity}")))
        return
    if layers is None:
        layers = (s, e)
    elif not (s <= layers[0] and layers[1] <= e):
        rep.problems.append(Problem("range", name, detail=(
            f"the slice holds layers [{s}, {e}), layers [{layers[0]}, {layers[1]}) were asked")))
        return
    if metadata_sha256(head) != m.model["metadata_sha256"]:
        rep.problems.append(Problem("different", name, "metadata",
                                    "the slice's metadata differs from the model's"))
    expect = m.needed((s, e))
    have = set(head.by_name)
    for t in sorted(expect - have):
        rep.problems.append(Problem("missing", name, f"tensor {t}",
                                    f"a slice of [{s}, {e}) must hold it"))
    for t in sorted(have - expect):
        rep.problems.append(Problem("different", name, f"tensor {t}",
                                    f"not a tensor of layers [{s}, {e}) of the model"))
    check = []
    for tn in sorted(m.needed(layers) & have, key=lambda n: head.by_name[n].offset):
        t, ref = head.by_name[tn], m.tensors_by_name[tn]
        if t.type_name != ref["type"] or list(t.shape) != ref["shape"]:
            rep.problems.append(Problem("different", name, f"tensor {tn}", (
                f"{t.type_name} {list(t.shape)}, the model has {ref['type']} {ref['shape']}")))
        elif t.offset + t.nbytes > head.file_size:
            rep.problems.append(Problem("truncated", name, f"tensor {tn}", (
                f"ends at byte {t.offset + t.nbytes}, the file has {head.file_size}")))
        else:
            check.append((t, ref))
    rep.bytes_planned = sum(t.nbytes for t, _ in check)
    sig = stat_sig(path)
    entry = jr.entry(path, sig)
    todo = [(t, ref) for t, ref in check if t.name not in entry["tensors"]]
    rep.bytes_journal = rep.bytes_planned - sum(t.nbytes for t, _ in todo)
    reader = _Reader()
    alg = m.data["hashes"]["tensor"]
    bar = Progress(sum(t.nbytes for t, _ in todo), "verify", progress)
    pending = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for t, ref in todo:
            digest = reader.hash_range(fd, t.offset, t.offset + t.nbytes, alg)
            bar.update(t.nbytes, t.name)
            if digest != ref["hash"]:
                layer = f"layer {ref['layer']}" if ref["layer"] is not None else ref["role"]
                rep.problems.append(Problem("different", name, f"tensor {t.name}",
                                            f"bytes {t.offset}..{t.offset + t.nbytes}, {layer}"))
                continue
            entry["tensors"].add(t.name)
            pending += t.nbytes
            if pending >= flush_bytes:
                jr.flush()
                pending = 0
            if on_unit_done is not None:
                on_unit_done(jr)
    finally:
        os.close(fd)
        bar.close()
    rep.bytes_read = reader.bytes
    if stat_sig(path) != sig:
        jr.drop(path)
        rep.problems.append(Problem("changed", name,
                                    detail="modified while being verified; run again"))
    jr.flush()


_RAISE_ORDER = [("range", InvalidLayerRange), ("missing", ArtifactMissing),
                ("truncated", ArtifactTruncated), ("foreign", ArtifactMismatch),
                ("oversized", ArtifactMismatch), ("different", ArtifactMismatch),
                ("changed", ArtifactMismatch), ("unreadable", ArtifactError)]


def raise_for(report: VerifyReport, model: str | os.PathLike | None = None) -> None:
    """Raise the typed error for a failed report (nothing when it is ok)."""
    if report.ok:
        return
    kinds = {p.kind for p in report.problems}
    cls = next((c for k, c in _RAISE_ORDER if k in kinds), ArtifactError)
    shown = "; ".join(str(p) for p in report.problems[:8])
    more = len(report.problems) - 8
    where = f" at {model}" if model is not None else ""
    msg = (f"model artifacts{where} do not match manifest {report.manifest} "
           f"({report.identity}): {shown}" + (f"; and {more} more" if more > 0 else ""))
    if cls is InvalidLayerRange:
        raise InvalidLayerRange(msg)
    raise cls(msg, report.problems)


def verify_for_worker(manifest_path: "str | os.PathLike | Manifest",
                      model_path: str | os.PathLike, layers: tuple[int, int] | None, *,
                      journal: str | os.PathLike | None | bool = None,
                      progress: bool = False) -> str:
    """Check, before serving, that ``model_path`` holds what the manifest certifies.

    Verifies the headers of every file and the chunks holding the tensors a stage owning
    ``layers`` loads (everything for None), resuming from the journal, so a restart on
    unchanged files reads nothing. ``model_path`` is the model (a one-file GGUF or any split)
    or a dgr slice of it. On success the files are remembered as verified, so
    ``dgr.artifacts.identity.model_identity(model_path)`` returns the manifest's identity without
    hashing.

    Returns
    -------
    str
        The model identity (``sha256:...``) the worker reports.

    Raises
    ------
    dgr.errors.InvalidManifest
        The manifest is unreadable or of another schema.
    dgr.errors.InvalidLayerRange
        ``layers`` is outside the model, or not held by the slice.
    dgr.errors.ArtifactMissing
        A file (e.g. a split) or, in a slice, a tensor is missing.
    dgr.errors.ArtifactTruncated
        A file is shorter than the manifest says.
    dgr.errors.ArtifactMismatch
        Bytes differ (header, tensor, padding), or the file is another model's.
    """
    rep = verify(manifest_path, model=model_path, layers=layers, journal=journal,
                 progress=progress)
    raise_for(rep, model_path)
    return rep.identity



# ---- pre-load check -----------------------------------------------------------------------


def precheck(model_path: str | os.PathLike, layers: tuple[int, int] | None = None) -> dict:
    """Cheap checks before an engine loads ``model_path`` (reads headers only).

    Returns ``{"load_path", "files", "n_layer", "slice", "layers"}``: ``load_path`` is the
    first split (llama.cpp must be given the first split of a split model), ``slice`` the
    range a dgr slice holds (None for a whole model), ``layers`` the resolved range.

    Raises
    ------
    dgr.errors.ModelNotFound, dgr.errors.InvalidModel
    dgr.errors.ArtifactMissing
        A split of a split model is missing.
    dgr.errors.InvalidLayerRange
        The range is outside the model, or outside what a slice holds.
    """
    p = Path(model_path)
    head = gguf_io.read_header(p, decode_arrays=False)
    files = gguf_io.model_files(p)
    missing = [f for f in files if not f.exists()]
    if missing:
        raise ArtifactMissing(f"split model {files[0].name} is missing "
                              f"{', '.join(f.name for f in missing)} (in {files[0].parent})")
    block_count = head.arch_int("block_count")
    if block_count is None:
        first = gguf_io.read_header(files[0], decode_arrays=False)
        block_count = first.arch_int("block_count")
        head = first
    if block_count is None:
        raise InvalidModel(f"{files[0]} has no block_count")
    # the file's own tensors tell whether a NextN block is there, unless other files (splits)
    # or another stage's cut (a slice) may hold it
    whole_file = len(files) == 1 and head.slice_range is None
    names = [t.name for t in head.tensors] if whole_file else None
    n_layer = n_layer_of(block_count, head.arch_int("nextn_predict_layers", 0), head.arch, names)
    a, b = (0, n_layer) if layers is None else check_range(layers, n_layer, str(p))
    held = head.slice_range
    if held is not None and not (held[0] <= a and b <= held[1]):
        raise InvalidLayerRange(
            f"{p.name} is a dgr slice holding layers [{held[0]}, {held[1]}) of {n_layer}; it "
            f"cannot serve layers [{a}, {b}): load the full model or a slice that holds them")
    return {"load_path": files[0], "files": files, "n_layer": n_layer, "slice": held,
            "layers": (a, b)}

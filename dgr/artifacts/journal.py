"""The verification journal: which chunks (or, for slices, tensors) of which files an earlier
run verified, so an interrupted verification resumes where it stopped (``docs/artifacts.md``)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from dgr.artifacts.manifest import Manifest
from dgr.artifacts.storage import read_json, update_json

__all__ = ["JOURNAL_SCHEMA", "Journal", "stat_sig", "default_journal_path"]

JOURNAL_SCHEMA = "dgr.artifacts.journal/1"


def _ranges(ints: Iterable[int]) -> str:
    out, run = [], None
    for i in sorted(set(ints)):
        if run and i == run[1] + 1:
            run[1] = i
        else:
            if run:
                out.append(f"{run[0]}" if run[0] == run[1] else f"{run[0]}-{run[1]}")
            run = [i, i]
    if run:
        out.append(f"{run[0]}" if run[0] == run[1] else f"{run[0]}-{run[1]}")
    return ",".join(out)


def _unranges(s: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, s.split(",")):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def stat_sig(p: Path) -> list[int] | None:
    """What identifies a file as it is now: size, mtime, ctime, inode, device (None: absent)."""
    try:
        st = p.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class Journal:
    """What an earlier run verified, per file as it then was (size, mtime, ctime, inode).

    Entries only ever claim chunks (or tensors) whose hashes matched; a file whose stat
    changed loses its entry. Written atomically (temporary file, fsync, rename) and merged
    under a lock with concurrent verifiers of the same manifest.
    """

    def __init__(self, path: Path | None, manifest_sha256: str):
        self.path = path
        self.manifest_sha256 = manifest_sha256
        self.files: dict[str, dict] = {}
        if path is not None:
            self.files = self._read()

    def _read(self) -> dict[str, dict]:
        return self._parse(read_json(self.path))

    def _parse(self, data: dict) -> dict[str, dict]:
        """The files of a journal's JSON object; none where it is another manifest's or
        another schema's."""
        if (data.get("schema") != JOURNAL_SCHEMA
                or data.get("manifest_sha256") != self.manifest_sha256):
            return {}
        out = {}
        for k, e in (data.get("files") or {}).items():
            try:
                out[k] = {"stat": list(e["stat"]), "chunks": _unranges(e.get("chunks", "")),
                          "tensors": set(e.get("tensors", []))}
            except (KeyError, TypeError, ValueError):
                continue
        return out

    def entry(self, p: Path, sig: list[int] | None) -> dict:
        key = str(p.resolve())
        e = self.files.get(key)
        if e is None or sig is None or e["stat"] != sig:
            e = {"stat": sig, "chunks": set(), "tensors": set()}
            self.files[key] = e
        return e

    def drop(self, p: Path) -> None:
        self.files.pop(str(p.resolve()), None)

    def flush(self) -> None:
        """Write the journal, merged with what other processes wrote to it meanwhile (for a
        file whose size and mtime did not change: the chunks and tensors either verified)."""
        if self.path is None:
            return

        def merged(raw: dict) -> dict:
            theirs = self._parse(raw)
            for k, mine in self.files.items():
                t = theirs.get(k)
                if t is not None and t["stat"] == mine["stat"]:
                    mine["chunks"] |= t["chunks"]
                    mine["tensors"] |= t["tensors"]
            both = {**theirs, **self.files}
            return {"schema": JOURNAL_SCHEMA, "manifest_sha256": self.manifest_sha256,
                    "files": {k: {"stat": e["stat"], "chunks": _ranges(e["chunks"]),
                                  "tensors": sorted(e["tensors"])}
                              for k, e in both.items() if e["stat"] is not None}}

        update_json(self.path, merged)


def _cache_dir() -> Path:
    from dgr.vendor import cache_root

    return cache_root() / "artifacts"


def default_journal_path(manifest: Manifest) -> Path:
    """``$DGR_CACHE/artifacts/journal-<manifest sha256>.json`` (mounted model storage is often
    read-only, so the journal does not go next to the manifest unless asked)."""
    return _cache_dir() / f"journal-{manifest.sha256[:32]}.json"

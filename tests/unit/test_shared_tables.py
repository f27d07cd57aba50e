"""The JSON tables under ``$DGR_CACHE`` that several processes update (the model identity
cache, the prefix-rows measurements, the verification journal): no process loses another's
entries (``dgr.artifacts.storage.update_json``)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap

from dgr.artifacts.storage import read_json, update_json

_WRITER = textwrap.dedent("""
    import sys, time
    from dgr.artifacts.storage import update_json
    path, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    def add(i):
        def update(table):
            time.sleep(0.01)  # a slow read-modify-write: another process reads meanwhile
            return {**table, f"{name}-{i}": i}
        return update
    for i in range(n):
        update_json(path, add(i))
""")


def test_processes_updating_one_table_keep_every_entry(tmp_path):
    path = tmp_path / "cache" / "table.json"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), f"p{k}", "12"])
             for k in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    table = json.loads(path.read_text())
    assert sorted(table) == sorted(f"p{k}-{i}" for k in range(4) for i in range(12))


def test_update_json_starts_from_an_empty_table_where_the_file_is_not_one(tmp_path):
    path = tmp_path / "t.json"
    assert read_json(path) == {}
    for bad in ("not json", "[1, 2]"):
        path.write_text(bad)
        assert update_json(path, lambda t: {**t, "k": 1}) == {"k": 1}
    assert read_json(path) == {"k": 1}


def test_the_identity_cache_merges_its_entries_into_the_table(tmp_path, monkeypatch):
    """An entry written meanwhile stays; a file's new digest replaces its old one."""
    from dgr.artifacts import identity

    cache = tmp_path / "identity-cache.json"
    monkeypatch.setattr(identity, "_cache_file", lambda: cache)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    identity.file_sha256(f)
    # another entry, written after this process's first one
    update_json(cache, lambda t: {**t, "theirs|1|2": "sha256:ab"})
    identity.remember_file_sha256(f, "cd" * 32)
    table = read_json(cache)
    assert table["theirs|1|2"] == "sha256:ab"
    assert [v for k, v in table.items() if k.startswith(f"{f}|")] == ["sha256:" + "cd" * 32]


def test_a_prefix_rows_measurement_says_what_it_measures(tmp_path, monkeypatch, caplog):
    """A worker's first start on a new stage measures for a while (tens of seconds on a slow
    CPU): its log says so, and the result; the next start reads it from the table."""
    from dgr.control import prefix

    monkeypatch.setenv("DGR_CACHE", str(tmp_path))
    monkeypatch.setattr(prefix, "_key", lambda engine: "k")
    runs = []
    monkeypatch.setattr(prefix, "rows_exact", lambda engine, slot=0: runs.append(1) or True)

    class Stage:
        layers = (3, 7)

    with caplog.at_level(logging.INFO, logger="dgr.control.prefix"):
        assert prefix.rows_exact_cached(Stage()) is True
        assert prefix.rows_exact_cached(Stage()) is True
    said = [r.getMessage() for r in caplog.records]
    assert runs == [1] and len(said) == 2, said
    assert "layers [3, 7)" in said[0] and "prefix-rows.json" in said[0]
    assert re.search(r": yes \(\d+\.\d s\)$", said[1]), said[1]  # the result, its time
    assert read_json(tmp_path / "prefix-rows.json") == {"k": True}

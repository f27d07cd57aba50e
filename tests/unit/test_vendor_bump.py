"""``dgr.vendor.bump.try_stack``: each patch of a stack reported as it applies to another
tree: cleanly, with an offset or fuzz (and where), failed (and which hunk), and the ones after
a failure not tried."""

from __future__ import annotations

import shutil

import pytest

from dgr.vendor.bump import report_markdown, try_stack

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="needs patch")

BASE = [f"line {i}\n" for i in range(1, 21)]


def _diff(name: str, before: list[str], after: list[str]) -> str:
    import difflib

    return "".join(difflib.unified_diff(before, after, f"a/{name}", f"b/{name}"))


def test_each_patch_is_reported_as_it_applies(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    # the tree the stack meets: three lines inserted at the top (a later llama.cpp)
    (tree / "f.txt").write_text("".join(["new a\n", "new b\n", "new c\n", *BASE]))
    (tree / "g.txt").write_text("".join(BASE))
    clean = _diff("g.txt", BASE, BASE[:10] + ["patched g\n"] + BASE[10:])
    edited = BASE[:5] + ["changed 6\n"] + BASE[6:]
    moved = _diff("f.txt", BASE, edited)  # written for the old tree: applies at an offset
    gone = _diff("f.txt", ["absent 1\n", "absent 2\n", "absent 3\n", "absent 4\n"],
                 ["absent 1\n", "x\n", "absent 3\n", "absent 4\n"])
    paths = []
    for i, (name, text) in enumerate([("clean", clean), ("moved", moved), ("gone", gone),
                                      ("after", clean)], 1):
        p = tmp_path / f"000{i}-{name}.patch"
        p.write_text(text)
        paths.append(p)
    got = try_stack(tree, paths)
    assert [a.status for a in got] == ["applied", "fuzz", "failed", "not tried"]
    assert "offset 3" in got[1].detail and "FAILED" in got[2].detail
    assert "changed 6" in (tree / "f.txt").read_text()  # the fuzzy one was applied
    text = report_markdown({"from": "0.3.36", "from_commit": "a" * 40, "to": "0.3.37",
                            "to_commit": "", "sdist": "x.tar.gz", "sdist_sha256": "b" * 64,
                            "tree": str(tree), "patches": got, "clean": False,
                            "applies": False})
    assert "4 patches: 1 applied, 1 with fuzz or offsets, 1 failed, 1 not tried" in text
    assert "| 0003-gone.patch | failed |" in text and "refresh the failed patch" in text

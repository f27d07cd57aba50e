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


def test_the_proof_steps_are_reported_and_the_pin_counts_are_read(tmp_path):
    """--check's steps in the report (each pass/FAIL with its time and last words), and the
    probe's yardstick: the architectures table's own count, read from the real doc."""
    from pathlib import Path

    from dgr.vendor.bump import Step, _split_count

    root = Path(__file__).resolve().parents[2]
    n, split = _split_count(root / "docs" / "architectures.md")
    assert 100 < split <= n
    base = {"from": "0.3.36", "from_commit": "a" * 40, "to": "0.3.37", "to_commit": "c" * 40,
            "sdist": "x.tar.gz", "sdist_sha256": "b" * 64, "tree": str(tmp_path),
            "patches": [], "clean": True, "applies": True, "work": str(tmp_path),
            "same": False}
    ok = [Step("build", True, 601.2, "built"), Step("probe", True, 300, f"{split} of {n}"),
          Step("parity", True, 40, "matches")]
    text = report_markdown({**base, "steps": ok})
    assert "| build | pass | 601 | built |" in text and "`--write` pins it" in text
    text = report_markdown({**base, "steps": ok[:1] + [Step("probe", False, 9, "3 of 9")]})
    assert "| probe | FAIL | 9 | 3 of 9 |" in text and f"its log is under `{tmp_path}`" in text
    assert "nothing to write" in report_markdown({**base, "same": True, "steps": ok})
    assert "--check" in report_markdown({**base, "steps": []})
    # said while the proof runs: the patches, without advice to run what is running
    assert "Next," not in report_markdown({**base, "steps": []}, advice=False)

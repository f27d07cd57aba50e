"""docs/architectures.md is the current support table: written for the pinned llama.cpp commit
and this patch stack (a patch change can change every verdict, so it must be rewritten with
``python -m dgr.testing.archs --markdown docs/architectures.md``), and it covers the
architectures issue 16 names."""

from __future__ import annotations

import re
from pathlib import Path

from dgr.testing.archs import FAMILIES
from dgr.vendor import Vendor

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architectures.md").read_text(encoding="utf-8")
NAMED = FAMILIES  # the families the suite requires to split (dgr.testing.archs)


def test_the_table_is_for_this_pin_and_patch_stack():
    v = Vendor(ROOT)
    m = re.search(r"llama\.cpp commit: `([0-9a-f]{40})`, patch stack `([0-9a-f]{16})`", DOC)
    assert m, "docs/architectures.md names no commit and patch stack"
    assert m.group(1) == v.commit
    assert m.group(2) == v.patch_stack_hash()[:16], (
        "the patch stack changed since docs/architectures.md was written: rerun "
        "python -m dgr.testing.archs --markdown docs/architectures.md")


def test_the_table_covers_the_named_architectures():
    rows = dict(re.findall(r"^\| `([\w.-]+)` \|.*\| ([^|]+) \|$", DOC, re.M))
    assert len(rows) >= 100, len(rows)
    missing = [a for a in NAMED if a not in rows]
    assert not missing, missing
    assert all(v.split()[0] in ("pass", "refused", "FAIL:", "-") for v in rows.values()), rows


def test_the_readme_names_the_architectures_that_pass():
    """The README's count is the table's, and every family it names passes there."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    m = re.search(r"stage graph honours a range today: (\d+) of the (\d+) that llama\.cpp's "
                  r"fixture generator writes.*?among them the families people split across "
                  r"machines: (.*?)\. Any other", readme)
    assert m, "README does not say which architectures split"
    rows = dict(re.findall(r"^\| `([\w.-]+)` \|.*\| ([^|]+) \|$", DOC, re.M))
    passing = {a for a, v in rows.items() if v.startswith("pass")}
    written = {a for a, v in rows.items() if v.strip() != "-"}  # "-": the generator wrote none
    assert (int(m.group(1)), int(m.group(2))) == (len(passing), len(written))
    named = set(re.findall(r"`([\w.-]+)`", m.group(3)))
    assert named == set(NAMED), named ^ set(NAMED)
    assert named <= passing, named - passing


def test_every_refused_architecture_has_its_reason_and_no_splittable_one_is_explained():
    """The table's refusals carry dgr.core.refusals' reason (what UnsupportedArchitecture
    says), and that module explains no architecture the build splits (a stale entry)."""
    from dgr._core import arch_supports_layer_range
    from dgr.core import refusals

    rows = dict(re.findall(r"^\| `([\w.-]+)` \|.*\| ([^|]+) \|$", DOC, re.M))
    refused = {a: v for a, v in rows.items() if v.startswith("refused")}
    assert refused, "no refused architecture in the table"
    for arch, verdict in refused.items():
        assert verdict == f"refused ({refusals.refusal_reason(arch)})", (arch, verdict)
    explained = refusals.MEMORY | refusals.NON_CAUSAL | set(refusals.SPECIFIC)
    assert not [a for a in explained if arch_supports_layer_range(a)]
    assert "recurrent" in refusals.refusal_reason("rwkv6qwen2")
    assert "per-layer inputs" in refusals.refusal_reason("gemma3n")
    assert "non-causal" in refusals.refusal_reason("llada")
    assert "not been cut" in refusals.refusal_reason("no-such-arch")

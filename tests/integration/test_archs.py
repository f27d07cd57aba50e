"""Every architecture upstream's generator writes (tests/test-llama-archs.cpp, grown to 4
layers): it loads whole and runs a forward, and a split is either refused with
``UnsupportedArchitecture`` naming the arch or bit-exact at every boundary.

Each model is probed in a child process (:func:`dgr.testing.archs.probe_all`), so an abort in
llama.cpp fails the arch it happened on instead of the run. The table arch / layers / whole
load / split is printed and kept as ``support-table.txt`` (and ``.json``) under the pytest
tmp dir (``archs*/``): the start of issue 16's support table.
"""

from __future__ import annotations

import json

import pytest

from dgr._core import arch_supports_layer_range
from dgr.errors import VendorError
from dgr.testing import archs

#: the families people split (dgr.testing.archs.FAMILIES): each must be written, load whole,
#: run a forward and split bit-exact
REQUIRED = archs.FAMILIES
#: M-RoPE models: a later stage's boundary batch needs the sectioned positions the engine fills
MROPE = ("qwen2vl", "qwen3vlmoe", "hunyuan_vl", "glm4moe")


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    written = archs.write()  # cached per vendor key; compiles the generator on first use
    out = tmp_path_factory.mktemp("archs")
    rows = archs.probe_all(written.files, log_dir=out / "logs")
    table = archs.format_table(rows)
    for arch, kind, why in written.failed:
        table += (f"\n(not written: {arch} {kind}: the generator failed at "
                  f"{archs.N_LAYER} layers: {why})")
    (out / "support-table.txt").write_text(table + "\n")
    (out / "support-table.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\n{table}\n(kept in {out})")
    return written, rows


def _rows(probed, arch):
    rows = [r for r in probed[1] if r["arch"] == arch]
    assert rows, f"the generator wrote no {arch} model"
    return rows


def test_tweaks_apply_once_to_the_pinned_source():
    from dgr.vendor import Vendor

    src = (Vendor().src / archs.GENERATOR_SOURCE).read_text()
    out = archs.tweaked_source(src)
    assert f"uint32_t n_layer = {archs.N_LAYER_ENV};" in out and archs.FAILED_TAG in out
    with pytest.raises(VendorError, match="anchor occurs 0 times"):
        archs.tweaked_source(src.replace("uint32_t n_layer = 2;", "uint32_t n_layer = 3;"))


@pytest.mark.slow
def test_generator_writes_every_required_arch_with_a_middle_layer(probed):
    written, rows = probed
    missing = [a for a in REQUIRED if a not in written.archs]
    assert not missing, f"the generator wrote no model for {missing}"
    # upstream writes 2 layers for most; the tweak makes 4, so first, middle and last stages
    # exist (nemotron_h keeps the generator's own 3)
    short = [(r["file"], r["n_layer"]) for r in rows if r["arch"] in REQUIRED and r["n_layer"] < 3]
    assert not short, short
    assert len(rows) == len(written.files)
    assert not [f for f in written.failed if f[0] in REQUIRED], written.failed


@pytest.mark.slow
def test_write_into_a_directory_and_into_the_cache(tmp_path):
    w = archs.write("^qwen2$", tmp_path)
    assert [f.name for f in w.files] == ["qwen2-dense.gguf"] and w.failed == ()
    assert [p.name for p in tmp_path.iterdir()] == ["qwen2-dense.gguf"]  # no scratch left
    c1 = archs.write("^qwen2$")
    assert c1.files[0].parent != tmp_path and (c1.files[0].parent / "written.json").exists()
    assert c1.files[0].read_bytes() == w.files[0].read_bytes()  # fixed seed: same bytes
    mtime = c1.files[0].stat().st_mtime_ns
    assert archs.write("^qwen2$") == c1 and c1.files[0].stat().st_mtime_ns == mtime  # reused


@pytest.mark.slow
def test_every_written_model_loads_whole_and_runs_a_forward(probed):
    bad = [f"{r['arch']} ({r['file']}): {r['whole']}" for r in probed[1] if r["whole"] != "ok"]
    assert not bad, "models that do not load whole or abort:\n  " + "\n  ".join(bad)
    nonfinite = [r["file"] for r in probed[1] if not r["forward_finite"]]
    assert not nonfinite, f"non-finite logits from {nonfinite}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", REQUIRED)
def test_whole_load(probed, arch):
    for r in _rows(probed, arch):
        assert r["whole"] == "ok", f"{arch} ({r['file']}): {r['whole']}"
        assert r["forward_finite"], f"{arch} ({r['file']}): non-finite logits"


@pytest.mark.slow
@pytest.mark.parametrize("arch", REQUIRED)
def test_split_refused_or_bit_exact(probed, arch):
    """A refused arch names itself in UnsupportedArchitecture; an accepted one is bit-exact
    at every interior boundary and in single-layer stages."""
    supported = arch_supports_layer_range(arch)
    for r in _rows(probed, arch):
        assert r["supported"] is supported, r
        assert r["split_ok"], f"{arch} ({r['file']}, supported={supported}): {r['split']}"
        if supported:
            assert r["split"] == f"pass {r['n_layer']} splits bit-exact", r
        else:
            assert r["split"] == "refused", r


@pytest.mark.slow
@pytest.mark.parametrize("arch", REQUIRED + MROPE)
def test_family_splits_bit_exact(probed, arch):
    """The families people split, and the M-RoPE models whose later stages take sectioned
    positions, are accepted and pass every split (not merely refused cleanly)."""
    assert arch_supports_layer_range(arch)
    for r in _rows(probed, arch):
        assert r["split"] == f"pass {r['n_layer']} splits bit-exact", r


@pytest.mark.slow
def test_every_written_model_refuses_or_passes_a_split(probed):
    bad = [f"{r['arch']} ({r['file']}): {r['split']}" for r in probed[1]
           if r["whole"] == "ok" and not r["split_ok"]]
    assert not bad, "splits neither refused nor bit-exact:\n  " + "\n  ".join(bad)


# a stand-in child: aborts on "crash*", hangs on "hang*", answers for anything else
_FAKE_CHILD = """
import json, os, sys, time
for f in sys.argv[1:]:
    print(json.dumps({"start": f}), flush=True)
    name = os.path.basename(f)
    if name.startswith("crash"):
        print("GGML_ASSERT(fake) failed", file=sys.stderr, flush=True)
        os.abort()
    if name.startswith("hang"):
        time.sleep(600)
    print(json.dumps({"result": {"file": name, "whole": "ok"}}), flush=True)
"""


def test_probe_all_survives_an_abort_and_a_hang(monkeypatch, tmp_path):
    monkeypatch.setattr(archs, "_CHILD", _FAKE_CHILD)
    files = [tmp_path / n for n in ("a-dense.gguf", "crash-dense.gguf", "b-moe.gguf",
                                    "hang-moe.gguf", "c-dense.gguf")]
    rows = archs.probe_all(files, per_file_timeout=3, log_dir=tmp_path / "logs")
    assert [r["file"] for r in rows] == [f.name for f in files]
    assert [r["whole"] for r in rows][::2] == ["ok", "ok", "ok"]
    crash, hang = rows[1], rows[3]
    assert crash["whole"].startswith("crash: exit -6") and "GGML_ASSERT(fake)" in crash["whole"]
    assert crash["arch"] == "crash" and not crash["split_ok"]
    assert hang["whole"].startswith("timeout: no result in 3 s"), hang
    assert len(list((tmp_path / "logs").glob("probe-*.stderr"))) == 3


def test_generator_needs_a_built_vendor_tree(monkeypatch, tmp_path):
    monkeypatch.setenv("DGR_CACHE", str(tmp_path))  # an empty cache: nothing is built there
    with pytest.raises(VendorError, match="not built .*python -m dgr.vendor build"):
        archs.generator()
    assert list(tmp_path.iterdir()) == []  # nothing was written on the way


def test_the_cache_keeps_one_vendor_keys_models():
    """Writing into the cache drops the generator workspaces of other llama.cpp builds."""
    v = archs._vendor()
    stale = v.cache / "archs-0000000000000000"
    (stale / "models-x").mkdir(parents=True, exist_ok=True)
    (stale / "models-x" / "m.gguf").write_bytes(b"GGUF")
    archs.write("^llama$")  # cached or written: either way the stale workspace goes
    assert not stale.exists()
    assert archs._workspace(v).is_dir()

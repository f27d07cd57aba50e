"""Regenerate ``dgr/_proto`` from ``proto/dgr.proto``: ``python -m dgr.transport.codegen``.

The generated modules are committed, and this command reproduces them byte for byte with the
generator that wrote them: ``grpcio-tools`` at the version the ``test`` extra of
``pyproject.toml`` pins (the one definition of it). Each release of the generator stamps its
own version into the code, so an unpinned one would make the committed files look stale with
no change of the proto.

``--check`` generates afresh and compares with the committed files, the generators' version
stamps set aside: it fails on a real difference of the proto (or of the generated code's
shape), not on a release of the tool. Writing refuses any generator but the pinned one. To
move the pin: change it in pyproject.toml, install it, regenerate, and raise the runtime floors
of ``grpcio`` and ``protobuf`` (and protobuf's bound below the next major) to what the new
gencode checks at import (``GRPC_GENERATED_VERSION`` in ``dgr_pb2_grpc.py``,
``ValidateProtobufRuntimeVersion`` in ``dgr_pb2.py``); ``tests/unit/test_transport_status.py``
holds them together.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "dgr" / "_proto"
PYPROJECT = ROOT / "pyproject.toml"
FILES = ("dgr_pb2.py", "dgr_pb2.pyi", "dgr_pb2_grpc.py", "__init__.py")

_INIT = '"""Generated protobuf/gRPC code for proto/dgr.proto (python -m dgr.transport.codegen)."""\n'

#: Where a generator writes its own version into the code: grpcio-tools' gRPC stub, protoc's
#: header line and the runtime check of the message module.
_STAMPS = (
    (re.compile(r"^(GRPC_GENERATED_VERSION = )'[^']*'$", re.M), r"\1'<version>'"),
    (re.compile(r"^(# Protobuf Python Version: ).*$", re.M), r"\1<version>"),
    (re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.\w+,)"
                r"\s*\d+,\s*\d+,\s*\d+,\s*'[^']*',"), r"\1 <version>,"),
)


class CodegenError(Exception):
    """The generator is missing, or not the pinned one."""


def pinned_generator(pyproject: Path = PYPROJECT) -> str:
    """The ``grpcio-tools`` version the test extra pins (``grpcio-tools==X``)."""
    m = re.search(r"""["']grpcio-tools==([0-9][0-9A-Za-z.]*)["']""", pyproject.read_text())
    if not m:
        raise CodegenError(f"{pyproject} pins no grpcio-tools version (grpcio-tools==X in the "
                           "test extra): the committed gencode is that version's output")
    return m.group(1)


def installed_generator() -> str:
    from importlib import metadata

    try:
        return metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        raise CodegenError("grpcio-tools is not installed: pip install -e '.[test]' installs "
                           "the pinned version") from None


def generated_stamp(out: Path = OUT_DIR) -> str:
    """The grpcio-tools version the gencode in ``out`` says wrote it."""
    m = _STAMPS[0][0].search((out / "dgr_pb2_grpc.py").read_text())
    if not m:
        raise CodegenError(f"{out / 'dgr_pb2_grpc.py'} has no GRPC_GENERATED_VERSION")
    return m.group(0).split("'")[1]


def unstamped(text: str) -> str:
    """``text`` with every generator version stamp replaced by ``<version>``."""
    for pattern, repl in _STAMPS:
        text = pattern.sub(repl, text)
    return text


def generate(out: Path, proto_dir: Path = PROTO_DIR) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}",
        f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
        str(proto_dir / "dgr.proto"),
    ])
    if rc != 0:
        raise CodegenError(f"protoc failed with status {rc}")
    # protoc writes a top-level import (`import dgr_pb2`); make it package-relative.
    g = out / "dgr_pb2_grpc.py"
    g.write_text(re.sub(r"^import dgr_pb2 as", "from . import dgr_pb2 as", g.read_text(),
                        flags=re.M))
    (out / "__init__.py").write_text(_INIT)


def differing(fresh: Path, committed: Path) -> list[str]:
    """The files of ``committed`` that differ from ``fresh`` once stamps are set aside."""
    return [f for f in FILES
            if not (committed / f).exists()
            or unstamped((committed / f).read_text()) != unstamped((fresh / f).read_text())]


def check(proto_dir: Path = PROTO_DIR, out: Path = OUT_DIR) -> int:
    installed = installed_generator()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp), proto_dir)
        stale = differing(Path(tmp), out)
    if stale:
        print(f"{out} is stale: {', '.join(stale)} differ from {proto_dir / 'dgr.proto'} "
              "(version stamps aside); run python -m dgr.transport.codegen", file=sys.stderr)
        if installed != generated_stamp(out):
            print(f"  (grpcio-tools {installed} is installed, the committed code was written by "
                  f"{generated_stamp(out)}: a generator's new release may write other code)",
                  file=sys.stderr)
        return 1
    print(f"{out} matches {proto_dir / 'dgr.proto'} (generated by grpcio-tools {installed})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgr.transport.codegen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="compare a fresh generation with the committed files, version stamps "
                         "aside; exit 1 on a difference")
    ap.add_argument("--proto-dir", type=Path, default=PROTO_DIR, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        if args.check:
            return check(args.proto_dir, args.out_dir)
        pin, installed = pinned_generator(), installed_generator()
        if installed != pin:
            raise CodegenError(f"grpcio-tools {installed} is installed; pyproject.toml pins "
                               f"{pin}, which wrote the committed code: pip install "
                               f"grpcio-tools=={pin}, or move the pin first (see --help)")
        args.out_dir.mkdir(exist_ok=True)
        generate(args.out_dir, args.proto_dir)
    except CodegenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"generated {', '.join(FILES)} in {args.out_dir} with grpcio-tools {installed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

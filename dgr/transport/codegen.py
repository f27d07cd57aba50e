"""Regenerate ``dgr/_proto`` from ``proto/dgr.proto``: ``python -m dgr.transport.codegen``.

Needs ``grpcio-tools`` (in the ``test`` extra). The generated modules are committed; this
command reproduces them. The runtime floor for ``protobuf`` in pyproject.toml must be at least
the version the gencode checks (``_runtime_version.ValidateProtobufRuntimeVersion`` in
``dgr_pb2.py``); ``--check`` fails when the committed files differ from a fresh generation.
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
FILES = ("dgr_pb2.py", "dgr_pb2.pyi", "dgr_pb2_grpc.py")

_INIT = '"""Generated protobuf/gRPC code for proto/dgr.proto (python -m dgr.transport.codegen)."""\n'


def generate(out: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}",
        f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
        str(PROTO_DIR / "dgr.proto"),
    ])
    if rc != 0:
        raise SystemExit(f"protoc failed with status {rc}")
    # protoc writes a top-level import (`import dgr_pb2`); make it package-relative.
    g = out / "dgr_pb2_grpc.py"
    g.write_text(re.sub(r"^import dgr_pb2 as", "from . import dgr_pb2 as", g.read_text(),
                        flags=re.M))
    (out / "__init__.py").write_text(_INIT)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgr.transport.codegen", description=__doc__)
    ap.add_argument("--check", action="store_true",
                    help="compare a fresh generation with the committed files; exit 1 on a diff")
    args = ap.parse_args(argv)
    if not args.check:
        OUT_DIR.mkdir(exist_ok=True)
        generate(OUT_DIR)
        print(f"generated {', '.join(FILES)} in {OUT_DIR}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [f for f in (*FILES, "__init__.py")
                 if not (OUT_DIR / f).exists()
                 or (OUT_DIR / f).read_bytes() != (Path(tmp) / f).read_bytes()]
    if stale:
        print(f"dgr/_proto is stale: {', '.join(stale)} differ; run python -m dgr.transport.codegen",
              file=sys.stderr)
        return 1
    print("dgr/_proto matches proto/dgr.proto")
    return 0


if __name__ == "__main__":
    sys.exit(main())

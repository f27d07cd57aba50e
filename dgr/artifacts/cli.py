"""The command line: ``python -m dgr artifacts {manifest,verify,slice}`` (``add_subparser``)
and ``python -m dgr.artifacts ...`` (``main``)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from dgr.artifacts.manifest import DEFAULT_CHUNK_SIZE, TENSOR_HASHES, build_manifest, write_manifest
from dgr.artifacts.slice import slice_model
from dgr.artifacts.store import resolve_output
from dgr.artifacts.verify import verify
from dgr.errors import DgrError

__all__ = ["add_subparser", "main"]


def _parse_range(s: str) -> tuple[int, int]:
    try:
        a, b = s.split(":")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (e.g. 0:10), got {s!r}") from None


def _parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]i?B?)?", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 64MiB, got {s!r}")
    unit = (m.group(2) or "").upper()[:1]
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]


def _build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument("--store", metavar="DIR", default=None,
                       help="artifact store: a relative --out is written here (default: "
                            "$DGR_STORE, else the current directory); nothing under /home")
    sub = p.add_subparsers(dest="artifacts_cmd", required=True)
    mk = sub.add_parser("manifest", parents=[store],
                        help="hash a model's files into a JSON manifest",
                        description="Hash a model (a GGUF, or a split GGUF: give any split or "
                                    "all of them) into a manifest: files, chunks, tensors, "
                                    "identity (docs/artifacts.md).")
    mk.add_argument("paths", nargs="+", metavar="PATH")
    mk.add_argument("--out", help="write here (default: stdout)")
    mk.add_argument("--chunk-size", type=_parse_size, default=DEFAULT_CHUNK_SIZE,
                    help="verification chunk, e.g. 64MiB (default)")
    mk.add_argument("--tensor-hash", choices=TENSOR_HASHES, default="sha256")
    mk.add_argument("--quiet", action="store_true", help="no progress bar")
    vf = sub.add_parser("verify", help="check files against a manifest (resumable)",
                        description="Verify model files against a manifest with a progress "
                                    "bar; progress is journaled so an interrupted run resumes. "
                                    "Exit status 1 names every missing, truncated or "
                                    "different file, header or tensor.")
    vf.add_argument("manifest", metavar="MANIFEST")
    vf.add_argument("--dir", help="directory holding the files (default: the manifest's)")
    vf.add_argument("--model", help="check this artifact instead: a file of the model or a "
                                    "dgr slice of it")
    vf.add_argument("--range", type=_parse_range, metavar="A:B",
                    help="only what a stage owning layers [A, B) loads, plus every header")
    vf.add_argument("--journal", help="journal file (default: $DGR_CACHE/artifacts/...)")
    vf.add_argument("--no-journal", action="store_true", help="neither read nor write one")
    vf.add_argument("--fresh", action="store_true", help="ignore earlier progress")
    vf.add_argument("--threads", type=int, default=None, help="parallel chunk hashing")
    vf.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    vf.add_argument("--quiet", action="store_true", help="no progress bar")
    sl = sub.add_parser("slice", parents=[store],
                        help="write a GGUF with only one stage's tensors",
                        description="Write a GGUF holding the tensors a stage owning layers "
                                    "[A, B) loads (plus the embeddings on the first stage and "
                                    "the head on the last), the full metadata and the range.")
    sl.add_argument("model", metavar="MODEL")
    sl.add_argument("--layers", type=_parse_range, required=True, metavar="A:B")
    sl.add_argument("--out", required=True)
    sl.add_argument("--manifest", help="check the copied tensors against this manifest")
    sl.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
    return p


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Register ``artifacts`` on a parent CLI's subparsers (``python -m dgr artifacts``)."""
    p = subparsers.add_parser("artifacts", help="model manifests, verification, slices",
                              description="Model artifacts: hashed manifests, resumable "
                                          "verification, split GGUFs, per-range slices.")
    return _build_parser(p)


def _run(args) -> int:
    try:
        if args.artifacts_cmd in ("manifest", "slice") and args.out is not None:
            args.out = str(resolve_output(args.out, args.store))  # refused under /home
        if args.artifacts_cmd == "manifest":
            data = build_manifest(args.paths, chunk_size=args.chunk_size,
                                  tensor_hash=args.tensor_hash, progress=not args.quiet)
            text = write_manifest(data, args.out)
            if args.out is None:
                sys.stdout.write(text)
            else:
                print(f"{args.out}: {len(data['files'])} file(s), {len(data['tensors'])} "
                      f"tensors, {data['identity']}", file=sys.stderr)
            return 0
        if args.artifacts_cmd == "verify":
            journal = False if args.no_journal else args.journal
            rep = verify(args.manifest, dir=args.dir, model=args.model, layers=args.range,
                         journal=journal, fresh=args.fresh, threads=args.threads,
                         progress=not args.quiet)
            if args.json:
                print(json.dumps(rep.to_dict(), indent=1))
            what = f"layers [{rep.layers[0]}, {rep.layers[1]})" if rep.layers else "everything"
            if rep.ok:
                print(f"ok: {what} of {rep.identity}; {rep.bytes_read / 2**20:.1f} MiB hashed, "
                      f"{rep.bytes_journal / 2**20:.1f} MiB verified earlier (journal), "
                      f"{rep.seconds:.2f} s", file=sys.stderr)
                return 0
            print(f"FAILED: {what} of {rep.identity}:", file=sys.stderr)
            for p in rep.problems:
                print(f"  {p}", file=sys.stderr)
            return 1
        info = slice_model(args.model, args.layers, args.out, manifest=args.manifest,
                           progress=not args.quiet)
        print(f"{info['path']}: layers [{info['layers'][0]}, {info['layers'][1]}), "
              f"{info['tensors']} tensors, {info['size'] / 2**20:.1f} MiB "
              f"({info['needed_bytes'] / 2**20:.1f} MiB needed), slice of {info['source']}",
              file=sys.stderr)
        return 0
    except DgrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """``python -m dgr.artifacts {manifest,verify,slice}``."""
    p = _build_parser(argparse.ArgumentParser(
        prog="python -m dgr artifacts",
        description="Model artifacts: hashed manifests, resumable verification, split GGUFs, "
                    "per-range slices."))
    args = p.parse_args(argv)
    return args.func(args)

"""``python -m dgr.vendor``: the vendor pipeline's command line (fetch, patch, build, verify,
status, pin, path, pack, bump). Standard library only, as the pipeline."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dgr.errors import VendorError
from dgr.vendor import BACKENDS, PREPARED_EXCLUDE, Vendor

__all__ = ["main"]

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dgr.vendor",
        description="Fetch, patch and build the llama.cpp pinned by vendor-manifest.json into "
                    "$DGR_CACHE (default ~/.cache/dgr). Each step runs the ones before it when "
                    "needed and reuses what is current.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", choices=list(BACKENDS), default=None,
                        help="the ggml backend built beside the CPU one (default: $DGR_BACKEND, "
                             "else the one this checkout's compiled core was built with, else "
                             "cpu); each backend builds in its own cached workspace")
    commands = {
        "fetch": "download the pinned sdist with pip, check sha256, unpack llama.cpp",
        "patch": "apply patches/NNNN-*.patch in manifest order",
        "build": "build static PIC libraries (CMAKE_ARGS passes through; DGR_CPU_VARIANT="
                 "x86-64-v3 builds the portable CPU baseline instead of -march=native)",
        "verify": "check the archive, patches and build against the manifest",
        "status": "print commit, patch-stack hash, cache path and build state",
        "pin": "rewrite the manifest's patch list (sha256) from patches/",
    }
    parsers = {name: sub.add_parser(name, parents=[common], help=text)
               for name, text in commands.items()}
    parsers["build"].add_argument(
        "--tools", default="",
        help="comma-separated upstream programs to build too, e.g. "
             "llama-completion,llama-simple,llama-bench,ggml-rpc-server")
    sub.add_parser("path", parents=[common], help="print the workspace path (for scripts)")
    pk = sub.add_parser("pack", parents=[common],
                        help="write the prepared source archive (the pinned tree less docs and "
                             "test vocabularies) for a machine without a package registry: "
                             "DGR_VENDOR_ARCHIVE=PATH builds from it")
    pk.add_argument("dest", help="the .tar.gz to write")
    pk.add_argument("--pin", action="store_true",
                    help="also pin its tree's sha256 in vendor-manifest.json (prepared)")
    bp = sub.add_parser("bump", help="try the patch stack on another llama-cpp-python sdist's "
                                     "llama.cpp in a scratch workspace, and report each patch "
                                     "(applied, with fuzz, failed); changes nothing here")
    bp.add_argument("--to", required=True, metavar="VERSION",
                    help="the llama-cpp-python version whose vendored llama.cpp to try")
    bp.add_argument("--commit", default="",
                    help="the llama.cpp commit that sdist vendors (for the report)")
    bp.add_argument("--workdir", help="the scratch workspace (default: a new temporary one)")
    bp.add_argument("--report", help="also write the report (Markdown) here")
    bp.add_argument("--check", action="store_true",
                    help="when the stack applies, prove it: build it in a scratch checkout and "
                         "venv, probe every architecture whole and split, run the parity suite")
    bp.add_argument("--write", action="store_true",
                    help="with --check (implied): write the new vendor-manifest.json and "
                         "docs/architectures.md here when every step passed")
    args = parser.parse_args(argv)
    if args.cmd == "bump":
        return _bump(args)
    try:
        v = Vendor(backend=args.backend)
        if args.cmd == "fetch":
            print(v.fetch())
        elif args.cmd == "patch":
            print(v.patch())
        elif args.cmd == "build":
            tools = [t for t in args.tools.split(",") if t]
            print(v.build(tools))
        elif args.cmd == "verify":
            problems = v.verify()
            for p in problems:
                print(f"FAIL {p}")
            if problems:
                return 1
            print(f"OK llama.cpp {v.commit} with {len(v.patches)} patches, built at {v.workspace}")
        elif args.cmd == "status":
            st = v.status()
            width = max(map(len, st))
            for k, val in st.items():
                print(f"{k:<{width}}  {val}")
        elif args.cmd == "pin":
            for p in v.pin():
                print(f"{p.sha256}  {p.file}")
        elif args.cmd == "path":
            print(v.workspace)
        elif args.cmd == "pack":
            path, tree = v.pack(Path(args.dest))
            pin = (v.manifest.get("prepared") or {}).get("tree_sha256")
            if args.pin:
                v.manifest["prepared"] = {"exclude": list(PREPARED_EXCLUDE), "tree_sha256": tree}
                (v.root / "vendor-manifest.json").write_text(
                    json.dumps(v.manifest, indent=2) + "\n")
            elif pin and pin != tree:
                print(f"error: the tree's sha256 {tree} is not the manifest's {pin}",
                      file=sys.stderr)
                return 1
            print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB), tree sha256 {tree}")
    except VendorError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _bump(args) -> int:
    from dgr.vendor import repo_root
    from dgr.vendor.bump import bump, prove, report_markdown, write_pin

    try:
        r = bump(args.to, commit=args.commit,
                 workdir=Path(args.workdir) if args.workdir else None)
        if r["applies"] and (args.check or args.write):
            print(report_markdown(r, advice=False), end="", file=sys.stderr)  # the patches' part, at once
            r["steps"] = prove(r)
    except VendorError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = report_markdown(r)
    print(text, end="")
    if args.report:
        Path(args.report).write_text(text)
    proved = not r["steps"] or all(st.ok for st in r["steps"])
    if args.write and r["steps"] and proved and not r["same"]:
        for path in write_pin(r, repo_root()):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if r["applies"] and proved else 1

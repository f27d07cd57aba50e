"""A benchmark's function run in a fresh Python process, its JSON result read back.

Some measurements must not share a process with what else a benchmark holds open (the whole
model measured apart from a route's driver, an engine that must start cold). ``call`` runs
``python -m harness.fresh MODULE FUNCTION`` in ``benches/`` (so ``MODULE`` is any benchmark
script or harness module, imported by name), passes the arguments as JSON on stdin and reads
the function's JSON-able result from a file: whatever the function prints stays its own.

    out = fresh.call("compare", "whole_measure", 64, [128, 512], set={"MODEL": path})
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile

BENCHES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def call(module: str, function: str, *args, set: dict | None = None,  # noqa: A002
         timeout: float = 600, **kwargs):
    """``module.function(*args, **kwargs)`` in a fresh process; its result as JSON gives it.

    ``set``: module attributes to set before the call (e.g. ``{"MODEL": path}``). Raises
    RuntimeError with the child's stderr when it fails."""
    with tempfile.TemporaryDirectory(prefix="dgr-fresh-") as tmp:
        out = os.path.join(tmp, "result.json")
        request = json.dumps({"args": list(args), "kwargs": kwargs, "set": set or {},
                              "out": out})
        done = subprocess.run([sys.executable, "-m", "harness.fresh", module, function],
                              input=request, capture_output=True, text=True, cwd=BENCHES,
                              timeout=timeout)
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{module}.{function} in a fresh process failed "
                               f"({done.returncode}):\n{done.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m harness.fresh MODULE FUNCTION  (a JSON request on stdin)",
              file=sys.stderr)
        return 2
    module, function = argv
    request = json.load(sys.stdin)
    mod = importlib.import_module(module)
    for name, value in request["set"].items():
        setattr(mod, name, value)
    result = getattr(mod, function)(*request["args"], **request["kwargs"])
    with open(request["out"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

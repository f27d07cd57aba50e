"""The arguments every benchmark script shares, declared once.

    ap = cli.parser(__doc__, stages=3, rounds=5, json=True)
    ap.add_argument("--tokens", ...)  # the script's own
    args = ap.parse_args(argv)
    ...
    cli.write_json(args.json, results)

``--stages`` takes the type of its default: an int (one route's stage count) or a string of
comma-separated counts (``"2,3,4"``, read with ``counts``)."""

from __future__ import annotations

import argparse
import json as _json


def parser(doc: str, *, stages: int | str | None = None, rounds: int | None = None,
           json: bool = False, **kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser described by ``doc``'s first paragraph, with the shared arguments
    asked for: ``--stages`` (default ``stages``), ``--rounds`` (default ``rounds``) and
    ``--json PATH``. ``kwargs`` go to ArgumentParser (e.g. ``formatter_class``)."""
    kwargs.setdefault("description", doc.split("\n\n")[0])
    ap = argparse.ArgumentParser(**kwargs)
    if isinstance(stages, str):
        ap.add_argument("--stages", default=stages,
                        help=f"comma-separated stage counts, one route each (default {stages})")
    elif stages is not None:
        ap.add_argument("--stages", type=int, default=stages,
                        help=f"stages of the route (default {stages})")
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds,
                        help=f"interleaved rounds; figures are their medians (default {rounds})")
    if json:
        ap.add_argument("--json", metavar="PATH", help="also write every figure here as JSON")
    return ap


def counts(text: str) -> list[int]:
    """``"2,3,4"`` -> [2, 3, 4]."""
    return [int(x) for x in text.split(",") if x.strip()]


def write_json(path: str | None, data, indent: int | None = 1) -> None:
    """Write ``data`` as JSON to ``path`` (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            _json.dump(data, f, indent=indent)

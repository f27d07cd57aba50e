"""The command line's speculative-decoding options (docs/speculative.md), shared by
``run``, ``generate`` and ``serve`` (``RouteConfig.from_args`` reads them)."""

from __future__ import annotations

__all__ = ["add_speculate_arguments"]


def add_speculate_arguments(p) -> None:
    """``--speculate`` and ``--max-draft``: speculative decoding in the decode loop."""
    p.add_argument("--speculate", choices=["off", "ngram", "mtp"], default="off",
                   help="speculative decoding (docs/speculative.md): the last stage drafts the "
                        "next tokens and one ring trip verifies them, so a trip can make "
                        "several tokens (the same tokens as without). ngram: drafts from the "
                        "session's own tokens (repeated text, code edits); mtp: from the "
                        "model's multi-token-prediction block (the last worker runs --mtp). "
                        "Default off")
    p.add_argument("--max-draft", type=int, default=8, metavar="K",
                   help="at most K drafts per trip (default 8; the last stage adapts the "
                        "number to what is accepted, down to none)")

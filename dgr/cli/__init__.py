"""The command line: ``python -m dgr`` (the demo, generation, artifacts, certification)."""

from dgr.cli.commands import main

__all__ = ["main"]

"""The command lines and the classes they configure are one set of options: every worker
flag that sets a ``Worker`` keyword maps to it in one place (``dgr.worker.main.WORKER_OPTIONS``),
and a flag's default is the keyword's own default, so a worker started from the command line
and one built in code (``ThreadedWorker``, the SDK, tests) behave alike; the same for the
route options of ``run``, ``generate`` and ``serve``."""

from __future__ import annotations

import inspect

from dgr.worker import main
from dgr.worker.stage import Worker

PARAMS = inspect.signature(Worker.__init__).parameters
#: Worker's keywords the command line sets elsewhere (parsed and checked on their own) or not
#: at all: --relay-allow and the security group; the name is the bound address; the frame cap
OTHERWISE = {"relay_allow", "security", "name", "max_message"}


def test_the_flags_defaults_are_the_workers_own(monkeypatch):
    monkeypatch.delenv("DGR_CERT_STORE", raising=False)
    got = main.worker_options(main.build_parser().parse_args([]))
    for name, value in got.items():
        assert name in PARAMS, name
        assert value == PARAMS[name].default, (name, value, PARAMS[name].default)


def test_every_keyword_of_the_worker_is_mapped_or_named():
    keywords = set(PARAMS) - {"self", "engine"}
    assert keywords - set(main.WORKER_OPTIONS) == OTHERWISE
    assert set(main.WORKER_OPTIONS) <= keywords


def test_flags_reach_the_keywords():
    args = main.build_parser().parse_args(
        ["--ttl", "7", "--evict-after", "2", "--no-batching", "--no-ring-groups", "--frames",
         "python", "--busy-poll-us", "500", "--inline-compute", "--inline-below-ms", "1.5",
         "--max-sessions-per-credential", "3", "--max-queued-per-credential", "4",
         "--cert-store", "/tmp/certs", "--prefix-entries", "5"])
    assert main.worker_options(args) == {
        "ttl": 7.0, "evict_after": 2.0, "batching": False, "ring_groups": False,
        "native_frames": False, "busy_poll_s": 5e-4, "inline": True, "inline_below_ms": 1.5,
        "max_sessions_per_credential": 3, "max_queued_per_credential": 4,
        "cert_store": "/tmp/certs", "prefix_entries": 5}


def test_the_route_flags_defaults_are_the_routes_own():
    """``run``, ``generate`` and ``serve`` give ``AsyncRoute`` its speculation keywords
    (``dgr.cli.speculate``); left at their defaults they are the route's own."""
    import argparse

    from dgr.cli.speculate import add_speculate_arguments, speculate_of
    from dgr.driver.async_route import AsyncRoute

    p = argparse.ArgumentParser()
    add_speculate_arguments(p)
    params = inspect.signature(AsyncRoute.__init__).parameters
    for name, value in speculate_of(p.parse_args([])).items():
        assert value == params[name].default, (name, value, params[name].default)

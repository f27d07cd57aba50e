"""The command lines and the classes they configure are one set of options: every worker
flag that sets a ``WorkerConfig`` field maps to it in one place (``dgr.worker.config
.WORKER_FLAGS``), and a flag's default is the field's own default, so a worker started from the
command line and one built in code (``ThreadedWorker``, the SDK, tests) behave alike; the same
for the route options of ``run``, ``generate`` and ``serve`` (``RouteConfig``)."""

from __future__ import annotations

import inspect

import pytest

from dgr import errors
from dgr.worker import main
from dgr.worker.config import WORKER_FLAGS, WorkerConfig
from dgr.worker.worker import Worker

FIELDS = WorkerConfig.__dataclass_fields__
#: WorkerConfig's fields the command line does not set: the frame cap
NOT_FLAGS = {"max_message"}


def test_the_flags_defaults_are_the_workers_own(monkeypatch):
    monkeypatch.delenv("DGR_CERT_STORE", raising=False)
    assert WorkerConfig.from_args(main.build_parser().parse_args([])) == WorkerConfig()


def test_every_setting_is_a_flag_or_named_and_the_worker_takes_the_rest_as_objects():
    assert set(FIELDS) - set(WORKER_FLAGS) == NOT_FLAGS
    assert set(WORKER_FLAGS) <= set(FIELDS)
    params = set(inspect.signature(Worker.__init__).parameters)
    assert params == {"self", "engine", "config", "name", "security", "relay_allow",
                      "settings"}


def test_flags_reach_the_settings():
    args = main.build_parser().parse_args(
        ["--ttl", "7", "--evict-after", "2", "--no-batching", "--no-ring-groups", "--frames",
         "native", "--busy-poll-us", "500", "--inline-compute", "--inline-below-ms", "1.5",
         "--max-sessions-per-credential", "3", "--max-queued-per-credential", "4",
         "--cert-store", "/tmp/certs", "--prefix-entries", "5"])
    assert WorkerConfig.from_args(args) == WorkerConfig(
        ttl=7.0, evict_after=2.0, batching=False, ring_groups=False, native_frames=True,
        busy_poll_s=5e-4, inline=True, inline_below_ms=1.5, max_sessions_per_credential=3,
        max_queued_per_credential=4, cert_store="/tmp/certs", prefix_entries=5)
    assert not WorkerConfig.from_args(main.build_parser().parse_args(
        ["--frames", "python"])).native_frames


@pytest.mark.parametrize("bad", [dict(ttl=0), dict(evict_after=-1), dict(busy_poll_s=-1e-6),
                                 dict(prefix_entries=-1), dict(max_sessions_per_credential=0),
                                 dict(busy_poll_s=1e-4, native_frames=False),
                                 dict(inline_below_ms=-1)])
def test_a_bad_setting_is_refused(bad):
    with pytest.raises(errors.InvalidArgument):
        WorkerConfig(**bad)
    with pytest.raises(errors.InvalidArgument, match="unknown worker setting.*tll"):
        WorkerConfig().with_(tll=3)


def test_the_route_flags_defaults_are_the_routes_own():
    """``run``, ``generate`` and ``serve`` build the route's ``RouteConfig`` from their flags
    (``ROUTE_FLAGS``); left at their defaults they are the config's own."""
    from dgr.cli.commands import build_parser
    from dgr.driver.config import ROUTE_FLAGS, RouteConfig

    fields = set(RouteConfig.__dataclass_fields__)
    assert set(ROUTE_FLAGS) <= fields
    base = {"run": [], "generate": ["--route", "127.0.0.1:1"], "serve": []}
    for cmd, extra in base.items():
        args = build_parser().parse_args([cmd, *extra])
        assert RouteConfig.from_args(args) == RouteConfig(), cmd
    # and the flags reach the config
    args = build_parser().parse_args(
        ["generate", "--route", "127.0.0.1:1", "--timeout", "3", "--relay", "off", "--codec",
         "f16", "--speculate", "ngram", "--max-draft", "4", "--mixed-devices"])
    assert RouteConfig.from_args(args) == RouteConfig(
        timeout=3.0, relay=False, codec="f16", speculate="ngram", max_draft=4,
        mixed_devices=True)


def test_a_route_config_refuses_what_it_cannot_do():
    from dgr import errors
    from dgr.driver.async_route import AsyncRoute
    from dgr.driver.config import RouteConfig

    for bad in (dict(codec="zip"), dict(relay=True, codec="q8"), dict(loop_window=0),
                dict(speculate="magic"), dict(max_draft=0), dict(timeout=0),
                dict(max_retries=-1)):
        with pytest.raises((errors.InvalidArgument, errors.UnknownCodec)):
            RouteConfig(**bad)
    with pytest.raises(errors.InvalidArgument, match="unknown route setting.*relai"):
        AsyncRoute(["127.0.0.1:1"], relai=False)
    # keywords change the given config; the route's attributes are the settings
    r = AsyncRoute(["127.0.0.1:1"], config=RouteConfig(batching=False), relay=False,
                   spares=["127.0.0.1:2"])
    assert r.config == RouteConfig(batching=False, relay=False, spares=("127.0.0.1:2",))
    assert (r.batching, r.relay, r.timeout) == (False, False, RouteConfig().timeout)
    assert not RouteConfig(codec="f16").relay_wanted and RouteConfig().relay_wanted


def test_every_flag_has_its_name_for_the_errors():
    from dgr.worker.config import FLAG_NAMES

    assert set(FLAG_NAMES) == set(WORKER_FLAGS)
    options = {o for a in main.build_parser()._actions for o in a.option_strings}
    assert set(FLAG_NAMES.values()) <= options

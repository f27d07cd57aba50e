"""The embedded route provider: a static pool with spares per layer range (no workers)."""

import asyncio

import pytest

from dgr import errors
from dgr.driver.provider import RouteProvider, StaticPool


def run(coro):
    return asyncio.run(coro)


def pool():
    return StaticPool(["a:1", "b:1", "b2:1", "c:1"],
                      layers={"a:1": (0, 1), "b:1": (1, 3), "b2:1": (1, 3), "c:1": (3, 4)})


def test_route_covers_every_layer_once_with_the_preferred_workers():
    assert run(pool().route()) == ["a:1", "b:1", "c:1"]


def test_a_failed_worker_ranks_last_and_the_route_avoids_it():
    p = pool()
    p.report_failure("b:1", (1, 3), errors.WorkerUnavailable("gone"))
    assert run(p.candidates((1, 3))) == ["b2:1", "b:1"]
    assert run(p.route()) == ["a:1", "b2:1", "c:1"]
    p.report_failure("b2:1", (1, 3), errors.StepDeadlineExceeded("slow"))
    assert run(p.candidates((1, 3))) == ["b:1", "b2:1"]  # the longest ago failed first
    assert p.failures() == {"a:1": 0, "b:1": 1, "b2:1": 1, "c:1": 0}


def test_candidates_serve_exactly_the_range():
    assert run(pool().candidates((0, 1))) == ["a:1"]
    assert run(pool().candidates((0, 3))) == []


def test_a_range_nobody_serves_is_named():
    p = StaticPool(["a:1", "c:1"], layers={"a:1": (0, 1), "c:1": (3, 4)})
    with pytest.raises(errors.NoHealthyWorker, match="layers starting at 1"):
        run(p.route())


def test_unreachable_pool_is_reported():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    p = StaticPool([f"127.0.0.1:{port}"], describe_timeout=0.5)
    with pytest.raises(errors.NoHealthyWorker, match="could be reached"):
        run(p.route())


def test_the_interface_is_abstract():
    with pytest.raises(TypeError):
        RouteProvider()

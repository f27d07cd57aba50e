"""A pytest plugin (the suite's ``tests/conftest.py`` loads it): the garbage is collected
after every test, so a test that leaks an open socket or file in a reference cycle fails
itself, every run, with the ResourceWarning the suite turns into an error.

Without it the collector runs when allocations happen to trigger it, and the warning fails
whichever later test is running then (seen: a system test's unclosed client socket failed a
test of another module, once in a clean-clone run). The objects alive once the tests are
collected (imported modules: about 230k with the API clients) are frozen out of every
collection (``gc.freeze``) until the session ends, so a collection after a test costs
milliseconds, not 100 ms.
"""

from __future__ import annotations

import gc

import pytest

try:  # pytest's own reader of what the collector raised (pytest >= 8.4; a private module)
    from _pytest.unraisableexception import collect_unraisable
except ImportError:  # then pytest reports it at the next test's setup, still every run
    collect_unraisable = None


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session) -> None:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    # frozen objects are invisible to gc.get_referrers, which a plugin imported late (for
    # its summary) may rely on: hypothesis's register_random warns then
    gc.unfreeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    # after the fixtures this test ends are torn down (the runner's own teardown runs first);
    # pytest has already read this phase's unraisable exceptions, so read them again: the
    # leak is this test's teardown error
    gc.collect()
    if collect_unraisable is not None:
        collect_unraisable(item.config)

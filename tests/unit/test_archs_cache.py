"""The generator's model workspaces in ``$DGR_CACHE`` (dgr.testing.archs): a process that uses
one holds it, and another build's prune of other keys' workspaces leaves a held one alone (a
suite on one checkout once lost its fixtures mid-run to a build of another)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

from dgr.testing import archs

HOLD = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); "
        "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(120)")


class _Vendor:
    def __init__(self, cache):
        self.cache = cache

    def key(self):
        return "current"


def test_a_prune_keeps_the_workspace_another_process_holds(tmp_path):
    held, idle, unlocked, current = (tmp_path / f"archs-{k}"
                                     for k in ("held", "idle", "unlocked", "current"))
    for d in (held, idle, unlocked, current):
        d.mkdir()
        (d / "m.gguf").write_bytes(b"model")
    (idle / archs._LOCK).touch()  # a lock file nobody holds any more
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(held / archs._LOCK)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "held\n"
        archs._prune_other_keys(_Vendor(tmp_path))
        assert held.exists() and current.exists()
        assert not idle.exists() and not unlocked.exists()
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    archs._prune_other_keys(_Vendor(tmp_path))  # its holder is gone
    assert not held.exists() and current.exists()


def test_a_process_holds_the_workspace_it_uses_until_it_exits(tmp_path):
    ws = tmp_path / "archs-x"
    archs._hold(ws)
    try:
        fd = os.open(ws / archs._LOCK, os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("an exclusive lock was granted on a held workspace")
            except BlockingIOError:
                pass
        finally:
            os.close(fd)
        archs._hold(ws)  # once per process
        assert list(archs._HELD).count(ws) == 1
    finally:
        os.close(archs._HELD.pop(ws))

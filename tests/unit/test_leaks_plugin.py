"""dgr.testing.leaks (loaded by tests/conftest.py): a test that leaks a socket in a reference
cycle fails its own teardown, every run, and the next test passes."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LEAKY = '''
import socket


class Cycle:
    def __init__(self):
        self.me = self
        self.sock = socket.socket()


def test_leaks():
    Cycle()


def test_next():
    pass
'''


def _run(tmp_path, plugin: bool):
    (tmp_path / "conftest.py").write_text(
        'pytest_plugins = ["dgr.testing.leaks"]\n' if plugin else "")
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "no:hypothesispytest", "-o", "filterwarnings=error", "-rE", "test_leaky.py"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)})


def test_a_leaked_socket_fails_the_test_that_leaked_it(tmp_path):
    r = _run(tmp_path, plugin=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "ERROR at teardown of test_leaks" in r.stdout, r.stdout
    assert "unclosed <socket.socket" in r.stdout
    assert "2 passed, 1 error" in r.stdout  # test_next is not blamed


def test_without_it_no_test_is_blamed(tmp_path):
    """What the plugin changes: without it the cycle is not collected during the tests."""
    r = _run(tmp_path, plugin=False)
    assert "ERROR at teardown of test_leaks" not in r.stdout, r.stdout

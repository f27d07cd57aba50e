"""The Vulkan device of a test run (lavapipe on a machine without a GPU).

ggml lists a software Vulkan device (Mesa's lavapipe, ``llvmpipe``) only when
``GGML_VK_VISIBLE_DEVICES`` names it, and reads that variable once per process, when its
backend registry starts. Tests therefore run every Vulkan engine in a child process whose
environment names device 0 (:func:`vulkan_env`); the test process itself, and the upstream
tools the CPU tests run, keep the environment they had (a tool that saw lavapipe would
offload to it by default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

__all__ = ["vulkan_env", "vulkan_device", "NoVulkan"]


class NoVulkan(RuntimeError):
    """This build or machine has no Vulkan device (the message says which and what to do)."""


def vulkan_env(base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with ``GGML_VK_VISIBLE_DEVICES`` naming
    Vulkan device 0 unless it names devices already."""
    env = dict(os.environ if base is None else base)
    env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    return env


def vulkan_device(timeout: float = 120) -> dict:
    """The first Vulkan device a child process with :func:`vulkan_env` sees (a record of
    ``python -m dgr devices --json``).

    Raises
    ------
    NoVulkan
        The build has no Vulkan backend, or the machine no Vulkan device.
    """
    proc = subprocess.run([sys.executable, "-m", "dgr", "devices", "--json"], env=vulkan_env(),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise NoVulkan(f"python -m dgr devices failed: {proc.stderr.strip()[-500:]}")
    rec = json.loads(proc.stdout)
    if "Vulkan" not in rec["backends"]:
        raise NoVulkan("this build of dgr has no Vulkan backend (backends: "
                       f"{', '.join(rec['backends'])}): build it with `DGR_BACKEND=vulkan pip "
                       "install -e .` (the README's test command does)")
    devs = [d for d in rec["devices"] if d["backend"] == "Vulkan"]
    if not devs:
        raise NoVulkan("the Vulkan backend sees no device: install a Vulkan driver (Debian's "
                       "mesa-vulkan-drivers gives lavapipe; .ci/system-packages installs it)")
    return devs[0]

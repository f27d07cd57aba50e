"""Shared fixtures: generated tiny models, the registry's real model, upstream tools."""

from __future__ import annotations

import pytest

# the garbage collected after every test: a leaked socket or file fails the test that leaked it
pytest_plugins = ["dgr.testing.leaks"]


def pytest_addoption(parser):
    parser.addoption("--run-release", action="store_true",
                     help="also run the release tests (tests/release: the portable wheel, built "
                          "with its own llama.cpp: about 20 minutes cold on 2 cores)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-release"):
        return
    skip = pytest.mark.skip(reason="a release test: run with --run-release (it builds the "
                                   "portable wheel's llama.cpp)")
    for item in items:
        if "release" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A 4-layer random-weight llama GGUF (tied embeddings), written once per session."""
    from dgr.testing.fixtures import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_q8(tmp_path_factory):
    """The tiny llama with q8_0 matrices, written once per session: its one-row products take
    the many-row kernel's path (as SmolLM2's Q4_1 ones do), where f32 matrices take another."""
    from dgr.testing.fixtures import TinyLlama, write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("q8") / "tiny-q8.gguf",
                            TinyLlama(weight_type="q8_0"))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct Q4_1 from the model registry (fetched and verified if missing)."""
    from dgr.artifacts import models

    return models.path(models.DEFAULT_MODEL)


@pytest.fixture(scope="session")
def llama_tool():
    """Path of an upstream program built from the same patched tree (built on first use)."""
    from dgr.vendor import Vendor

    v = Vendor()

    def get(name: str):
        v.build(tools=[name])
        return v.tool_path(name)

    return get

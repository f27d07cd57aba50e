"""Fixtures of the unit tests."""

from __future__ import annotations

import threading

import pytest


class StandIn:
    """The engine facts a worker reads, none of them a default value."""

    settings = {"n_ctx": 96, "n_slots": 3, "n_threads": 2, "n_ubatch": 16, "flash_attn": False,
                "type_k": "q8_0", "type_v": "f32", "batch_invariant": True}
    layers = (2, 5)
    is_first, is_last, needs_token_ids = False, False, True
    n_embd_boundary, n_vocab, n_slots = 24, 40, 3

    def __init__(self):
        self.lock = threading.RLock()

    def describe(self):
        return {"identity": "sha256:standin", "model": "/nowhere/standin.gguf", "arch": "toy",
                "n_layer": 7, "add_bos": True, "weight_bytes": 11, "kv_bytes": 13}

    def is_eog(self, t):
        return t in (4, 9)

    def release(self, slot):
        pass


@pytest.fixture()
def stand_in() -> StandIn:
    """An engine with the facts a worker reads, none of them a default value; it computes
    nothing (no model)."""
    return StandIn()

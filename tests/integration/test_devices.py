"""Compute devices on every build: the registry's list, the CPU device's facts, typed errors
for a device this process cannot use, and a lost device (injected) refusing work."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr.core import backends
from dgr.testing.waits import wait_until

SETTINGS = dict(n_ctx=64, n_slots=2, n_threads=1, n_ubatch=16)


def test_the_cpu_is_listed_first_with_its_memory():
    devs = dgr.devices()
    cpu = devs[0]
    assert cpu["name"] == "cpu" and cpu["type"] == "cpu" and cpu["backend"] == "CPU"
    assert cpu["kind"] == "cpu" and cpu["software"] is False
    assert 0 < cpu["memory_free"] <= cpu["memory_total"]
    assert "CPU" in backends()


def test_the_devices_command_lists_what_this_build_can_use():
    out = subprocess.run([sys.executable, "-m", "dgr", "devices", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    rec = json.loads(out)
    assert rec["backends"] == backends()
    assert [d["name"] for d in rec["devices"]][0] == "cpu"
    table = subprocess.run([sys.executable, "-m", "dgr", "devices"], capture_output=True,
                           text=True, timeout=120, check=True).stdout
    assert table.startswith("backends in this build: ") and "\ncpu " in table


def test_the_cpu_engine_names_its_device_and_holds_every_byte_there(tiny_llama):
    eng = dgr.Engine(tiny_llama, device="CPU", **SETTINGS)  # any case
    f = eng.compute_facts()
    assert eng.device == "cpu" and eng.compute == "cpu"
    assert f["backend"] == "cpu" and f["type"] == "cpu" and not f["software"]
    info = eng.describe()
    assert f["weight_bytes"] == info["weight_bytes"] > 0
    assert f["kv_bytes"] == info["kv_bytes"] > 0
    assert info["compute"] == "cpu"


def test_an_unknown_device_is_a_typed_error_naming_the_usable_ones(tiny_llama):
    with pytest.raises(errors.DeviceNotFound, match="no device named 'gpu7'.*cpu"):
        dgr.Engine(tiny_llama, device="gpu7", **SETTINGS)


@pytest.mark.parametrize("device,backend", [("CUDA0", "CUDA"), ("ROCm0", "ROCm"),
                                            ("MTL0", "Metal"), ("Vulkan0", "Vulkan")])
def test_a_device_of_a_backend_this_build_lacks_says_which_build_has_it(tiny_llama, device,
                                                                         backend):
    if backend in backends():
        pytest.skip(f"this build carries the {backend} backend")
    with pytest.raises(errors.DeviceNotFound, match=f"needs the {backend} backend.*DGR_BACKEND="):
        dgr.Engine(tiny_llama, device=device, **SETTINGS)


def test_a_lost_device_clears_every_slot_and_refuses_all_compute(tiny_llama):
    eng = dgr.Engine(tiny_llama, **SETTINGS)
    toks = np.array([1, 2, 3], dtype=np.int32)
    eng.forward(0, 0, toks)
    assert eng.next_pos(0) == 3
    eng._inject_fault("device_lost")
    assert eng.next_pos(0) == 0  # the slot's state went with the device
    with pytest.raises(errors.DeviceLost, match="lost"):
        eng.forward(0, 0, toks)
    with pytest.raises(errors.DeviceLost):
        eng.forward_batch([0, 1], [0, 0], [1, 2])
    with pytest.raises(errors.DeviceLost):
        eng.truncate(0, 0)
    # a route treats it as a stage gone: fail over (DeviceLost is a WorkerUnavailable)
    assert issubclass(errors.DeviceLost, errors.WorkerUnavailable)
    with pytest.raises(errors.InvalidArgument, match="unknown fault"):
        eng._inject_fault("meteor")


def test_a_backend_saying_its_device_is_lost_is_recognised_and_the_engine_refuses(tiny_llama):
    """What a Vulkan backend throws on a lost device ("...: ErrorDeviceLost"), thrown inside
    the decode: the forward answers DeviceLost, the slots are gone, later calls refuse."""
    eng = dgr.Engine(tiny_llama, **SETTINGS)
    eng.forward(1, 0, np.array([4, 5], dtype=np.int32))
    eng._inject_fault("device_lost_in_decode")
    with pytest.raises(errors.DeviceLost, match="ErrorDeviceLost"):
        eng.forward(0, 0, np.array([1, 2, 3], dtype=np.int32))
    assert eng.next_pos(1) == 0
    with pytest.raises(errors.DeviceLost, match="lost"):
        eng.forward(0, 0, np.array([1], dtype=np.int32))


@pytest.mark.parametrize("relay", [False, None], ids=["grpc", "relay"])
def test_a_stage_whose_device_is_lost_fails_over_to_a_spare(tiny_llama, relay):
    """A lost device (injected) refuses every step with DeviceLost, a WorkerUnavailable: the
    route replaces the stage with its spare, re-prefills, and the tokens stay the whole
    model's."""
    from dgr.core.local import generate_local
    from dgr.driver.route import Route
    from dgr.worker.process import ThreadedWorker

    prompt = [1, 2, 3, 4, 5, 6, 7]
    ref, _ = generate_local(dgr.Engine(tiny_llama, **SETTINGS), prompt, max_tokens=12,
                            stop_on_eog=False)
    engines = [dgr.Engine(tiny_llama, layers=r, **SETTINGS) for r in ((0, 2), (2, 4), (2, 4))]
    ws = [ThreadedWorker(e) for e in engines]
    try:
        with Route([ws[0].address, ws[1].address], spares=[ws[2].address], relay=relay,
                   connect_timeout=10) as r:
            s = r.session()
            it = s.generate(prompt, max_tokens=12, stop_on_eog=False)
            got = [next(it) for _ in range(4)]
            engines[1]._inject_fault("device_lost_in_decode")
            got += list(it)
            assert got == ref
            assert r.stages[1].endpoint == ws[2].address  # the spare took the stage
            assert s.recoveries >= 1
        # the stage that lost its device takes itself out: draining, health NOT_SERVING
        assert ws[1].worker.pipeline.device_lost and ws[1].worker.pipeline.draining
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        def health():
            with grpc.insecure_channel(ws[1].address) as ch:
                return health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=10).status

        # the compute thread hands the change to the server's event loop: wait for it there
        wait_until(lambda: health() == health_pb2.HealthCheckResponse.NOT_SERVING,
                   "the stage whose device was lost answers health NOT_SERVING")
    finally:
        for w in ws:
            w.stop()

"""A lane's id is the hash of its record: the device fields join it only off the CPU, so a CPU
lane keeps the id it had before devices were recorded, and a device lane's id names its
device."""

from __future__ import annotations

import hashlib

import msgspec

from dgr.control.certificates import Lane, lane_id

CPU_LANE = dict(backend="cpu", model_identity="sha256:" + "0" * 64, model_name="m.gguf",
                quantisation="Q4_1", codec="raw",
                settings={"n_ctx": 64, "n_slots": 1, "n_threads": 1, "n_ubatch": 8,
                          "flash_attn": True, "type_k": "f16", "type_v": "f16"},
                stages=[[0, 2], [2, 4]])


def test_a_cpu_lane_keeps_its_id():
    lane = Lane(**CPU_LANE)
    # the record as written before the device fields existed, hashed as lane_id hashes it
    before = msgspec.json.encode(CPU_LANE, order="sorted")
    assert lane_id(lane) == hashlib.sha256(before).hexdigest()[:16]
    assert b"device" not in msgspec.json.encode(lane)


def test_a_device_lane_names_its_device_and_its_id_differs():
    vk = Lane(**{**CPU_LANE, "backend": "vulkan"}, device="llvmpipe (LLVM 15.0.6, 256 bits)",
              device_type="gpu", driver="llvmpipe Mesa 22.3.6", software_device=True)
    rec = msgspec.json.decode(msgspec.json.encode(vk), type=Lane)
    assert rec.software_device and rec.device.startswith("llvmpipe")
    assert lane_id(vk) != lane_id(Lane(**CPU_LANE))

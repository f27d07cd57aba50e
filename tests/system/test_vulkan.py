"""Vulkan stages on lavapipe (Mesa's Vulkan device that computes on the CPU): a split computes
the whole model's bits on the device for five families (the hybrid Qwen3.5 among them) and for
DeepSeek V3 at every cut, a certified lane of three Vulkan workers survives a failover and is
recorded as a software-device lane, a mixed CPU + Vulkan
route is refused unless asked for and its difference from each whole model is measured, and
the device's typed errors.

Every Vulkan engine runs in a child process whose environment names the device
(``dgr.testing.devices``). Under CI (``CI`` set) a build or machine without a Vulkan device
fails these tests; elsewhere they skip. lavapipe is slow (SmolLM2 decodes at ~2 tokens/s):
the models and generations are small.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dgr import errors
from dgr.testing.devices import NoVulkan, vulkan_device, vulkan_env

pytestmark = [pytest.mark.slow, pytest.mark.system]

SMALL = ["--ctx", "128", "--slots", "4", "--ubatch", "32", "--threads", "1"]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def vk() -> dict:
    try:
        return vulkan_device()
    except NoVulkan as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))


def _dgr(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgr", *map(str, args)], env=vulkan_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_lavapipe_is_listed_as_a_software_device_with_its_driver(vk):
    assert vk["backend"] == "Vulkan" and vk["name"].startswith("Vulkan")
    assert vk["type"] in ("gpu", "igpu")
    assert "llvmpipe" in vk["description"] and vk["software"] is True
    assert vk["kind"] == f"vulkan:{vk['description']}"
    assert "llvmpipe" in vk["driver"] and "Mesa" in vk["driver"]
    assert vk["memory_total"] > 0


@pytest.fixture(scope="module")
def families(tiny_llama, smollm2, tmp_path_factory) -> dict:
    from dgr.testing import archs
    from dgr.testing.fixtures import TinyDeepseek4, write_tiny_deepseek4

    moe = [f for f in archs.write("^qwen3moe$").files if f.name.endswith("-moe.gguf")]
    assert moe, "the generator wrote no qwen3moe MoE fixture"
    v4 = write_tiny_deepseek4(tmp_path_factory.mktemp("models") / "tiny-dsv4.gguf",
                              TinyDeepseek4())
    (qwen35,) = archs.write("^qwen35$", n_layer=8).files  # hybrid: delta net + attention
    return {"llama": (tiny_llama, "2"), "smollm2": (smollm2, "12"),
            "qwen3moe": (moe[0], "1"), "deepseek4": (v4, "1"), "qwen35": (qwen35, "3,6")}


@pytest.mark.parametrize("family", ["llama", "smollm2", "qwen3moe", "deepseek4", "qwen35"])
def test_a_split_computes_the_whole_models_bits_on_the_device(vk, families, family, tmp_path):
    model, splits = families[family]
    out = tmp_path / "parity.json"
    p = _dgr("parity", "--model", model, "--splits", splits, "--device", vk["name"],
             "--steps", 4, "--prompt", PROMPT, "--json", out, *SMALL)
    assert out.exists(), p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["settings"]["device"] == vk["name"]
    assert rep["prompt_rows_identical"], (family, rep)
    assert rep["bit_identical"] and rep["max_abs_diff"] == 0.0, (family, p.stdout[-2000:])
    assert p.returncode == 0


def _parity(model, splits, vk, out, env=None) -> dict:
    p = subprocess.run([sys.executable, "-m", "dgr", "parity", "--model", str(model), "--splits",
                        str(splits), "--device", vk["name"], "--steps", "4", "--prompt", PROMPT,
                        "--json", str(out), *SMALL], env=vulkan_env(env),
                       capture_output=True, text=True, timeout=600)
    assert out.exists(), p.stderr[-3000:]
    return json.loads(out.read_text())


def test_deepseek2_splits_the_whole_models_bits_at_every_cut_on_the_device(vk, tmp_path):
    """DeepSeek V3/R1 and Kimi K2 (deepseek2) at 8 layers, cut in two after every layer. With
    ggml-vulkan's op fusion on, the decode steps of the cuts after layer 5, 6 and 7 differed
    from the whole model's (max |diff| 4.5e-08 to 6.0e-08: a stage's graph fused other runs of
    ops than the whole model's); dgr's engine turns the fusion off (docs/devices.md), and
    ``DGR_VK_FUSION=1`` brings it, and the difference, back."""
    from dgr.testing import archs

    (model,) = archs.write("^deepseek2$", n_layer=8).files
    for cut in range(1, 8):
        rep = _parity(model, cut, vk, tmp_path / f"cut{cut}.json")
        assert rep["settings"]["device"] == vk["name"]
        assert rep["bit_identical"] and rep["max_abs_diff"] == 0.0, (cut, rep["steps"])
    rep = _parity(model, 6, vk, tmp_path / "fused.json",
                  env={**os.environ, "DGR_VK_FUSION": "1"})
    assert rep["prompt_rows_identical"] and not rep["bit_identical"], rep


def test_a_certified_vulkan_lane_survives_a_failover_and_is_a_software_device_lane(
        vk, tiny_llama, tmp_path):
    store = tmp_path / "certs"
    # flash attention off: lavapipe (Mesa 22.3.6) crashes in the flash-attention decode of
    # several sequences whose slots were released and filled again, which the batching
    # measure of certify runs (docs/devices.md)
    p = _dgr("certify", "--model", tiny_llama, "--stages", 3, "--failover", "--store", store,
             "--device", vk["name"], "--max-tokens", 10, "--prompt", PROMPT, *SMALL,
             "--flash-attn", "off")
    assert p.returncode == 0, p.stderr[-4000:]
    [path] = list(store.glob("*.json"))
    rec = json.loads(path.read_text())
    lane = rec["lane"]
    assert lane["backend"] == "vulkan" and lane["device"] == vk["description"]
    assert lane["software_device"] is True and "llvmpipe" in lane["driver"]
    assert rec["parity"]["passed"] and rec["parity"]["logits_bit_identical"]
    fo = rec["scenario"]["failover"]
    assert fo["passed"] and fo["tokens_match"] and fo["replaced_by"] == fo["spare"]
    # batching and speculative rollback measured on the device, each with its verdict
    assert rec["batching"]["rows"] > 0 and rec["speculation"]["trips"] > 0
    lanes = _dgr("lanes", "--store", store)
    assert lanes.returncode == 0, lanes.stderr
    assert f"vulkan:{vk['description']} [software device, not hardware]" in lanes.stdout


def test_the_demo_runs_every_stage_on_the_device(vk, tiny_llama):
    p = _dgr("run", "--model", tiny_llama, "--device", vk["name"], "--stages", 3,
             "--max-tokens", 6, "--no-chat", "--prompt", PROMPT, "--parity", *SMALL)
    assert p.returncode == 0, p.stderr[-4000:]
    assert ("matches the whole model (in-process dgr.Engine, same settings): yes; logits "
            "bit-identical over") in p.stderr
    assert "computes on" not in p.stderr  # the whole model is on the route's kind of device


# lavapipe computes a token of the tiny DeepSeek V4 in about 1.9 s (GET_ROWS, CONT, SET_ROWS
# and the lightning indexer at milliseconds a dispatch: GGML_VK_PERF_LOGGER), so its
# certification takes 10-12 minutes on 2 cores, and 16 next to two CPU hogs (over the suite's
# 15, where it failed): 40 minutes for this one
@pytest.mark.timeout(2400)
def test_deepseek4_batches_and_rolls_back_speculative_drafts_on_the_device(vk, families,
                                                                             tmp_path):
    """The tiny DeepSeek V4 on the device (its compressed and indexer caches there): a
    2-stage lane certified, with batched rows and speculative trips (drafts rolled back by
    truncating those caches) measured against single-token rows."""
    store = tmp_path / "certs"
    p = _dgr("certify", "--model", families["deepseek4"][0], "--splits", 3, "--store", store,
             "--device", vk["name"], "--max-tokens", 8, "--prompt", PROMPT, *SMALL,
             "--flash-attn", "off",  # flash attention off: see the failover lane above
             timeout=2300)
    assert p.returncode == 0, p.stderr[-4000:]
    [path] = list(store.glob("*.json"))
    rec = json.loads(path.read_text())
    assert rec["arch"] == "deepseek4" and rec["lane"]["backend"] == "vulkan"
    assert rec["parity"]["passed"] and rec["parity"]["logits_bit_identical"]
    sp, ba = rec["speculation"], rec["batching"]
    assert sp["trips"] > 0 and sp["rows"] > 0 and ba["rows"] > 0
    # a chat's next turn on a kept session (those caches cut back to the kept positions)
    # gives a fresh prefill's bits
    pc = rec["prefix_cache"]
    assert pc["bit_identical"] and pc["tokens_match"] and pc["kept_positions"] > 0, pc
    print(f"deepseek4 on {vk['name']}: speculation {sp}, batching {ba}, prompt cache {pc}")


_WHOLE_LOGITS = textwrap.dedent("""
    import sys, numpy as np, dgr
    model, device, out = sys.argv[1:4]
    toks = np.array([int(t) for t in sys.argv[4].split(",")], dtype=np.int32)
    eng = dgr.Engine(model, device=device, n_ctx=128, n_slots=4, n_ubatch=32)
    np.save(out, eng.forward(0, 0, toks, logits="all"))
""")


def test_a_mixed_cpu_and_vulkan_route_is_refused_unless_asked_and_its_difference_measured(
        vk, tiny_llama, tmp_path, monkeypatch):
    import dgr
    from dgr.driver.route import Route
    from dgr.worker.process import LocalCluster

    settings = dict(n_ctx=128, n_slots=4, n_ubatch=32, n_threads=1)
    cpu = LocalCluster(tiny_llama, [(0, 2)], settings=settings)
    with monkeypatch.context() as m:  # the Vulkan worker's environment names the device
        for k, v in vulkan_env().items():
            m.setenv(k, v)
        gpu = LocalCluster(tiny_llama, [(2, 4)], settings={**settings, "device": vk["name"]})
        gpu_eps = gpu.start(timeout=300)
    try:
        eps = cpu.start(timeout=300) + gpu_eps
        with pytest.raises(errors.ModelMismatch, match="mixed_devices=True"):
            Route(eps).close()
        whole = dgr.Engine(tiny_llama, **settings)
        with Route(eps, tokenizer=whole, mixed_devices=True) as route:
            assert [s.compute for s in route.stages] == ["cpu", vk["kind"]]
            assert route.stages[0].identity != route.stages[1].identity
            prompt = [int(t) for t in whole.tokenize(PROMPT, True, True)]
            session = route.session()
            got = list(session.generate(prompt, max_tokens=8, logits=True))
            rows = np.stack(session.logits)
            session.close()
    finally:
        cpu.stop()
        gpu.stop()
    seq = prompt + got
    # each whole model over the same tokens: the rows that chose tokens 1..n
    ref_cpu = whole.forward(0, 0, np.array(seq[:-1], dtype=np.int32), logits="all")
    out = tmp_path / "vk.npy"
    subprocess.run([sys.executable, "-c", _WHOLE_LOGITS, str(tiny_llama), vk["name"], str(out),
                    ",".join(map(str, seq[:-1]))], env=vulkan_env(), check=True, timeout=600)
    ref_vk = np.load(out)
    tail = slice(len(prompt) - 1, len(seq) - 1)
    figures = {}
    for name, ref in (("cpu", ref_cpu[tail]), ("vulkan", ref_vk[tail])):
        diff = float(np.max(np.abs(ref.astype(np.float64) - rows)))
        top1 = float(np.mean(np.argmax(ref, axis=1) == np.argmax(rows, axis=1)))
        figures[name] = (diff, top1)
    whole_vs_whole = float(np.max(np.abs(ref_cpu[tail].astype(np.float64) - ref_vk[tail])))
    print(f"mixed route vs whole models (max |diff|, top-1 agreement): {figures}; the two "
          f"whole models differ by {whole_vs_whole}")
    # the device path really ran on the device: its kernels give other bits than the CPU's
    assert whole_vs_whole > 0
    # a mixed route computes other bits than either whole model, but the same model
    assert all(d > 0 and np.isfinite(d) for d, _ in figures.values()), figures
    assert all(top1 >= 0.5 for _, top1 in figures.values()), figures


def test_a_range_over_the_memory_cap_is_refused_with_the_figures(vk, tiny_llama):
    code = textwrap.dedent("""
        import sys, dgr
        try:
            dgr.Engine(sys.argv[1], device=sys.argv[2], n_ctx=64, device_memory_limit=4096)
        except dgr.errors.DeviceOutOfMemory as e:
            print("DeviceOutOfMemory:", e)
        eng = dgr.Engine(sys.argv[1], device=sys.argv[2], n_ctx=64)
        f = eng.compute_facts()
        print(f["weight_bytes"], f["kv_bytes"], f["memory_total"])
    """)
    p = subprocess.run([sys.executable, "-c", code, str(tiny_llama), vk["name"]],
                       env=vulkan_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    refused, figures = p.stdout.strip().splitlines()
    assert refused.startswith("DeviceOutOfMemory:") and "KiB of weights on" in refused
    assert "this engine may use 4.0 KiB" in refused and "free of" in refused
    weights, kv, total = map(int, figures.split())
    assert weights > 0 and kv > 0 and total > 0  # held in the device's own buffers


def test_the_device_lane_bench_runs_on_lavapipe_at_a_tiny_size(vk, tmp_path):
    """benches/device/lane.sh's measuring half (its building half is pip install -e . with
    DGR_BACKEND): certified, side by side with llama.cpp's programs on the device, a table
    last."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "lane.json"
    p = subprocess.run([sys.executable, os.path.join(root, "benches", "device_lane.py"),
                        "--device", vk["name"], "--tiny", "--json", str(out)], env=vulkan_env(),
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads(out.read_text())
    m = rec["models"]["tiny"]
    assert m["certify"]["passed"] and m["certify"]["bit_identical"]
    assert m["whole"]["decode_tps"] > 0 and all(r["aggregate_tps"] > 0
                                                  for r in m["relay"].values())
    bb = m["batched_bench"]
    assert bb["4"]["n_gpu_layers"] == 99, bb  # the reference ran on the device
    assert m["llama_bench_pp"]["pp_tps"] > 0 and "Vulkan" in m["llama_bench_pp"]["backends"]
    table = p.stdout.strip().splitlines()
    assert table[0].startswith(f"device {vk['name']}: llvmpipe") and table[-1].startswith(
        "| tiny | pp64")
    sh = subprocess.run(["bash", "-n", os.path.join(root, "benches", "device", "lane.sh")],
                        capture_output=True, text=True)
    assert sh.returncode == 0, sh.stderr

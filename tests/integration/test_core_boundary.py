"""The native boundary guards itself: ``dgr._core.Engine._forward``, called directly with
buffers that do not fit the step (lengths, dtypes, layout, a short output, a boundary of the
wrong width), raises the typed error before any C++ call, and with arguments the stage does
not take (a boundary on the first stage: the C++ engine's check) before anything is computed;
a valid call after them gives the bits of a fresh engine; and a C++ exception inside the
engine comes back as ``EngineError`` instead of taking the process down. Tiny random llama,
real engines."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr._core import Engine as CoreEngine

SETTINGS = dict(n_ctx=64, n_slots=1, n_threads=1, n_ubatch=8)
N_VOCAB, WIDTH = 128, 64  # the tiny llama's vocabulary and boundary width
TOKENS = np.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], dtype=np.int32)
N = len(TOKENS)  # > n_ubatch: the valid call is computed in two chunks

needs_ranges = pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp")


def _core(path, layers=(0, -1)) -> CoreEngine:
    """The compiled engine itself, not ``dgr.Engine`` (whose forward checks first)."""
    return CoreEngine(str(path), layers[0], layers[1], **SETTINGS)


def _pos(n: int = N) -> np.ndarray:
    return np.arange(n, dtype=np.int32)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# (id, forward arguments after the slot, error) on the whole model: first and last stage
WHOLE_CASES = [
    ("1-token-64-positions", lambda: (_pos(64), TOKENS[:1].copy(), None, None, None),
     errors.InvalidPosition),
    ("more-tokens-than-positions", lambda: (_pos(1), TOKENS, None, None, None),
     errors.InvalidPosition),
    ("positions-none", lambda: (None, TOKENS, None, None, None), errors.InvalidPosition),
    ("positions-int64", lambda: (_pos().astype(np.int64), TOKENS, None, None, None),
     errors.InvalidPosition),
    ("positions-non-contiguous", lambda: (np.repeat(_pos(), 2)[::2], TOKENS, None, None, None),
     errors.InvalidPosition),
    ("positions-2d", lambda: (_pos().reshape(1, N), TOKENS, None, None, None),
     errors.InvalidPosition),
    ("positions-list", lambda: (list(range(N)), TOKENS, None, None, None),
     errors.InvalidPosition),
    ("tokens-int64", lambda: (_pos(), TOKENS.astype(np.int64), None, None, None),
     errors.InvalidArgument),
    ("tokens-non-contiguous", lambda: (_pos(), np.repeat(TOKENS, 2)[::2], None, None, None),
     errors.InvalidArgument),
    ("tokens-big-endian", lambda: (_pos(), TOKENS.astype(">i4"), None, None, None),
     errors.InvalidArgument),
    ("tokens-list", lambda: (_pos(), TOKENS.tolist(), None, None, None),
     errors.InvalidArgument),
    ("tokens-2d", lambda: (_pos(), TOKENS.reshape(1, N), None, None, None),
     errors.InvalidArgument),
    ("mask-short", lambda: (_pos(), TOKENS, None, np.ones(N - 1, np.uint8), None),
     errors.InvalidArgument),
    ("mask-int32", lambda: (_pos(), TOKENS, None, np.ones(N, np.int32), None),
     errors.InvalidArgument),
    ("out-no-rows", lambda: (_pos(), TOKENS, None, None, np.empty((0, N_VOCAB), np.float32)),
     errors.InvalidArgument),
    ("out-short-for-all-rows", lambda: (_pos(), TOKENS, None, np.ones(N, np.uint8),
                                        np.empty((N - 1, N_VOCAB), np.float32)),
     errors.InvalidArgument),
    ("out-narrow", lambda: (_pos(), TOKENS, None, None, np.empty((1, N_VOCAB - 1), np.float32)),
     errors.InvalidArgument),
    ("out-float64", lambda: (_pos(), TOKENS, None, None, np.empty((1, N_VOCAB), np.float64)),
     errors.InvalidArgument),
    ("out-non-contiguous", lambda: (_pos(), TOKENS, None, None,
                                    np.empty((1, 2 * N_VOCAB), np.float32)[:, ::2]),
     errors.InvalidArgument),
    ("out-read-only", lambda: (_pos(), TOKENS, None, None,
                               _readonly(np.empty((1, N_VOCAB), np.float32))),
     errors.InvalidArgument),
    ("out-list", lambda: (_pos(), TOKENS, None, None, [[0.0] * N_VOCAB]),
     errors.InvalidArgument),
    ("boundary-on-first-stage", lambda: (_pos(), TOKENS, np.zeros((N, WIDTH), np.float32),
                                         None, None), errors.InvalidBoundary),
]

# the same on the second half (layers [2, 4)): takes the boundary, returns logits
HALF_CASES = [
    ("boundary-too-wide", lambda: (_pos(), None, np.zeros((N, WIDTH + 1), np.float32), None,
                                   None), errors.InvalidBoundary),
    ("boundary-too-narrow", lambda: (_pos(), None, np.zeros((N, WIDTH - 1), np.float32), None,
                                     None), errors.InvalidBoundary),
    ("boundary-1-row-64-positions", lambda: (_pos(64), None, np.zeros((1, WIDTH), np.float32),
                                             None, None), errors.InvalidPosition),
    ("boundary-rows-not-tokens", lambda: (_pos(), TOKENS, np.zeros((N - 1, WIDTH), np.float32),
                                          None, None), errors.InvalidBoundary),
    ("boundary-float64", lambda: (_pos(), None, np.zeros((N, WIDTH)), None, None),
     errors.InvalidBoundary),
    ("boundary-non-contiguous", lambda: (_pos(), None,
                                         np.zeros((N, 2 * WIDTH), np.float32)[:, ::2], None,
                                         None), errors.InvalidBoundary),
    ("boundary-flat", lambda: (_pos(), None, np.zeros(N * WIDTH, np.float32), None, None),
     errors.InvalidBoundary),
    ("boundary-list", lambda: (_pos(), None, np.zeros((N, WIDTH), np.float32).tolist(), None,
                               None), errors.InvalidBoundary),
]


@pytest.fixture(scope="module")
def whole(tiny_llama):
    return _core(tiny_llama)


@pytest.fixture(scope="module")
def half(tiny_llama):
    if not HAS_LAYER_RANGES:
        pytest.skip("needs the patched llama.cpp")
    return _core(tiny_llama, (2, 4))


@pytest.fixture(scope="module")
def boundary(tiny_llama):
    """The boundary entering layer 2 for TOKENS (from a fresh engine of layers [0, 2))."""
    if not HAS_LAYER_RANGES:
        pytest.skip("needs the patched llama.cpp")
    b = dgr.Engine(tiny_llama, layers=(0, 2), **SETTINGS).forward(0, 0, TOKENS)
    assert b.shape == (N, WIDTH) and b.dtype == np.float32
    return b


def _refused(eng: CoreEngine, args, error) -> None:
    """The call raises exactly ``error`` and computes nothing (the slot stays empty)."""
    eng.release(0)
    with pytest.raises(errors.DgrError) as info:
        eng._forward(0, *args)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert eng.next_pos(0) == 0


@pytest.mark.parametrize("make,error", [c[1:] for c in WHOLE_CASES],
                         ids=[c[0] for c in WHOLE_CASES])
def test_whole_model_refuses_buffers_that_do_not_fit(whole, make, error):
    _refused(whole, make(), error)


@needs_ranges
@pytest.mark.parametrize("make,error", [c[1:] for c in HALF_CASES],
                         ids=[c[0] for c in HALF_CASES])
def test_later_stage_refuses_boundaries_that_do_not_fit(half, make, error):
    _refused(half, make(), error)


def test_valid_call_after_the_refusals_matches_a_fresh_engine(whole, tiny_llama):
    for _, make, error in WHOLE_CASES:
        _refused(whole, make(), error)
    whole.release(0)
    got = whole._forward(0, _pos(), TOKENS, None, None, None)
    assert whole.next_pos(0) == N
    fresh = dgr.Engine(tiny_llama, **SETTINGS).forward(0, 0, TOKENS)
    assert got.shape == fresh.shape == (1, N_VOCAB)
    assert got.tobytes() == fresh.tobytes()
    # a bool mask is the same mask as uint8 (dgr.Engine passes its uint8 view)
    whole.release(0)
    mask = np.zeros(N, dtype=bool)
    mask[[0, N - 1]] = True
    rows = whole._forward(0, _pos(), TOKENS, None, mask, None)
    whole.release(0)
    assert rows.shape == (2, N_VOCAB)
    assert rows.tobytes() == whole._forward(0, _pos(), TOKENS, None, mask.view(np.uint8),
                                            None).tobytes()
    whole.release(0)


@needs_ranges
def test_later_stage_after_the_refusals_matches_a_fresh_engine(half, boundary, tiny_llama):
    for _, make, error in HALF_CASES:
        _refused(half, make(), error)
    half.release(0)
    out = np.full((1, N_VOCAB), np.nan, dtype=np.float32)
    got = half._forward(0, _pos(), None, boundary, None, out)
    assert got is out and half.next_pos(0) == N
    fresh = dgr.Engine(tiny_llama, layers=(2, 4), **SETTINGS).forward(0, 0, boundary=boundary)
    assert fresh.shape == (1, N_VOCAB)
    assert got.tobytes() == fresh.tobytes()
    half.release(0)


def test_a_cpp_exception_comes_back_as_engine_error(tiny_llama):
    """std::bad_alloc inside the engine (detokenize sizes its output at 8 bytes a token; the
    address space is capped below that) is an EngineError, and the engine works after it.
    In a subprocess: the cap, and a C++ exception that escaped, would end the test run."""
    code = textwrap.dedent(f"""
        import resource, sys
        import numpy as np
        from dgr import errors
        from dgr._core import Engine
        eng = Engine({str(tiny_llama)!r}, 0, -1, n_ctx=64, n_slots=1, n_threads=1, n_ubatch=8)
        toks = np.zeros(64 << 20, dtype=np.int32)  # 256 MiB here, 512 MiB of text to hold
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm + (128 << 20), hard))
        try:
            eng.detokenize(toks)
        except errors.EngineError as e:
            print("EngineError:", e)
        else:
            print("no error")
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        del toks
        print("after:", eng.detokenize([0, 10, 127, 2]))
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert len(lines) == 2, r.stdout
    assert lines[0].startswith("EngineError: detokenize failed") and "out of memory" in lines[0]
    assert lines[1] == "after: 0a7f2"

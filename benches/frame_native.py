"""Python (dgr.protocol.wire) against C++ (dgr._core._frame) frame codec: microseconds per frame.

Frames are the ones a SmolLM2-135M route sends between stages under direct relay with the
decode loop (dgr/worker/forwarder.py): a decode step (1 token, boundary of 576 floats) and a
64-token prefill chunk (64 x 576), raw f32, plus the last stage's token reply. Measured per
frame, medians of short batches:

- ``py decode``: ``wire.decode`` (validate, header objects, numpy view);
- ``c++ decode``: ``decode_frame`` (the same checks, a dict of the fields, numpy view);
- ``c++ decode only``: the C++ decoder in a C++ loop, no Python objects (the cost left once
  the stage loop itself is native);
- ``py encode`` / ``c++ encode``: ``wire.encode`` / ``encode_frame`` to ``bytes`` (the
  latter reads the header's fields from the msgspec struct, the most of its cost);
- ``c++ enc only``: the C++ encoder in a C++ loop into one reused buffer.

Not a test: run ``python benches/frame_native.py [--json PATH]`` from a built checkout.
"""

from __future__ import annotations

import sys

import numpy as np

from harness import cli
from harness.measure import median_us

from dgr._core import _frame
from dgr.protocol import wire

WIDTH = 576  # SmolLM2-135M n_embd


def frames() -> dict[str, tuple[wire.Message, np.ndarray | None]]:
    rng = np.random.default_rng(0)
    hops = [wire.Hop(endpoint="127.0.0.1:40003", tokens=False)]
    loop = [wire.Hop(endpoint="127.0.0.1:40001", tokens=True), wire.Hop(endpoint="127.0.0.1:40002"),
            *hops]
    common = {"model": "smollm2-135m-instruct-q4_1:0123456789abcdef", "session": "9f1c2e7a5b3d4c6e8f0a",
                  "epoch": 1, "layer": 20, "want": "token",
                  "sampling": wire.Sampling(temperature=0.7, top_k=40, top_p=0.95, seed=42),
                  "relay": hops, "reply_to": "route-4b1e9c"}
    step = wire.Forward(**common, first_pos=137, n_tokens=1, loop=loop, steps=30, stop_tokens=[2])
    prefill = wire.Forward(**common, first_pos=0, n_tokens=64)
    reply = wire.Result(session=common["session"], epoch=1, first_pos=137, n_tokens=1, tokens=[1234])
    return {
        "decode step 1x576": (step, rng.standard_normal((1, WIDTH), dtype=np.float32)),
        "prefill 64x576": (prefill, rng.standard_normal((64, WIDTH), dtype=np.float32)),
        "token reply": (reply, None),
    }


def main(argv=None) -> int:
    """Print one line per frame and case (microseconds per frame)."""
    args = cli.parser(__doc__, json=True).parse_args(argv)
    out = {}
    print(f"{'frame':>18} {'bytes':>7} {'py decode':>10} {'c++ decode':>11} {'c++ only':>9} "
          f"{'py encode':>10} {'c++ encode':>11} {'c++ enc only':>13}")
    for name, (header, array) in frames().items():
        frame = wire.encode(header, array)
        assert _frame.encode_frame(header, array) == frame
        n = 2000
        only = min(_frame._decode_loop(frame, n) for _ in range(20)) / n * 1e6
        enc_only = min(_frame._encode_loop(header, array, n) for _ in range(20)) / n * 1e6
        row = [
            median_us(lambda f=frame: wire.decode(f)),
            median_us(lambda f=frame: _frame.decode_frame(f)),
            only,
            median_us(lambda h=header, a=array: wire.encode(h, a)),
            median_us(lambda h=header, a=array: _frame.encode_frame(h, a)),
            enc_only,
        ]
        print(f"{name:>18} {len(frame):>7} " + " ".join(f"{v:>{w}.2f}" for v, w in
                                                         zip(row, (10, 11, 9, 10, 11, 13))))
        out[name] = dict(zip(("bytes", "py_decode_us", "cpp_decode_us", "cpp_decode_only_us",
                              "py_encode_us", "cpp_encode_us", "cpp_encode_only_us"),
                             (len(frame), *row)))
    print("microseconds per frame (medians; 'only' columns: best of 20 loops of 2000 in C++)")
    cli.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Median encode+decode time of one raw f32 token of width 16384, checksums included.

    python benches/wire_micro.py [--json PATH]   # exits 1 when encode+decode misses the goal
"""

from __future__ import annotations

import sys

import numpy as np

from harness import cli
from harness.measure import median_us

from dgr.protocol import wire

GOAL_US = 20.0


def main(argv=None) -> int:
    """Print the medians (microseconds) and exit 1 when encode+decode misses the goal."""
    args = cli.parser(__doc__, json=True).parse_args(argv)
    array = np.random.default_rng(0).standard_normal((1, 16384), dtype=np.float32)
    header = wire.Forward(model="bench", session="s", epoch=1, first_pos=0, n_tokens=1, layer=1)
    frame = wire.encode(header, array)
    buf = bytearray()

    def roundtrip() -> None:
        wire.decode(wire.encode(header, array))

    def roundtrip_into() -> None:
        wire.encode_into(header, array, buf)
        wire.decode(buf)

    cases = {
        "encode": lambda: wire.encode(header, array),
        "decode": lambda: wire.decode(frame),
        "encode+decode": roundtrip,
        "encode_into+decode": roundtrip_into,
    }
    medians = {}
    for name, fn in cases.items():
        medians[name] = median_us(fn, number=10, repeat=3000)
        print(f"{name:>20}: median {medians[name]:6.2f} us")
    ok = medians["encode+decode"] < GOAL_US
    print(f"1 x 16384 raw encode+decode median {medians['encode+decode']:.2f} us; "
          f"goal < {GOAL_US:.0f} us: {'met' if ok else 'MISSED'}")
    cli.write_json(args.json, {"medians_us": medians, "goal_us": GOAL_US, "met": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

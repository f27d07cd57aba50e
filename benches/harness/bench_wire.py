"""asv benchmarks of dgr.protocol.wire: encode/decode time, throughput and bytes per token per codec."""

from __future__ import annotations

import functools
import time

import numpy as np

from dgr.protocol import wire

# "raw" is the parity codec; "+zstd" adds zstd level 3 over the codec bytes.
CODECS = [f"{c}{z}" for c in wire.CODECS for z in ("", "+zstd")]
TOKENS = [1, 16, 512]
WIDTHS = [576, 16384]  # SmolLM2-135M n_embd; DeepSeek V4 hyper-connection width (4 x 4096)
SEED = 0


def _random_boundary(tokens: int, width: int) -> np.ndarray:
    """Seeded N(0, 1) float32 data: random data, not a real boundary (those come later)."""
    return np.random.default_rng(SEED).standard_normal((tokens, width), dtype=np.float32)


def _split(codec: str) -> tuple[str, bool]:
    name, _, z = codec.partition("+")
    return name, z == "zstd"


def _header(tokens: int) -> wire.Forward:
    return wire.Forward(
        model="bench", session="bench", epoch=1, first_pos=0, n_tokens=tokens, layer=1,
        tokens=list(range(tokens)),
    )


@functools.lru_cache(maxsize=None)
def _case(codec: str, tokens: int, width: int):
    """(header, array, codec name, compress, frame, buffer) for one parameter set, built once.

    Not in a setup() hook: asv_runner re-runs setup hooks before every timed call (number
    forced to 1, asv#966), which times one cold call after fresh allocations instead of the
    steady state of the hot path.
    """
    name, compress = _split(codec)
    header, array = _header(tokens), _random_boundary(tokens, width)
    frame = wire.encode(header, array, codec=name, compress=compress)
    return header, array, name, compress, frame, bytearray()


class Encode:
    """encode(): header + codec + optional zstd + checksum + the one copy into the frame."""

    params = (CODECS, TOKENS, WIDTHS)
    param_names = ["codec", "tokens", "width"]

    def time_encode(self, codec: str, tokens: int, width: int) -> None:
        header, array, name, compress, _, _ = _case(codec, tokens, width)
        wire.encode(header, array, codec=name, compress=compress)

    def time_encode_into(self, codec: str, tokens: int, width: int) -> None:
        header, array, name, compress, _, buf = _case(codec, tokens, width)
        wire.encode_into(header, array, buf, codec=name, compress=compress)

    def peakmem_encode(self, codec: str, tokens: int, width: int) -> None:
        header, array, name, compress, _, _ = _case(codec, tokens, width)
        wire.encode(header, array, codec=name, compress=compress)


class Decode:
    """decode(): full validation, checksums, zstd and codec back to float32 (raw: a view)."""

    params = (CODECS, TOKENS, WIDTHS)
    param_names = ["codec", "tokens", "width"]

    def time_decode(self, codec: str, tokens: int, width: int) -> None:
        wire.decode(_case(codec, tokens, width)[4])

    def peakmem_decode(self, codec: str, tokens: int, width: int) -> None:
        wire.decode(_case(codec, tokens, width)[4])


class RandomDataRates:
    """Throughput and wire size per codec on random data (real boundaries compress better)."""

    params = (CODECS, WIDTHS)
    param_names = ["codec", "width"]
    tokens = 16

    def setup(self, codec: str, width: int) -> None:
        self.array = _random_boundary(self.tokens, width)
        self.header = _header(self.tokens)
        self.codec, self.compress = _split(codec)

    def _best_seconds(self, fn, repeat: int = 20) -> float:
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    def track_random_data_encode_decode_mbps(self, codec: str, width: int) -> float:
        """f32 MB (1e6 bytes) per second through encode + decode, random data."""

        def roundtrip() -> None:
            wire.decode(wire.encode(self.header, self.array, codec=self.codec, compress=self.compress))

        return self.array.nbytes / self._best_seconds(roundtrip) / 1e6

    track_random_data_encode_decode_mbps.unit = "MB/s"

    def track_random_data_wire_bytes_per_token(self, codec: str, width: int) -> float:
        """Frame bytes per token (header amortised over 16 tokens), random data."""
        frame = wire.encode(self.header, self.array, codec=self.codec, compress=self.compress)
        return len(frame) / self.tokens

    track_random_data_wire_bytes_per_token.unit = "bytes/token"

    def track_random_data_compression_ratio(self, codec: str, width: int) -> float:
        """f32 bytes / frame bytes, random data."""
        frame = wire.encode(self.header, self.array, codec=self.codec, compress=self.compress)
        return self.array.nbytes / len(frame)

    track_random_data_compression_ratio.unit = "ratio"


# Built at import, not in a setup() hook: asv_runner re-runs setup hooks before every timed call
# (number forced to 1, asv#966), which would time one cold call after fresh allocations instead
# of the steady state of a worker's hot path.
_HOT_ARRAY = _random_boundary(1, 16384)
_HOT_HEADER = _header(1)


class RawRoundTrip:
    """The parity codec's hot path: encode + decode of one token at width 16384, checksum on."""

    def time_raw_encode_decode_1x16384(self) -> None:
        wire.decode(wire.encode(_HOT_HEADER, _HOT_ARRAY))


class RealBoundaries:
    """Wire bytes per token and codec error on real SmolLM2 boundaries (after layer 15).

    The boundaries come from ``dgr.Engine(layers=(0, 15))`` over a seeded 128-token prompt.
    """

    params = (CODECS,)
    param_names = ["codec"]
    timeout = 300

    def setup_cache(self):
        import dgr

        from .common import SETTINGS, prompt_tokens, smollm2_path

        eng = dgr.Engine(smollm2_path(), layers=(0, 15), **SETTINGS)
        return np.ascontiguousarray(eng.forward(0, 0, prompt_tokens(128, eng.n_vocab)))

    def setup(self, boundary, codec: str) -> None:
        self.codec, self.compress = _split(codec)
        self.frame = wire.encode(_header(len(boundary)), boundary, codec=self.codec,
                                 compress=self.compress)

    def track_real_boundary_wire_bytes_per_token(self, boundary, codec: str) -> float:
        return len(self.frame) / len(boundary)

    track_real_boundary_wire_bytes_per_token.unit = "bytes/token"

    def track_real_boundary_max_abs_error(self, boundary, codec: str) -> float:
        got = wire.decode(self.frame).array
        return float(np.max(np.abs(got.astype(np.float64) - boundary)))

    track_real_boundary_max_abs_error.unit = "abs"

"""Whole-model throughput of dgr.Engine on SmolLM2-135M Q4_1 (1 thread)."""

from .common import SETTINGS, decode_tps, prefill_tps, smollm2_path


class WholeModel:
    """Prefill and decode tokens/s of the whole model in one process."""

    timeout = 600
    repeat = 1
    number = 1

    def setup_cache(self):
        return smollm2_path()

    def setup(self, path):
        import dgr

        self.eng = dgr.Engine(path, **SETTINGS)

    def track_prefill_128_tokens_per_s(self, path):
        return prefill_tps(self.eng, 128)

    track_prefill_128_tokens_per_s.unit = "tokens/s"

    def track_prefill_512_tokens_per_s(self, path):
        return prefill_tps(self.eng, 512)

    track_prefill_512_tokens_per_s.unit = "tokens/s"

    def track_decode_tokens_per_s(self, path):
        return decode_tps(self.eng, 64)

    track_decode_tokens_per_s.unit = "tokens/s"

    def peakmem_load(self, path):
        import dgr

        dgr.Engine(path, **SETTINGS)

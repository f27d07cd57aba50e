"""Decode throughput of a route of 1, 2 and 3 worker processes on loopback vs the whole model.

Each stage is a ``python -m dgr.worker`` process with the same settings as the in-process
whole model (one thread each, see common.SETTINGS). ``benches/seams.py`` prints the same
measurements as a table.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from .clusters import start_cluster
from .common import SETTINGS, decode_tps, prompt_tokens, smollm2_path

STAGES = [1, 2, 3]
N_DECODE = 64
N_PROMPT = 16


async def _route_decode(endpoints, n_decode: int, rounds: int, **route_kw) -> dict:
    """Decode tokens/s over the route (asyncio API), median of ``rounds``; per-stage RTTs."""
    from dgr.driver.route import AsyncRoute

    prompt = [int(t) for t in prompt_tokens(N_PROMPT, 49152)]
    async with AsyncRoute(endpoints, **route_kw) as r:
        s = r.session()
        tps, walls, steps = [], 0.0, 0
        before = await r.describe()
        for _ in range(rounds):
            t_first = None
            n = 0
            async for _ in s.generate(prompt, max_tokens=n_decode + 1, stop_on_eog=False):
                if t_first is None:
                    t_first = time.perf_counter()
                n += 1
            wall = time.perf_counter() - t_first
            tps.append((n - 1) / wall)
            walls, steps = walls + wall, steps + n - 1
        infos = await r.describe()
        await s.close()
        relay, loop = r.relay, r.loop
    # each stage's mean compute over the single-token steps it computed in these rounds (the
    # workers' exact totals; an end-of-generation step may add one per round)
    from dgr.protocol.describe import measured_compute

    counted = measured_compute(before, infos)
    compute = [1e3 * sec / k for k, sec in counted]
    if relay:
        # the driver sees whole-route steps: transport = TPOT - compute over the same rounds,
        # over the links a token crosses (the decode loop: n stages -> n links; token by
        # token: n + 1); negative when the workers computed other sessions' steps too
        links = len(infos) if loop else len(infos) + 1
        hop = (1e3 * walls / steps - sum(compute)) / links
    else:  # the driver's round trip to each stage minus that stage's compute
        hop = statistics.mean(st.decode_rtt_ms - c for st, c in zip(s.stats, compute,
                                                                     strict=True))
    return {
        "tokens_per_s": statistics.median(tps),
        "rtt_ms": [st.decode_rtt_ms for st in s.stats],
        "compute_ms": compute,
        "relay": relay,
        "loop": loop,
        "hop_ms": hop,
    }


def route_decode(endpoints, n_decode: int = N_DECODE, rounds: int = 1, **route_kw) -> dict:
    return asyncio.run(_route_decode(endpoints, n_decode, rounds, **route_kw))


def route_decode_sync(endpoints, n_decode: int = N_DECODE, rounds: int = 1) -> float:
    """The same through the blocking API (one thread handoff per token)."""
    from dgr.driver.route import Route

    prompt = [int(t) for t in prompt_tokens(N_PROMPT, 49152)]
    tps = []
    with Route(endpoints) as r:
        s = r.session()
        for _ in range(rounds):
            t_first, n = None, 0
            for _ in s.generate(prompt, max_tokens=n_decode + 1, stop_on_eog=False):
                if t_first is None:
                    t_first = time.perf_counter()
                n += 1
            tps.append((n - 1) / (time.perf_counter() - t_first))
        s.close()
    return statistics.median(tps)


class RouteDecode:
    """Decode tokens/s of a route of N stages, and its ratio to the whole model in-process."""

    params = STAGES
    param_names = ["stages"]
    timeout = 600
    repeat = 1
    number = 1

    def setup_cache(self):
        import dgr

        path = smollm2_path()
        return {"path": path, "whole": decode_tps(dgr.Engine(path, **SETTINGS), N_DECODE)}

    def setup(self, cache, stages):
        self.cluster = start_cluster(cache["path"], stages)
        self.m = route_decode(self.cluster.endpoints)

    def teardown(self, cache, stages):
        self.cluster.stop()

    def track_decode_tokens_per_s(self, cache, stages):
        return self.m["tokens_per_s"]

    track_decode_tokens_per_s.unit = "tokens/s"

    def track_ratio_to_whole_model(self, cache, stages):
        return self.m["tokens_per_s"] / cache["whole"]

    track_ratio_to_whole_model.unit = "ratio"

    def track_added_ms_per_token(self, cache, stages):
        return 1e3 / self.m["tokens_per_s"] - 1e3 / cache["whole"]

    track_added_ms_per_token.unit = "ms"

    def track_hop_ms_per_stage(self, cache, stages):
        """Transport per link a token crosses: with relay (the default) TPOT minus the stages'
        compute, over the links; on the gRPC path the driver's round trip minus the stage's
        compute, averaged over the stages."""
        return self.m["hop_ms"]

    track_hop_ms_per_stage.unit = "ms"

"""What a generation over a route cost, stage by stage and seam by seam.

Shared by ``python -m dgr run`` / ``generate`` (``dgr.cli.commands._report`` prints it) and
``python -m dgr certify`` (``dgr.cli.certify`` records it in the lane's scenario). Each
stage's compute per decode token is the mean over the single-token steps its worker computed
between a describe taken before the generation and one after it (the workers' exact totals,
``dgr.protocol.describe.compute_between``; never the moving average ``recent_step_ms``), so
compute and transport add up to the time per token measured over the same steps.

- Hop by hop (gRPC through the driver): a stage's hop is the driver's mean round trip per
  decode step to it (``StageStats.decode_rtt_ms``) minus that stage's compute; a seam adds
  one hop.
- Direct relay: the driver sees whole-route steps only, so the transport is the time per
  token minus every stage's compute, spread over the links a token crosses (the stages plus
  the way back to the driver; with the decode loop, the stages only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dgr.protocol.describe import compute_between

__all__ = ["MeasuredStage", "RouteCosts", "route_costs", "step_path"]


@dataclass
class MeasuredStage:
    """One stage over the timed generation (None: no figure; ``RouteCosts.notes`` say why)."""

    layers: tuple[int, int]
    endpoint: str
    data_port: int
    #: single-token steps its worker computed between the two describes
    decode_steps: int | None
    #: their mean compute, ms
    compute_ms: float | None
    #: hop by hop: the driver's mean round trip per decode step to this stage, ms
    rtt_ms: float | None = None
    #: hop by hop: ``rtt_ms - compute_ms``, this hop's transport, ms
    hop_ms: float | None = None
    #: hop by hop: bytes sent and received per step (every step of the session)
    bytes_per_step: float | None = None


@dataclass
class RouteCosts:
    """A timed generation's cost (``route_costs``)."""

    #: the session's step path: "hop-by-hop", "relay" or "relay+loop" (the decode loop)
    path: str
    #: decode tokens timed (the tokens after the first)
    decode_tokens: int
    #: the route's decode time per token, ms (None: fewer than two tokens, or no time)
    ms_per_token: float | None
    stages: list[MeasuredStage]
    #: transport links a decode token crosses (hops, or relay links)
    links: int
    #: transport per decode token over all links, ms (None: no figure)
    transport_ms: float | None = None
    #: why a figure is missing (each reason once)
    notes: list[str] = field(default_factory=list)

    @property
    def seam_ms(self) -> float | None:
        """Mean transport per link (per seam: a seam adds one link), ms."""
        if self.transport_ms is None or not self.links:
            return None
        return self.transport_ms / self.links

    @property
    def compute_ms(self) -> float | None:
        """Every stage's compute per decode token, summed, ms (None: a stage has none)."""
        if not self.stages or any(s.compute_ms is None for s in self.stages):
            return None
        return sum(s.compute_ms for s in self.stages)


def step_path(route) -> str:
    """The path a session of ``route`` (a ``dgr.driver.route.Route``) takes."""
    if route.aroute.relay:
        return "relay+loop" if route.aroute.loop else "relay"
    return "hop-by-hop"


def route_costs(route, session, before, after, decode_tokens: int,
                decode_s: float) -> RouteCosts:
    """The cost of ``session``'s generation on ``route``: ``before`` and ``after`` are
    ``route.describe()`` taken around it; ``decode_tokens`` tokens (those after the first)
    took ``decode_s`` seconds (from the first token to the last)."""
    tps = decode_tokens / decode_s if decode_tokens > 0 and decode_s > 0 else 0.0
    tpot = 1e3 / tps if tps else None
    comp = compute_between(before, after)
    notes = list(dict.fromkeys(c for c in comp if isinstance(c, str)))  # each reason once
    stages = [MeasuredStage(layers=tuple(info.layers), endpoint=info.endpoint,
                        data_port=info.data_port,
                        decode_steps=None if isinstance(c, str) else c[0],
                        compute_ms=None if isinstance(c, str) else 1e3 * c[1] / c[0])
              for info, c in zip(after, comp)]
    path = step_path(route)
    if route.aroute.relay:
        # the decode loop: s1 -> ... -> sN -> s1; token by token: driver -> s1 ... -> driver
        links = len(after) if route.aroute.loop else len(after) + 1
        costs = RouteCosts(path=path, decode_tokens=decode_tokens, ms_per_token=tpot,
                           stages=stages, links=links, notes=notes)
        total = costs.compute_ms
        if tpot is not None and not notes and total is not None:
            if tpot - total >= 0:
                costs.transport_ms = tpot - total
            else:
                costs.notes.append(
                    f"direct relay: the stages' compute per token ({total:.3f} ms) exceeds "
                    f"the {tpot:.3f} ms/token measured: the workers computed other steps "
                    "(another session) alongside these: no transport figure")
        return costs
    # the cost of each hop: the driver's round trip minus the worker's compute, over the
    # same single-token steps (the driver's count and the worker's must agree)
    for st, sc in zip(session.stats, stages):
        sc.rtt_ms = st.decode_rtt_ms
        sc.bytes_per_step = (st.bytes_sent + st.bytes_received) / max(st.steps, 1)
        if sc.compute_ms is None:
            continue
        if sc.decode_steps != st.decode_steps:
            notes.append(f"{sc.endpoint} computed {sc.decode_steps} single-token steps, this "
                         f"session sent it {st.decode_steps} (other sessions on it): no hop "
                         "figure")
        elif st.decode_rtt_ms - sc.compute_ms < 0:  # each round trip holds its step's compute
            notes.append(f"{sc.endpoint}: compute {sc.compute_ms:.3f} ms exceeds the round trip "
                         f"{st.decode_rtt_ms:.3f} ms over the same steps: no hop figure")
        else:
            sc.hop_ms = st.decode_rtt_ms - sc.compute_ms
    stages = stages[:len(session.stats)]
    costs = RouteCosts(path=path, decode_tokens=decode_tokens, ms_per_token=tpot,
                       stages=stages, links=len(stages), notes=notes)
    if (stages and all(st.decode_steps for st in session.stats[:len(stages)])
            and all(sc.hop_ms is not None for sc in stages)):
        costs.transport_ms = sum(sc.hop_ms for sc in stages)
    return costs

"""What the driver reports: per-stage timings of a session, and a generation's outcome."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Generation", "StageStats"]


@dataclass
class StageStats:
    """Per-stage timings seen by the driver (decode steps are single-token steps)."""

    endpoint: str
    layers: tuple[int, int]
    steps: int = 0
    decode_steps: int = 0
    decode_rtt_s: float = 0.0  # time from sending the frame to having the reply, decode steps
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def decode_rtt_ms(self) -> float:
        return 1e3 * self.decode_rtt_s / self.decode_steps if self.decode_steps else 0.0


@dataclass
class Generation:
    """The outcome of ``complete``: tokens, text, why it stopped, and timings."""

    tokens: list[int]
    text: str
    stop_reason: str              # "eos", "length" or "stop"
    prompt_tokens: int
    time_to_first_token_s: float
    decode_s: float               # from the first token to the last
    recoveries: int = 0           # re-prefills after a failure
    logits: list[np.ndarray] | None = None
    #: speculative decoding (docs/speculative.md): decode-loop trips, the drafts they
    #: carried, the drafts accepted
    trips: int = 0
    drafted: int = 0
    accepted: int = 0
    #: each token's arrival at the driver (``time.perf_counter()`` seconds): the gaps are
    #: the inter-token latencies, and several sessions' times show when they decoded at once
    token_times: list[float] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        """Drafts accepted over drafts sent (0 without drafts)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_trip(self) -> float:
        """Tokens each decode-loop trip made, on average (0 without trips)."""
        return (self.trips + self.accepted) / self.trips if self.trips else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

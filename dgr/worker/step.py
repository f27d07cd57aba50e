"""One admitted step of a stage: its frame, its lease and, once computed, what it returned.

The unit the pipeline (``dgr.worker.pipeline``) checks, leases, computes and finishes, and the
scheduler (``dgr.worker.scheduler``) batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dgr.protocol import wire
from dgr.worker.sessions import Lease

__all__ = ["Step"]


@dataclass(eq=False)
class Step:
    """One admitted step: its frame and lease and, once computed, what the engine returned."""

    header: wire.Forward
    array: Any  # the boundary it came with (None on a first stage)
    lease: Lease | None  # None until ``StagePipeline.lease`` (the stage loop, before compute)
    t_arrive: float  # time.perf_counter() when its frame arrived
    kind: str = "none"  # what ``result`` is: "boundary", "logits", "embedding" or "none"
    result: Any = None  # the boundary or the logits rows
    tokens: list[int] | None = None  # sampled, one per wanted row (verified: the emitted)
    accepted: int = 0  # drafts (``Forward.drafts``) the verification accepted
    seconds: float = 0.0  # the engine's forward call (its share of a batch's, by tokens)
    batch: tuple[int, int] | None = None  # (batch id, steps in it), set by the stage loop
    credential: Any = None  # the caller's (dgr.transport.security.Credential), if any

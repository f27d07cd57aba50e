"""The ``wire.Forward`` headers the driver sends: built here, for every path."""

from __future__ import annotations

from dgr.protocol import wire
from dgr.protocol.describe import StageInfo
from dgr.protocol.grammar import grammar_id
from dgr.protocol.sampling import SamplingParams

__all__ = ["forward_header", "media_header", "wire_sampling", "solo_of"]


def wire_sampling(p: SamplingParams | None, start: int = 0) -> wire.Sampling | None:
    """``Forward.sampling`` of ``p`` (None: greedy, the stage's default); ``start``: the
    position of the first token sampled (where ``p.grammar`` begins)."""
    if p is None or (p.greedy and not p.logit_bias and not p.penalized and not p.grammar):
        return None
    # what applies to greedy and sampling alike: the bias, the penalties, the grammar
    common = dict(bias_ids=tuple(int(t) for t, _ in p.logit_bias),
                  bias=tuple(float(b) for _, b in p.logit_bias))
    if p.penalized:
        common.update(penalty_last_n=int(p.penalty_last_n),
                      repeat_penalty=float(p.repeat_penalty),
                      frequency_penalty=float(p.frequency_penalty),
                      presence_penalty=float(p.presence_penalty))
    if p.grammar:
        common.update(grammar=p.grammar, grammar_id=grammar_id(p.grammar),
                      grammar_from=int(start))
    if p.greedy:
        return wire.Sampling(greedy=True, **common)
    return wire.Sampling(temperature=float(p.temperature), top_k=int(p.top_k),
                         top_p=float(p.top_p), seed=int(p.seed), min_p=float(p.min_p), **common)


def forward_header(session: str, epoch: int, stage: StageInfo, pos: int, toks: list[int], *,
                   want: str, sampling: wire.Sampling | None, last: bool = True,
                   tokens: bool = True, relay: list[wire.Hop] | None = None,
                   reply_to: str = "", loop: list[wire.Hop] | None = None, steps: int = 0,
                   stop_tokens: list[int] | None = None, solo: bool = False,
                   rollback: int = 0, speculate: str = "", max_draft: int = 0
                   ) -> wire.Forward:
    """The step of ``toks`` at ``pos`` of ``session`` (``epoch``), sent to ``stage``.

    ``last``: the step ends where the driver reads the reply, so it asks for ``want`` with
    ``sampling``; otherwise it asks for the boundary only. ``tokens``: the frame carries the
    token ids (the first stage, the last stage, and a stage whose range routes by token id).
    ``relay``, ``reply_to``: the stages after ``stage`` and the route to answer (direct relay);
    ``loop``, ``steps``, ``stop_tokens``: the decode loop (every stage, tokens to run, where
    the last stage stops it). ``solo``: every stage computes the step alone, not batched
    with other sessions' steps (``solo_of``). ``rollback``: positions every stage drops from
    the session's cache first (drafts a decode loop left there, rejected); ``speculate``,
    ``max_draft``: the decode loop's drafter on the last stage.
    """
    return wire.Forward(model=stage.identity, session=session, epoch=epoch, first_pos=pos,
                        n_tokens=len(toks), layer=stage.layers[0],
                        tokens=toks if tokens else None,
                        want=want if last else "boundary",
                        sampling=sampling if last else None, relay=relay, reply_to=reply_to,
                        loop=loop, steps=steps, stop_tokens=stop_tokens, solo=solo,
                        rollback=rollback, speculate=speculate, max_draft=max_draft)


def solo_of(route, want: str) -> bool:
    """Whether a step of ``route`` asking for ``want`` runs alone on every stage: when the
    route does not batch (``AsyncRoute(batching=False)``), and in the parity mode (a step
    that returns logits: they must be the whole model's own, bit for bit), and an embedding
    step (the last stage returns every row)."""
    return not route.batching or want in ("logits", "token+logits", "embedding")


def media_header(session: str, epoch: int, stage: StageInfo, step, *, want: str,
                 sampling: wire.Sampling | None, last: bool = True,
                 rollback: int = 0) -> wire.Forward:
    """The media step ``step`` (``dgr.driver.media.MediaStep``: an encoded image or audio
    chunk's rows, positions and causality) of ``session`` sent to ``stage``: no token ids,
    the array the rows (the first stage's) or the boundary, every position section, alone
    on every stage (never batched with other sessions' steps)."""
    sections = step.sections()
    return wire.Forward(model=stage.identity, session=session, epoch=epoch,
                        first_pos=step.first_pos, n_tokens=step.n_rows, layer=stage.layers[0],
                        want=want if last else "boundary", sampling=sampling if last else None,
                        solo=True, rollback=rollback, media=step.kind, sections=sections,
                        causal=step.causal)

"""Route checks: whether described stages form one route, and a stage's error as the driver
raises it."""

from __future__ import annotations

from typing import Sequence

from dgr import errors
from dgr.protocol import wire
from dgr.protocol.describe import StageInfo
from dgr.protocol.settings import NUMERIC_SETTINGS

__all__ = ["check_route", "stage_error", "stage_name"]


def stage_name(st: StageInfo) -> str:
    """``host:port [first, end)``: how the driver names a stage in its messages."""
    return f"{st.endpoint} [{st.layers[0]}, {st.layers[1]})"


def check_route(stages: Sequence[StageInfo], *, mixed_devices: bool = False) -> list[StageInfo]:
    """Order stages by layer and check they form one route; returns them in route order.

    Stages on different kinds of device (``StageInfo.compute``: the CPU, a Vulkan or CUDA
    device model) compute other bits than either whole model: such a mixed route is refused
    unless ``mixed_devices`` asks for it.

    Raises
    ------
    dgr.errors.ModelMismatch
        Stages serve different models, numeric settings, wire formats or llama.cpp pins
        (``llama_cpp_commit``, ``patch_stack_hash``), or compute on different kinds of
        device or CPU variants (``cpu_variant``) without ``mixed_devices``.
    dgr.errors.RouteError
        The layer ranges leave a gap, overlap, or do not reach both ends.
    dgr.errors.WorkerDraining
        A stage is shutting down.
    """
    if not stages:
        raise errors.RouteError("a route needs at least one stage")
    ref = stages[0]
    for s in stages[1:]:
        if s.model_identity != ref.model_identity:
            raise errors.ModelMismatch(
                f"{s.endpoint} serves model {s.model_identity}, but {ref.endpoint} serves "
                f"{ref.model_identity}")
        diff = [k for k in NUMERIC_SETTINGS if s.settings.get(k) != ref.settings.get(k)]
        if diff:
            pairs = ", ".join(f"{k}={s.settings.get(k)!r} vs {ref.settings.get(k)!r}"
                              for k in diff)
            raise errors.ModelMismatch(
                f"{s.endpoint} and {ref.endpoint} use different numeric settings ({pairs}); "
                "every stage of a route must use the same ones")
        if s.compute != ref.compute and not mixed_devices:
            raise errors.ModelMismatch(
                f"{s.endpoint} computes on {s.compute}, {ref.endpoint} on {ref.compute}: a route "
                "mixing kinds of device computes other bits than either whole model; ask for it "
                "with mixed_devices=True (--mixed-devices), or run every stage on one kind")
        if (s.cpu_variant and ref.cpu_variant and s.cpu_variant != ref.cpu_variant
                and not mixed_devices):
            raise errors.ModelMismatch(
                f"{s.endpoint} runs {s.cpu_variant} CPU code, {ref.endpoint} {ref.cpu_variant}: "
                "other kernels compute other bits, so the route would match neither whole "
                "model; ask for it with mixed_devices=True (--mixed-devices), or build every "
                "stage alike (DGR_CPU_VARIANT)")
        if s.wire_format_version != ref.wire_format_version:
            raise errors.ModelMismatch(
                f"{s.endpoint} speaks wire format {s.wire_format_version}, {ref.endpoint} "
                f"{ref.wire_format_version}")
        if (s.llama_cpp_commit, s.patch_stack_hash) != (ref.llama_cpp_commit,
                                                         ref.patch_stack_hash):
            raise errors.ModelMismatch(
                f"{s.endpoint} computes with {_pin(s)}, {ref.endpoint} with {_pin(ref)}: "
                "stages of other llama.cpp pins compute other bits; a route never mixes "
                "them (run every stage on one dgr build)")
    for s in stages:
        if s.wire_format_version != wire.FORMAT_VERSION:
            raise errors.ModelMismatch(f"{s.endpoint} speaks wire format "
                                       f"{s.wire_format_version}; this driver speaks "
                                       f"{wire.FORMAT_VERSION}")
        if s.draining:
            raise errors.WorkerDraining(f"{s.endpoint} is draining (shutting down)")
    order = sorted(stages, key=lambda s: s.layers)
    n = ref.n_layer
    name = stage_name

    if order[0].layers[0] != 0:
        raise errors.RouteError(f"layers [0, {order[0].layers[0]}) are not covered: the first "
                                f"stage is {name(order[0])}")
    for a, b in zip(order, order[1:]):
        if a.layers[1] < b.layers[0]:
            raise errors.RouteError(f"layers [{a.layers[1]}, {b.layers[0]}) are not covered: "
                                    f"gap between {name(a)} and {name(b)}")
        if a.layers[1] > b.layers[0]:
            raise errors.RouteError(f"layers [{b.layers[0]}, {min(a.layers[1], b.layers[1])}) "
                                    f"are served twice: {name(a)} overlaps {name(b)}")
    if order[-1].layers[1] != n:
        raise errors.RouteError(f"layers [{order[-1].layers[1]}, {n}) are not covered: the "
                                f"last stage is {name(order[-1])}")
    return order


def stage_error(reply: wire.ErrorReply, st: StageInfo) -> errors.DgrError:
    """The stage's error, its message prefixed with the stage (same class, same retry hint)."""
    exc = reply.to_exception()
    exc.args = (f"{stage_name(st)}: {reply.message}",)
    return exc


def _pin(s: StageInfo) -> str:
    """A stage's llama.cpp pin, as a refusal names it."""
    if not s.llama_cpp_commit:
        return "a llama.cpp pin it does not say (a dgr older than its Describe's pin fields)"
    return f"llama.cpp {s.llama_cpp_commit[:12]} + patch stack {s.patch_stack_hash[:12]}"

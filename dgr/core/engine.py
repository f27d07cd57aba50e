"""``dgr.Engine``: the public Python face of the compiled range engine."""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from dgr import errors
from dgr._core import Engine as _CoreEngine
from dgr._core import arch_supports_layer_range
from dgr.artifacts.identity import model_identity
from dgr.core.refusals import refusal_reason
from dgr.protocol.settings import NUMERIC_SETTINGS, compute_kind, is_software_device

__all__ = ["Engine", "NUMERIC_SETTINGS"]


def _load_path(model, layers, a: int, b: int):
    """The file llama.cpp must open, after the header-only checks llama.cpp cannot make.

    A split model loads from its first split (and every split must be present); a dgr slice
    serves only the layers it holds. Files that are missing or not GGUF at all are left to the
    engine, which reports them with its own typed errors.
    """
    from dgr.artifacts.verify import precheck

    try:
        return precheck(model, None if layers is None else (a, b))["load_path"]
    except (errors.ModelNotFound, errors.InvalidModel, OSError):
        return model


def _architecture(path: str) -> str:
    """The GGUF's ``general.architecture``, read from its header ("" where unreadable)."""
    from dgr.artifacts.gguf import read_header

    try:
        return str(read_header(path, decode_arrays=False).kv.get("general.architecture", ""))
    except Exception:  # noqa: BLE001 - the engine's own error then stands as it is
        return ""


class Engine(_CoreEngine):
    """Layers ``[a, b)`` of a GGUF model, computed by the patched llama.cpp on the CPU or on
    one device of a ggml backend (Vulkan, CUDA, ...).

    Parameters
    ----------
    model : str or os.PathLike
        Path of a ``.gguf`` file.
    layers : (int, int), optional
        The owned layer range ``[a, b)`` in absolute indices; ``None`` for the whole model.
        The first stage (``a == 0``) takes token ids; later stages take the boundary (the
        residual stream entering layer ``a``). The last stage (``b == n_layer``) returns
        logits; earlier stages return the boundary after layer ``b - 1``.
    n_ctx : int
        Context tokens per slot; 0: the model's trained context (``n_ctx_train``), capped by
        what ``kv_budget_mib`` holds. :attr:`n_ctx` is the one chosen (``describe()``'s
        ``n_ctx_source`` says why); ``settings["n_ctx"]`` stays as asked, and the stage
        identity spells it so (a cache's size does not change a row's bits: llama.cpp attends
        over the cells in use, padded to 256).
    n_slots : int
        Concurrent sequences; each has its own KV stream.
    n_threads : int
        CPU threads for every step (prompt and decode alike).
    n_ubatch : int
        Tokens per compute chunk (``n_batch == n_ubatch``); longer inputs are chunked.
    flash_attn : bool
        Flash attention on or off (never "auto").
    type_k, type_v : str
        KV cache types (``"f16"``, ``"f32"``, ``"bf16"``, ``"q8_0"``, ...).
    batch_invariant : bool
        Compute with ggml's CPU reference kernels (CPU device only), whose rows do not
        depend on what else a forward computes: a row has the same bits alone, in a chunk of
        any length (a whole ``n_ubatch`` chunk too), batched with other slots' rows or with
        drafts, at any KV length. Without it, with two threads or more, ggml's CPU flash
        attention splits a lone single-row step's KV of 512 cells or more over the threads,
        and a product of f32 or f16 matrices takes another kernel for one row than for
        several, so those rows differ (its flash attention computes a row alike in a batch of
        any length: patch 0026). Prefill is slower (docs/performance.md "Batch-invariant
        kernels").
    use_mmap : bool
        Map the file instead of reading it (does not change numerics).
    mtp : bool
        Load the model's NextN (MTP) block and draft with it (:meth:`mtp_draft`): the last
        stage of a deepseek4 model with one NextN block only. The trunk's logits stay
        bit-identical to ``mtp=False``; such a stage also takes the token ids with its
        boundary (``needs_token_ids``).
    device : str
        ``"cpu"``, or a device of this build's ggml backends such as ``"Vulkan0"`` or
        ``"CUDA0"`` (``dgr.devices()`` lists them). Every owned layer, its caches and, on the
        last stage, the head go there; boundary rows cross host memory once each way. Decides
        numerics: compare a split with the whole model on the same kind of device.
    device_memory_limit : int
        The most bytes this engine may hold on its device (weights, KV, compute buffers);
        0 for no cap but the device's free memory.
    kv_budget_mib : int
        With ``n_ctx=0``: the most MiB the KV cache and recurrent state of all slots may take;
        0 for half the memory free once the weights are in (the system's available memory on
        the CPU, the device's free memory elsewhere).
    state_snapshots : int
        A recurrent or hybrid model's stage keeps, per slot, a snapshot of its state at the
        end of each whole ``n_ubatch`` chunk prefilled from position 0, the last
        ``state_snapshots`` of them (host memory: ``describe()["state_bytes"]`` each), and
        :meth:`truncate` to one restores it (llama-server's context checkpoints): a prompt
        cache's next turn. 0 keeps none. Other models ignore it.

    Raises
    ------
    dgr.errors.ModelNotFound, dgr.errors.InvalidModel
        The file is missing, not GGUF, or truncated.
    dgr.errors.InvalidLayerRange, dgr.errors.UnsupportedArchitecture
        The range is empty or outside ``[0, n_layer)``, or the architecture has no stage graph.
    dgr.errors.InvalidArgument
        A setting is out of range.
    dgr.errors.MtpNotSupported
        ``mtp`` on a stage that is not the last, on a model without a NextN block, or on an
        architecture other than deepseek4.
    dgr.errors.DeviceNotFound
        No such device, or its backend is not in this build.
    dgr.errors.DeviceOutOfMemory
        The range does not fit the device's free memory (or ``device_memory_limit``); the
        message says how much it needs and how much is free.
    """

    def __init__(self, model: str | os.PathLike, layers: tuple[int, int] | None = None, *,
                 n_ctx: int = 1024, n_slots: int = 1, n_threads: int = 1, n_ubatch: int = 64,
                 flash_attn: bool = True, type_k: str = "f16", type_v: str = "f16",
                 batch_invariant: bool = False, use_mmap: bool = True, mtp: bool = False, device: str = "cpu",
                 device_memory_limit: int = 0, state_snapshots: int = 4, kv_budget_mib: int = 0):
        self.model_path = os.fspath(model)
        self.settings = {"n_ctx": n_ctx, "n_slots": n_slots, "n_threads": n_threads,
                         "n_ubatch": n_ubatch, "flash_attn": bool(flash_attn),
                         "type_k": type_k, "type_v": type_v,
                         "batch_invariant": bool(batch_invariant)}
        info = self._info()
        #: the device as ``device=`` names it ("cpu", "Vulkan0"), and its kind as routes and
        #: lanes compare it (``dgr.protocol.settings.compute_kind``)
        self.device: str = info["device"]
        self.compute: str = compute_kind(info["backend"], info["device_desc"])
        self.n_layer: int = info["n_layer"]
        self.layers: tuple[int, int] = (info["layer_start"], info["layer_end"])
        self.n_embd: int = info["n_embd"]
        #: context tokens per slot: ``n_ctx`` as given, or as chosen for ``n_ctx=0``
        self.n_ctx: int = info["n_ctx"]
        self.arch: str = info["arch"]
        self._identity: str | None = None

    def __new__(cls, model: str | os.PathLike, layers: tuple[int, int] | None = None, **kw: Any):
        if layers is None:
            a, b = 0, -1
        else:
            try:
                a, b = (int(x) for x in layers)
            except (TypeError, ValueError):
                raise errors.InvalidLayerRange(
                    f"layers must be a pair (start, end), got {layers!r}") from None
            if b < 0:
                raise errors.InvalidLayerRange(f"layer range end must be >= 0, got {b}")
        for name in ("n_slots", "n_threads", "n_ubatch"):
            if name in kw and (not isinstance(kw[name], (int, np.integer)) or kw[name] < 1):
                raise errors.InvalidArgument(f"{name} must be a positive integer, got {kw[name]!r}")
        for name in ("n_ctx", "kv_budget_mib"):
            if name in kw and (not isinstance(kw[name], (int, np.integer)) or kw[name] < 0):
                raise errors.InvalidArgument(
                    f"{name} must be a positive integer, or 0 for the default, got {kw[name]!r}")
        if kw.get("kv_budget_mib") and kw.get("n_ctx", 1024) != 0:
            raise errors.InvalidArgument(
                f"kv_budget_mib sizes the context of n_ctx=0 only; n_ctx={kw.get('n_ctx', 1024)} "
                "is set: give one or the other")
        s = kw.get("state_snapshots", 0)
        if not isinstance(s, (int, np.integer)) or not 0 <= s <= 1024:
            raise errors.InvalidArgument(f"state_snapshots must be an integer in [0, 1024], got {s!r}")
        path = os.fspath(_load_path(model, layers, a, b))
        try:
            return super().__new__(cls, path, a, b, **kw)
        except errors.UnsupportedArchitecture as e:
            arch = _architecture(path)
            if not arch or arch_supports_layer_range(arch):
                raise  # not this architecture's refusal (a build without layer ranges)
            # say what stands in the way of a split
            raise errors.UnsupportedArchitecture(
                f"{e}; {arch} is refused because {refusal_reason(arch)} "
                "(docs/architectures.md)") from None

    def compute_facts(self) -> dict[str, Any]:
        """The compute device and what this engine holds on it: ``device`` (as ``device=``
        names it), ``backend``, ``type``, ``description``, ``driver``, ``kind``
        (``compute_kind``), ``software`` (a software implementation such as lavapipe), and
        bytes: ``memory_free``/``memory_total`` of the device, and the engine's
        ``weight_bytes``, ``kv_bytes`` and ``compute_bytes`` there."""
        i = self._info()
        return {"device": i["device"], "backend": i["backend"].lower(), "type": i["device_type"],
                "description": i["device_desc"], "driver": i["device_driver"],
                "kind": compute_kind(i["backend"], i["device_desc"]),
                "software": i["device_type"] != "cpu" and is_software_device(i["device_desc"]),
                "memory_free": i["device_memory_free"], "memory_total": i["device_memory_total"],
                "weight_bytes": i["device_weight_bytes"], "kv_bytes": i["device_kv_bytes"],
                "compute_bytes": i["device_compute_bytes"]}

    # -- facts ------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        """Content hash of the model file (``sha256:...``), computed once and cached."""
        if self._identity is None:
            self._identity = model_identity(self.model_path)
        return self._identity

    def describe(self) -> dict[str, Any]:
        """What this engine serves: architecture, sizes, range, settings, memory, identity."""
        info = self._info()
        info.update(
            model=self.model_path,
            identity=self.identity,
            vocab_size=info["n_vocab"],
            layers=list(self.layers),
            is_first=self.is_first,
            is_last=self.is_last,
            boundary_width=info["n_embd_boundary"],
            boundary_dtype="float32",
            settings=dict(self.settings),
            compute=self.compute,
        )
        return info

    def __repr__(self) -> str:
        a, b = self.layers
        return (f"<dgr.Engine {self.arch} layers [{a}, {b}) of {self.n_layer} "
                f"{os.path.basename(self.model_path)!r}>")

    # -- compute ----------------------------------------------------------------------

    def _want(self, logits, n: int) -> np.ndarray | None:
        """The logits mask of ``forward``/``forward_batch`` (None: the engine's default)."""
        if not self.is_last:
            return None
        if isinstance(logits, str):
            if logits == "all":
                return np.ones(n, dtype=np.uint8)
            if logits != "last":
                raise errors.InvalidArgument(
                    f"logits must be 'last', 'all' or a mask, got {logits!r}")
            return None
        return np.ascontiguousarray(logits, dtype=np.bool_).view(np.uint8)

    def forward(self, slot: int, positions: int | Sequence[int] | np.ndarray,
                tokens: Sequence[int] | np.ndarray | None = None,
                boundary: np.ndarray | None = None, *,
                logits: str | Sequence[bool] | np.ndarray = "last",
                out: np.ndarray | None = None) -> np.ndarray:
        """Run tokens (first stage) or a boundary (later stages) through the owned layers.

        Parameters
        ----------
        slot : int
            Sequence slot in ``[0, n_slots)``.
        positions : int or int array
            Absolute positions of the rows, contiguous and continuing the slot; an int is the
            first position.
        tokens : int array, optional
            Token ids; required on the first stage (and on stages that route by token id).
        boundary : float32 array ``[n_tokens, boundary_width]``, optional
            Required on non-first stages.
        logits : "last", "all" or a boolean mask
            Last stage only: which rows return logits.
        out : float32 array, optional
            Reused output buffer (C-contiguous, enough rows).

        Returns
        -------
        numpy.ndarray
            float32 ``[rows, n_vocab]`` logits on the last stage, else the boundary
            ``[n_tokens, boundary_width]``. The array is the caller's (no aliasing of engine
            memory).

        Raises
        ------
        dgr.errors.InvalidToken, dgr.errors.InvalidPosition, dgr.errors.ContextFull,
        dgr.errors.UnknownSlot, dgr.errors.InvalidBoundary, dgr.errors.MissingTokenIds
        """
        # Only conversions here: the binding checks every buffer against the step (dtype,
        # layout, lengths, widths) and the C++ engine what the values mean (vocabulary,
        # positions, which stage takes what), each with the typed error named above.
        tok = None if tokens is None else np.ascontiguousarray(tokens, dtype=np.int32)
        # a float32 boundary of any layout is copied to C order; anything else is refused below
        bnd = np.ascontiguousarray(boundary) if isinstance(boundary, np.ndarray) else boundary
        if isinstance(positions, (int, np.integer)):
            rows = tok if tok is not None else (bnd if isinstance(bnd, np.ndarray) else None)
            n = 0 if rows is None else len(rows)
            pos = np.arange(int(positions), int(positions) + n, dtype=np.int32)
        else:
            pos = np.ascontiguousarray(positions, dtype=np.int32)
        want = self._want(logits, len(pos))
        return self._forward(int(slot), pos, tok, bnd, want, out)


    def forward_media(self, slot: int, positions: Sequence[int] | np.ndarray, rows: np.ndarray,
                      *, causal: bool = True,
                      logits: str | Sequence[bool] | np.ndarray = "last",
                      out: np.ndarray | None = None) -> np.ndarray:
        """Run one slot's media rows (an image or audio chunk: ``dgr.Media``) through the
        owned layers, on any stage: every stage of a route runs the same step.

        Parameters
        ----------
        positions : int array ``[n]``, or ``[n_pos_per_embd, n]``
            The rows' positions (``Media.positions``): consecutive from the slot's next one,
            or on an M-RoPE model (``describe()["n_pos_per_embd"]`` 4) mtmd's (t, y, x, z)
            per row, section-major; text after them continues at the highest + 1.
        rows : float32 array ``[n, width]``
            The first stage: the encoder's embedding rows (``n_embd_inp`` wide,
            ``Media.encode``); later stages: the boundary.
        causal : bool
            False (``Media.tokenize``'s ``non_causal``): the rows attend to each other both
            ways; the step must fit in one ``n_ubatch`` chunk.
        logits, out
            As for ``forward``.

        Raises
        ------
        dgr.errors.InvalidBoundary, dgr.errors.InvalidPosition, dgr.errors.ContextFull,
        dgr.errors.UnknownSlot, dgr.errors.MissingTokenIds (a stage that reads token ids),
        dgr.errors.InvalidArgument (a non-causal step longer than ``n_ubatch``)
        """
        r = np.ascontiguousarray(rows) if isinstance(rows, np.ndarray) else rows
        pos = np.ascontiguousarray(positions, dtype=np.int32)
        n = pos.shape[-1] if pos.ndim else 0
        return self._forward_media(int(slot), pos, r, bool(causal), self._want(logits, n), out)

    def embed(self, slot: int, positions: int | Sequence[int] | np.ndarray,
              tokens: Sequence[int] | np.ndarray | None = None,
              boundary: np.ndarray | None = None) -> np.ndarray:
        """``forward`` on the last stage that returns every row's final hidden state, after
        the model's output norm (llama.cpp's embeddings, never pooled: pool with
        ``dgr.protocol.embeddings.pool``): float32 ``[n_tokens, n_embd]``. The slot's cache
        grows as with ``forward``.

        Raises
        ------
        dgr.errors.InvalidArgument
            Not the last stage, or an engine that returns no embeddings (MTP, deepseek4).
        The errors of ``forward`` otherwise.
        """
        tok = None if tokens is None else np.ascontiguousarray(tokens, dtype=np.int32)
        bnd = np.ascontiguousarray(boundary) if isinstance(boundary, np.ndarray) else boundary
        if isinstance(positions, (int, np.integer)):
            rows = tok if tok is not None else bnd
            n = 0 if rows is None else len(rows)
            pos = np.arange(int(positions), int(positions) + n, dtype=np.int32)
        else:
            pos = np.ascontiguousarray(positions, dtype=np.int32)
        return self._embed(int(slot), pos, tok, bnd)

    def forward_batch(self, slots: Sequence[int] | np.ndarray,
                      positions: Sequence[int] | np.ndarray,
                      tokens: Sequence[int] | np.ndarray | None = None,
                      boundary: np.ndarray | None = None, *,
                      logits: str | Sequence[bool] | np.ndarray = "last",
                      out: np.ndarray | None = None) -> np.ndarray:
        """Run the tokens of several slots through the owned layers in one forward.

        Token ``i`` belongs to slot ``slots[i]`` at ``positions[i]``; slots may interleave.
        The tokens go to llama.cpp as one batch, which computes the rows of slots with
        consecutive ids in one ubatch (as many tokens of each as the one with fewest left),
        so slots should be numbered compactly.

        Whether a slot's rows are bit-identical to the same slot run alone through
        :meth:`forward` is measured per build by ``benches/batch_exactness.py``. On the CPU
        build it holds for quantized and f16 weights while, with ``n_threads >= 2``, its KV
        is under 512 cells (flash attention splits a lone decode row's KV past that); not for
        f32 weights (sgemm takes two rows or more). Until patch 0026 it held only while each
        slot's piece of a ubatch had under 64 rows both ways. Outside that, rows differ beyond
        rounding (top-1 may differ).

        Parameters
        ----------
        slots : int array
            Each token's slot in ``[0, n_slots)``.
        positions : int array
            Each token's absolute position. A slot's tokens, in input order, continue it: the
            first at ``next_pos(slot)``, each later one at the position after the one before.
        tokens : int array, optional
            Token ids; required on the first stage (and on stages that route by token id).
        boundary : float32 array ``[n_tokens, boundary_width]``, optional
            Required on non-first stages; row ``i`` is token ``i``'s.
        logits : "last", "all" or a boolean mask
            Last stage only: which rows return logits; "last" is the last token of each slot
            in the batch.
        out : float32 array, optional
            Reused output buffer (C-contiguous, enough rows).

        Returns
        -------
        numpy.ndarray
            float32 rows in input order: ``[rows, n_vocab]`` logits of the wanted tokens on
            the last stage, else the boundary ``[n_tokens, boundary_width]``. The array is
            the caller's (no aliasing of engine memory).

        Raises
        ------
        dgr.errors.InvalidToken, dgr.errors.InvalidPosition, dgr.errors.ContextFull,
        dgr.errors.UnknownSlot, dgr.errors.InvalidBoundary, dgr.errors.MissingTokenIds
            Nothing is computed when one is raised: every slot keeps its state. A failure of
            llama.cpp itself (``dgr.errors.EngineError``) clears every slot of the batch.
        """
        # Only conversions here, as in forward: the binding checks the buffers, the C++ engine
        # the values, each with its typed error.
        sl = np.ascontiguousarray(slots, dtype=np.int32)
        pos = np.ascontiguousarray(positions, dtype=np.int32)
        tok = None if tokens is None else np.ascontiguousarray(tokens, dtype=np.int32)
        bnd = np.ascontiguousarray(boundary) if isinstance(boundary, np.ndarray) else boundary
        want = self._want(logits, len(pos))
        return self._forward_batch(sl, pos, tok, bnd, want, out)

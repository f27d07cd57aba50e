"""GGUF headers read and written by dgr: a strict stdlib parser, split-file discovery, a raw writer.

dgr reads GGUF headers itself (no numpy, no llama.cpp tree needed) because workers parse them on
every start and verification must not depend on the vendor cache. Writing copies the source's
key/value bytes verbatim: gguf-py's ``GGUFWriter`` re-encodes values (it rejects empty arrays and
infers nested array types), which could change the metadata a slice is meant to keep intact.
``gguf_module()`` still gives the pinned tree's gguf-py for fixtures and cross-checks.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Sequence

from dgr.artifacts.storage import atomic_file
from dgr.errors import ArtifactTruncated, InvalidModel, ModelNotFound

__all__ = [
    "gguf_module", "GGML_TYPES", "GGUFTensor", "GGUFHeader", "SkippedArray", "read_header",
    "tensor_nbytes", "check_data_in_file",
    "SPLIT_RE", "split_paths", "model_files", "encode_kv", "write_gguf", "split_gguf",
]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml type id -> (name, elements per block, bytes per block); ggml.h at the pinned commit
# (tests/unit/test_artifacts.py checks it against the pinned gguf-py's GGML_QUANT_SIZES).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}

# GGUF value types (gguf.h): scalar struct formats; 8 = string, 9 = array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
T_U16, T_U32, T_I32, T_STRING, T_ARRAY = 2, 4, 5, 8, 9

# llama.cpp's llama_split_path: "<prefix>-%05d-of-%05d.gguf"
SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


_gguf = None


def gguf_module():
    """Import ``gguf`` (gguf-py) from the pinned llama.cpp tree in the vendor cache."""
    global _gguf
    if _gguf is not None:
        return _gguf
    from dgr.vendor import Vendor

    path = str(Vendor().gguf_py())
    if not Path(path).exists():
        from dgr.errors import VendorError

        raise VendorError(f"{path} is missing; run `python -m dgr.vendor fetch`")
    gguf = sys.modules.get("gguf")
    if gguf is None:  # the package loaded from its folder: sys.path is left as it is
        init = Path(path) / "gguf" / "__init__.py"
        spec = importlib.util.spec_from_file_location(
            "gguf", init, submodule_search_locations=[str(init.parent)])
        gguf = importlib.util.module_from_spec(spec)
        sys.modules["gguf"] = gguf
        try:
            spec.loader.exec_module(gguf)
        except BaseException:
            del sys.modules["gguf"]
            raise
    _gguf = gguf
    return gguf


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]          # ggml order (ne0 first)
    rel_offset: int                 # from the start of the data section
    offset: int                     # absolute in the file
    nbytes: int
    info_bytes: bytes               # the raw tensor-info record (name .. offset)

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


@dataclass
class GGUFHeader:
    path: Path
    version: int
    kv: dict[str, Any]              # decoded values (arrays as lists)
    kv_types: dict[str, int]
    kv_raw: dict[str, bytes]        # key -> raw encoded pair (key string, type, value)
    tensors: list[GGUFTensor]
    alignment: int
    info_end: int                   # end of the tensor-info records
    data_offset: int                # start of the (aligned) data section
    file_size: int
    by_name: dict[str, GGUFTensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.by_name = {t.name: t for t in self.tensors}

    @property
    def arch(self) -> str:
        return str(self.kv.get("general.architecture", ""))

    def arch_int(self, key: str, default: int | None = None) -> int | None:
        v = self.kv.get(f"{self.arch}.{key}", default)
        return int(v) if v is not None else None

    @property
    def split_no(self) -> int:
        return int(self.kv.get("split.no", 0))

    @property
    def split_count(self) -> int:
        return int(self.kv.get("split.count", 1))

    @property
    def slice_range(self) -> tuple[int, int] | None:
        """``(start, end)`` when this file is a dgr slice, else None."""
        if "dgr.slice.layer_start" not in self.kv:
            return None
        return int(self.kv["dgr.slice.layer_start"]), int(self.kv["dgr.slice.layer_end"])

    @property
    def data_end(self) -> int:
        """End of the last tensor's bytes (what the file must at least hold)."""
        return max((t.offset + t.nbytes for t in self.tensors), default=self.data_offset)


def check_data_in_file(h: GGUFHeader) -> GGUFHeader:
    """Return ``h`` when every tensor's data lies inside its file; a file cut short (a prefix
    of a larger file, whose header is whole but whose tensors end past its last byte) raises.

    Raises
    ------
    dgr.errors.ArtifactTruncated
        Naming the file's size, where its tensors end, and the first tensor cut.
    """
    if h.file_size < h.data_end:
        cut = [t.name for t in h.tensors if t.offset + t.nbytes > h.file_size]
        raise ArtifactTruncated(
            f"{h.path.name} is truncated: {h.file_size} bytes, its tensors end at {h.data_end} "
            f"(tensor data past the end of the file: {len(cut)} tensors cut, from {cut[0]})")
    return h


def tensor_nbytes(ggml_type: int, shape: Sequence[int]) -> int:
    """Bytes of a tensor's data (ggml_nbytes of a contiguous tensor)."""
    try:
        _, blck, size = GGML_TYPES[ggml_type]
    except KeyError:
        raise InvalidModel(f"unknown ggml type id {ggml_type}") from None
    n = 1
    for d in shape:
        n *= d
    if not shape or shape[0] % blck:
        raise InvalidModel(f"tensor row of {shape[0] if shape else 0} elements is not a multiple "
                           f"of the {GGML_TYPES[ggml_type][0]} block size {blck}")
    return n // blck * size


@dataclass(frozen=True)
class SkippedArray:
    """An array value that ``read_header(..., decode_arrays=False)`` stepped over."""

    element_type: int
    count: int


class _Cursor:
    """Bounds-checked little-endian reads over a buffer; a short read is a truncated header."""

    __slots__ = ("buf", "pos", "path", "decode_arrays")

    def __init__(self, buf, path: Path, decode_arrays: bool = True):
        self.buf, self.pos, self.path, self.decode_arrays = buf, 0, path, decode_arrays

    def take(self, n: int) -> int:
        p = self.pos
        if n < 0 or p + n > len(self.buf):
            raise InvalidModel(f"{self.path}: GGUF header is truncated (needs byte {p + n}, "
                               f"the file has {len(self.buf)})")
        self.pos = p + n
        return p

    def unpack(self, fmt: str):
        p = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, p)[0]

    def string(self, decode: bool = True):
        n = self.unpack("<Q")
        p = self.take(n)
        raw = bytes(self.buf[p:p + n])
        if not decode:
            return raw
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw

    def value(self, vtype: int, depth: int = 0):
        fmt = _SCALAR.get(vtype)
        if fmt is not None:
            return self.unpack(fmt)
        if vtype == T_STRING:
            return self.string()
        if vtype == T_ARRAY:
            if depth > 4:
                raise InvalidModel(f"{self.path}: GGUF arrays nested too deeply")
            et = self.unpack("<I")
            n = self.unpack("<Q")
            efmt = _SCALAR.get(et)
            if efmt is not None:
                size = struct.calcsize(efmt)
                p = self.take(n * size)
                if not self.decode_arrays:
                    return SkippedArray(et, n)
                return list(struct.unpack_from(f"<{n}{efmt[1]}", self.buf, p))
            if et not in (T_STRING, T_ARRAY):
                raise InvalidModel(f"{self.path}: unknown GGUF array element type {et}")
            if n > len(self.buf):
                raise InvalidModel(f"{self.path}: GGUF array claims {n} elements")
            if not self.decode_arrays and et == T_STRING:
                for _ in range(n):
                    self.take(self.unpack("<Q"))
                return SkippedArray(et, n)
            items = [self.value(et, depth + 1) for _ in range(n)]
            return items if self.decode_arrays else SkippedArray(et, n)
        raise InvalidModel(f"{self.path}: unknown GGUF value type {vtype}")


def read_header(path: str | os.PathLike, *, decode_arrays: bool = True) -> GGUFHeader:
    """Parse a GGUF file's header: metadata, tensor infos, and where the data starts.

    With ``decode_arrays=False`` array values (tokenizer vocabularies) are stepped over and
    stand as ``SkippedArray`` in ``kv`` (their raw bytes are still in ``kv_raw``): much faster
    when only scalar keys and tensor infos are wanted.

    Raises
    ------
    dgr.errors.ModelNotFound
        The file does not exist or cannot be read.
    dgr.errors.InvalidModel
        Not GGUF, an unsupported version, or a header cut short.
    """
    p = Path(path)
    try:
        f = open(p, "rb")
    except OSError as e:
        raise ModelNotFound(f"cannot open {p}: {e.strerror or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise InvalidModel(f"{p}: {size} bytes is too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return _parse(mm, p, size, decode_arrays)


def _parse(mm, p: Path, size: int, decode_arrays: bool) -> GGUFHeader:
    c = _Cursor(mm, p, decode_arrays)
    if bytes(mm[0:4]) != GGUF_MAGIC:
        raise InvalidModel(f"{p} is not a GGUF file (bad magic)")
    c.pos = 4
    version = c.unpack("<I")
    if version not in (2, 3):
        raise InvalidModel(f"{p}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = c.unpack("<Q")
    n_kv = c.unpack("<Q")
    if n_tensors > size or n_kv > size:
        raise InvalidModel(f"{p}: GGUF header claims {n_tensors} tensors and {n_kv} keys")
    kv: dict[str, Any] = {}
    kv_types: dict[str, int] = {}
    kv_raw: dict[str, bytes] = {}
    for _ in range(n_kv):
        start = c.pos
        key = c.string()
        if not isinstance(key, str):
            raise InvalidModel(f"{p}: a GGUF key is not UTF-8")
        vtype = c.unpack("<I")
        kv[key] = c.value(vtype)
        kv_types[key] = vtype
        kv_raw[key] = bytes(mm[start:c.pos])
    alignment = int(kv.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise InvalidModel(f"{p}: general.alignment {alignment} is not a power of two")
    infos = []
    for _ in range(n_tensors):
        start = c.pos
        name = c.string()
        n_dims = c.unpack("<I")
        if n_dims > 8:
            raise InvalidModel(f"{p}: tensor {name!r} has {n_dims} dimensions")
        shape = tuple(c.unpack("<Q") for _ in range(n_dims))
        ggml_type = c.unpack("<I")
        rel = c.unpack("<Q")
        infos.append((name, ggml_type, shape, rel, bytes(mm[start:c.pos])))
    info_end = c.pos
    data_offset = -(-info_end // alignment) * alignment
    tensors = []
    for name, ggml_type, shape, rel, raw in infos:
        if not isinstance(name, str):
            raise InvalidModel(f"{p}: a tensor name is not UTF-8")
        tensors.append(GGUFTensor(name, ggml_type, shape, rel, data_offset + rel,
                                  tensor_nbytes(ggml_type, shape), raw))
    return GGUFHeader(p, version, kv, kv_types, kv_raw, tensors, alignment, info_end,
                      data_offset, size)


# ---- split files ---------------------------------------------------------------------------


def split_paths(path: str | os.PathLike, count: int | None = None) -> list[Path]:
    """All files of the split model ``path`` belongs to, first split first (existing or not).

    ``path`` may be any split (``name-0000k-of-0000N.gguf``); a name without the split suffix
    is a one-file model.
    """
    p = Path(path)
    m = SPLIT_RE.match(p.name)
    if not m:
        return [p]
    n = int(m["count"]) if count is None else count
    return [p.with_name(f"{m['prefix']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def model_files(path: str | os.PathLike) -> list[Path]:
    """The files that make up the model at ``path``: itself, or every split of a split model.

    The split count is taken from the file's ``split.count`` metadata when it has it (and must
    agree with its name); missing splits are returned too, so callers can name them.
    """
    p = Path(path)
    h = read_header(p, decode_arrays=False)
    count = h.split_count
    m = SPLIT_RE.match(p.name)
    if count <= 1:
        return [p]
    if not m:
        raise InvalidModel(f"{p} says it is split {h.split_no + 1} of {count} but its name does "
                           "not end in -NNNNN-of-NNNNN.gguf, so the other splits cannot be found")
    if int(m["count"]) != count or int(m["no"]) != h.split_no + 1:
        raise InvalidModel(f"{p}: its name says split {int(m['no'])} of {int(m['count'])}, its "
                           f"metadata says split {h.split_no + 1} of {count}")
    return split_paths(p, count)


# ---- writing -------------------------------------------------------------------------------


def _enc_str(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def encode_kv(key: str, vtype: int, value: Any) -> bytes:
    """Encode one scalar or string key/value pair (what dgr itself adds to headers)."""
    out = _enc_str(key) + struct.pack("<I", vtype)
    if vtype == T_STRING:
        return out + _enc_str(value)
    return out + struct.pack(_SCALAR[vtype], value)


def _tensor_info(t: GGUFTensor, rel_offset: int) -> bytes:
    return (_enc_str(t.name) + struct.pack("<I", len(t.shape))
            + b"".join(struct.pack("<Q", d) for d in t.shape)
            + struct.pack("<IQ", t.ggml_type, rel_offset))


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


def write_gguf(out: str | os.PathLike, *, version: int, kv_pairs: Iterable[bytes],
               tensors: Sequence[tuple[GGUFTensor, str | os.PathLike]], alignment: int,
               block: int = 8 << 20, on_bytes=None) -> int:
    """Write a GGUF from raw key/value pairs and tensors copied from source files, streaming.

    ``tensors`` pairs each tensor (its info as read from a source header) with the source file
    its bytes are read from. The data is copied in ``block``-sized reads, so memory stays small
    whatever the model size. ``on_bytes(tensor, chunk)`` sees every data byte copied (for
    hashing).
    The file appears under ``out`` only when complete (written to a temporary name, fsynced,
    renamed). Returns the file size.

    Raises
    ------
    dgr.errors.StorageLocationError
        ``out`` lies under ``/home``, where no model artifact may be placed (nothing written).
    """
    from dgr.artifacts.store import check_production_path  # the /home rule (store.py)

    out = check_production_path(out, what="a GGUF file")
    pairs = list(kv_pairs)
    head = bytearray(GGUF_MAGIC + struct.pack("<IQQ", version, len(tensors), len(pairs)))
    for kvb in pairs:
        head += kvb
    rel = 0
    for t, _src in tensors:
        head += _tensor_info(t, rel)
        rel = _pad(rel + t.nbytes, alignment)
    head += b"\0" * (_pad(len(head), alignment) - len(head))
    handles: dict[str, BinaryIO] = {}
    try:
        with atomic_file(out) as f:
            f.write(head)
            buf = bytearray(block)
            for t, src in tensors:
                key = os.fspath(src)
                if key not in handles:
                    handles[key] = open(key, "rb")
                s = handles[key]
                s.seek(t.offset)
                left = t.nbytes
                while left:
                    view = memoryview(buf)[:min(block, left)]
                    got = s.readinto(view)
                    if not got:
                        raise InvalidModel(f"{src} ends inside tensor {t.name} "
                                           f"({t.nbytes - left} of {t.nbytes} bytes read)")
                    chunk = view[:got]
                    f.write(chunk)
                    if on_bytes is not None:
                        on_bytes(t, chunk)
                    left -= got
                f.write(b"\0" * (_pad(t.nbytes, alignment) - t.nbytes))
            size = f.tell()
    finally:
        for h in handles.values():
            h.close()
    return size


_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def split_gguf(src: str | os.PathLike, n_splits: int, out_dir: str | os.PathLike | None = None,
               prefix: str | None = None) -> list[Path]:
    """Split a one-file GGUF into ``n_splits`` files the way llama.cpp's ``gguf-split`` does.

    The first split holds every key plus the ``split.*`` keys; the others hold only the
    ``split.*`` keys; tensors are distributed in order, evenly by count. Names follow
    ``<prefix>-0000k-of-0000N.gguf``.

    Raises
    ------
    dgr.errors.StorageLocationError
        The splits would lie under ``/home`` (refused before anything is read or written).
    dgr.errors.ArtifactTruncated
        ``src`` is cut short (its tensors end past its last byte).
    """
    from dgr.artifacts.store import check_production_path  # the /home rule (store.py)

    out_dir = Path(out_dir) if out_dir is not None else Path(src).parent
    prefix = prefix or Path(src).stem
    paths = split_paths(out_dir / f"{prefix}-00001-of-{n_splits:05d}.gguf")
    for path in paths:
        check_production_path(path, what="a split GGUF")
    h = check_data_in_file(read_header(src))
    if h.split_count > 1:
        raise InvalidModel(f"{src} is already split")
    if not 1 <= n_splits <= max(len(h.tensors), 1):
        raise ValueError(f"cannot split {len(h.tensors)} tensors into {n_splits} files")
    groups, base, extra, i = [], *divmod(len(h.tensors), n_splits), 0
    for k in range(n_splits):
        n = base + (1 if k < extra else 0)
        groups.append(h.tensors[i:i + n])
        i += n
    for k, (path, group) in enumerate(zip(paths, groups)):
        split_kv = [encode_kv("split.no", T_U16, k), encode_kv("split.count", T_U16, n_splits),
                    encode_kv("split.tensors.count", T_I32, len(h.tensors))]
        kv = ([raw for key, raw in h.kv_raw.items() if key not in _SPLIT_KEYS] if k == 0 else [])
        # gguf-split writes general.alignment only into the first split; keep it everywhere so
        # every file's data section is aligned the same way
        if k and "general.alignment" in h.kv_raw:
            kv.append(h.kv_raw["general.alignment"])
        write_gguf(path, version=h.version, kv_pairs=kv + split_kv,
                   tensors=[(t, src) for t in group], alignment=h.alignment)
    return paths

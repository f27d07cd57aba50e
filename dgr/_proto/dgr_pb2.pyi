from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineSettings(_message.Message):
    __slots__ = ("n_ctx", "n_slots", "n_threads", "n_ubatch", "flash_attn", "type_k", "type_v", "batch_invariant")
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    N_SLOTS_FIELD_NUMBER: _ClassVar[int]
    N_THREADS_FIELD_NUMBER: _ClassVar[int]
    N_UBATCH_FIELD_NUMBER: _ClassVar[int]
    FLASH_ATTN_FIELD_NUMBER: _ClassVar[int]
    TYPE_K_FIELD_NUMBER: _ClassVar[int]
    TYPE_V_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    n_ctx: int
    n_slots: int
    n_threads: int
    n_ubatch: int
    flash_attn: bool
    type_k: str
    type_v: str
    batch_invariant: bool
    def __init__(self, n_ctx: _Optional[int] = ..., n_slots: _Optional[int] = ..., n_threads: _Optional[int] = ..., n_ubatch: _Optional[int] = ..., flash_attn: _Optional[bool] = ..., type_k: _Optional[str] = ..., type_v: _Optional[str] = ..., batch_invariant: _Optional[bool] = ...) -> None: ...

class ComputeDevice(_message.Message):
    __slots__ = ("backend", "name", "type", "description", "driver", "software", "memory_free", "memory_total", "weight_bytes", "kv_bytes", "compute_bytes")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_BYTES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    name: str
    type: str
    description: str
    driver: str
    software: bool
    memory_free: int
    memory_total: int
    weight_bytes: int
    kv_bytes: int
    compute_bytes: int
    def __init__(self, backend: _Optional[str] = ..., name: _Optional[str] = ..., type: _Optional[str] = ..., description: _Optional[str] = ..., driver: _Optional[str] = ..., software: _Optional[bool] = ..., memory_free: _Optional[int] = ..., memory_total: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., compute_bytes: _Optional[int] = ...) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("model_identity", "model_name", "arch", "n_layer", "layer_start", "layer_end", "is_first", "is_last", "needs_token_ids", "boundary_width", "boundary_dtype", "n_vocab", "settings", "eog_tokens", "add_bos", "free_slots", "sessions", "free_context", "queue_depth", "recent_tokens_per_s", "recent_step_ms", "draining", "dgr_version", "wire_format_version", "wire_schema_version", "weight_bytes", "kv_bytes", "steps_total", "errors_total", "uptime_s", "capability_json", "data_port", "decode_steps_total", "decode_compute_s_total", "tokens_computed_total", "compute_s_total", "drafters", "device", "prefix_rows_exact", "prefix_single_rows_exact", "prefix_store", "prefix_chunk_rows_exact", "rollback_window", "state_bytes", "state_snapshots", "n_ctx", "n_ctx_train", "n_ctx_source", "media_marker", "media_vision", "media_audio", "llama_cpp_commit", "patch_stack_hash", "cpu_variant")
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    N_LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    IS_FIRST_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    NEEDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    EOG_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FREE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RECENT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DGR_VERSION_FIELD_NUMBER: _ClassVar[int]
    WIRE_FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WIRE_SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_JSON_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DECODE_COMPUTE_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMPUTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ROWS_EXACT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SINGLE_ROWS_EXACT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_STORE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CHUNK_ROWS_EXACT_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    N_CTX_TRAIN_FIELD_NUMBER: _ClassVar[int]
    N_CTX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_MARKER_FIELD_NUMBER: _ClassVar[int]
    MEDIA_VISION_FIELD_NUMBER: _ClassVar[int]
    MEDIA_AUDIO_FIELD_NUMBER: _ClassVar[int]
    LLAMA_CPP_COMMIT_FIELD_NUMBER: _ClassVar[int]
    PATCH_STACK_HASH_FIELD_NUMBER: _ClassVar[int]
    CPU_VARIANT_FIELD_NUMBER: _ClassVar[int]
    model_identity: str
    model_name: str
    arch: str
    n_layer: int
    layer_start: int
    layer_end: int
    is_first: bool
    is_last: bool
    needs_token_ids: bool
    boundary_width: int
    boundary_dtype: str
    n_vocab: int
    settings: EngineSettings
    eog_tokens: _containers.RepeatedScalarFieldContainer[int]
    add_bos: bool
    free_slots: int
    sessions: int
    free_context: int
    queue_depth: int
    recent_tokens_per_s: float
    recent_step_ms: float
    draining: bool
    dgr_version: str
    wire_format_version: int
    wire_schema_version: int
    weight_bytes: int
    kv_bytes: int
    steps_total: int
    errors_total: int
    uptime_s: float
    capability_json: bytes
    data_port: int
    decode_steps_total: int
    decode_compute_s_total: float
    tokens_computed_total: int
    compute_s_total: float
    drafters: _containers.RepeatedScalarFieldContainer[str]
    device: ComputeDevice
    prefix_rows_exact: bool
    prefix_single_rows_exact: bool
    prefix_store: PrefixStore
    prefix_chunk_rows_exact: bool
    rollback_window: int
    state_bytes: int
    state_snapshots: int
    n_ctx: int
    n_ctx_train: int
    n_ctx_source: str
    media_marker: str
    media_vision: bool
    media_audio: bool
    llama_cpp_commit: str
    patch_stack_hash: str
    cpu_variant: str
    def __init__(self, model_identity: _Optional[str] = ..., model_name: _Optional[str] = ..., arch: _Optional[str] = ..., n_layer: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., is_first: _Optional[bool] = ..., is_last: _Optional[bool] = ..., needs_token_ids: _Optional[bool] = ..., boundary_width: _Optional[int] = ..., boundary_dtype: _Optional[str] = ..., n_vocab: _Optional[int] = ..., settings: _Optional[_Union[EngineSettings, _Mapping]] = ..., eog_tokens: _Optional[_Iterable[int]] = ..., add_bos: _Optional[bool] = ..., free_slots: _Optional[int] = ..., sessions: _Optional[int] = ..., free_context: _Optional[int] = ..., queue_depth: _Optional[int] = ..., recent_tokens_per_s: _Optional[float] = ..., recent_step_ms: _Optional[float] = ..., draining: _Optional[bool] = ..., dgr_version: _Optional[str] = ..., wire_format_version: _Optional[int] = ..., wire_schema_version: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., steps_total: _Optional[int] = ..., errors_total: _Optional[int] = ..., uptime_s: _Optional[float] = ..., capability_json: _Optional[bytes] = ..., data_port: _Optional[int] = ..., decode_steps_total: _Optional[int] = ..., decode_compute_s_total: _Optional[float] = ..., tokens_computed_total: _Optional[int] = ..., compute_s_total: _Optional[float] = ..., drafters: _Optional[_Iterable[str]] = ..., device: _Optional[_Union[ComputeDevice, _Mapping]] = ..., prefix_rows_exact: _Optional[bool] = ..., prefix_single_rows_exact: _Optional[bool] = ..., prefix_store: _Optional[_Union[PrefixStore, _Mapping]] = ..., prefix_chunk_rows_exact: _Optional[bool] = ..., rollback_window: _Optional[int] = ..., state_bytes: _Optional[int] = ..., state_snapshots: _Optional[int] = ..., n_ctx: _Optional[int] = ..., n_ctx_train: _Optional[int] = ..., n_ctx_source: _Optional[str] = ..., media_marker: _Optional[str] = ..., media_vision: _Optional[bool] = ..., media_audio: _Optional[bool] = ..., llama_cpp_commit: _Optional[str] = ..., patch_stack_hash: _Optional[str] = ..., cpu_variant: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session", "keep", "chunk", "whole")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    session: str
    keep: _containers.RepeatedScalarFieldContainer[bytes]
    chunk: int
    whole: int
    def __init__(self, session: _Optional[str] = ..., keep: _Optional[_Iterable[bytes]] = ..., chunk: _Optional[int] = ..., whole: _Optional[int] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released", "kept")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    released: bool
    kept: bool
    def __init__(self, released: _Optional[bool] = ..., kept: _Optional[bool] = ...) -> None: ...

class ReuseRequest(_message.Message):
    __slots__ = ("session", "epoch", "keys", "chunk")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    session: str
    epoch: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    chunk: int
    def __init__(self, session: _Optional[str] = ..., epoch: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., chunk: _Optional[int] = ...) -> None: ...

class ReuseReply(_message.Message):
    __slots__ = ("next_pos",)
    NEXT_POS_FIELD_NUMBER: _ClassVar[int]
    next_pos: int
    def __init__(self, next_pos: _Optional[int] = ...) -> None: ...

class PrefixStore(_message.Message):
    __slots__ = ("size", "entries", "positions", "bytes", "hits", "misses", "evictions")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    size: int
    entries: int
    positions: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    def __init__(self, size: _Optional[int] = ..., entries: _Optional[int] = ..., positions: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("session", "epoch", "into", "into_epoch")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INTO_FIELD_NUMBER: _ClassVar[int]
    INTO_EPOCH_FIELD_NUMBER: _ClassVar[int]
    session: str
    epoch: int
    into: _containers.RepeatedScalarFieldContainer[str]
    into_epoch: int
    def __init__(self, session: _Optional[str] = ..., epoch: _Optional[int] = ..., into: _Optional[_Iterable[str]] = ..., into_epoch: _Optional[int] = ...) -> None: ...

class ForkReply(_message.Message):
    __slots__ = ("next_pos",)
    NEXT_POS_FIELD_NUMBER: _ClassVar[int]
    next_pos: int
    def __init__(self, next_pos: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special", "parse_special")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special: bool
    parse_special: bool
    def __init__(self, text: _Optional[str] = ..., add_special: _Optional[bool] = ..., parse_special: _Optional[bool] = ...) -> None: ...

class TokenizeReply(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodeMediaRequest(_message.Message):
    __slots__ = ("prompt", "media", "add_special", "parse_special", "first_pos", "encode_from", "max_pixels")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    PARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    FIRST_POS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_FROM_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    media: _containers.RepeatedScalarFieldContainer[bytes]
    add_special: bool
    parse_special: bool
    first_pos: int
    encode_from: int
    max_pixels: int
    def __init__(self, prompt: _Optional[str] = ..., media: _Optional[_Iterable[bytes]] = ..., add_special: _Optional[bool] = ..., parse_special: _Optional[bool] = ..., first_pos: _Optional[int] = ..., encode_from: _Optional[int] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class MediaChunk(_message.Message):
    __slots__ = ("kind", "tokens", "n_rows", "n_pos", "id", "non_causal", "width", "rows", "positions")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_ROWS_FIELD_NUMBER: _ClassVar[int]
    N_POS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NON_CAUSAL_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    n_rows: int
    n_pos: int
    id: str
    non_causal: bool
    width: int
    rows: bytes
    positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., n_rows: _Optional[int] = ..., n_pos: _Optional[int] = ..., id: _Optional[str] = ..., non_causal: _Optional[bool] = ..., width: _Optional[int] = ..., rows: _Optional[bytes] = ..., positions: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodeMediaReply(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[MediaChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[MediaChunk, _Mapping]]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens", "remove_special", "unparse_special")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    UNPARSE_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    remove_special: bool
    unparse_special: bool
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., remove_special: _Optional[bool] = ..., unparse_special: _Optional[bool] = ...) -> None: ...

class DetokenizeReply(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenPiecesRequest(_message.Message):
    __slots__ = ("first", "count", "special")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    first: int
    count: int
    special: bool
    def __init__(self, first: _Optional[int] = ..., count: _Optional[int] = ..., special: _Optional[bool] = ...) -> None: ...

class TokenPiecesReply(_message.Message):
    __slots__ = ("pieces",)
    PIECES_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, pieces: _Optional[_Iterable[bytes]] = ...) -> None: ...

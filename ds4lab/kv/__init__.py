"""KV/session state of a ds4 session (docs/MODEL.md, "Where the KV state lives"; the formats in
docs/FORMATS.md, "The DSV4 session payload", and docs/FORMATS.md, "KVC files and the KV store")."""

from . import sizes  # ds4lab.kv.sizes after `import ds4lab`, as the README names it
from .kvfile import KVFile, KVFileError, KVHeader
from .layout import comp_cap_for, expected_row_counts, graph_caps, layer_comp_cap, layer_state_shapes
from .payload import (
    HEADER_BYTES,
    MAGIC,
    VERSION,
    LayerPayload,
    Payload,
    PayloadError,
    decode_payload,
    encode_payload,
    payload_nbytes,
)

__all__ = [
    "HEADER_BYTES", "MAGIC", "VERSION", "KVFile", "KVFileError", "KVHeader", "LayerPayload", "Payload",
    "PayloadError", "comp_cap_for", "decode_payload", "encode_payload", "expected_row_counts", "graph_caps",
    "layer_comp_cap", "layer_state_shapes", "payload_nbytes", "sizes",
]

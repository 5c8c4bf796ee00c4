"""The KV transfer format: ``KVState``, codecs, checksums, fingerprints and ``kv_id``s (numpy only, no torch)."""

from prfaas.kv.codecs import CODECS
from prfaas.kv.fingerprint import FORMAT_VERSION, Fingerprint
from prfaas.kv.format import BlobHeader, BlobReader, BlobTrailer, BlobWriter, decode_state, encode_state
from prfaas.kv.kvid import check_kv_id, new_kv_id
from prfaas.kv.state import KVState, LayerState

__all__ = [
    "CODECS", "FORMAT_VERSION", "BlobHeader", "BlobReader", "BlobTrailer", "BlobWriter", "Fingerprint",
    "KVState", "LayerState", "check_kv_id", "decode_state", "encode_state", "new_kv_id",
]

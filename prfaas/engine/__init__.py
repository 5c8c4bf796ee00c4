"""The model engine: transformers on PyTorch (``TransformersEngine``) or a synthetic stand-in
(``SyntheticEngine``), both implementing the ``Engine`` protocol the roles use. The only package that imports torch.

    from prfaas.engine import load_engine
    engine = load_engine("smollm2-135m")
    out = engine.prefill(token_ids)                   # out.kv: KVState, out.next_token: int
    tokens = engine.decode(decode_state(encode_state(out.kv)), out.next_token, max_new_tokens=16)
"""

from prfaas.engine.base import EngineBase
from prfaas.engine.engine import TransformersEngine
from prfaas.engine.loader import load_engine
from prfaas.engine.models import BUILTIN_MODELS, TINY_MODELS
from prfaas.engine.protocol import Engine, PrefillOutput

__all__ = ["BUILTIN_MODELS", "TINY_MODELS", "Engine", "EngineBase", "PrefillOutput", "TransformersEngine",
           "load_engine"]

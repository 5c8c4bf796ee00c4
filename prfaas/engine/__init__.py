"""The model engine: transformers on PyTorch. The only package that imports torch.

    from prfaas.engine import load_engine
    engine = load_engine("smollm2-135m")
    out = engine.prefill(token_ids)                   # out.kv: KVState, out.next_token: int
    tokens = engine.decode(KVState.from_bytes(out.kv.to_bytes()), out.next_token, max_new_tokens=16)
"""

from prfaas.engine.engine import Engine, PrefillOutput
from prfaas.engine.loader import load_engine
from prfaas.engine.models import BUILTIN_MODELS, TINY_MODELS

__all__ = ["BUILTIN_MODELS", "TINY_MODELS", "Engine", "PrefillOutput", "load_engine"]

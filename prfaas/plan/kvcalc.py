"""KV bytes per request, layer by layer, from a Hugging Face config.

Conventions (what is counted is what a decode instance must receive to continue the sequence):
- full attention: K and V for every token: ``kv_heads × (head_dim + v_head_dim)`` elements per token;
- MLA: ``mla_layout="latent"`` (default, as serving engines and transformers ≥ 5 store it) counts the latent
  ``kv_lora_rank + qk_rope_head_dim`` once per token; ``"expanded"`` counts per-head K and V;
- sliding / chunked windows: ``window_mode="held"`` (default) caps at ``window − 1`` tokens, which is what
  transformers' ``DynamicSlidingWindowLayer`` keeps after a prefill and all the next token needs;
  ``"full"`` caps at ``window`` (what a paged serving engine allocates);
- recurrent layers (linear attention, SSM, short convolution): a fixed state per request (``states.py``), in
  ``state_dtype`` (default: the KV dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prfaas.errors import InvalidRequest
from prfaas.plan.arch import layer_kinds
from prfaas.plan.dtypes import dtype_bits, nbytes
from prfaas.plan.hfconfig import Fields, load_config, text_config
from prfaas.plan.states import recurrent_state

MLA_LAYOUTS = ("latent", "expanded")
WINDOW_MODES = ("held", "full")


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache: ``elements_per_token`` grow with the sequence (up to ``cap`` tokens when windowed);
    ``fixed_elements`` do not."""

    index: int
    kind: str
    elements_per_token: int
    fixed_elements: int
    window: int | None
    cap: int | None
    token_bits: int
    state_bits: int
    detail: str

    @property
    def bytes_per_token(self) -> int:
        return nbytes(self.elements_per_token, self.token_bits)

    @property
    def fixed_bytes(self) -> int:
        return nbytes(self.fixed_elements, self.state_bits)

    def tokens_held(self, seq_len: int) -> int:
        return seq_len if self.cap is None else min(seq_len, self.cap)

    def bytes_at(self, seq_len: int) -> int:
        return nbytes(self.tokens_held(seq_len) * self.elements_per_token, self.token_bits) + self.fixed_bytes

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "bytes_per_token": self.bytes_per_token,
                "fixed_bytes": self.fixed_bytes, "window": self.window, "tokens_cap": self.cap,
                "detail": self.detail}


@dataclass(frozen=True)
class KVPlan:
    model: str
    dtype: str
    state_dtype: str
    mla_layout: str
    window_mode: str
    layers: tuple[LayerKV, ...]

    def kv_bytes(self, seq_len: int) -> int:
        """Exact bytes held for one request after ``seq_len`` tokens."""
        if seq_len < 0:
            raise InvalidRequest(f"sequence length must be >= 0, got {seq_len}")
        return sum(layer.bytes_at(seq_len) for layer in self.layers)

    @property
    def bytes_per_token(self) -> int:
        """Growth per token once every window is full (unbounded layers only)."""
        return sum(layer.bytes_per_token for layer in self.layers if layer.cap is None)

    @property
    def fixed_bytes(self) -> int:
        """Length-independent state (recurrent layers)."""
        return sum(layer.fixed_bytes for layer in self.layers)

    @property
    def window_bytes(self) -> int:
        """What windowed layers hold once full (a constant for long prompts)."""
        return sum(nbytes((layer.cap or 0) * layer.elements_per_token, layer.token_bits)
                   for layer in self.layers if layer.cap is not None)

    def kind_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
        return counts

    def to_json(self, lengths: list[int]) -> dict[str, Any]:
        return {
            "model": self.model, "dtype": self.dtype, "state_dtype": self.state_dtype,
            "mla_layout": self.mla_layout, "window_mode": self.window_mode,
            "num_layers": len(self.layers), "layer_kinds": self.kind_counts(),
            "bytes_per_token": self.bytes_per_token, "fixed_bytes": self.fixed_bytes,
            "window_bytes": self.window_bytes,
            "per_length": [{"seq_len": n, "kv_bytes": self.kv_bytes(n)} for n in lengths],
            "layers": [layer.to_json() for layer in self.layers],
        }


def _attention(f: Fields, kind: str, mla_layout: str) -> tuple[str, int, str]:
    """(kind name, elements per token, detail) of an attention layer."""
    if f.has("kv_lora_rank"):
        rank, rope = f.num("kv_lora_rank"), f.num("qk_rope_head_dim")
        if mla_layout == "latent":
            return "mla", rank + rope, f"MLA latent r={rank}+rope={rope}"
        heads, nope, vd = f.num("num_attention_heads"), f.num("qk_nope_head_dim"), f.num("v_head_dim")
        return "mla", heads * (nope + rope + vd), f"MLA expanded H={heads} k={nope + rope} v={vd}"
    heads, hd = f.kv_heads, f.head_dim
    vd = f.num("v_head_dim", hd)
    if f.model_type == "mimo_v2_flash" and kind == "sliding":
        heads *= 2  # MiMo-V2-Flash's sliding layers have twice the KV heads
    name = {"full": "full_attention", "sliding": "sliding_attention", "chunked": "chunked_attention"}[kind]
    return name, heads * (hd + vd), f"KV heads={heads} k={hd} v={vd}"


def _window(f: Fields, kind: str) -> int | None:
    if kind == "sliding":
        if f.model_type == "mimo_v2_flash" and f.has("sliding_window_size"):
            return f.num("sliding_window_size") + 1
        return f.num("sliding_window")
    if kind == "chunked":
        return f.num("attention_chunk_size")
    return None


def _layer(f: Fields, i: int, kind: str, bits: tuple[int, int], opts: tuple[str, str]) -> LayerKV:
    token_bits, state_bits = bits
    mla_layout, window_mode = opts
    if kind == "none":
        return LayerKV(i, "none", 0, 0, None, None, token_bits, state_bits, "no cache (MLP/MoE only)")
    if kind == "recurrent":
        st = recurrent_state(f, i)
        return LayerKV(i, st.family, 0, st.elements, None, None, token_bits, state_bits, st.detail)
    attn_kind = "full" if kind == "hybrid" else kind
    name, per_token, detail = _attention(f, attn_kind, mla_layout)
    window = _window(f, attn_kind)
    cap = None if window is None else (max(window - 1, 0) if window_mode == "held" else window)
    fixed = 0
    if kind == "hybrid":
        st = recurrent_state(f, i)
        name, fixed, detail = f"{name}+{st.family}", st.elements, f"{detail}; {st.detail}"
    return LayerKV(i, name, per_token, fixed, window, cap, token_bits, state_bits, detail)


def plan_from_config(cfg: dict[str, Any], *, dtype: str = "bfloat16", state_dtype: str | None = None,
                     mla_layout: str = "latent", window_mode: str = "held", name: str = "") -> KVPlan:
    """The per-layer KV plan of a config dict (the whole ``config.json``; nested text configs are found)."""
    if mla_layout not in MLA_LAYOUTS:
        raise InvalidRequest(f"mla layout must be one of {MLA_LAYOUTS}, got {mla_layout!r}")
    if window_mode not in WINDOW_MODES:
        raise InvalidRequest(f"window mode must be one of {WINDOW_MODES}, got {window_mode!r}")
    base = Fields(text_config(cfg))
    bits = (dtype_bits(dtype), dtype_bits(state_dtype or dtype))
    layers = tuple(
        _layer(base.layer_view(i), i, kind, bits, (mla_layout, window_mode))
        for i, kind in enumerate(layer_kinds(base))
    )
    model = name or str(cfg.get("_name_or_path") or base.model_type or "model")
    return KVPlan(model, dtype, state_dtype or dtype, mla_layout, window_mode, layers)


def plan_from_path(path: str | Path, **kwargs: Any) -> KVPlan:
    """``plan_from_config`` of a ``config.json`` file or a model directory."""
    kwargs.setdefault("name", Path(path).name if Path(path).is_dir() else Path(path).stem)
    return plan_from_config(load_config(path), **kwargs)

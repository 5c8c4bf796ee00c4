"""Synthetic engines: the KV sizes and compute times of a large real model, without its weights.

``synthetic-kimi-linear-48b`` and ``synthetic-minimax-m2`` let the acceptance matrix run 8K/32K prompts on a small
CPU machine while the real router, scheduler, KV format, store and transfer code move KV blobs of the true size.
They never produce meaningful text: every token decodes to ``" syn<id>"`` and the model name says ``synthetic``.

KV layout, per layer, comes from ``prfaas plan kv`` (``plan_from_config``) applied to the published ``config.json``
fields below (copied from the Hugging Face model cards; the same files are test fixtures under
``tests/plan/fixtures``), KV and states in bfloat16 as published:

- Kimi-Linear-48B-A3B-Instruct (``moonshotai/Kimi-Linear-48B-A3B-Instruct``): 27 layers; 7 MLA layers
  (1-indexed 4, 8, 12, 16, 20, 24, 27) holding ``kv_lora_rank 512 + qk_rope_head_dim 64`` = 576 elements per token
  (1152 B); 20 KDA layers with a fixed state of ``3·32·128·4`` conv + ``32·128·128`` recurrent elements (1.09 MiB
  each). Per token 8064 B; fixed 22.9 MB. 48 B total / 3 B active parameters, 256 experts, 8 per token.
- MiniMax-M2 (``MiniMaxAI/MiniMax-M2``): 62 full-attention layers, 8 KV heads × head_dim 128, K and V: 4096 B per
  token per layer, 253,952 B (248 KiB) per token; no fixed state. 230 B total / 10 B active, 256 experts, 8 per
  token.

Compute model (a roofline; the numbers are stated, not measured), scaled to the accelerator named in each spec:

- prefill of L tokens: ``FLOPs = 2·active·L + n_attn·H·(d_qk + d_v)·L² + n_linear·4·H_lin·d_lin²·L``, divided by
  ``devices × peak BF16 FLOP/s × MFU``;
- one decode step over B rows holding C context tokens in all: the larger of ``bytes / (devices × HBM B/s × MBU)``
  (weights read: dense part plus the share of experts any row touches, ``1 − (1 − k/E)^B``; plus the KV of all
  rows) and ``2·active·B / (devices × peak × MFU)``, plus a fixed per-step overhead (launches, tensor-parallel
  all-reduce).

Kimi-Linear runs on one H200 (bf16 weights, 96 GB); MiniMax-M2 on four H200 with tensor parallelism (FP8 weights,
230 GB). H200: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e; MFU 0.4, MBU 0.6.

Behaviour: the engine sleeps (``time.sleep``, never spins) for the modelled time; a prefill's (last) pass sleeps
layer by layer and hands each layer's ``LayerState`` to ``on_layer`` between two layers, so chunks stream out while
"compute" continues and what ``on_layer`` costs adds to the pass, as on a real engine.
Tensor contents are a fixed pseudo-random bfloat16 pattern (views, no per-request copy); the first token is a hash
of the prompt and every next token a function of the previous one and its position, so local and remote paths give
the same tokens. A restore checks the fingerprint and that every layer has exactly the planned bytes, then keeps only
the sequence length. ``keeps_kv = False`` tells decode to pull with a reader that verifies and parses every byte but
keeps none (``BlobReader(retain=False)``), so even a 32K MiniMax-M2 blob (8.3 GB) streams through decode in a few
chunk buffers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import torch
import xxhash

from prfaas.engine.base import EngineBase
from prfaas.engine.protocol import ChunkPlan, ChunkResult, LayerCallback, RowCallback, pass_tokens
from prfaas.errors import InvalidRequest, KVBadFormat
from prfaas.kv import Fingerprint, KVState, LayerState
from prfaas.messages import SamplingParams
from prfaas.plan.kvcalc import KVPlan, plan_from_config

TOKEN_LOW, TOKEN_SPAN = 1000, 1000  # generated tokens fall in [1000, 2000)
KV_DTYPE = "bfloat16"
_KINDS = {"mla": ("mla", True), "full_attention": ("full_attention", True), "kda": ("linear_attention", False),
          "lightning": ("linear_attention", False)}


@dataclass(frozen=True)
class Accelerator:
    name: str
    devices: int
    bf16_tflops: float  # dense, per device
    hbm_tb_s: float  # per device
    mfu: float = 0.4
    mbu: float = 0.6
    step_overhead_ms: float = 2.0

    @property
    def flops(self) -> float:
        return self.devices * self.bf16_tflops * 1e12 * self.mfu

    @property
    def bandwidth(self) -> float:
        return self.devices * self.hbm_tb_s * 1e12 * self.mbu


@dataclass(frozen=True)
class SyntheticSpec:
    name: str
    source: str
    config: dict[str, Any]
    total_params: float
    active_params: float
    experts: int
    experts_per_token: int
    weight_bytes: float  # per parameter
    attn: tuple[int, int, int, int]  # softmax/MLA layers, heads, d_qk, d_v
    linear: tuple[int, int, int]  # linear-attention layers, heads, head dim
    accelerator: Accelerator
    max_seq_len: int
    eos_token_id: int | None  # None: not in the published config (generated tokens never hit one anyway)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dense_params(self) -> float:
        """Parameters every token reads: from ``active = dense + k/E·(total − dense)``."""
        share = self.experts_per_token / self.experts
        return (self.active_params - share * self.total_params) / (1 - share)

    def prefill_seconds(self, tokens: int, start: int = 0) -> float:
        """Modelled time to prefill positions ``[start, tokens)``."""
        n_attn, heads, dqk, dv = self.attn
        n_lin, lheads, ld = self.linear
        new = tokens - start
        flops = (2 * self.active_params * new + n_attn * heads * (dqk + dv) * (tokens ** 2 - start ** 2)
                 + n_lin * 4 * lheads * ld * ld * new)
        return flops / self.accelerator.flops

    def decode_step_seconds(self, rows: int, context_tokens: int, plan: KVPlan) -> float:
        touched = 1 - (1 - self.experts_per_token / self.experts) ** rows
        weights = (self.dense_params + (self.total_params - self.dense_params) * touched) * self.weight_bytes
        kv = plan.bytes_per_token * context_tokens + plan.fixed_bytes * rows
        memory = (weights + kv) / self.accelerator.bandwidth
        compute = 2 * self.active_params * rows / self.accelerator.flops
        return max(memory, compute) + self.accelerator.step_overhead_ms / 1e3


H200 = Accelerator("1x H200", 1, 989.0, 4.8)
H200_TP4 = Accelerator("4x H200 (TP4)", 4, 989.0, 4.8, step_overhead_ms=4.0)

KIMI_CONFIG: dict[str, Any] = {
    "model_type": "kimi_linear", "num_hidden_layers": 27, "hidden_size": 2304, "num_attention_heads": 32,
    "num_key_value_heads": 32, "head_dim": 72, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "q_lora_rank": None, "mla_use_nope": True, "vocab_size": 163840,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
                           "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]},
}
MINIMAX_M2_CONFIG: dict[str, Any] = {
    "model_type": "minimax_m2", "num_hidden_layers": 62, "hidden_size": 3072, "num_attention_heads": 48,
    "num_key_value_heads": 8, "head_dim": 128, "attn_type_list": [1] * 62, "vocab_size": 200064,
}

SPECS: dict[str, SyntheticSpec] = {
    "synthetic-kimi-linear-48b": SyntheticSpec(
        "synthetic-kimi-linear-48b", "moonshotai/Kimi-Linear-48B-A3B-Instruct", KIMI_CONFIG, 48e9, 3e9, 256, 8,
        2.0, (7, 32, 192, 128), (20, 32, 128), H200, 1_048_576, 163586),
    "synthetic-minimax-m2": SyntheticSpec(
        "synthetic-minimax-m2", "MiniMaxAI/MiniMax-M2", MINIMAX_M2_CONFIG, 230e9, 10e9, 256, 8,
        1.0, (62, 48, 128, 128), (0, 0, 0), H200_TP4, 196_608, None),
}
SYNTHETIC_MODELS = tuple(SPECS)


class SyntheticTokenizer:
    """Bytes in (``1000 + byte``), ``" syn<id>"`` out: enough for the OpenAI API, meaningless on purpose."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [TOKEN_LOW + b for b in text.encode()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" syn{int(i)}" for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int]:
        return self.encode("\n".join(str(m.get("content", "")) for m in messages) + "\n")


@dataclass
class SyntheticCache:
    """What a synthetic decode keeps of a sequence: its length (``layers`` is empty, so batching has nothing to
    pad, stack or trim)."""

    seq_len: int
    layers: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class _Config:
    model_type: str
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int
    raw: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


class _Pattern:
    """One growing read-only bfloat16 buffer that every tensor is a view of."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flat = np.zeros(0, dtype=ml_dtypes.bfloat16)

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        with self._lock:
            if self._flat.size < n:
                base = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
                flat = np.resize(base, max(n, 2 * self._flat.size)).astype(ml_dtypes.bfloat16)
                flat.setflags(write=False)
                self._flat = flat
            return self._flat[:n].reshape(shape)


class SyntheticEngine(EngineBase):
    """An engine (the ``Engine`` protocol) with the KV sizes and timings of ``spec`` (see the module docstring)."""

    keeps_kv = False  # decode streams pulled KV through verification and keeps none of it

    def __init__(self, spec: SyntheticSpec) -> None:
        self.spec = spec
        self.plan = plan_from_config(spec.config, dtype=KV_DTYPE, name=spec.name)
        self.config = _Config(spec.config["model_type"], len(self.plan.layers), int(spec.config["vocab_size"]),
                              spec.max_seq_len, spec.config)
        digest = xxhash.xxh64_hexdigest(repr((spec.name, spec.source, spec.config)).encode())
        fingerprint = Fingerprint(model=spec.name, arch=self.config.model_type, weights=digest,
                                  tokenizer=xxhash.xxh64_hexdigest(b"synthetic-bytes-v1"), dtype=KV_DTYPE,
                                  max_seq_len=spec.max_seq_len)
        eos = () if spec.eos_token_id is None else (spec.eos_token_id,)
        super().__init__(spec.name, SyntheticTokenizer(), fingerprint, eos, self.config.vocab_size,
                         torch.device("cpu"))
        self._pattern = _Pattern()

    @property
    def num_layers(self) -> int:
        return len(self.plan.layers)

    @property
    def cache_class(self) -> str:
        return SyntheticCache.__name__

    # -- KV ------------------------------------------------------------------------------------------------------
    def layer_state(self, index: int, seq_len: int) -> LayerState:
        """Layer ``index`` after ``seq_len`` tokens, with exactly the planned bytes."""
        layer = self.plan.layers[index]
        kind, grows = _KINDS.get(layer.kind, (layer.kind, layer.elements_per_token > 0))
        tensors: dict[str, np.ndarray] = {}
        per_token = layer.elements_per_token
        if per_token and kind == "mla":
            tensors["keys"] = self._pattern.take((1, layer.tokens_held(seq_len), per_token))
        elif per_token:
            half = per_token // 2
            tensors["keys"] = self._pattern.take((1, layer.tokens_held(seq_len), half))
            tensors["values"] = self._pattern.take((1, layer.tokens_held(seq_len), per_token - half))
        if layer.fixed_elements:
            tensors["state"] = self._pattern.take((layer.fixed_elements,))
        return LayerState(index, kind, grows, layer.window, tensors, {})

    def snapshot(self, cache: Any, seq_len: int, first_token: int | None = None) -> KVState:
        layers = [self.layer_state(i, seq_len) for i in range(self.num_layers)]
        return KVState(self.fingerprint, seq_len, layers, cache=SyntheticCache.__name__, first_token=first_token)

    def restore(self, kv: KVState) -> SyntheticCache:
        """Check the fingerprint, the layout and every layer's size against the plan; keep only the length."""
        self.fingerprint.check_compatible(kv.fingerprint)
        if len(kv.layers) != self.num_layers or kv.cache != SyntheticCache.__name__:
            raise KVBadFormat(f"KV has {len(kv.layers)} layers of {kv.cache}; {self.name} has "
                              f"{self.num_layers} of {SyntheticCache.__name__}")
        for layer, planned in zip(kv.layers, self.plan.layers, strict=True):
            want = planned.bytes_at(kv.seq_len)
            if layer.nbytes != want:
                raise KVBadFormat(f"layer {layer.index} holds {layer.nbytes} bytes; {self.name} plans {want} "
                                  f"for {kv.seq_len} tokens")
        return SyntheticCache(kv.seq_len)

    def new_cache(self) -> SyntheticCache:
        return SyntheticCache(0)

    # -- prefill -------------------------------------------------------------------------------------------------
    def first_token(self, token_ids: Sequence[int]) -> int:
        digest = xxhash.xxh64_intdigest(np.asarray(token_ids, dtype=np.int64).tobytes())
        return TOKEN_LOW + digest % TOKEN_SPAN

    def prefill_cache(self, token_ids: Sequence[int], on_layer: LayerCallback | None = None,
                      sampling: SamplingParams | None = None, step: int = 0) -> ChunkResult:
        """Sleep the modelled prefill time layer by layer, handing each layer to ``on_layer`` (``_layers``)."""
        ids = self.check_prompt(token_ids)
        started = time.perf_counter()
        self._layers(self.spec.prefill_seconds(len(ids)), len(ids), on_layer)
        return SyntheticCache(len(ids)), self.first_token(ids), time.perf_counter() - started

    def _layers(self, seconds: float, seq_len: int, on_layer: LayerCallback | None) -> None:
        """One pass of ``seconds``, layer by layer: each layer sleeps its share, then ``on_layer`` gets its state on
        this thread before the next layer starts, as a real engine's hook runs between two layers (so what
        ``on_layer`` costs, encoding the layer's chunks, adds to the pass as it does there)."""
        for index in range(self.num_layers):
            _sleep_until(time.perf_counter() + seconds / self.num_layers)
            if on_layer is not None:
                on_layer(self.layer_state(index, seq_len))

    def prefill_chunks(self, token_ids: Sequence[int], chunk: int | ChunkPlan,
                       sampling: SamplingParams | None = None, step: int = 0,
                       on_layer: LayerCallback | None = None) -> Iterator[ChunkResult | None]:
        """As the transformers engine's: ``None`` between passes; the last pass runs layer by layer (``_layers``), so
        a long prompt's chunks stream while it "computes"."""
        ids = self.check_prompt(token_ids)
        seconds, start = 0.0, 0
        while True:
            size = pass_tokens(chunk, start) or len(ids)
            end = min(len(ids), start + size)
            began = time.perf_counter()
            took = self.spec.prefill_seconds(end, start)
            if end == len(ids):
                self._layers(took, len(ids), on_layer)
                seconds += time.perf_counter() - began
                break
            _sleep_until(began + took)
            seconds += time.perf_counter() - began
            yield None
            start = end
        yield SyntheticCache(len(ids)), self.first_token(ids), seconds

    def prefill_batch(self, prompts: Sequence[Sequence[int]], on_layer: RowCallback | None = None,
                      samplings: Sequence[SamplingParams | None] | None = None) -> tuple[list[int], float]:
        """The modelled time of the prompts one after the other (the model has no batched kernel to model)."""
        tokens, seconds = [], 0.0
        for row, prompt in enumerate(prompts):
            def one(state: LayerState, row: int = row) -> None:
                assert on_layer is not None
                on_layer(row, state)
            _, token, took = self.prefill_cache(prompt, one if on_layer else None)
            tokens.append(token)
            seconds += took
        return tokens, seconds

    # -- decode --------------------------------------------------------------------------------------------------
    def forward_rows(self, tokens: list[int], positions: list[int], mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """One batched step: sleeps the modelled step time; logits pick ``next_token`` for every row."""
        began = time.perf_counter()
        _sleep_until(began + self.spec.decode_step_seconds(len(tokens), sum(positions), self.plan))
        return self._logits([next_token(t, p) for t, p in zip(tokens, positions, strict=True)])

    def stream(self, cache: Any, next_token_id: int, position: int, max_new_tokens: int,
               sampling: SamplingParams | None = None, step: int = 1) -> Iterator[int]:
        current = int(next_token_id)
        for _ in range(max_new_tokens):
            if position >= self.max_seq_len:
                return
            current = int(torch.argmax(self.forward_rows([current], [position], torch.ones(1), cache)[0]))
            position += 1
            yield current

    def generate(self, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        cache, first, _ = self.prefill_cache(token_ids)
        return [first, *self.stream(cache, first, cache.seq_len, max_new_tokens - 1)][:max_new_tokens]

    def continuation_logits(self, kv: KVState, tokens: Sequence[int]) -> torch.Tensor:
        raise InvalidRequest(f"{self.name} is synthetic: it has no logits to compare")

    @staticmethod
    def _logits(picks: list[int]) -> torch.Tensor:
        """One row per pick, a margin so large that sampling at any temperature returns the pick too."""
        logits = torch.zeros(len(picks), TOKEN_LOW + TOKEN_SPAN)
        logits[torch.arange(len(picks)), torch.tensor(picks)] = 1e4
        return logits


def next_token(token: int, position: int) -> int:
    """The token after ``token`` fed at ``position``: deterministic, in ``[TOKEN_LOW, TOKEN_LOW + TOKEN_SPAN)``."""
    return TOKEN_LOW + (int(token) * 7919 + int(position) * 104729) % TOKEN_SPAN


def _sleep_until(deadline: float) -> None:
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)


def load_synthetic(name: str) -> SyntheticEngine:
    if name not in SPECS:
        raise InvalidRequest(f"unknown synthetic model {name!r}; known: {', '.join(SYNTHETIC_MODELS)}")
    return SyntheticEngine(SPECS[name])

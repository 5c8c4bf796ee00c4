"""``Engine``: one model, prefill into a ``KVState``, restore a ``KVState`` and decode from it.

Every forward pass, prefill and decode alike, passes ``position_ids`` and a full attention mask explicitly, as
``generate`` does: some hybrids go silently wrong without them, and identical inputs keep greedy decoding through a
shipped KV bit-identical to a monolithic ``generate``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prfaas.engine.cache import restore_layer, snapshot_layer
from prfaas.errors import InvalidRequest, KVBadFormat
from prfaas.kv import Fingerprint, KVState, LayerState
from prfaas.messages import SamplingParams

LayerCallback = Callable[[LayerState], None]


@dataclass(frozen=True)
class PrefillOutput:
    """``kv`` shares memory with the cache the prefill built (and then dropped); ``next_token`` is greedy."""

    kv: KVState
    next_token: int
    seconds: float


class Engine:
    """A loaded model with its tokenizer and compatibility fingerprint. Not thread-safe: one caller at a time."""

    keeps_kv = True  # restore() needs the KV bytes (a synthetic engine needs only their sizes)
    root = ""  # the directory the tokenizer loads from, which load tools read; "" where there is none (synthetic)

    def __init__(self, model: Any, tokenizer: Any, name: str, fingerprint: Fingerprint, root: str = "") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.fingerprint = fingerprint
        self.root = root
        self.config = model.config.get_text_config(decoder=True)
        self.device = next(model.parameters()).device
        self.max_seq_len = fingerprint.max_seq_len
        self.eos_token_ids = _eos_ids(model)
        self._is_mla = getattr(self.config, "kv_lora_rank", None) is not None
        self._logits_to_keep = "logits_to_keep" in _forward_params(model)
        self._cache_cls = self._probe_cache_class()

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def cache_class(self) -> str:
        return self._cache_cls.__name__

    @functools.cached_property
    def kv_footprint(self) -> tuple[int, int]:
        """(fixed bytes, bytes per token) of one sequence's KV, measured from two tiny prefills."""
        one, two = (self.prefill([0] * n).kv.nbytes for n in (1, 2))
        return one - (two - one), two - one

    @functools.cached_property
    def layer_table(self) -> tuple[dict[str, Any], ...]:
        """Kind, growth and window of every layer, known before a prompt runs (a blob header needs it)."""
        return tuple(layer.table_entry() for layer in self.prefill([0]).kv.layers)

    def prefill(self, token_ids: Sequence[int], on_layer: LayerCallback | None = None,
                sampling: SamplingParams | None = None) -> PrefillOutput:
        """Run the prompt; ``on_layer`` receives each layer's state as soon as that layer has run."""
        cache, next_token, seconds = self.prefill_cache(token_ids, on_layer, sampling)
        kv = self.snapshot(cache, len(token_ids), first_token=next_token)
        return PrefillOutput(kv=kv, next_token=next_token, seconds=seconds)

    def prefill_cache(self, token_ids: Sequence[int], on_layer: LayerCallback | None = None,
                      sampling: SamplingParams | None = None, step: int = 0) -> tuple[Any, int, float]:
        """Like ``prefill`` but keeps the live model cache (for decoding in the same process)."""
        ids = self._check_prompt(token_ids)
        cache = self.new_cache()
        started = time.perf_counter()
        hooks = self._layer_hooks(cache, on_layer) if on_layer else []
        try:
            logits = self._forward(ids, cache, start=0)
        finally:
            for hook in hooks:
                hook.remove()
        return cache, pick_token(logits, sampling, step=step), time.perf_counter() - started

    def prefill_chunks(self, token_ids: Sequence[int], chunk: int, sampling: SamplingParams | None = None,
                       step: int = 0, on_layer: LayerCallback | None = None,
                       ) -> Iterator[tuple[Any, int, float] | None]:
        """Prefill ``chunk`` tokens per forward pass, yielding ``None`` between chunks (so a scheduler can run
        other work in between) and finally ``(cache, next_token, seconds)``; ``on_layer`` receives each layer's
        whole state during the last chunk."""
        ids = self._check_prompt(token_ids)
        cache, seconds, size = self.new_cache(), 0.0, chunk or len(ids)
        for start in range(0, len(ids), size):
            last = start + size >= len(ids)
            hooks = self._layer_hooks(cache, on_layer) if on_layer and last else []
            began = time.perf_counter()
            try:
                logits = self._forward(ids[start:start + size], cache, start=start)
            finally:
                for hook in hooks:
                    hook.remove()
            seconds += time.perf_counter() - began
            if not last:
                yield None
        yield cache, pick_token(logits, sampling, step=step), seconds

    def prefill_batch(self, prompts: Sequence[Sequence[int]],
                      on_layer: Callable[[int, LayerState], None] | None = None,
                      samplings: Sequence[SamplingParams | None] | None = None) -> tuple[list[int], float]:
        """Several prompts in one forward pass (``prefill_batch.py``): each one's first token, and the seconds."""
        from prfaas.engine.prefill_batch import prefill_batch

        return prefill_batch(self, prompts, on_layer, samplings)

    def decode(self, kv: KVState, next_token: int, max_new_tokens: int = 16,
               sampling: SamplingParams | None = None) -> list[int]:
        """Tokens that follow ``next_token`` (greedy by default); stops after an EOS (included) or
        ``max_new_tokens``."""
        return list(self.stream(self.restore(kv), next_token, kv.seq_len, max_new_tokens, sampling))

    def stream(self, cache: Any, next_token: int, position: int, max_new_tokens: int,
               sampling: SamplingParams | None = None, step: int = 1) -> Iterator[int]:
        """Yield tokens one by one from a live cache holding ``position`` tokens (``next_token`` not yet fed);
        ``step`` numbers the first yielded token for seeded sampling."""
        current, produced = int(next_token), 0
        while produced < max_new_tokens and current not in self.eos_token_ids and position < self.max_seq_len:
            current = pick_token(self._forward([current], cache, start=position), sampling, step=step + produced)
            produced += 1
            position += 1
            yield current

    def continuation_logits(self, kv: KVState, tokens: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits (float32, one row per token) after feeding ``tokens`` on top of ``kv``.

        Used to measure what a lossy codec does to the next-token distribution.
        """
        cache = self.restore(kv)
        rows = [self._forward([int(t)], cache, start=kv.seq_len + i) for i, t in enumerate(tokens)]
        return torch.stack(rows)

    def generate(self, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Monolithic reference: ``model.generate`` greedy, prompt excluded (first token included)."""
        ids = torch.tensor([self._check_prompt(token_ids)], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=self.eos_token_ids[0])
        return [int(t) for t in out[0, ids.shape[1]:]]

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        if self._cache_cls is DynamicCache:
            return DynamicCache(config=self.model.config)
        return self._cache_cls()

    def snapshot(self, cache: Any, seq_len: int, first_token: int | None = None) -> KVState:
        layers = [snapshot_layer(cache, i, self.config.model_type, self._is_mla) for i in range(self.num_layers)]
        return KVState(fingerprint=self.fingerprint, seq_len=seq_len, layers=layers,
                       cache=type(cache).__name__, first_token=first_token)

    def restore(self, kv: KVState) -> Any:
        """A fresh model cache holding ``kv``; ``KV_INCOMPATIBLE`` names every mismatching fingerprint field."""
        self.fingerprint.check_compatible(kv.fingerprint)
        if len(kv.layers) != self.num_layers or kv.cache != self._cache_cls.__name__:
            raise KVBadFormat(f"KV has {len(kv.layers)} layers of {kv.cache}; this model has "
                              f"{self.num_layers} of {self._cache_cls.__name__}")
        cache = self.new_cache()
        for layer in kv.layers:
            restore_layer(cache, layer, self.device)
        linear = getattr(cache, "linear_cache", None)
        if linear is not None:
            linear.extend([] for _ in range(self.num_layers - len(linear)))
        return cache

    def check_prompt(self, token_ids: Sequence[int]) -> list[int]:
        """The prompt as ints, or ``INVALID_REQUEST`` (empty, too long for the context, ids outside the vocab)."""
        return self._check_prompt(token_ids)

    def _check_prompt(self, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if len(ids) > self.max_seq_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; this model's context is {self.max_seq_len}")
        vocab = int(self.config.vocab_size)
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequest(f"token ids must be in [0, {vocab})")
        return ids

    def forward_rows(self, tokens: list[int], positions: list[int], mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode step for a batch: one token per row at its own position; float32 logits [rows, vocab]."""
        kwargs: dict[str, Any] = {
            "input_ids": torch.tensor(tokens, device=self.device).unsqueeze(1),
            "position_ids": torch.tensor(positions, device=self.device).unsqueeze(1),
            "attention_mask": mask, "cache": cache, "use_cache": True,
        }
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with torch.inference_mode():
            out = self.model(**kwargs)
        return out.logits[:, -1].float()

    def _forward(self, ids: list[int], cache: Any, start: int) -> torch.Tensor:
        n = len(ids)
        kwargs: dict[str, Any] = {
            "input_ids": torch.tensor([ids], device=self.device),
            "position_ids": torch.arange(start, start + n, device=self.device).unsqueeze(0),
            "attention_mask": torch.ones(1, start + n, dtype=torch.long, device=self.device),
            "cache": cache, "use_cache": True,
        }
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with torch.inference_mode():
            out = self.model(**kwargs)
        return out.logits[0, -1].float()

    def _layer_hooks(self, cache: Any, on_layer: LayerCallback) -> list[Any]:
        def hook_for(index: int) -> Callable[..., None]:
            def hook(module: Any, args: Any, output: Any) -> None:
                on_layer(snapshot_layer(cache, index, self.config.model_type, self._is_mla))
            return hook

        return [layer.register_forward_hook(hook_for(i)) for i, layer in enumerate(_decoder_layers(self.model))]

    def _probe_cache_class(self) -> type:
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([[0]], device=self.device), use_cache=True)
        return type(out.cache)


GREEDY_BELOW = 1e-6  # a temperature under this is greedy: the scaled logits would be all but one -inf anyway


def pick_token(logits: torch.Tensor, sampling: SamplingParams | None, step: int) -> int:
    """Greedy, or a draw from a generator seeded by (seed, step): the same on every host.

    Numerically safe for any temperature ``SamplingParams`` lets through, and for a caller that bypasses it: the
    logits are scaled in float32 after subtracting their maximum, so the largest is exactly 0 and the rest are
    ≤ 0 (at worst -inf, probability 0) — never inf or NaN; a temperature under ``GREEDY_BELOW`` is greedy."""
    if sampling is None or sampling.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    logits = logits.float()
    probs = torch.softmax((logits - logits.max()) / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    generator = torch.Generator().manual_seed((sampling.seed * 1_000_003 + step) % (2**63))
    return int(torch.multinomial(probs, 1, generator=generator))


def _decoder_layers(model: Any) -> Any:
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise InvalidRequest(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def _forward_params(model: Any) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def _eos_ids(model: Any) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))

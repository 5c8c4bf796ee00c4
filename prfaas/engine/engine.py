"""``TransformersEngine``: one transformers model on PyTorch, prefill into a ``KVState``, restore a ``KVState``
and decode from it (the ``Engine`` protocol of ``protocol.py``, on ``EngineBase``).

Every forward pass, prefill and decode alike, passes ``position_ids`` and a full attention mask explicitly, as
``generate`` does: some hybrids go silently wrong without them, and identical inputs keep greedy decoding through a
shipped KV bit-identical to a monolithic ``generate``.

On models whose every layer is full attention of the usual shape (``FOLDS``), a prefill pass can carry a decode
batch's rows (``carry``): one packed row of the chunk's tokens and one token per decode row, so the weights are read
once for both (``attention.Fold`` splits attention and the caches). The rows' tokens equal a separate step's except
where the batched kernels' floating-point differences meet a near-tie (CONTRACTS), as for batched decode.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from prfaas.engine import prefill_batch as batched
from prfaas.engine.attention import Fold
from prfaas.engine.base import EngineBase
from prfaas.engine.cache import restore_layer, snapshot_layer
from prfaas.engine.hooks import after_each_layer
from prfaas.engine.protocol import ChunkPlan, ChunkResult, LayerCallback, Riders, RowCallback, pass_tokens
from prfaas.engine.sampling import pick_token
from prfaas.errors import KVBadFormat
from prfaas.kv import Fingerprint, KVState
from prfaas.kv import state as kinds
from prfaas.messages import SamplingParams

# Model types whose attention takes rotary positions per token, updates the cache once and hands its keyword
# arguments to the attention function: what a folded pass relies on (each layer full attention is checked too).
FOLDS = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class TransformersEngine(EngineBase):
    """A transformers model with its tokenizer and compatibility fingerprint. Not thread-safe: one caller at a
    time."""

    def __init__(self, model: Any, tokenizer: Any, name: str, fingerprint: Fingerprint, root: str = "") -> None:
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        super().__init__(name, tokenizer, fingerprint, _eos_ids(model), int(self.config.vocab_size),
                         next(model.parameters()).device, root)
        self.is_mla = getattr(self.config, "kv_lora_rank", None) is not None
        self.logits_to_keep = "logits_to_keep" in _forward_params(model)  # the forward can skip all but last logits
        self._cache_cls = self._probe_cache_class()
        self._riders: Riders | None = None

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def cache_class(self) -> str:
        return self._cache_cls.__name__

    def prefill_cache(self, token_ids: Sequence[int], on_layer: LayerCallback | None = None,
                      sampling: SamplingParams | None = None, step: int = 0) -> ChunkResult:
        """Like ``prefill`` but keeps the live model cache (for decoding in the same process)."""
        ids = self.check_prompt(token_ids)
        cache = self.new_cache()
        started = time.perf_counter()
        hooks = self._layer_hooks(cache, on_layer) if on_layer else []
        try:
            logits = self._forward(ids, cache, start=0)
        finally:
            for hook in hooks:
                hook.remove()
        return cache, pick_token(logits, sampling, step=step), time.perf_counter() - started

    def prefill_chunks(self, token_ids: Sequence[int], chunk: int | ChunkPlan,
                       sampling: SamplingParams | None = None, step: int = 0,
                       on_layer: LayerCallback | None = None) -> Iterator[ChunkResult | None]:
        """Prefill ``chunk`` tokens per forward pass (or as a ``ChunkPlan`` says before each pass), yielding ``None``
        between chunks (so a scheduler can run other work in between) and finally
        ``(cache, next_token, seconds)``; ``on_layer`` receives each layer's whole state during the last chunk."""
        ids = self.check_prompt(token_ids)
        yield from self.resume_chunks(self.new_cache(), ids, 0, chunk, sampling, step, on_layer)

    def resume_chunks(self, cache: Any, ids: list[int], start: int, chunk: int | ChunkPlan,
                      sampling: SamplingParams | None = None, step: int = 0, on_layer: LayerCallback | None = None,
                      boundary: int | None = None,
                      on_boundary: Callable[[Any], None] | None = None) -> Iterator[ChunkResult | None]:
        """``prefill_chunks`` of ``ids[start:]`` on top of ``cache``, which holds ``ids[:start]`` (a prefix cache's
        hit). With ``start < boundary < len(ids)``, a forward pass ends exactly after ``boundary`` tokens and
        ``on_boundary(cache)`` sees the cache there, before the next pass changes it (a prefix cache's checkpoint)."""
        seconds, begin = 0.0, start
        while True:
            end = _pass_end(begin, len(ids), pass_tokens(chunk, begin), boundary)
            last = end == len(ids)
            hooks = self._layer_hooks(cache, on_layer) if on_layer and last else []
            began = time.perf_counter()
            try:
                logits = self._forward(ids[begin:end], cache, start=begin)
            finally:
                for hook in hooks:
                    hook.remove()
            seconds += time.perf_counter() - began
            if end == boundary and on_boundary is not None:
                on_boundary(cache)
            if last:
                break
            yield None
            begin = end
        yield cache, pick_token(logits, sampling, step=step), seconds

    def prefill_batch(self, prompts: Sequence[Sequence[int]], on_layer: RowCallback | None = None,
                      samplings: Sequence[SamplingParams | None] | None = None) -> tuple[list[int], float]:
        """Several prompts in one forward pass (``prefill_batch.py``): each one's first token, and the seconds."""
        return batched.prefill_batch(self, prompts, on_layer, samplings)

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
        ids = torch.tensor([self.check_prompt(token_ids)], device=self.device)
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
        layers = [snapshot_layer(cache, i, self.config.model_type, self.is_mla) for i in range(self.num_layers)]
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

    def forward_rows(self, tokens: list[int], positions: list[int], mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode step for a batch: one token per row at its own position; float32 logits [rows, vocab]."""
        kwargs: dict[str, Any] = {
            "input_ids": torch.tensor(tokens, device=self.device).unsqueeze(1),
            "position_ids": torch.tensor(positions, device=self.device).unsqueeze(1),
            "attention_mask": mask, "cache": cache, "use_cache": True,
        }
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with torch.inference_mode():
            out = self.model(**kwargs)
        return out.logits[:, -1].float()

    @functools.cached_property
    def folds(self) -> bool:  # type: ignore[override]
        from transformers import DynamicCache

        return (self.config.model_type in FOLDS and self._cache_cls is DynamicCache and not self.is_mla
                and all(entry["kind"] == kinds.FULL_ATTENTION for entry in self.layer_table))

    def carry(self, rows: Riders | None) -> None:
        self._riders = rows if rows is not None and self.folds else None

    def _forward(self, ids: list[int], cache: Any, start: int) -> torch.Tensor:
        riders, self._riders = self._riders, None
        if riders is not None:
            return self._folded(ids, cache, start, riders)
        n = len(ids)
        kwargs: dict[str, Any] = {
            "input_ids": torch.tensor([ids], device=self.device),
            "position_ids": torch.arange(start, start + n, device=self.device).unsqueeze(0),
            "attention_mask": torch.ones(1, start + n, dtype=torch.long, device=self.device),
            "cache": cache, "use_cache": True,
        }
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with torch.inference_mode():
            out = self.model(**kwargs)
        return out.logits[0, -1].float()

    def _folded(self, ids: list[int], cache: Any, start: int, riders: Riders) -> torch.Tensor:
        """``_forward`` of a prefill chunk that also steps ``riders``: one packed row, each part's mask made by the
        model's own mask function on its own cache, as its separate pass would."""
        from transformers.masking_utils import create_causal_mask

        tokens, positions, mask = riders.inputs()
        n, rows = len(ids), len(tokens)
        shape = next(self.model.parameters())

        def part_mask(batch: int, width: int, attention: torch.Tensor, part: Any, at: torch.Tensor) -> Any:
            return create_causal_mask(config=self.config, inputs_embeds=shape.new_empty(batch, width, 1),
                                      attention_mask=attention, cache=part, position_ids=at)

        at = torch.tensor([[*range(start, start + n), *positions]], device=self.device)
        with torch.inference_mode():
            fold = Fold(chunk=n, prefill=cache,
                        prefill_mask=part_mask(1, n, torch.ones(1, start + n, dtype=torch.long, device=self.device),
                                               cache, at[:, :n]),
                        rows=riders.cache, rows_mask=part_mask(rows, 1, mask, riders.cache, at[0, n:, None]))
            kwargs: dict[str, Any] = {"input_ids": torch.tensor([[*ids, *tokens]], device=self.device),
                                      "position_ids": at, "use_cache": False, "prfaas_fold": fold}
            if self.logits_to_keep:
                kwargs["logits_to_keep"] = rows + 1
            logits = self.model(**kwargs).logits[0, -(rows + 1):].float()
        riders.advance(logits[1:])
        return logits[0]

    def _layer_hooks(self, cache: Any, on_layer: LayerCallback) -> list[Any]:
        def ran(index: int) -> None:
            on_layer(snapshot_layer(cache, index, self.config.model_type, self.is_mla))

        return after_each_layer(self.model, ran)

    def _probe_cache_class(self) -> type:
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([[0]], device=self.device), use_cache=True)
        return type(out.cache)


def _pass_end(begin: int, stop: int, size: int, boundary: int | None) -> int:
    """Where a forward pass from ``begin`` of at most ``size`` tokens (0: the rest) ends: at ``stop``, or at
    ``boundary`` when it lies strictly inside (the cache there is a prefix cache's checkpoint)."""
    end = min(stop, begin + size) if size > 0 else stop
    return boundary if boundary is not None and begin < boundary < end else end


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

"""Batched prefill: several prompts in one forward pass, left-padded and masked, each row's KV split out per layer.

Rows are left-padded to the longest prompt; the 2-D attention mask hides the padding and every row gets its own
positions ``0 … n-1``, so a row's KV and first token equal its own prefill up to floating-point differences of the
batched kernels (CONTRACTS' near-tie rule applies, as for batched decode). Each row's layer state is handed to
``on_layer(row, state)`` as soon as that layer has run for the whole batch, sliced to the row's own positions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from prfaas.engine.cache import snapshot_rows
from prfaas.engine.hooks import after_each_layer
from prfaas.engine.protocol import ChunkResult, LayerCallback, RowCallback
from prfaas.engine.sampling import pick_token
from prfaas.kv import LayerState
from prfaas.messages import SamplingParams


class BatchModel(Protocol):
    """What a batched prefill needs of ``TransformersEngine`` (named here, so this file does not import it)."""

    model: Any
    config: Any
    device: torch.device
    is_mla: bool
    logits_to_keep: bool

    def check_prompt(self, token_ids: Sequence[int]) -> list[int]: ...

    def new_cache(self) -> Any: ...

    def prefill_cache(self, token_ids: Sequence[int], on_layer: LayerCallback | None = None,
                      sampling: SamplingParams | None = None, step: int = 0) -> ChunkResult: ...


def prefill_batch(engine: BatchModel, prompts: Sequence[Sequence[int]], on_layer: RowCallback | None = None,
                  samplings: Sequence[SamplingParams | None] | None = None) -> tuple[list[int], float]:
    """Each prompt's first token and the seconds the forward pass took."""
    ids = [engine.check_prompt(p) for p in prompts]
    samplings = list(samplings) if samplings is not None else [None] * len(ids)
    if len(ids) == 1:  # no padding: exactly the single-sequence prefill
        def one(state: LayerState) -> None:
            if on_layer is not None:
                on_layer(0, state)
        _, token, seconds = engine.prefill_cache(ids[0], one if on_layer else None, samplings[0])
        return [token], seconds
    lengths = [len(i) for i in ids]
    width = max(lengths)
    device = engine.device
    tokens = torch.zeros(len(ids), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(ids), width, dtype=torch.long, device=device)
    positions = torch.zeros(len(ids), width, dtype=torch.long, device=device)
    for row, (prompt, n) in enumerate(zip(ids, lengths, strict=True)):
        tokens[row, width - n:] = torch.tensor(prompt, device=device)
        mask[row, width - n:] = 1
        positions[row, width - n:] = torch.arange(n, device=device)
    cache = engine.new_cache()
    hooks = _row_hooks(engine, cache, lengths, on_layer) if on_layer else []
    started = time.perf_counter()
    try:
        kwargs: dict[str, Any] = {"input_ids": tokens, "position_ids": positions, "attention_mask": mask,
                                  "cache": cache, "use_cache": True}
        if engine.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with torch.inference_mode():
            logits = engine.model(**kwargs).logits[:, -1].float()
    finally:
        for hook in hooks:
            hook.remove()
    seconds = time.perf_counter() - started
    return [pick_token(logits[row], samplings[row], step=0) for row in range(len(ids))], seconds


def _row_hooks(engine: BatchModel, cache: Any, lengths: list[int], on_layer: RowCallback) -> list[Any]:
    def ran(index: int) -> None:
        for row, state in enumerate(snapshot_rows(cache, index, lengths, engine.config.model_type, engine.is_mla)):
            on_layer(row, state)

    return after_each_layer(engine.model, ran)

"""``PrefixPrefill``: an engine's chunked prefill through its ``PrefixCache``, so a prompt computes only what the
cache lacks.

A prompt of ``n`` tokens is looked up by its chain of block hashes, salted with the model fingerprint and the
request's tenant (``prfaas.kv.prefix``); the longest usable prefix is restored into a fresh model cache and only
the rest is prefilled. One forward pass ends at the prompt's last block boundary below ``n`` (``resume_chunks``),
where the cache is snapshotted and stored: pages for attention layers, a checkpoint for the fixed-state ones. The
next prompt that extends this one (the next turn of a chat) hits there. Generated tokens are not stored.

Used on the engine thread of a prefill instance (``PrefillScheduler``) and of a decode instance (its local
prefill). Engines whose KV is sizes only (``SyntheticEngine``) or lives in another process (vLLM) have none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from prfaas.engine.prefix_cache import Hit, PrefixCache
from prfaas.engine.prefix_records import PrefixLifecycle
from prfaas.engine.protocol import ChunkPlan, ChunkResult, LayerCallback
from prfaas.errors import KVPrefixMissing
from prfaas.kv import Fingerprint, KVState
from prfaas.kv.prefix import BLOCK_TOKENS, block_hashes, chain_hex, prefix_salt
from prfaas.kv.suffix import join
from prfaas.messages import SamplingParams
from prfaas.obs import metrics


@runtime_checkable
class Resumable(Protocol):
    """What a prefix cache needs of an engine (``TransformersEngine`` has it)."""

    @property
    def fingerprint(self) -> Fingerprint: ...

    @property
    def cache_class(self) -> str: ...

    def check_prompt(self, token_ids: Sequence[int]) -> list[int]: ...

    def new_cache(self) -> Any: ...

    def restore(self, kv: KVState) -> Any: ...

    def snapshot(self, cache: Any, seq_len: int, first_token: int | None = None) -> KVState: ...

    def resume_chunks(self, cache: Any, ids: list[int], start: int, chunk: int | ChunkPlan,
                      sampling: SamplingParams | None = None, step: int = 0, on_layer: LayerCallback | None = None,
                      boundary: int | None = None,
                      on_boundary: Callable[[Any], None] | None = None) -> Iterator[ChunkResult | None]: ...


class PrefixPrefill:
    """An engine and its prefix cache of ``budget_bytes``; ``role`` labels the metrics. Engine thread only."""

    def __init__(self, engine: Resumable, budget_bytes: int, role: str, block_tokens: int = BLOCK_TOKENS,
                 lifecycle: PrefixLifecycle | None = None) -> None:
        self.engine = engine
        self.cache = PrefixCache(budget_bytes, block_tokens, lifecycle)
        self.role = role
        self._evictions_counted = 0
        # what heartbeats report (``summary``): rebuilt here, on the engine thread that owns the cache, after each
        # prompt, so the event loop reads one immutable tuple instead of the cache's dict while it changes
        self._held: tuple[str, ...] = ()

    @classmethod
    def maybe(cls, engine: Any, budget_bytes: int, role: str,
              lifecycle: Callable[[], PrefixLifecycle] = PrefixLifecycle) -> PrefixPrefill | None:
        """A prefix cache for ``engine``, or None when the budget is 0 or the engine cannot resume a prefill;
        ``lifecycle`` makes its TTL, residency and records (``prefix_records``), only when there is a cache."""
        if budget_bytes <= 0 or not isinstance(engine, Resumable):
            return None
        return cls(engine, budget_bytes, role, lifecycle=lifecycle())

    def chunks(self, token_ids: Sequence[int], tenant: str | None, chunk: int | ChunkPlan,
               sampling: SamplingParams | None = None, step: int = 0,
               on_layer: LayerCallback | None = None) -> Iterator[ChunkResult | None]:
        """``Engine.prefill_chunks`` of the prompt, reusing and then extending the cache of ``tenant``."""
        ids = self.engine.check_prompt(token_ids)
        hit = self.cache.lookup(self._keys(ids, tenant), len(ids), tenant or "")
        self._count(len(ids), hit.length)
        try:
            yield from self._resume(ids, hit, chunk, sampling, step, on_layer)
        finally:
            self._settle(hit)

    def keep(self, token_ids: Sequence[int], tenant: str | None, kv: KVState) -> None:
        """Store the full blocks of ``kv``, the state after the whole prompt ``token_ids`` (a transferred blob just
        restored), under ``tenant``, so the next turn of the conversation finds its history here. The fixed-state
        layers are kept only when the prompt ends on a block boundary (``PrefixCache.store``)."""
        hit = self.cache.held(self._keys(token_ids, tenant), tenant or "")
        try:
            self.cache.store(hit, kv)
        finally:
            self._settle(hit)

    def extend(self, token_ids: Sequence[int], tenant: str | None, suffix: KVState) -> KVState:
        """The whole state of ``token_ids`` from the suffix-only ``suffix`` (``prfaas.kv.suffix``) and this cache's
        pages of the prefix it names. ``KVPrefixMissing`` when the prefix is not held (evicted, or never stored
        here) or the blob names another chain than this prompt's under ``tenant``."""
        assert suffix.prefix is not None
        ref, size = suffix.prefix, self.cache.block_tokens
        keys = self._keys(token_ids, tenant)[:ref.tokens // size]
        if ref.tokens % size or not keys or len(keys) * size != ref.tokens or chain_hex(keys[-1]) != ref.chain_hash:
            raise KVPrefixMissing(f"the blob extends a prefix of {ref.tokens} tokens that is not this prompt's")
        after = suffix.seq_len - ref.tokens
        hit = self.cache.pages(keys, after)
        try:
            if hit.length != ref.tokens:
                raise KVPrefixMissing(f"the prefix of {ref.tokens} tokens the blob extends is no longer cached here")
            return join(self.cache.state(hit, self.engine.fingerprint, self.engine.cache_class, after), suffix)
        finally:
            self._settle(hit)

    def sweep(self) -> None:
        """Drop what outlived its TTL now, between prompts (the engine thread's schedulers call it when idle), so
        an idle instance deletes expired prefixes on time and its heartbeats stop naming them."""
        if self.cache.lifecycle.ttl_s > 0:
            self.cache.expire()
            self._gauge()
            self._held = self.cache.summary()

    def summary(self) -> list[str]:
        """The held blocks a heartbeat reports (``PrefixCache.summary``, as of the last prompt); any thread."""
        return list(self._held)

    def _resume(self, ids: list[int], hit: Hit, chunk: int | ChunkPlan, sampling: SamplingParams | None, step: int,
                on_layer: LayerCallback | None) -> Iterator[ChunkResult | None]:
        engine, size = self.engine, self.cache.block_tokens
        if hit.length:
            cache = engine.restore(self.cache.state(hit, engine.fingerprint, engine.cache_class))
        else:
            cache = engine.new_cache()
        boundary = (len(ids) - 1) // size * size  # the last block boundary before the prompt's last token

        def keep(live: Any) -> None:
            self.cache.store(hit, engine.snapshot(live, boundary))

        yield from engine.resume_chunks(cache, ids, hit.length, chunk, sampling, step, on_layer,
                                        boundary if boundary > hit.length else None, keep)

    def _keys(self, token_ids: Sequence[int], tenant: str | None) -> list[int]:
        return block_hashes(token_ids, prefix_salt(self.engine.fingerprint, tenant), self.cache.block_tokens)

    def _settle(self, hit: Hit) -> None:
        """After a prompt: unpin its blocks, update the gauges and the summary heartbeats report."""
        self.cache.release(hit)
        self._gauge()
        self._held = self.cache.summary()

    def _count(self, prompt: int, saved: int) -> None:
        metrics.PREFIX_LOOKUPS.labels(self.role, "hit" if saved else "miss").inc()
        metrics.PREFIX_PROMPT_TOKENS.labels(self.role).inc(prompt)
        metrics.PREFIX_SAVED_TOKENS.labels(self.role).inc(saved)
        stats = self.cache.stats
        metrics.PREFIX_HIT_RATIO.labels(self.role).set(stats.saved_tokens / max(1, stats.prompt_tokens))

    def _gauge(self) -> None:
        metrics.PREFIX_CACHED_TOKENS.labels(self.role).set(self.cache.cached_tokens)
        metrics.PREFIX_BYTES.labels(self.role).set(self.cache.nbytes)
        evictions = metrics.PREFIX_EVICTIONS.labels(self.role)
        evictions.inc(self.cache.stats.evictions - self._evictions_counted)
        self._evictions_counted = self.cache.stats.evictions

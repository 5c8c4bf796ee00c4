"""``PrefixCache``: one engine's reusable prompt prefixes, as blocks named by chain hashes (``prfaas.kv.prefix``).

What a block keeps, by layer kind (a block ends ``end`` tokens into the prompt):

- full attention and MLA: a *page*, the layer's K/V (``keys``, ``values``, ``indexer_keys``) at the block's
  positions; a hit concatenates the pages of its chain.
- sliding-window attention: a page too, but only of the positions the layer still held when the block was stored
  (its last ``window - 1``), so a page may hold just the block's tail; a hit needs only the pages its window
  covers.
- linear attention, SSM, convolution and cache-level state (MiniMax): no positions to page, so a block may carry a
  *checkpoint*, those layers' whole state after exactly ``end`` tokens; a hit of a model with such layers must end
  on a block with a checkpoint (an exact match, never an approximation).

A block's presence implies its parent's (blocks are stored root first and only childless blocks are evicted), so
a lookup walks the chain from the root. The budget bounds the bytes of every page and checkpoint; eviction takes
the least recently used block that is no lookup's and has no children. Everything is a copy: the live model cache
goes on changing in place after a snapshot. Owned by one engine thread: not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice

import numpy as np

from prfaas.engine.prefix_records import Entry, PrefixLifecycle
from prfaas.kv import Fingerprint, KVState, LayerState
from prfaas.kv import state as kinds
from prfaas.kv.prefix import BLOCK_TOKENS, SUMMARY_BLOCKS, summary_key
from prfaas.kv.state import POSITIONAL
from prfaas.records import EVICTED, EXPIRED, TENANT_DELETED

Page = dict[str, np.ndarray]  # tensor name → that tensor at the block's positions (axis -2), or at its tail


@dataclass
class Block:
    key: int
    parent: int | None  # None: the prompt's first block
    end: int  # tokens from the prompt's start to this block's end
    pages: dict[int, Page] = field(default_factory=dict)  # attention layer index → its page
    checkpoint: tuple[LayerState, ...] | None = None  # every fixed-state layer after exactly ``end`` tokens
    children: int = 0
    pins: int = 0  # lookups in progress that hold this block
    entry: Entry | None = None  # the store that added it: its tenant, its TTL, its records (prefix_records)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(page) for page in self.pages.values()) + sum(layer.nbytes for layer in self.checkpoint or ())


@dataclass
class Hit:
    """A lookup's result: the prompt's block keys, the blocks of them held (pinned until ``release``) and the
    tokens reusable from them (a block boundary; 0 on a miss)."""

    keys: list[int]
    blocks: list[Block]
    length: int
    tenant: str = ""  # whose prompt (the salt's tenant): what a store of it is recorded under


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    saved_tokens: int = 0  # prompt tokens served from the cache instead of prefilled
    evictions: int = 0


class PrefixCache:
    """Blocks of one model's prefixes within ``budget_bytes`` (see the module docstring)."""

    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS,
                 lifecycle: PrefixLifecycle | None = None) -> None:
        self.budget_bytes, self.block_tokens = budget_bytes, block_tokens
        self.lifecycle = lifecycle or PrefixLifecycle()  # TTL, residency and records of the blocks
        self.nbytes = 0
        self.stats = PrefixStats()
        self._blocks: OrderedDict[int, Block] = OrderedDict()
        self._template: list[LayerState] = []  # each layer's kind and bookkeeping, from the first store

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    def summary(self, limit: int = SUMMARY_BLOCKS) -> tuple[str, ...]:
        """The ``limit`` most recently used blocks, most recent first, as heartbeats name them
        (``prfaas.kv.prefix.summary_key``): a lookup touches its chain root first, so a prompt's deepest block is
        its most recent, and one held block stands for its whole chain."""
        return tuple(summary_key(key) for key in islice(reversed(self._blocks), limit))

    def lookup(self, keys: Sequence[int], prompt_len: int, tenant: str = "") -> Hit:
        """The longest reusable prefix of a prompt of ``prompt_len`` tokens whose full blocks are ``keys``. At least
        one token is always left to compute (its logits give the first token)."""
        chain = self._walk(keys)
        usable = next((j for j in range(min(len(chain), (prompt_len - 1) // self.block_tokens), 0, -1)
                       if self._usable(chain, j)), 0)
        length = usable * self.block_tokens
        self.stats.lookups += 1
        self.stats.hits += length > 0
        self.stats.prompt_tokens += prompt_len
        self.stats.saved_tokens += length
        return Hit(list(keys), chain, length, tenant)

    def held(self, keys: Sequence[int], tenant: str = "") -> Hit:
        """The held part of the chain ``keys``, pinned (``release`` it) but not counted as a lookup: what a store
        of a state that did not come from a lookup (a restored blob) extends."""
        return Hit(list(keys), self._walk(keys), 0, tenant)

    def pages(self, keys: Sequence[int], after: int) -> Hit:
        """The chain ``keys`` whole, for a suffix-only blob of ``after`` more tokens that extends it: ``length`` is
        every key's tokens when each attention layer's pages cover what the suffix does not (the blob brings the
        fixed-state layers whole, so no checkpoint is needed), else 0. Pinned until ``release``."""
        hit = self.held(keys)
        count = len(keys)
        if len(hit.blocks) == count and count and self._usable(hit.blocks, count, checkpoint=False, after=after):
            hit.length = count * self.block_tokens
        return hit

    def release(self, hit: Hit) -> None:
        """Unpin what ``lookup`` and ``store`` pinned for ``hit``."""
        for block in hit.blocks:
            block.pins -= 1
        hit.blocks = []

    def state(self, hit: Hit, fingerprint: Fingerprint, cache_class: str, after: int = 0) -> KVState:
        """The model state after ``hit.length`` tokens, assembled from the hit's blocks (arrays shared with the
        cache: a restore copies them); with ``after``, only the attention positions a suffix of ``after`` more
        tokens does not bring."""
        chain = hit.blocks[:hit.length // self.block_tokens]
        fixed = {layer.index: layer for layer in chain[-1].checkpoint or ()} if chain else {}
        layers = []
        for template in self._template:
            if template.kind in kinds.ATTENTION_KINDS:
                layers.append(self._attention_state(template, chain, hit.length, after))
            else:
                layers.append(fixed.get(template.index, template))
        return KVState(fingerprint=fingerprint, seq_len=hit.length, layers=layers, cache=cache_class)

    def store(self, hit: Hit, kv: KVState) -> None:
        """Keep the full blocks of ``kv``, a snapshot after ``kv.seq_len`` tokens of the prompt ``hit`` was looked
        up for; blocks already held gain what they lack (a longer sliding page, the checkpoint). The fixed-state
        layers are checkpointed only when ``kv.seq_len`` is a block boundary (their state is exact only there).
        Stops at the first block the budget cannot make room for. Nothing is kept of a tenant whose residency
        forbids this instance's datacenter; what is kept and what it evicts are recorded (``PrefixLifecycle``)."""
        if not self.lifecycle.allows(hit.tenant):
            return
        entry, before = self.lifecycle.entry(hit.tenant), {b.key: b.nbytes for b in hit.blocks}
        self._fill_blocks(hit, kv, entry)
        self.lifecycle.flush()  # what it evicted, recorded before what it added
        added = [b for b in hit.blocks if b.entry is entry]
        self.lifecycle.stored(entry, len(added), len(added) * self.block_tokens,
                              sum(b.nbytes - before.get(b.key, 0) for b in hit.blocks))

    def expire(self) -> None:
        """Drop every block whose TTL has passed (and the blocks after it, unreachable without it); a block a
        prompt in progress holds goes at the first call after that prompt ends."""
        if self.lifecycle.ttl_s > 0:
            self._drop_where(lambda b: self.lifecycle.expired(b.entry), EXPIRED)

    def drop_tenant(self, tenant: str) -> None:
        """Drop every block of ``tenant`` (the salt's tenant) that no prompt in progress holds: its data is
        deleted."""
        self._drop_where(lambda b: b.entry is not None and b.entry.tenant == tenant, TENANT_DELETED)

    def _fill_blocks(self, hit: Hit, kv: KVState, entry: Entry) -> None:
        if not self._template:
            self._template = [_strip(layer) for layer in kv.layers]
        count = kv.seq_len // self.block_tokens
        for j in range(count):
            block = hit.blocks[j] if j < len(hit.blocks) else None
            if not self._fill(hit, j, block, kv, last=j == count - 1, entry=entry):
                return

    def _fill(self, hit: Hit, j: int, block: Block | None, kv: KVState, last: bool, entry: Entry) -> bool:
        end = (j + 1) * self.block_tokens
        exact = last and end == kv.seq_len
        if block is not None and self._complete(block, kv, end, exact):
            return True  # nothing to gain: no copy (a restore stores a prompt whose prefix is mostly held)
        pages = {layer.index: page for layer in kv.layers if layer.kind in kinds.ATTENTION_KINDS
                 if (page := self._page(layer, end, kv.seq_len)) is not None}
        checkpoint = tuple(_copy(layer) for layer in kv.layers if _is_fixed(layer)) if exact else None
        if block is None:
            block = Block(key=hit.keys[j], parent=hit.keys[j - 1] if j else None, end=end, entry=entry)
        else:  # held already: it gains only a longer page or a missing checkpoint
            pages = {i: page for i, page in pages.items() if _length(page) > _length(block.pages.get(i))}
            checkpoint = checkpoint if block.checkpoint is None else None
        replaced = sum(_nbytes(block.pages[i]) for i in pages if i in block.pages)
        added = sum(_nbytes(p) for p in pages.values()) + sum(s.nbytes for s in checkpoint or ()) - replaced
        if added > 0 and not self._make_room(added):
            return False
        self._attach(hit, block, pages, checkpoint)
        return True

    def _complete(self, block: Block, kv: KVState, end: int, exact: bool) -> bool:
        """Whether held ``block`` (ending at ``end``) has every position ``kv`` holds of it, and its checkpoint
        where ``kv`` could give one."""
        if exact and block.checkpoint is None and any(_is_fixed(layer) for layer in kv.layers):
            return False
        for layer in kv.layers:
            if layer.kind in kinds.ATTENTION_KINDS:
                held_from = kv.seq_len - next((a.shape[-2] for n, a in layer.tensors.items() if n in POSITIONAL), 0)
                if _length(block.pages.get(layer.index)) < end - max(end - self.block_tokens, held_from):
                    return False
        return True

    def _attach(self, hit: Hit, block: Block, grow: dict[int, Page], checkpoint: tuple[LayerState, ...] | None) -> None:
        self.nbytes -= block.nbytes
        block.pages.update(grow)
        if checkpoint:
            block.checkpoint = checkpoint
        self.nbytes += block.nbytes
        if block.key not in self._blocks:
            self._blocks[block.key] = block
            if block.parent is not None:
                self._blocks[block.parent].children += 1
            block.pins += 1  # a stored block stays until its prompt is done, so its children can attach
            hit.blocks.append(block)
        self._blocks.move_to_end(block.key)

    def _page(self, layer: LayerState, end: int, seq_len: int) -> Page | None:
        """Layer ``layer``'s positions of the block ending at ``end`` (a copy), or the part of them it still holds
        after ``seq_len`` tokens; None when it holds none of them."""
        held_from = seq_len - next((a.shape[-2] for n, a in layer.tensors.items() if n in POSITIONAL), 0)
        begin = max(end - self.block_tokens, held_from)
        if begin >= end:
            return None
        return {name: array[..., begin - held_from:end - held_from, :].copy()
                for name, array in layer.tensors.items() if name in POSITIONAL}

    def _usable(self, chain: list[Block], count: int, checkpoint: bool = True, after: int = 0) -> bool:
        """Whether the first ``count`` blocks of ``chain`` hold everything a restore after them needs (without
        ``checkpoint``: every attention page it needs, when a suffix brings ``after`` more tokens)."""
        end = count * self.block_tokens
        if checkpoint and any(_is_fixed(t) for t in self._template) and chain[count - 1].checkpoint is None:
            return False
        for template in self._template:
            if template.kind in kinds.ATTENTION_KINDS:
                need = _need(template, end, after)
                for block in chain[:count]:
                    covered = block.end - max(block.end - self.block_tokens, end - need)
                    if covered > 0 and _length(block.pages.get(template.index)) < covered:
                        return False
        return True

    def _attention_state(self, template: LayerState, chain: list[Block], end: int, after: int) -> LayerState:
        keep = _need(template, end, after)
        parts: dict[str, list[np.ndarray]] = {}
        for block in chain:
            covered = block.end - max(block.end - self.block_tokens, end - keep)
            for name, array in block.pages.get(template.index, {}).items() if covered > 0 else ():
                parts.setdefault(name, []).append(array[..., array.shape[-2] - covered:, :])
        attrs = dict(template.attrs)
        if "cumulative_length" in attrs:
            attrs["cumulative_length"] = end
        return LayerState(index=template.index, kind=template.kind, grows=template.grows, window=template.window,
                          tensors={n: np.concatenate(p, axis=-2) for n, p in parts.items()}, attrs=attrs)

    def _walk(self, keys: Sequence[int]) -> list[Block]:
        """The held blocks of the chain ``keys`` from its root, pinned and made the most recently used; expired
        blocks are dropped first, so none is ever served."""
        self.expire()
        chain: list[Block] = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            chain.append(block)
        for block in chain:
            block.pins += 1
            self._blocks.move_to_end(block.key)
        return chain

    def _make_room(self, need: int) -> bool:
        """Evict least recently used, unpinned, childless blocks until ``need`` more bytes fit the budget."""
        if need > self.budget_bytes:  # would never fit: keep what is held
            return False
        while self.nbytes + need > self.budget_bytes:
            victim = next((b for b in self._blocks.values() if b.pins == 0 and b.children == 0), None)
            if victim is None:
                return False
            self._drop(victim, EVICTED)
            self.stats.evictions += 1
        return True

    def _drop_where(self, doomed: Callable[[Block], bool], reason: str) -> None:
        """Drop each unpinned block that is ``doomed`` or whose parent was dropped, parents first (a pinned
        block's parent is pinned too, so no held chain loses a link), and record them."""
        gone: set[int] = set()
        for block in sorted(self._blocks.values(), key=lambda b: b.end):
            if block.pins == 0 and (block.parent in gone or doomed(block)):
                gone.add(block.key)
                self._drop(block, reason)
        self.lifecycle.flush()

    def _drop(self, block: Block, reason: str) -> None:
        del self._blocks[block.key]
        if block.parent is not None and block.parent in self._blocks:  # a dropped parent went first
            self._blocks[block.parent].children -= 1
        self.nbytes -= block.nbytes
        self.lifecycle.dropped(block.entry, self.block_tokens, block.nbytes, reason)


def _need(template: LayerState, end: int, after: int) -> int:
    """Positions before ``end`` an attention layer needs from the cache when ``after`` more tokens follow in a
    suffix: all of them, or a sliding window's ``window - 1`` less what the suffix holds."""
    return end if template.window is None else min(end, max(0, template.window - 1 - after))


def _is_fixed(layer: LayerState) -> bool:
    return layer.kind not in kinds.ATTENTION_KINDS and layer.kind != kinds.NONE


def _length(page: Page | None) -> int:
    return next((a.shape[-2] for a in page.values()), 0) if page else 0


def _nbytes(page: Page) -> int:
    return sum(a.nbytes for a in page.values())


def _strip(layer: LayerState) -> LayerState:
    """A layer's kind and bookkeeping without its tensors (pages and checkpoints hold those)."""
    return LayerState(index=layer.index, kind=layer.kind, grows=layer.grows, window=layer.window,
                      attrs=dict(layer.attrs))


def _copy(layer: LayerState) -> LayerState:
    return LayerState(index=layer.index, kind=layer.kind, grows=layer.grows, window=layer.window,
                      tensors={n: a.copy() for n, a in layer.tensors.items()}, attrs=dict(layer.attrs))

"""``PrfaasConnector``: a vLLM KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``) that moves a request's
prompt KV from a prefill instance (producer) to a decode instance (consumer) as a prfaas blob.

Load it with::

    --kv-transfer-config '{"kv_connector": "PrfaasConnector", "kv_connector_module_path": "prfaas.vllm.connector",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"kv_address": "127.0.0.1:7301"}}'

(keys of ``kv_connector_extra_config``: ``prfaas.vllm.settings``). The P/D flow is vLLM's: the prefill instance
gets the request with ``max_tokens=1`` and ``kv_transfer_params: {"do_remote_decode": true}`` (``kv_id`` may be
given, as prfaas's router allocates it up front; else the connector makes one); its response carries
``kv_transfer_params`` = ``{"do_remote_prefill": true, "kv_id", "kv_address", "kv_tokens"}``, which the decode
instance gets with the original request.

Scheduler side (vLLM's scheduler process): decides what to save or load each step and sends it to the worker in
``PrfaasMetadata``. Producer: a request with ``do_remote_decode`` is saved in the step where its prefill
completes — every prompt block of every layer, the earlier steps' blocks included, since each layer's cache holds
the whole prompt by the time that layer runs in that step. Consumer: a request with ``do_remote_prefill`` reports
the tokens the blob covers (``kv_tokens``, where the request says it) but never the prompt's last, loaded
asynchronously (vLLM computes the last prompt token itself, for its logits): ``prompt - 1`` for the producer's own
prompt, all of it when decode's prompt is the producer's plus the first token the producer sampled.
Hybrid models (vLLM's KV cache groups): a sliding-window group is carried from the block holding the first token in
the window of the prompt's last one (the consumer holds vLLM's null block before it); for a model with a Mamba
state group the producer prefills all but the prompt's last token, since a state cannot be rolled back a token.

Worker side: producer — ``save_kv_layer`` copies the request's whole blocks of that layer out of the paged cache
(the only work on vLLM's thread) and hands them to the data plane (``prfaas.vllm.dataplane``), which encodes and
sends each chunk as soon as it is full, while later layers compute; ``wait_for_save`` adds the state layers
(vLLM hands attention layers only to ``save_kv_layer``) and closes the blob. Nothing
holds vLLM's blocks after the step, so ``request_finished`` never delays their freeing. Consumer — ``start_load_kv``
starts the pull; at each step's end ``get_transfer_results`` checks the finished pulls on vLLM's thread (in a step
that computes nothing it first waits up to ``IDLE_WAIT_S`` for one, so that the engine loop, which steps every
millisecond while a request waits for remote KV, does not spin through the producer's cores): the
fingerprint and every layer's block shape and dtype are verified, the blocks written into the request's blocks, the
blob released. Any failure (``KV_NOT_FOUND`` after the creation grace, ``KV_TIMEOUT`` past ``kv_deadline_s``,
``KV_CORRUPT`` still corrupt after the retries, ``KV_INCOMPATIBLE``, …) reports the request in ``failed_recving``
and its blocks as load errors: with ``kv_load_failure_policy: recompute`` vLLM then computes the prompt itself.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from prfaas.errors import KVIncompatible, KVTimeout, PrfaasError
from prfaas.kv.format import BlobHeader
from prfaas.kv.kvid import check_kv_id, new_kv_id
from prfaas.kv.state import KVState, LayerState
from prfaas.vllm import layout
from prfaas.vllm.dataplane import DataPlane
from prfaas.vllm.settings import ConnectorSettings

log = logging.getLogger("vllm.prfaas")  # under vLLM's logger: its handlers and format
LOAD_MARGIN_S = 2.0  # past the pull's own deadline, the worker gives up on it even if the loop is stuck
# A step that schedules nothing while pulls are pending waits this long for one to finish (at once when one does):
# vLLM's engine loop steps every millisecond while a request waits for remote KV, and on shared cores those empty
# steps take CPU from the producer computing that very KV.
IDLE_WAIT_S = 0.01


@dataclass(frozen=True)
class SaveSpec:
    """Save request ``req_id``'s blocks ``block_ids[g]`` of each group ``g`` (its block table's positions
    ``first[g]``…, in order) as blob ``kv_id``, into the store at ``address`` (this producer's own, or a relay's)."""

    req_id: str
    kv_id: str
    address: str
    tokens: int
    block_ids: tuple[list[int], ...]
    first: tuple[int, ...]


@dataclass(frozen=True)
class LoadSpec:
    """Load blob ``kv_id`` from ``address`` into blocks ``block_ids[g]``, which sit at ``positions[g]`` of the
    request's block table of group ``g``; ``block_ids`` empty: only release it (the request needs none of it)."""

    req_id: str
    kv_id: str
    address: str
    block_ids: tuple[list[int], ...] = ()
    positions: tuple[list[int], ...] = ()


@dataclass
class PrfaasMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    idle: bool = False  # the step computes no token: the worker may wait a little for a pending pull


@dataclass
class _Load:
    spec: LoadSpec
    future: concurrent.futures.Future[KVState]
    deadline: float
    started: float = field(default_factory=time.monotonic)


class PrfaasConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        with contextlib.suppress(ImportError):
            from vllm.v1.metrics.cache_hit_source import CacheHitSource

            self._cache_hit_source = CacheHitSource.P2P
        self.settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.groups = layout.groups(kv_cache_config)
        self.fingerprint = layout.fingerprint(vllm_config, kv_cache_config)
        self.producer = bool(self._kv_transfer_config.is_kv_producer)
        self.consumer = bool(self._kv_transfer_config.is_kv_consumer)
        self.plane: DataPlane | None = None
        self.block_bytes = layout.block_bytes(kv_cache_config, self.groups)
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        if role == KVConnectorRole.WORKER:
            self._init_worker()
        else:
            self._init_scheduler()
            if self.settings.info_file:  # the scheduler side exists once per engine: it speaks for the instance
                layout.write_info(self.settings.info_file, self.fingerprint, kv_cache_config, self.groups)
        log.info("PrfaasConnector %s as %s, %s", self._kv_transfer_config.kv_role, role.name, self.fingerprint.arch)

    # ==============================================================================================================
    # scheduler side
    # ==============================================================================================================

    def _init_scheduler(self) -> None:
        self._producing: dict[str, tuple[Any, str, str]] = {}  # req_id → (request, kv_id, address) until saved
        self._saved: dict[str, SaveSpec] = {}  # req_id → what was saved, until request_finished
        self._local: dict[str, int] = {}  # req_id → tokens computed locally when the external ones were counted
        self._saves: list[SaveSpec] = []
        self._loads: list[LoadSpec] = []
        self._held_back: set[str] = set()  # req_ids whose last prompt token the producer does not compute
        self._has_state = any(g.is_state for g in self.groups)

    def on_new_request(self, request: Any) -> None:
        """A producer of a model with state (Mamba) groups prefills all but the prompt's last token: the consumer
        computes that token itself, for its logits, from the state after the others; a state that already
        includes it cannot be rolled back."""
        params = request.kv_transfer_params or {}
        if not (self.producer and self._has_state and params.get("do_remote_decode")):
            return
        if request.num_prompt_tokens < 2 or request.prompt_token_ids is None or request.prompt_is_token_ids is not None:
            return  # nothing to hold back, or a prompt of embeddings: the consumer recomputes it
        request.prompt_token_ids.pop()
        request._all_token_ids.pop()  # the list behind vLLM's read-only all_token_ids view
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        self._held_back.add(request.request_id)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not (self.consumer and params.get("do_remote_prefill") and _valid_source(params)):
            return 0, False
        count = _external_tokens(params, len(request.prompt_token_ids or ())) - num_computed_tokens
        self._local[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode") and self.producer and request.request_id not in self._producing:
            self._produce(request, params)
        if not (self.consumer and params.get("do_remote_prefill") and _valid_source(params)):
            return
        params["do_remote_prefill"] = False  # one load per request, whatever vLLM asks again
        local = self._local.pop(request.request_id, 0)
        if num_external_tokens <= 0:  # a full local hit: the blob is only released
            self._loads.append(LoadSpec(request.request_id, params["kv_id"], params["kv_address"]))
            return
        ids = self._block_ids(request.request_id, blocks)
        null = self._null_block()
        fill = [layout.to_fill(b[:g.blocks_for(local + num_external_tokens)], local // g.block_size, null)
                for b, g in zip(ids, self.groups, strict=True)]
        self._loads.append(LoadSpec(request.request_id, params["kv_id"], params["kv_address"],
                                    tuple(f[0] for f in fill), tuple(f[1] for f in fill)))

    def _produce(self, request: Any, params: dict[str, Any]) -> None:
        try:
            address = self.settings.destination(params.get("relay"))
        except PrfaasError as exc:
            log.warning("request %s: %s; its KV is not sent", request.request_id, exc)
            return
        if address is not None:
            self._producing[request.request_id] = (request, self._kv_id_for(params), address)

    def _kv_id_for(self, params: dict[str, Any]) -> str:
        given = params.get("kv_id")
        if given:
            try:
                return check_kv_id(given)
            except PrfaasError as exc:
                log.warning("ignoring the request's kv_id: %s", exc)
        return new_kv_id(self.fingerprint.short_hash())

    def _block_ids(self, req_id: str, blocks: Any) -> tuple[list[int], ...]:
        manager = getattr(self, "_kv_cache_manager", None)
        ids = manager.get_block_ids(req_id) if manager is not None else blocks.get_block_ids()
        return tuple(list(group) for group in ids)

    def _null_block(self) -> int:
        """vLLM's null block (what a sliding window's block table holds before the window): block 0 of the pool."""
        manager = getattr(self, "_kv_cache_manager", None)
        return int(manager.block_pool.null_block.block_id) if manager is not None else 0

    def _save_spec(self, req_id: str, kv_id: str, address: str, tokens: int) -> SaveSpec | None:
        """What a consumer of this prompt needs: the blocks of every group's block table from the first one in the
        window of the prompt's last token (vLLM's consumer holds null blocks before it; a state group's last
        block is its state), through the last block computed. None (logged) if one of them was already freed,
        which vLLM's window rule never does."""
        held_back = req_id in self._held_back
        self._held_back.discard(req_id)
        if self._has_state and not held_back:
            log.warning("request %s: its state includes the last prompt token; its KV is not sent", req_id)
            return None
        loaded = tokens if held_back else tokens - 1  # what the consumer will load
        first = tuple(g.skipped_blocks(loaded) for g in self.groups)
        ids = tuple(list(b[f:g.blocks_for(tokens)])
                    for b, f, g in zip(self._block_ids(req_id, None), first, self.groups, strict=True))
        if any(self._null_block() in b for b in ids):
            log.warning("request %s: a block its consumer needs was already freed; its KV is not sent", req_id)
            return None
        return SaveSpec(req_id, kv_id, address, tokens, ids, first)

    def build_connector_meta(self, scheduler_output: Any) -> PrfaasMetadata:
        for req_id, (request, kv_id, address) in list(self._producing.items()):
            if self._prefill_completes(scheduler_output, req_id, request.num_prompt_tokens):
                del self._producing[req_id]
                spec = self._save_spec(req_id, kv_id, address, int(request.num_prompt_tokens))
                if spec is not None:
                    self._saves.append(spec)
                    self._saved[req_id] = spec
        meta = PrfaasMetadata(saves=self._saves, loads=self._loads,
                              idle=not scheduler_output.total_num_scheduled_tokens)
        self._saves, self._loads = [], []
        return meta

    @staticmethod
    def _prefill_completes(scheduler_output: Any, req_id: str, prompt_tokens: int) -> bool:
        scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
        if not scheduled:
            return False
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id == req_id:
                return bool(new.num_computed_tokens + scheduled >= prompt_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, cached_id in enumerate(cached.req_ids):
            if cached_id == req_id:
                return bool(cached.num_computed_tokens[i] + scheduled >= prompt_tokens)
        return False

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Never delays freeing (the blocks were copied out during the step); returns the blob's params."""
        req_id = request.request_id
        self._producing.pop(req_id, None)
        self._local.pop(req_id, None)
        self._held_back.discard(req_id)
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and _valid_source(params):  # finished before it was ever scheduled
            params["do_remote_prefill"] = False
            self._loads.append(LoadSpec(req_id, params["kv_id"], params["kv_address"]))
        saved = self._saved.pop(req_id, None)
        if saved is None:
            return False, None
        return False, {"do_remote_prefill": True, "do_remote_decode": False, "kv_id": saved.kv_id,
                       "kv_address": saved.address, "kv_tokens": saved.tokens,
                       "kv_bytes": sum(len(i) * b for i, b in zip(saved.block_ids, self.block_bytes, strict=True)),
                       "kv_engine": "prfaas"}

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(g.index for g in self.groups)

    # ==============================================================================================================
    # worker side
    # ==============================================================================================================

    def _init_worker(self) -> None:
        self.plane = DataPlane(self.settings)
        if self.producer and self.settings.relay is None:
            if self.settings.kv_address is None:
                raise PrfaasError("a PrfaasConnector producer needs kv_address (direct mode) or relay")
            self.plane.serve(self.settings.kv_address)
        self._caches: dict[str, Any] = {}
        self._group_of = {name: g for g in self.groups for name in g.layers}
        self._table: tuple[dict[str, Any], ...] = ()
        self._index: dict[str, int] = {}
        self._begun: set[str] = set()
        self._hold = False  # saved layers wait for the step's end (settings.overlap; set with the caches)
        self._pending: dict[str, _Load] = {}
        self._bad_blocks: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # The blob's layer table must list the layers in the order they are saved: attention layers as the forward
        # pass reaches them (vLLM's dict is in group order: a hybrid's sliding layers first), then the state
        # layers, copied once the step's forward pass is over.
        names = sorted((name for name in kv_caches if name in self._group_of),
                       key=lambda name: (self._group_of[name].is_state, layout.forward_order(name)))
        self._caches = {name: layout.scheduler_blocks(kv_caches[name], self.num_blocks) for name in names}
        device = next(iter(self._caches.values())).device.type if self._caches else "cpu"
        self._hold = self.settings.holds_layers(device)
        self._index = {name: i for i, name in enumerate(self._caches)}
        self._table = tuple({"index": i, "kind": self._group_of[name].kind, "grows": not self._group_of[name].is_state,
                             "window": self._group_of[name].window} for i, name in enumerate(self._caches))

    # -- producer ---------------------------------------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        group = self._group_of.get(layer_name)
        if not isinstance(meta, PrfaasMetadata) or group is None or self.plane is None:
            return
        for spec in meta.saves:
            self._begin(spec)
            self._add_layer(spec, layer_name, kv_layer)

    def _add_layer(self, spec: SaveSpec, layer_name: str, kv_layer: Any) -> None:
        assert self.plane is not None
        group = self._group_of[layer_name]
        blocks, ready = layout.gather(layout.scheduler_blocks(kv_layer, self.num_blocks),
                                      spec.block_ids[group.index])
        entry = self._table[self._index[layer_name]]
        attrs = {"layer": layer_name, "first_block": spec.first[group.index]}
        self.plane.add_layer(spec.kv_id, LayerState(tensors={layout.TENSOR: blocks}, attrs=attrs, **entry),
                             hold=self._hold, ready=ready)

    def _begin(self, spec: SaveSpec) -> None:
        if spec.kv_id in self._begun or self.plane is None:
            return
        self._begun.add(spec.kv_id)
        header = BlobHeader(kv_id=spec.kv_id, fingerprint=self.fingerprint, codec=self.settings.codec,
                            seq_len=spec.tokens, cache=layout.CACHE, chunk_size=self.settings.chunk_bytes,
                            layers=self._table, created_ms=int(time.time() * 1000))
        self.plane.begin(header, spec.address if self.settings.pushes_to(spec.address) else None)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PrfaasMetadata) or self.plane is None:
            return
        for spec in meta.saves:
            self._begin(spec)
            for name, cache in self._caches.items():  # vLLM hands attention layers only to save_kv_layer
                if self._group_of[name].is_state:
                    self._add_layer(spec, name, cache)
            self.plane.finish(spec.kv_id)
            self._begun.discard(spec.kv_id)

    # -- consumer ---------------------------------------------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PrfaasMetadata) or self.plane is None:
            return
        for spec in meta.loads:
            if not spec.block_ids:
                self._release(spec)
                continue
            deadline = time.monotonic() + self.settings.kv_deadline_s + LOAD_MARGIN_S
            self._pending[spec.req_id] = _Load(spec, self.plane.pull(spec.address, spec.kv_id), deadline)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its load was reported finished

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        self._wait_if_idle()
        done, failed = set(), set()
        for req_id, load in list(self._pending.items()):
            if not load.future.done() and time.monotonic() < load.deadline:
                continue
            del self._pending[req_id]
            done.add(req_id)
            try:
                self._restore(load)
                log.info("restored %s into %d blocks, %.1f ms after the pull started", load.spec.kv_id,
                         sum(len(b) for b in load.spec.block_ids), (time.monotonic() - load.started) * 1e3)
            except Exception as exc:  # whatever went wrong, vLLM's worker goes on and recomputes the prompt
                code = exc.code if isinstance(exc, PrfaasError) else type(exc).__name__
                log.warning("KV load of %s (%s) failed, %s: %s; vLLM recomputes it", req_id, load.spec.kv_id,
                            code, exc)
                failed.add(req_id)
                if len(self.groups) == 1:  # vLLM maps block-level errors back to requests for one group only
                    self._bad_blocks.update(load.spec.block_ids[0])
            self._release(load.spec)  # used or refused, the blob is not needed any more (gone: logged)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def _wait_if_idle(self) -> None:
        """In a step that computes nothing, give a pending pull up to ``IDLE_WAIT_S`` to finish (vLLM's thread)."""
        meta = self._connector_metadata
        if isinstance(meta, PrfaasMetadata) and meta.idle and self._pending:
            concurrent.futures.wait([load.future for load in self._pending.values()], timeout=IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def _restore(self, load: _Load) -> None:
        """Verify the pulled blob and write its blocks; on vLLM's thread, between steps."""
        spec = load.spec
        try:
            state = load.future.result(timeout=0)
        except concurrent.futures.TimeoutError as exc:
            load.future.cancel()
            raise KVTimeout(f"pull of {spec.kv_id} passed its {self.settings.kv_deadline_s} s deadline") from exc
        except concurrent.futures.CancelledError as exc:
            raise KVTimeout(f"pull of {spec.kv_id} was cancelled") from exc
        try:
            self.fingerprint.check_compatible(state.fingerprint)
            self._check_layers(state)
            for layer in state.layers:
                name = layer.attrs["layer"]
                group = self._group_of[name]
                blocks = layer.tensors[layout.TENSOR]
                index = layout.blob_indices(spec.positions[group.index], int(layer.attrs.get("first_block", 0)),
                                            blocks.shape[0])
                layout.scatter(self._caches[name], spec.block_ids[group.index], blocks[index])
        finally:
            del state  # the pull's arena is reused once nothing refers to it

    def _check_layers(self, state: KVState) -> None:
        names = [layer.attrs.get("layer") for layer in state.layers]
        if names != list(self._caches) or any(set(layer.tensors) != {layout.TENSOR} for layer in state.layers):
            raise KVIncompatible(f"the blob's layers {names[:3]}… are not this model's {list(self._caches)[:3]}…")

    def _release(self, spec: LoadSpec) -> None:
        if self.plane is not None:
            self.plane.release(spec.address, spec.kv_id).add_done_callback(_log_release_failure)

    def shutdown(self) -> None:
        if self.plane is not None:
            self.plane.close()
            self.plane = None


def _external_tokens(params: dict[str, Any], prompt_tokens: int) -> int:
    """The prompt tokens to load from the blob: all it covers (``kv_tokens``, as the producer returned it), but
    never the prompt's last, which vLLM computes itself for its logits. A request that does not say what the blob
    covers is the producer's own prompt: all but its last token (held back already where the model has state)."""
    covered = params.get("kv_tokens")
    last = prompt_tokens - 1
    if isinstance(covered, int) and not isinstance(covered, bool) and covered > 0:
        return min(covered, last)
    return last


def _valid_source(params: dict[str, Any]) -> bool:
    try:
        check_kv_id(params.get("kv_id"))  # type: ignore[arg-type]
    except PrfaasError:
        return False
    return bool(params.get("kv_address"))


def _log_release_failure(future: concurrent.futures.Future[Any]) -> None:
    exc = future.exception()
    if exc is not None:
        log.info("release of a pulled blob failed: %s", exc)

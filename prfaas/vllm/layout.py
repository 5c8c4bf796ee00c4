"""What a vLLM instance's KV blocks are, as prfaas sees them: the fingerprint, the layer table and whole-block
copies between the paged cache and numpy.

The unit is the whole block. vLLM hands a connector each layer's cache as a logical ``[blocks, kv_heads,
block_size, content]`` view, but what lies inside a block depends on the attention backend: on CPU (ISA ``vec``,
fp32) the first half of each (block, head) row block is K *transposed* and the second half V. Slicing per token
reads the wrong bytes there; copying whole blocks is exact whatever the interior. So the blob carries, per layer,
the request's blocks in sequence order, and the fingerprint names everything that fixes the interior — engine,
platform, ISA, dtype, block size, KV heads, head size — so that a consumer with another layout refuses the blob
(``KV_INCOMPATIBLE``) instead of reading garbage.

A hybrid model has several KV cache groups, each with its own block table: a sliding-window group's blocks before
the window are vLLM's null block and are not carried; a Mamba group holds one state block per request, a raw page
copied whole like any other block (docs/vllm.md, "Hybrid models").

Nothing in ``Fingerprint`` has a field for a layout, so it travels in ``arch`` (``<HF architecture>|<layout>``):
prfaas's engine and vLLM instances, or two vLLM instances of different ISAs, never pair.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch

from prfaas.errors import InvalidRequest, KVIncompatible
from prfaas.kv.fingerprint import WEIGHT_FILES, Fingerprint, files_digest, tokenizer_files_digest
from prfaas.kv.state import FULL_ATTENTION, MAMBA, SLIDING_ATTENTION

CACHE = "vllm-paged-blocks"  # the blob header's ``cache``: whole paged blocks, one tensor per layer
TENSOR = "blocks"
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16), torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2), torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),  # a Mamba layer's raw state pages
}
_NATIVE = (torch.float32, torch.float16, torch.uint8, torch.int8)  # dtypes numpy holds as they are
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class Group:
    """One vLLM KV cache group: its layers share a block table and a block size."""

    index: int
    layers: tuple[str, ...]
    block_size: int
    kind: str
    window: int | None
    head_size: int
    dtype: str
    describe: str  # what fixes a block's bytes, for the fingerprint

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    @property
    def is_state(self) -> bool:
        """A fixed-size state per request (Mamba), not KV per token."""
        return self.kind == MAMBA

    def skipped_blocks(self, computed: int) -> int:
        """Whole blocks the token after ``computed`` ones does not read (vLLM's ``get_num_skipped_tokens``): before
        a sliding window, where vLLM's consumer holds its null block; a state group's blocks before the one
        holding the state after ``computed`` tokens. They are neither read nor carried."""
        if self.is_state:
            return max(0, computed - 1) // self.block_size
        if self.window is None:
            return 0
        return max(0, computed - self.window + 1) // self.block_size


def groups(kv_cache_config: Any) -> tuple[Group, ...]:
    """The KV cache groups of ``kv_cache_config``: attention (full, sliding window) and Mamba state groups;
    ``InvalidRequest`` for any other kind, which this connector does not carry."""
    found = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec).__name__ == "MambaSpec":
            found.append(_state_group(index, group))
            continue
        if not all(hasattr(spec, name) for name in ("num_kv_heads", "head_size", "block_size")):
            raise InvalidRequest(f"PrfaasConnector carries attention KV and Mamba state only; group {index} is "
                                 f"{type(spec).__name__}")
        window = getattr(spec, "sliding_window", None)
        kind = SLIDING_ATTENTION if window else FULL_ATTENTION
        describe = (f"{type(spec).__name__}:b{spec.block_size}:kvh{spec.num_kv_heads}:hd{spec.head_size}:"
                    f"{_dtype_name(spec.dtype)}" + (f":w{window}" if window else ""))
        found.append(Group(index, tuple(group.layer_names), int(spec.block_size), kind,
                           int(window) if window else None, int(spec.head_size), _dtype_name(spec.dtype), describe))
    return tuple(found)


def _state_group(index: int, group: Any) -> Group:
    """A Mamba group: one state block per request (its conv and SSM states) whatever the prompt's length, when
    vLLM keeps no state checkpoints (prefix caching off: ``mamba_cache_mode`` none)."""
    spec = group.kv_cache_spec
    if spec.mamba_cache_mode != "none" or spec.num_speculative_blocks:
        raise InvalidRequest(f"PrfaasConnector carries Mamba state without prefix caching or speculative decoding "
                             f"only; group {index} has mamba_cache_mode {spec.mamba_cache_mode}")
    dtypes = ",".join(_dtype_name(d) for d in spec.dtypes)
    describe = f"MambaSpec:{spec.mamba_type.name}:b{spec.block_size}:{list(spec.shapes)}:{dtypes}"
    return Group(index, tuple(group.layer_names), int(spec.block_size), MAMBA, None, 0, dtypes, describe)


def fingerprint(vllm_config: Any, kv_cache_config: Any) -> Fingerprint:
    """This instance's fingerprint: the weights' and tokenizer's files, and the KV layout (module docstring)."""
    model = vllm_config.model_config
    path = Path(str(model.model))
    tokenizer = Path(str(getattr(model, "tokenizer", None) or path))
    arch = ",".join(getattr(model.hf_config, "architectures", None) or [str(model.hf_config.model_type)])
    specs = groups(kv_cache_config)
    return Fingerprint(model=str(model.served_model_name or model.model), arch=f"{arch}|{layout(specs)}",
                       weights=files_digest(path, WEIGHT_FILES), tokenizer=tokenizer_files_digest(tokenizer),
                       dtype=next((g.dtype for g in specs if not g.is_state), specs[0].dtype),
                       max_seq_len=int(model.max_model_len))


def block_bytes(kv_cache_config: Any, specs: tuple[Group, ...]) -> tuple[int, ...]:
    """Bytes of one block across all of a group's layers, per group (what a blob carries per block: a Mamba
    page's state, not the padding vLLM adds to match the attention page)."""
    pages = [int(getattr(g.kv_cache_spec, "real_page_size_bytes", g.kv_cache_spec.page_size_bytes))
             for g in kv_cache_config.kv_cache_groups]
    return tuple(pages[g.index] * len(g.layers) for g in specs)


def write_info(path: str, fingerprint: Fingerprint, kv_cache_config: Any, specs: tuple[Group, ...]) -> None:
    """What the prfaas instance beside this vLLM server advertises to its router (``info_file``): the fingerprint,
    the KV bytes per token and the KV cache's size. Written whole, then renamed: a reader never sees half a file."""
    per_token = sum(b / g.block_size for b, g in zip(block_bytes(kv_cache_config, specs), specs, strict=True)
                    if not g.is_state)  # a state's bytes do not grow with the prompt
    info = {"fingerprint": fingerprint.to_wire(), "kv_bytes_per_token": math.ceil(per_token),
            "kv_budget_bytes": sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)}
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    tmp.rename(path)


def layout(specs: tuple[Group, ...]) -> str:
    """``vllm/<platform>/<isa>/<group>;<group>…``: what fixes the bytes inside one block."""
    from vllm.platforms import current_platform

    platform = str(current_platform.device_type)
    isa = ",".join(sorted({_cpu_isa(g) for g in specs if not g.is_state})) if platform == "cpu" else platform
    return f"vllm/{platform}/{isa}/" + ";".join(g.describe for g in specs)


def _cpu_isa(group: Group) -> str:
    """The CPU attention kernel's ISA, which decides the block interior (vec, vec16, amx, neon, …)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(getattr(torch, group.dtype), group.block_size, group.head_size))
    except Exception as exc:  # a vLLM without that helper: refuse to pair with anything but the same answer
        return f"unknown-{type(exc).__name__}"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def scheduler_blocks(kv_layer: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``kv_layer`` with dimension 0 counting the scheduler's ``num_blocks`` blocks (the ids in block tables). Where
    the attention kernel splits each into ``k`` smaller kernel blocks (vLLM's ``kernel_blocks_per_block``: a
    hybrid's attention page matched to its Mamba page), that is the view ``[num_blocks, k, …]``."""
    kernel = int(kv_layer.shape[0])
    if kernel == num_blocks or num_blocks <= 0:
        return kv_layer
    per, remainder = divmod(kernel, num_blocks)
    if remainder or per < 1:
        raise KVIncompatible(f"a KV cache of {kernel} kernel blocks does not split into {num_blocks} blocks")
    return kv_layer.unflatten(0, (num_blocks, per))


def gather(kv_layer: torch.Tensor, block_ids: list[int]) -> tuple[np.ndarray, Callable[[], None] | None]:
    """The whole blocks ``block_ids`` of one layer, in that order, as host numpy (exact bytes), and what to call
    before reading them: None on the CPU (the copy is done); on a GPU the copy is only queued on the current stream
    (into pinned host memory, behind the kernels that write this layer) and the call waits for it, so that the
    thread launching the forward pass never waits for the GPU."""
    if kv_layer.device.type == "cpu":
        return to_numpy(kv_layer.index_select(0, torch.tensor(block_ids, dtype=torch.long))), None
    index = torch.tensor(block_ids, dtype=torch.long).pin_memory().to(kv_layer.device, non_blocking=True)
    picked = kv_layer.index_select(0, index)
    host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
    host.copy_(picked, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return to_numpy(host), done.synchronize


def forward_order(layer_name: str) -> tuple[int, ...]:
    """A sort key putting vLLM's layer names (``model.layers.12.self_attn.attn``) in forward-pass order."""
    return tuple(int(part) for part in layer_name.split(".") if part.isdigit())


def to_fill(block_ids: list[int], first: int, null: int) -> tuple[list[int], list[int]]:
    """The blocks of a request's block table (one group) to write from position ``first`` on, as (block ids,
    positions): positions holding vLLM's ``null`` block (before a sliding window) are neither read nor written."""
    kept = [(block, position) for position, block in enumerate(block_ids) if position >= first and block != null]
    return [block for block, _ in kept], [position for _, position in kept]


def blob_indices(positions: list[int], start: int, count: int) -> slice | list[int]:
    """Which of a layer's blob blocks fill ``positions``: the blob holds ``count`` blocks for positions ``start``…
    (a slice when the positions run in sequence, as they do: no copy of the layer). ``KVIncompatible`` if a
    position is not in it."""
    missing = [p for p in positions if not start <= p < start + count]
    if missing:
        raise KVIncompatible(f"the blob holds blocks {start}-{start + count - 1} of a layer; block {missing[0]} "
                             "is needed")
    indices = [p - start for p in positions]
    if not indices:
        return slice(0, 0)
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[-1] + 1)
    return indices


def scatter(kv_layer: torch.Tensor, block_ids: list[int], blocks: np.ndarray) -> None:
    """Write ``blocks`` (whole blocks, in order) into ``kv_layer`` at ``block_ids``. ``KVIncompatible`` if their
    shape or dtype is not this layer's."""
    if tuple(blocks.shape[1:]) != tuple(kv_layer.shape[1:]) or blocks.dtype != _NUMPY_DTYPES.get(kv_layer.dtype):
        raise KVIncompatible(f"KV blocks {blocks.dtype}{list(blocks.shape[1:])} do not fit this cache's "
                             f"{_dtype_name(kv_layer.dtype)}{list(kv_layer.shape[1:])}")
    if len(block_ids) > blocks.shape[0]:
        raise KVIncompatible(f"the blob holds {blocks.shape[0]} blocks of this layer; {len(block_ids)} are needed")
    source = from_numpy(np.ascontiguousarray(blocks[:len(block_ids)]))
    index = torch.tensor(block_ids, dtype=torch.long)
    if kv_layer.device.type != "cpu":  # through pinned memory, queued on the current stream like the steps after it
        source = source.pin_memory().to(kv_layer.device, non_blocking=True)
        index = index.pin_memory().to(kv_layer.device, non_blocking=True)
    kv_layer.index_copy_(0, index, source)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` on the host as numpy with the same bytes and dtype (bfloat16 and fp8 through ml_dtypes)."""
    host = tensor.detach().cpu().contiguous()
    target = _NUMPY_DTYPES.get(host.dtype)
    if target is None:
        raise InvalidRequest(f"KV dtype {host.dtype} is not carried")
    if host.dtype in _NATIVE:
        return host.numpy()
    return host.view(_SAME_WIDTH[host.element_size()]).numpy().view(target)


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """The inverse of ``to_numpy`` (shares memory when it can)."""
    torch_dtype = next((t for t, n in _NUMPY_DTYPES.items() if n == array.dtype), None)
    if torch_dtype is None:
        raise KVIncompatible(f"KV dtype {array.dtype} is not carried")
    if not array.flags.writeable:  # torch wants writable memory; the copy is one layer's blocks
        array = array.copy()
    if torch_dtype in _NATIVE:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(np.dtype(f"i{array.dtype.itemsize}") if array.dtype.itemsize > 1
                                       else np.uint8)).view(torch_dtype)

"""The block bookkeeping of ``prfaas.vllm.layout`` that hybrid models need, without vLLM: which blocks a sliding
window or a Mamba state group carries, where a blob's blocks go in a block table holding vLLM's null block, the
blob's layer order, whole-block copies of a Mamba layer's raw int8 pages and of a cache whose kernel blocks are
smaller than the scheduler's, and the same copies on a GPU (run where torch sees one: through pinned host memory,
queued on the stream)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prfaas.errors import KVIncompatible
from prfaas.kv.state import FULL_ATTENTION, MAMBA, SLIDING_ATTENTION
from prfaas.vllm import layout

NULL = 0


def _group(kind: str, block_size: int = 32, window: int | None = None) -> layout.Group:
    return layout.Group(0, ("model.layers.0.self_attn.attn",), block_size, kind, window, 64, "float32", "test")


def test_sliding_window_skips_the_blocks_before_the_window() -> None:
    sliding = _group(SLIDING_ATTENTION, window=64)
    assert sliding.skipped_blocks(460) == 12  # tokens 397… are in the window of token 460: block 12 holds 397
    assert sliding.skipped_blocks(63) == 0 and sliding.skipped_blocks(95) == 1
    assert _group(FULL_ATTENTION).skipped_blocks(10_000) == 0


def test_state_group_keeps_only_the_last_state() -> None:
    state = _group(MAMBA, block_size=1024)
    assert state.is_state and state.skipped_blocks(460) == 0 and state.skipped_blocks(1025) == 1


def test_fill_skips_null_blocks_and_blob_indices_map_positions() -> None:
    ids, positions = layout.to_fill([NULL, NULL, NULL, 7, 9, 4], first=0, null=NULL)
    assert ids == [7, 9, 4] and positions == [3, 4, 5]
    assert layout.blob_indices(positions, start=3, count=3) == slice(0, 3)
    assert layout.blob_indices([5], start=3, count=3) == slice(2, 3)
    assert layout.to_fill([5, 6, 8], first=1, null=NULL) == ([6, 8], [1, 2])  # a local prefix hit: from block 1


def test_blob_without_a_needed_block_is_incompatible() -> None:
    with pytest.raises(KVIncompatible):
        layout.blob_indices([2, 3, 4], start=3, count=3)


def test_layers_in_forward_order() -> None:
    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.1.mixer"]
    assert sorted(names, key=layout.forward_order) == names[::-1]


def test_int8_state_pages_copy_whole_blocks_exactly() -> None:
    """A Mamba layer's cache as vLLM's CPU build hands it: raw int8 pages, each padded to the attention page."""
    pages = torch.zeros(6, 1, 1, 96, dtype=torch.int8)
    cache = pages.as_strided((6, 1, 1, 80), (96, 96, 96, 1))  # 80 bytes of state in each 96-byte page
    cache[2] = torch.arange(80, dtype=torch.int8).view(1, 1, 80)
    blocks, ready = layout.gather(cache, [2])
    assert ready is None  # on the CPU the copy is done
    assert blocks.dtype == np.int8 and blocks.shape == (1, 1, 1, 80)
    layout.scatter(cache, [4], blocks)
    assert torch.equal(cache[4], cache[2]) and not pages[4, 0, 0, 80:].any()


def test_kernel_blocks_smaller_than_the_schedulers_copy_as_one_block() -> None:
    """A hybrid's attention cache may count kernel blocks, k per scheduler block: block ids still name scheduler
    blocks, and a block's copy is its k kernel blocks."""
    cache = torch.arange(12 * 2 * 4, dtype=torch.float32).view(12, 2, 4)  # 4 scheduler blocks of 3 kernel blocks
    view = layout.scheduler_blocks(cache, 4)
    assert view.shape == (4, 3, 2, 4) and view.data_ptr() == cache.data_ptr()
    blocks, _ = layout.gather(view, [2])
    assert np.array_equal(blocks[0], cache[6:9].numpy())
    layout.scatter(view, [0], blocks)
    assert torch.equal(cache[0:3], cache[6:9])
    assert layout.scheduler_blocks(cache, 12) is cache
    with pytest.raises(KVIncompatible, match="does not split"):
        layout.scheduler_blocks(cache, 5)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="torch sees no CUDA GPU"))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_whole_blocks_round_trip_exactly_on_each_device(device: str, dtype: torch.dtype) -> None:
    """vLLM's attention cache ``[blocks, kv_heads, block_size, 2 × head_size]`` (FlashAttention's on a GPU): blocks
    out in a request's order, into other blocks of another cache, bit for bit; nothing else changes."""
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(32, 2, 16, 128, generator=generator).to(device=device, dtype=dtype)
    target = torch.zeros_like(source)
    blocks, ready = layout.gather(source, [7, 3, 30])
    assert (ready is None) == (device == "cpu")
    if ready is not None:
        ready()
    assert blocks.shape == (3, 2, 16, 128) and blocks.dtype.itemsize == source.element_size()
    layout.scatter(target, [1, 2, 9], blocks)
    assert torch.equal(target[[1, 2, 9]].cpu().view(torch.uint8), source[[7, 3, 30]].cpu().view(torch.uint8))
    untouched = [i for i in range(32) if i not in (1, 2, 9)]
    assert not target[untouched].any()
    with pytest.raises(KVIncompatible, match="do not fit"):
        layout.scatter(target[:, :1], [0], blocks)

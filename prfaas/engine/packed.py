"""Linear layers whose weights are packed once, at load, into oneDNN's blocked layout (CPU only).

A plain ``nn.Linear`` hands oneDNN (bfloat16) or MKL (float32) a row-major weight on every call; a decode step reads
every weight of the model once, and the same matmuls run faster over weights reordered beforehand into the layout
oneDNN's kernels read (``benchmarks/engine_profile.py`` times a step both ways).
``pack`` swaps every ``nn.Linear`` of a CPU model for a ``PackedLinear`` holding that reordered weight — the same
pair of ops (``mkldnn._reorder_linear_weight`` and ``mkldnn._linear_pointwise``) torch's own compiler uses when it
freezes a CPU graph. The swap happens after the weights' hash is taken, so fingerprints do not change; in bfloat16 the
products are bit-identical to ``F.linear``'s (``tests/engine/test_packed.py``), in float32 oneDNN's summation order
differs from MKL's in the last bits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# oneDNN picks the blocked layout for a batch size; any batch size runs on it. A decode step's (rows) is the case
# the packing is for.
BATCH_HINT = 8


class PackedLinear(nn.Module):
    """``nn.Linear`` on a prepacked weight. ``weight`` unpacks a copy, for code that reads a linear's weight; the state
    dict holds it unpacked, so a packed model saves as a plain one."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight  # a saved model is a plain one

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packable(dtype: torch.dtype) -> bool:
    """oneDNN is there and runs ``dtype`` natively (bfloat16 only with AVX-512 BF16, AMX or Arm BF16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def pack(model: Any) -> int:
    """Swap every plain ``nn.Linear`` on the CPU whose dtype oneDNN runs natively for a ``PackedLinear``; returns
    how many were swapped. A tied output head gets its own packed copy; the embedding keeps the original."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            weight = getattr(child, "weight", None)
            if type(child) is nn.Linear and weight is not None and weight.device.type == "cpu" \
                    and packable(weight.dtype):
                setattr(module, name, PackedLinear(child))
                swapped += 1
    return swapped

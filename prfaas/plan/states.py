"""Fixed-size per-request state of recurrent layers, in elements, as transformers' cache holds it.

Convolution states keep ``kernel`` columns (transformers pads the prefill's conv input to the full kernel;
vLLM keeps ``kernel - 1``: a few KiB per layer). Families:

| family | model types | conv state | recurrent state |
|---|---|---|---|
| gated_deltanet | qwen3_next, qwen3_5 | (2·Hk·dk + Hv·dv) × kernel | Hv × dk × dv |
| kda | kimi_linear | 3·H·d × kernel | H × d × d |
| lightning | minimax (Text-01, M1) | — | H × d × d |
| mamba | jamba, mamba, falcon_mamba | expand·hidden × d_conv | expand·hidden × d_state |
| mamba2 | bamba, nemotron_h, falcon_h1, granitemoehybrid, mamba2, zamba2 | (I + 2·G·N) × d_conv | H × P × N |
| short_conv | lfm2 | hidden × L_cache | — |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prfaas.errors import InvalidRequest
from prfaas.plan.hfconfig import Fields


@dataclass(frozen=True)
class RecurrentState:
    family: str
    conv_elements: int
    recurrent_elements: int
    detail: str

    @property
    def elements(self) -> int:
        return self.conv_elements + self.recurrent_elements


def _gated_deltanet(f: Fields) -> RecurrentState:
    hk, hv = f.num("linear_num_key_heads"), f.num("linear_num_value_heads")
    dk, dv = f.num("linear_key_head_dim"), f.num("linear_value_head_dim")
    kernel = f.num("linear_conv_kernel_dim", 4)
    conv = (2 * hk * dk + hv * dv) * kernel
    detail = f"GDN Hk={hk} Hv={hv} dk={dk} dv={dv} k={kernel}"
    return RecurrentState("gated_deltanet", conv, hv * dk * dv, detail)


def _kda(f: Fields) -> RecurrentState:
    lac = f.raw("linear_attn_config", {})
    lac = lac if isinstance(lac, dict) else {}
    sub = Fields(lac, f"{f.where}.linear_attn_config")
    heads = sub.num("num_heads", f.num("linear_num_heads", 32))
    dim = sub.num("head_dim", f.num("linear_head_dim", 128))
    kernel = sub.num("short_conv_kernel_size", f.num("linear_conv_kernel_dim", 4))
    detail = f"KDA H={heads} d={dim} k={kernel}"
    return RecurrentState("kda", 3 * heads * dim * kernel, heads * dim * dim, detail)


def _lightning(f: Fields) -> RecurrentState:
    heads, dim = f.num("num_attention_heads"), f.head_dim
    return RecurrentState("lightning", 0, heads * dim * dim, f"lightning H={heads} d={dim}")


def _mamba(f: Fields) -> RecurrentState:
    if f.model_type == "jamba":
        inner = f.num("mamba_expand", 2) * f.num("hidden_size")
        d_state, d_conv = f.num("mamba_d_state", 16), f.num("mamba_d_conv", 4)
    else:
        inner = f.num("intermediate_size", f.num("expand", 2) * f.num("hidden_size"))
        d_state, d_conv = f.num("state_size", 16), f.num("conv_kernel", 4)
    return RecurrentState("mamba", inner * d_conv, inner * d_state, f"mamba I={inner} N={d_state} k={d_conv}")


def _mamba2(f: Fields) -> RecurrentState:
    hidden = f.num("hidden_size")
    if f.model_type == "nemotron_h":
        heads, head_dim = f.num("mamba_num_heads"), f.num("mamba_head_dim")
        inner = heads * head_dim
        groups = f.first_int(("n_groups", "mamba_n_groups"), 8)
        d_state = f.first_int(("ssm_state_size", "mamba_d_state"), 128)
        d_conv = f.first_int(("conv_kernel", "mamba_d_conv"), 4)
    elif f.model_type in ("mamba2",):
        heads, head_dim = f.num("num_heads"), f.num("head_dim")
        inner = f.num("expand", 2) * hidden
        groups, d_state, d_conv = f.num("n_groups", 1), f.num("state_size", 128), f.num("conv_kernel", 4)
    else:  # bamba, falcon_h1, granitemoehybrid, zamba2: the mamba_* spelling
        inner = f.num("mamba_d_ssm") if f.has("mamba_d_ssm") else f.num("mamba_expand", 2) * hidden
        heads = f.num("mamba_n_heads", 128)
        head_dim = f.num("mamba_d_head") if isinstance(f.raw("mamba_d_head"), int) else inner // heads
        groups, d_state = f.num("mamba_n_groups", 1), f.num("mamba_d_state", 256)
        d_conv = f.num("mamba_d_conv", 4)
    conv = (inner + 2 * groups * d_state) * d_conv
    return RecurrentState("mamba2", conv, heads * head_dim * d_state,
                          f"mamba2 I={inner} H={heads} P={head_dim} G={groups} N={d_state} k={d_conv}")


def _short_conv(f: Fields) -> RecurrentState:
    hidden, cache = f.num("hidden_size"), f.num("conv_L_cache", 3)
    return RecurrentState("short_conv", hidden * cache, 0, f"short conv C={hidden} L={cache}")


_FAMILIES: dict[str, Callable[[Fields], RecurrentState]] = {
    "qwen3_next": _gated_deltanet, "qwen3_5": _gated_deltanet, "qwen3_5_text": _gated_deltanet,
    "qwen3_5_moe": _gated_deltanet, "qwen3_5_moe_text": _gated_deltanet,
    "kimi_linear": _kda,
    "minimax": _lightning, "minimax_text_01": _lightning, "minimax_m1": _lightning,
    "jamba": _mamba, "mamba": _mamba, "falcon_mamba": _mamba,
    "bamba": _mamba2, "nemotron_h": _mamba2, "falcon_h1": _mamba2, "granitemoehybrid": _mamba2,
    "mamba2": _mamba2, "zamba2": _mamba2,
    "lfm2": _short_conv, "lfm2_moe": _short_conv,
}


def recurrent_state(f: Fields, layer: int) -> RecurrentState:
    """The state of recurrent layer ``layer``; an unknown family is an error naming ``model_type``."""
    fn = _FAMILIES.get(f.model_type)
    if fn is None:
        raise InvalidRequest(
            f"layer {layer} is a linear-attention/SSM layer but model_type {f.model_type!r} has no known "
            f"state layout (known: {', '.join(sorted(_FAMILIES))})")
    return fn(f)

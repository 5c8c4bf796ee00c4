"""``prfaas measure``: run the real engine, size the KV it holds per codec, time prefill, compute Φ_kv.

Output is a speed profile (docs/contracts.md) plus extras. In ``kv`` rows, ``bytes`` is the whole blob a transfer
ships (header, chunk frames, trailer), ``encode_seconds`` the time to write those frames from the layers as a
prefill instance's engine thread does (``encoded``: fastest of ``--repeats``, after one run that touches the
reused buffers), and ``tensor_bytes`` the raw tensor bytes (codec ``none``: ``KVState.nbytes``), which ``plan
kv`` must match exactly (``plan_bytes``, ``plan_matches``). It lives
beside the engine it runs, above ``prfaas.plan`` (whose arithmetic it checks), so the planner never imports the
engine.
"""

from __future__ import annotations

import platform
import random
import time
from collections import deque
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from prfaas.engine.loader import load_engine
from prfaas.kv import BlobWriter, KVState
from prfaas.kv.format import Frame, state_frames
from prfaas.kv.frames import FRAME_POOL_BYTES, FramePool
from prfaas.plan.kvcalc import plan_from_config
from prfaas.plan.profile import phi_kv_gbps
from prfaas.plan.transfer import PUSH_QUEUE_BYTES


def prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 100003 + length)
    return [rng.randrange(3, vocab) for _ in range(length)]


def mla_layout_of(kv: Any, config: Any) -> str:
    """Which MLA layout the engine's cache holds: the latent (one "head" of kv_lora_rank) or per-head K/V."""
    rank = getattr(config, "kv_lora_rank", None)
    for layer in kv.layers:
        if layer.kind == "mla" and "keys" in layer.tensors:
            keys = layer.tensors["keys"]
            return "latent" if keys.shape[1] == 1 and keys.shape[-1] == rank else "expanded"
    return "latent"


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} × {torch.get_num_threads()} threads"


def encoded(state: KVState, codec: str, pool: FramePool) -> tuple[int, float]:
    """The blob's bytes and the seconds to write its frames as a relay-mode prefill instance's engine thread does:
    the header, each layer's chunk frames as the layer is added, the trailer; the chunk frames in the instance's
    reused buffers (``pool``), each let go once a push's queue holds ``PUSH_QUEUE_BYTES`` after it, as when the
    link takes the frames as fast as they come (a slower link holds the engine back instead: the planner's slack)."""
    started = time.perf_counter()
    queue: deque[Frame] = deque()
    queued = total = 0
    for frame in state_frames(BlobWriter.for_state(state, codec=codec, pool=pool), state):
        queue.append(frame)
        queued += len(frame)
        total += len(frame)
        while queued > PUSH_QUEUE_BYTES:
            queued -= len(queue.popleft())
    return total, time.perf_counter() - started


def run_measure(*, model: str, lengths: list[int], codecs: list[str], dtype: str = "float32",
                repeats: int = 1, device: str = "cpu") -> dict[str, Any]:
    engine = load_engine(model, dtype=dtype, device=device)
    vocab = int(engine.config.vocab_size)
    prefill_rows, kv_rows = [], []
    plan = None
    pool = FramePool(FRAME_POOL_BYTES)
    for n in lengths:
        ids = prompt(n, vocab)
        best, out = float("inf"), None
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            out = engine.prefill(ids)
            best = min(best, time.perf_counter() - t0)
        assert out is not None
        if plan is None:
            plan = plan_from_config(engine.config.to_dict(), dtype=dtype,
                                    mla_layout=mla_layout_of(out.kv, engine.config), name=model)
        prefill_rows.append({"seq_len": n, "seconds": best})
        for codec in codecs:
            encoded(out.kv, codec, pool)  # the pool's buffers touched once, as a serving instance's are
            blob, encode = min(encoded(out.kv, codec, pool) for _ in range(max(1, repeats)))
            row: dict[str, Any] = {"seq_len": n, "codec": codec, "bytes": blob, "encode_seconds": encode,
                                   "phi_kv_gbps": phi_kv_gbps(blob, best)}
            if codec == "none":
                row.update(tensor_bytes=out.kv.nbytes, plan_bytes=plan.kv_bytes(n),
                           plan_matches=out.kv.nbytes == plan.kv_bytes(n))
            kv_rows.append(row)
    return {"model": model, "dtype": dtype, "hardware": _hardware(engine.device), "prefill": prefill_rows, "decode": [],
            "kv": kv_rows, "mla_layout": plan.mla_layout if plan else "latent",
            "notes": ["bytes = whole blob as shipped; tensor_bytes = KVState.nbytes (codec none)",
                      "encode seconds: the blob's frames written into reused buffers, fastest of --repeats",
                      "prefill seconds: fastest of --repeats runs, one sequence, no batching"]}


def render_measure(out: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]{out['model']}[/] {out['dtype']} on {out['hardware']}")
    secs = {r["seq_len"]: r["seconds"] for r in out["prefill"]}
    t = Table("seq_len", "prefill s", "codec", "blob bytes", "encode s", "Φ_kv Gbps", "tensor bytes", "plan kv")
    for r in out["kv"]:
        plan = "-" if "plan_bytes" not in r else ("= " if r["plan_matches"] else "≠ ") + f"{r['plan_bytes']:,}"
        t.add_row(f"{r['seq_len']:,}", f"{secs[r['seq_len']]:.4f}", r["codec"], f"{r['bytes']:,}",
                  f"{r['encode_seconds']:.4f}", f"{r['phi_kv_gbps']:.3f}",
                  f"{r.get('tensor_bytes', 0):,}" if "tensor_bytes" in r else "-", plan)
    console.print(t)

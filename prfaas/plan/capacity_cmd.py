"""``plan capacity``: Φ_kv per measured length and the best PrfaaS configuration."""

from __future__ import annotations

from typing import Any

from prfaas.errors import InvalidRequest
from prfaas.plan.capacity import Cluster, optimise, point_json
from prfaas.plan.kvcurve import KVCurve
from prfaas.plan.lengths import LengthDist, parse_dist
from prfaas.plan.options import kv_curve
from prfaas.plan.profile import SpeedProfile, phi_kv_gbps


def _curve(prof: SpeedProfile, kv: str | None, config: str | None, model: str | None,
           dtype: str, codec: str) -> KVCurve:
    if kv or config or model:
        return kv_curve(kv, config, model, dtype=dtype, codec=codec)
    points = prof.kv_points(codec)
    if not points:
        raise InvalidRequest(f"profile {prof.model!r} has no KV sizes for codec {codec!r}: give --kv")
    return KVCurve(prof.model, points=points)


def _decode_rate(prof: SpeedProfile, output_len: float, batch: int | None,
                 tpot_ms: float | None) -> float | None:
    if tpot_ms is not None:
        if not batch:
            raise InvalidRequest("--tpot-ms needs --decode-batch")
        return batch / (output_len * tpot_ms / 1e3)
    return prof.decode_rate(output_len, batch)


def run_capacity(*, profile: str, local_profile: str | None, kv: str | None, config: str | None,
                 model: str | None, dtype: str, codec: str, lengths: str | None, prfaas: int, local: int,
                 link_bps: float, link_share: float, output_len: float, decode_batch: int | None,
                 tpot_ms: float | None) -> dict[str, Any]:
    remote = SpeedProfile.from_file(profile)
    near = SpeedProfile.from_file(local_profile) if local_profile else remote
    curve = _curve(remote, kv, config, model, dtype, codec)
    phi = []
    for n, seconds in remote.prefill:
        b = curve.kv_bytes(n)
        g = phi_kv_gbps(b, seconds)
        phi.append({"seq_len": n, "kv_bytes": b, "kv_mib": b / 2**20, "prefill_seconds": seconds,
                    "phi_kv_gbps": g, "instances_per_link": link_share * link_bps / 1e9 / g if g else None})
    plain = dict.fromkeys((n for n, _ in remote.prefill), 1.0)
    dist = parse_dist(lengths) if lengths else LengthDist.of(plain, "profile lengths")
    rate = _decode_rate(near, output_len, decode_batch, tpot_ms)
    cluster = Cluster(prfaas, local, link_bps, link_share, rate)
    points = optimise(dist, cluster, remote.prefill_seconds, near.prefill_seconds, curve.kv_bytes)
    notes = [] if rate is not None else ["no decode timings: the decode term is left unbounded"]
    return {"model": remote.model, "link_bps": link_bps, "link_share": link_share,
            "prfaas_instances": prfaas, "local_instances": local, "distribution": dist.to_json(),
            "phi_kv": phi, "best": point_json(points[0]), "thresholds": [point_json(p) for p in points[:10]],
            "decode_rate_per_instance": rate, "notes": notes}

"""``prfaas admin check``: a pre-flight before (or during) a rolling upgrade. It compares what every registered
instance reports — fingerprint (pool), blob format version, config digest, health, draining — and lists what
would break, worst first. Pure functions over ``/admin/instances`` and ``/admin/pools``; never changes anything.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from prfaas.kv import Fingerprint

ERROR, WARN, INFO = "error", "warn", "info"


@dataclass(frozen=True)
class Finding:
    level: str
    message: str


def check(instances: list[dict[str, Any]], pools: dict[str, Any]) -> list[Finding]:
    found = [*_health(instances), *_pools(instances, pools), *_formats(instances, pools), *_configs(instances, pools)]
    order = {ERROR: 0, WARN: 1, INFO: 2}
    return sorted(found, key=lambda f: order[f.level])


def pool_key(info: dict[str, Any]) -> str:
    return Fingerprint.from_wire(info["fingerprint"]).pool_key() if info.get("fingerprint") else ""


def _health(instances: list[dict[str, Any]]) -> list[Finding]:
    out = [Finding(ERROR, f"{i['instance_id']} ({i['role']}) has missed its heartbeats")
           for i in instances if not i.get("healthy", True)]
    out += [Finding(INFO, f"{i['instance_id']} ({i['role']}) is draining: it takes no new work")
            for i in instances if i.get("draining")]
    return out


def _pools(instances: list[dict[str, Any]], pools: dict[str, Any]) -> list[Finding]:
    roles: dict[str, set[str]] = defaultdict(set)
    fps: dict[str, Fingerprint] = {}
    for info in instances:
        key = pool_key(info)
        if key:
            roles[key].add(info["role"])
            fps[key] = Fingerprint.from_wire(info["fingerprint"])
    weights = {p["pool"]: p.get("weight") for p in pools.get("pools", [])}
    out: list[Finding] = []
    for key, fp in sorted(fps.items()):
        name = f"pool {key} ({fp.model})"
        if "decode" not in roles[key]:
            out.append(Finding(ERROR, f"{name} has no decode instance: its prefill instances can pair with "
                                      f"nothing (the router pairs only matching fingerprints)"))
        elif "prefill" not in roles[key]:
            out.append(Finding(WARN, f"{name} has no prefill instance: all its prompts prefill locally"))
        if weights.get(key) == 0:
            out.append(Finding(INFO, f"{name} has weight 0: it gets no traffic unless a request names it"))
    if len(fps) > 1:
        base_key, base = sorted(fps.items())[0]
        for key, fp in sorted(fps.items())[1:]:
            diff = ", ".join(base.mismatches(fp))
            out.append(Finding(INFO, f"pools {base_key} ({base.model}) and {key} ({fp.model}) differ in {diff}: "
                                     f"KV never crosses between them"))
    return out


def _formats(instances: list[dict[str, Any]], pools: dict[str, Any]) -> list[Finding]:
    """Every reader accepts its own and the previous version, so versions more than one apart cannot mix."""
    versions = {i["instance_id"]: int(i["fingerprint"].get("format_version", 0))
                for i in instances if i.get("fingerprint")}
    if "router_format_version" in pools:
        versions["router"] = int(pools["router_format_version"])
    if not versions:
        return []
    low, high = min(versions.values()), max(versions.values())
    if high - low > 1:
        olds = sorted(k for k, v in versions.items() if v == low)
        news = sorted(k for k, v in versions.items() if v == high)
        return [Finding(ERROR, f"blob format versions {low} ({', '.join(olds)}) and {high} ({', '.join(news)}) "
                               f"are more than one apart: upgrade through version {low + 1} first")]
    if high != low:
        return [Finding(WARN, f"blob format versions {low} and {high} are mixed: blobs are written at {low} "
                              f"until the last version-{low} reader is gone (this is a rolling upgrade)")]
    return []


def _configs(instances: list[dict[str, Any]], pools: dict[str, Any]) -> list[Finding]:
    digests: dict[str, list[str]] = defaultdict(list)
    if pools.get("router_config_hash"):
        digests[pools["router_config_hash"]].append("router")
    for info in instances:
        digests[info.get("config_hash") or "unknown"].append(info["instance_id"])
    if len(digests) <= 1:
        return []
    groups = "; ".join(f"{h}: {', '.join(sorted(ids))}" for h, ids in sorted(digests.items()))
    return [Finding(WARN, f"config differs across instances (digest of the shared keys) — {groups}")]


def render(findings: list[Finding], instances: int) -> str:
    lines = [f"{f.level.upper():5} {f.message}" for f in findings]
    errors = sum(1 for f in findings if f.level == ERROR)
    lines.append(f"checked {instances} instances: {errors} problem(s) that would break, "
                 f"{sum(1 for f in findings if f.level == WARN)} warning(s)")
    return "\n".join(lines)

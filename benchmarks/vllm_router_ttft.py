"""TTFT through prfaas's router with vLLM as the engine, against vLLM alone, in one run.

    .venv/bin/python benchmarks/vllm_router_ttft.py [--samples 8] [--mode direct] [--out FILE.json]

Stages, one after the other (a vLLM server here takes about 4 GB):
1. ``prfaas up --engine vllm --model smollm2-135m --dtype float32 --offload-threshold 0``: every prompt remote.
   Each sample is two requests, alternating: as a client sends it (the decode instance streams prefill's first
   token at once: ``remote``), and the same with a stop string that never occurs, which keeps decode's vLLM
   computing the first token again after the pull, as before prfaas passed it on (``remote_recompute_first``;
   the same text). Beside each sample the same prompt goes straight to the prefill instance's own vLLM server,
   which computed the remote prompt (``beside_prefill``), then to the decode instance's (``beside_remote``):
   vLLM without prfaas's path, with the same neighbours at the same moment, so that the machine's drift between
   stages does not enter the comparison; those go after the sample's deployment requests on even samples and
   before them on odd ones (whichever goes first after the pause was slower here).
2. The same deployment with its prefill instance drained (``/admin/drain/prefill-0``): every prompt local, the
   decode's vLLM prefilling it (``local``), each sample paired with the same prompt straight to that vLLM
   (``beside_local``), in turn after and before it.
   Between the two, the hops on their own (``hops``), on one keep-alive connection each as the router holds
   them: the decode instance's ``/tokenize`` of a prompt (through its vLLM's), its ``/generate`` of a one-token
   answer whose token prefill already sampled (streamed at once; the blob it names does not exist, so it only
   releases), and the router's ``/health``.
3. vLLM alone (``tests/vllm/servers.py``, the instance's flags, the same launcher): without a KV connector
   (``vllm``), and with ``PrfaasConnector`` loaded as a consumer that is never sent a blob
   (``vllm_with_connector``). Both on the OpenMP threads the instances' servers get (``CONNECTOR_CPUS``: vLLM
   reserves one CPU more where a connector is configured, which on 2 CPUs means two OpenMP threads instead of
   one); the goal is taken against the faster of the two.
4. P's cost of saving: one vLLM server with ``PrfaasConnector`` as a producer keeping blobs in its own store, each
   prompt sent plain, then as the router's prefill requests are (saved); once with the connector's ``overlap``
   ``layers`` (each layer encoded while later ones compute) and once ``step`` (after the step: the CPU default).
Every request: a prompt of about 460 tokens, distinct per sample (prefix caching is off everywhere), greedy,
streaming, ``max_tokens`` 4, one at a time with a pause between, on one kept-alive connection per server (as a
serving client holds it; a new ``httpx`` client per request costs about 20 ms of TLS set-up on the client's side
alone); TTFT is the client's, from sending to the first chunk with text. Reports median, min–max and quartiles per
stage; per request of the deployment, the time outside its engine's prefill (``outside_ms``: TTFT − the router's
``stages.prefill_ms`` on the remote routes, the time P's instance waited for its vLLM; TTFT − ``stages.decode_ms``
on the local one, decode's wait for its vLLM's first token); and the goal (TTFT overhead over vLLM alone within
max(5 %, 1 RTT + 10 ms); RTT here is loopback, taken as 0), against vLLM alone and, paired sample by sample, against
the vLLM beside that computed the prompt (``over_beside_ms``, the median of the paired differences, with their
quartiles: two prefills of one prompt differ by up to ±100 ms on 2 shared cores; on the remote routes also against
D's, ``over_decode_vllm_ms``). Writes JSON with the machine's provenance (CPU model, ISA flags, load average) and
the load average before each stage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from prfaas.bench.provenance import provenance
from prfaas.kv import Fingerprint
from prfaas.kv.kvid import new_kv_id
from prfaas.messages import GenerateRequest, SamplingParams
from prfaas.transfer import client as transfer
from tests.services.deploy import deployment, free_port
from tests.vllm.servers import CONNECTOR_CPUS, INSTALLED, Server, deployed_servers, start, stop, wait_healthy

MODEL = "smollm2-135m"
SENTENCES = 33  # about 460 tokens of SmolLM2's tokenizer
MAX_TOKENS = 4
PAUSE_S = 1.0
NEVER = "\u2603never\u2603"  # a stop string no answer here contains
DRAIN_S = 120.0
DEPLOYED = ("remote", "remote_recompute_first", "local")
BESIDE = ("beside_prefill", "beside_remote", "beside_local")  # the same prompt straight to P's or D's own vLLM
OVERLAPS = ("layers", "step")  # the connector's overlap: each layer sent while later ones compute, or after the step


Request = tuple[str, str, dict[str, Any]]  # stage, server, extra fields of the body


def prompt(seed: int) -> str:
    base = 100 + (37 * seed) % 800
    return " ".join(f"The number {i} is followed by {i + 1}." for i in range(base, base + SENTENCES))


def ttft(client: httpx.Client, url: str, seed: int, **extra: Any) -> dict[str, Any]:
    """One streaming completion on ``client``'s kept-alive connection to ``url``: the client's TTFT, the prompt's
    tokens and the router's ``prfaas`` field."""
    body = {"model": MODEL, "prompt": prompt(seed), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    started, first, text = time.perf_counter(), None, ""
    meta: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices", []):
                if choice.get("text") and first is None:
                    first = (time.perf_counter() - started) * 1e3
                text += choice.get("text") or ""
            meta, usage = chunk.get("prfaas", meta), chunk.get("usage") or usage
    if first is None:
        raise RuntimeError(f"{url} streamed no text")
    time.sleep(PAUSE_S)
    stages = meta.get("stages") or {}
    engine = stages.get("prefill_ms") if meta.get("route") == "remote" else stages.get("decode_ms")
    return {"ttft_ms": round(first, 1), "prompt_tokens": usage.get("prompt_tokens"), "text": text,
            "route": meta.get("route"), "stages": meta.get("stages"),
            "outside_ms": None if engine is None else round(first - engine, 1)}


def spread(values: list[float]) -> dict[str, Any]:
    values = sorted(values)
    quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return {"n": len(values), "median_ms": round(statistics.median(values), 1), "min_ms": values[0],
            "max_ms": values[-1], "q1_ms": round(quartiles[0], 1), "q3_ms": round(quartiles[2], 1)}


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    row = spread([s["ttft_ms"] for s in samples])
    outside = [s["outside_ms"] for s in samples if s.get("outside_ms") is not None]
    return {**row, "outside_median_ms": round(statistics.median(outside), 1)} if outside else row


def timed(call: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    answer = call(*args, **kwargs)
    return round((time.perf_counter() - started) * 1e3, 2), answer


def generate_known_first(client: httpx.Client, decode: dict[str, Any], body: GenerateRequest) -> str:
    """``/generate``'s first line: the token prefill sampled, which the decode instance streams at once."""
    with client.stream("POST", f"{decode['url']}/generate", json=body.to_json()) as reply:
        return next(reply.iter_lines())


def hops(url: str, samples: int) -> dict[str, dict[str, Any]]:
    """Each hop the routes take besides the engines' work, alone, on one keep-alive connection per instance."""
    instances = {i["role"]: i for i in httpx.get(f"{url}/admin/instances", timeout=30).json()}
    decode, prefill = instances["decode"], instances["prefill"]
    kv_id = f"{Fingerprint.from_wire(decode['fingerprint']).short_hash()}-0-{'a' * 20}"  # no such blob
    out: dict[str, list[float]] = {"tokenize": [], "generate_known_first": [], "router_health": []}
    with httpx.Client(timeout=60) as client:
        for i in range(samples):
            ms, reply = timed(client.post, f"{decode['url']}/tokenize", json={"prompt": prompt(i)})
            ids = [int(t) for t in reply.json()["token_ids"]]
            out["tokenize"].append(ms)
            body = GenerateRequest(request_id=f"hop-{i}", token_ids=ids, max_tokens=1,
                                   sampling=SamplingParams(temperature=0), kv_id=kv_id,
                                   kv_address=prefill["kv_address"], first_token=ids[-1], first_text="x",
                                   kv_tokens=len(ids))
            out["generate_known_first"].append(timed(generate_known_first, client, decode, body)[0])
            out["router_health"].append(timed(client.get, f"{url}/health")[0])
            time.sleep(0.2)
    return {name: spread(values) for name, values in out.items()}


def alternate(i: int, deployed: list[Request], beside: list[Request]) -> list[Request]:
    """Sample ``i``'s requests: the deployment's first on even samples, vLLM's beside it first on odd ones."""
    return deployed + beside if i % 2 == 0 else beside + deployed


def drain_prefill(url: str) -> None:
    httpx.post(f"{url}/admin/drain/prefill-0", timeout=30).raise_for_status()
    deadline = time.monotonic() + DRAIN_S
    while any(i["role"] == "prefill" for i in httpx.get(f"{url}/admin/instances", timeout=30).json()):
        if time.monotonic() > deadline:
            raise RuntimeError("the prefill instance did not drain")
        time.sleep(0.5)


def deployed(client: httpx.Client, mode: str, samples: int, loads: dict[str, list[float]],
             hop_rows: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The remote and local stages of one deployment, each sample followed by the same prompt sent straight to the
    decode instance's own vLLM server (``beside_remote``, ``beside_local``: vLLM without prfaas's path, with the
    same neighbours at the same moment); ``loads`` gets the load average before each, ``hop_rows`` the hops."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in (*DEPLOYED, *BESIDE)}
    with deployment(MODEL, mode, threshold=0, extra=("--engine", "vllm", "--dtype", "float32")) as (url, proc):
        (port,) = deployed_servers(proc.pid, "kv_consumer").values()
        (prefill_port,) = deployed_servers(proc.pid, "kv_producer").values()
        beside, beside_prefill = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prefill_port}"
        for server in (url, beside, beside_prefill):  # warm-up: a vLLM server's first request pays one-off costs
            ttft(client, server, 999)
        loads["remote"] = list(os.getloadavg())
        for i in range(samples):  # in turn first and second, so that the order does not enter the pairs
            routes: list[Request] = [("remote", url, {}), ("remote_recompute_first", url, {"stop": [NEVER]})]
            besides: list[Request] = [("beside_prefill", beside_prefill, {}), ("beside_remote", beside, {})]
            for name, server, extra in alternate(i, routes, besides):
                out[name].append(ttft(client, server, i, **extra))
        hop_rows.update(hops(url, samples))
        drain_prefill(url)
        ttft(client, url, 998)
        loads["local"] = list(os.getloadavg())
        for i in range(samples):
            for name, server, extra in alternate(i, [("local", url, {})], [("beside_local", beside, {})]):
                out[name].append(ttft(client, server, i, **extra))
    return out


def alone_server(role: str | None, extra: dict[str, Any] | None = None) -> Server:
    """SmolLM2 on vLLM alone, with the flags prfaas's instance gives its child and its OpenMP threads
    (``CONNECTOR_CPUS``); ``role``: ``PrfaasConnector``'s, with ``extra`` (None: no connector)."""
    from prfaas.engine import models

    args = ("--max-model-len", "4096", "--disable-uvicorn-access-log", "--enable-prompt-tokens-details")
    return start(models.smollm2_dir(), role, extra, name=MODEL, args=args, env=CONNECTOR_CPUS)


def alone(client: httpx.Client, samples: int, connector: bool) -> list[dict[str, Any]]:
    """vLLM alone with the flags prfaas's instance gives its child; ``connector``: ``PrfaasConnector`` loaded as a
    consumer that no request names a blob to."""
    server = alone_server("kv_consumer" if connector else None)
    try:
        wait_healthy([server])
        ttft(client, server.url, 999)
        return [ttft(client, server.url, i) for i in range(samples)]
    finally:
        stop(server)


def producer(client: httpx.Client, samples: int, overlap: str) -> dict[str, list[dict[str, Any]]]:
    """P's cost of saving, on one vLLM server with ``PrfaasConnector`` as a producer keeping blobs in its own store
    (``overlap``: when it encodes each saved layer): each prompt plain (``producer_plain_<overlap>``), then saved
    as the router's prefill requests are (``producer_saving_<overlap>``; the blob expires unread)."""
    extra = {"kv_address": f"127.0.0.1:{free_port()}", "overlap": overlap}
    server = alone_server("kv_producer", extra)
    out: dict[str, list[dict[str, Any]]] = {f"producer_plain_{overlap}": [], f"producer_saving_{overlap}": []}
    try:
        wait_healthy([server])
        ttft(client, server.url, 999, kv_transfer_params={"do_remote_decode": True, "kv_id": new_kv_id("0" * 12)})
        for i in range(samples):
            out[f"producer_plain_{overlap}"].append(ttft(client, server.url, i))
            params = {"do_remote_decode": True, "kv_id": new_kv_id("0" * 12)}
            out[f"producer_saving_{overlap}"].append(ttft(client, server.url, i, kv_transfer_params=params))
        store = asyncio.run(transfer.stat(extra["kv_address"]))
        if store["blobs"] + store["deleted"] < samples + 1:
            raise RuntimeError(f"the producer saved {store['blobs'] + store['deleted']} blobs of {samples + 1}")
        return out
    finally:
        stop(server)


def beside_goal(stages: dict[str, list[dict[str, Any]]], name: str, allowance: float) -> dict[str, Any]:
    """Stage ``name`` against the vLLM server that computed its prompt, asked the same prompt right after each
    sample (P's on the remote routes, D's on the local one): the median of the paired differences, and whether it
    is within ``allowance``; on the remote routes also against D's vLLM (``over_decode_vllm_ms``: two servers of
    the same flags differ here by tens of milliseconds from one deployment to the next, either way)."""
    def paired(base: str) -> list[float]:
        return [s["ttft_ms"] - b["ttft_ms"] for s, b in zip(stages[name], stages[base], strict=True)]

    differences = paired("beside_local" if name == "local" else "beside_prefill")
    over, (q1, _, q3) = statistics.median(differences), statistics.quantiles(differences, n=4)
    row = {"over_beside_ms": round(over, 1), "over_beside_q1_ms": round(q1, 1), "over_beside_q3_ms": round(q3, 1),
           "met_beside": over <= allowance}
    return row if name == "local" else {**row, "over_decode_vllm_ms": round(statistics.median(paired("beside_remote")),
                                                                            1)}


def saving_cost(stages: dict[str, list[dict[str, Any]]], overlap: str) -> dict[str, Any]:
    """Saving's TTFT cost on the producer: the median of (saved − plain) over the same prompts."""
    pairs = zip(stages[f"producer_saving_{overlap}"], stages[f"producer_plain_{overlap}"], strict=True)
    return {"overlap": overlap, "paired_median_ms": round(statistics.median(s["ttft_ms"] - p["ttft_ms"]
                                                                            for s, p in pairs), 1)}


def tables(rows: dict[str, Any], goal: dict[str, Any], hop_rows: dict[str, Any],
           loads: dict[str, list[float]]) -> dict[str, list[dict[str, Any]]]:
    """The summaries as lists of records, one per stage and one per hop (what docs/benchmarks.md shows)."""
    stages = [{"stage": name, **row, **goal.get(name, {}),
               "load_average_1m": loads.get("remote" if name.startswith("remote") else name, [None])[0]}
              for name, row in rows.items()]
    return {"stages": stages, "hop_times": [{"hop": name, **row} for name, row in hop_rows.items()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--mode", default="direct", choices=["direct", "relay"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vllm_router_ttft.json")
    args = parser.parse_args()
    if not INSTALLED:
        raise SystemExit("vLLM's CPU build is not installed: run `make vllm`")
    meta = provenance()
    loads: dict[str, list[float]] = {}
    hop_rows: dict[str, Any] = {}
    with httpx.Client(timeout=300) as client:  # one kept-alive connection per server, as a serving client holds
        stages = deployed(client, args.mode, args.samples, loads, hop_rows)
        for name, connector in (("vllm", False), ("vllm_with_connector", True)):
            loads[name] = list(os.getloadavg())
            stages[name] = alone(client, args.samples, connector)
        for overlap in OVERLAPS:
            loads[f"producer_{overlap}"] = list(os.getloadavg())
            stages.update(producer(client, args.samples, overlap))
    texts = {name: [s["text"] for s in rows] for name, rows in stages.items()}
    rows = {name: summary(samples) for name, samples in stages.items()}
    baselines = ("vllm", "vllm_with_connector")
    mono = min(rows[name]["median_ms"] for name in baselines)
    allowance = max(0.05 * mono, 10.0)  # 1 RTT (loopback: ~0) + 10 ms
    goal = {name: {"overhead_ms": round(r["median_ms"] - mono, 1), "allowance_ms": round(allowance, 1),
                   "met": r["median_ms"] - mono <= allowance, "over_local_ms": round(r["median_ms"] -
                                                                                      rows["local"]["median_ms"], 1),
                   **beside_goal(stages, name, allowance)}
            for name, r in rows.items() if name in DEPLOYED}
    result = {"provenance": meta, "mode": args.mode, "max_tokens": MAX_TOKENS, "load_average": loads,
              "same_text": all(texts[name] == texts["vllm"] for name in texts),
              **tables(rows, goal, hop_rows, loads),
              "saving_cost": [saving_cost(stages, overlap) for overlap in OVERLAPS], "samples": stages}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, r in rows.items():
        extra = f"  overhead {goal[name]['overhead_ms']:+.1f} ms" if name in goal else ""
        extra += f"  outside the engine {r['outside_median_ms']} ms" if "outside_median_ms" in r else ""
        print(f"{name:24} median {r['median_ms']:8.1f} ms  ({r['min_ms']}–{r['max_ms']}){extra}")
    for name, r in hop_rows.items():
        print(f"hop {name:20} median {r['median_ms']:8.1f} ms  ({r['min_ms']}–{r['max_ms']})")
    for cost in result["saving_cost"]:
        print(f"saving on the producer, overlap {cost['overlap']:6}: {cost['paired_median_ms']:+.1f} ms (paired)")
    print(f"same text as vLLM alone: {result['same_text']}; load average {loads}")


if __name__ == "__main__":
    main()

"""``prfaas demo``: the KV hand-off in two processes, shown step by step.

Process 1 (this one) tokenizes a chat prompt and prefills it; the KV state is serialized into a prfaas blob; a
second process, which shares nothing with this one but the bytes on its stdin, verifies the blob, restores the
model cache and decodes. The answer is checked against a monolithic ``generate`` in this process.
"""

from __future__ import annotations

import time

from rich.table import Table

from prfaas import terminal


def run_demo(model: str, prompt: str, codec: str, max_new_tokens: int) -> None:
    from prfaas.engine import load_engine
    from prfaas.engine.worker import DecodeWorker
    from prfaas.kv import encode_state

    console = terminal.console()
    console.rule("[bold]prfaas demo: prefill here, decode in another process")
    with console.status(f"loading {model} (the first run converts the embedded GGUF once)"):
        started = time.perf_counter()
        engine = load_engine(model)
        worker = DecodeWorker(model)
        console.print(f"loaded {model} in two processes in {time.perf_counter() - started:.1f} s")
    with worker:
        ids = chat_ids(engine, prompt)
        out = engine.prefill(ids)
        t0 = time.perf_counter()
        blob = encode_state(out.kv, codec=codec)
        encode_ms = (time.perf_counter() - t0) * 1e3
        reply = worker.decode(blob, out.next_token, max_new_tokens - 1)
        tokens = [out.next_token, *reply["tokens"]]
        reference = engine.generate(ids, max_new_tokens)
    answer = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    console.print(f"[bold]user:[/] {prompt}\n[bold]assistant (decoded in process {worker.proc.pid}):[/] {answer}")
    table = Table(title="what crossed the process boundary")
    table.add_column("")
    table.add_column("value", justify="right")
    rows = [
        ("prompt tokens", str(len(ids))),
        ("codec", codec),
        ("KV blob on the wire", _mib(len(blob))),
        ("raw KV tensors", _mib(out.kv.nbytes)),
        ("prefill (process 1)", f"{out.seconds * 1e3:.0f} ms"),
        ("encode to blob", f"{encode_ms:.0f} ms"),
        ("verify + parse (process 2)", f"{reply['parse_ms']:.0f} ms"),
        (f"restore + decode {len(reply['tokens'])} tokens", f"{reply['decode_ms']:.0f} ms"),
        ("tokens equal a monolithic run", "yes" if tokens == reference else "no"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if tokens != reference and codec == "none":
        raise SystemExit("disaggregated tokens differ from the monolithic run")


def chat_ids(engine: object, prompt: str) -> list[int]:
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    messages = [{"role": "user", "content": prompt}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"

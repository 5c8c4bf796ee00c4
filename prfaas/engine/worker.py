"""A decode worker in its own process: KV blobs in on stdin, tokens out on stdout.

Used by ``prfaas demo`` and the tests to prove that a KV state survives the trip to another process with nothing
shared but bytes. Frames are ``u32 length + msgpack`` both ways; a request is ``{"blob": bytes, "next_token": int,
"max_new_tokens": int}``; a reply is ``{"tokens": [...], "parse_ms": float, "decode_ms": float}`` or
``{"error": {"code", "message"}}``. The worker answers ``{"ready": fingerprint}`` once its model is loaded.

    python -m prfaas.engine.worker --model tiny-llama
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from typing import IO, Any

import msgpack

from prfaas.errors import PrfaasError

_LEN = struct.Struct(">I")


def write_frame(stream: IO[bytes], obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> Any | None:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return msgpack.unpackb(data, raw=False)


def serve(model: str, dtype: str, inp: IO[bytes], out: IO[bytes], device: str = "cpu") -> None:
    from prfaas.engine import load_engine
    from prfaas.kv import decode_state

    engine = load_engine(model, dtype=dtype, device=device)
    write_frame(out, {"ready": engine.fingerprint.to_wire()})
    while (request := read_frame(inp)) is not None:
        try:
            started = time.perf_counter()
            kv = decode_state(request["blob"])
            parsed = time.perf_counter()
            tokens = engine.decode(kv, int(request["next_token"]), int(request["max_new_tokens"]))
            done = time.perf_counter()
            write_frame(out, {"tokens": tokens, "parse_ms": (parsed - started) * 1e3,
                              "decode_ms": (done - parsed) * 1e3})
        except PrfaasError as exc:
            write_frame(out, {"error": exc.to_wire()})


class DecodeWorker:
    """Client side: starts ``python -m prfaas.engine.worker`` and talks to it. Use as a context manager."""

    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu") -> None:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, "-m", "prfaas.engine.worker", "--model", model,
                                      "--dtype", dtype, "--device", device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout
        ready = read_frame(self._out)
        if ready is None or "ready" not in ready:
            self.close()
            raise RuntimeError(f"decode worker for {model} failed to start (exit {self.proc.returncode})")
        self.fingerprint: dict[str, Any] = ready["ready"]

    def decode(self, blob: bytes, next_token: int, max_new_tokens: int) -> dict[str, Any]:
        from prfaas.errors import error_from_code

        write_frame(self._in, {"blob": blob, "next_token": next_token, "max_new_tokens": max_new_tokens})
        reply = read_frame(self._out)
        if reply is None:
            raise RuntimeError("decode worker exited")
        if "error" in reply:
            raise error_from_code(reply["error"]["code"], reply["error"]["message"])
        return dict(reply)

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    serve(args.model, args.dtype, sys.stdin.buffer, sys.stdout.buffer, args.device)


if __name__ == "__main__":
    main()

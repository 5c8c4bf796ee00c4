"""Coverage-guided fuzzing of the wire parsers with atheris (``make fuzz``): the KV blob reader, the data-plane
message decoder and the OpenAI request parser. Anything but a ``PrfaasError`` is a finding (atheris stops and
writes the input). Not collected by pytest (the file name does not start with ``test_``)."""

from __future__ import annotations

import json
import sys

import atheris  # type: ignore[import-not-found]

with atheris.instrument_imports():
    from prfaas.errors import PrfaasError
    from prfaas.kv.format import BlobReader
    from prfaas.services import openai_api
    from prfaas.transfer import protocol as p


def one_input(data: bytes) -> None:
    if not data:
        return
    target, rest = data[0] % 3, data[1:]
    try:
        if target == 0:
            BlobReader(max_bytes=1 << 20).feed(b"PRKV" + rest if len(rest) % 2 else rest)
        elif target == 1:
            p.decode(rest)
        else:
            try:
                body = json.loads(rest.decode("utf-8", "replace"))
            except ValueError:
                return
            openai_api.parse(body, chat=bool(len(rest) % 2))
    except PrfaasError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()

"""Where a benchmark's figures came from: the command, the date and the machine, recorded beside them.

Every script under benchmarks/ puts `provenance()` under the key "provenance" of the JSON it writes, so that
docs/benchmarks.md (`prfaas.bench.results`) can say for each figure how, when and on what it was measured.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import sys
from pathlib import Path

# The instruction-set extensions that decide CPU inference speed (bfloat16 natively or not, AMX tiles).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "asimd", "sve")


def cpu(cpuinfo: str) -> dict[str, object]:
    """CPU model and the ISA_FLAGS it has, from the text of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"cpu_model": fields.get("model name", platform.processor()),
            "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count()}


def provenance(argv: list[str] | None = None) -> dict[str, object]:
    """The command (default: this process's), the UTC time now and the machine, as one JSON-ready object."""
    info = Path("/proc/cpuinfo")
    machine = cpu(info.read_text() if info.exists() else "")
    machine |= {"kernel": platform.release(), "python": platform.python_version(), "load_average": os.getloadavg()}
    args = argv if argv is not None else [Path(sys.executable).name, *sys.argv]
    return {"command": shlex.join(args), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "machine": machine}

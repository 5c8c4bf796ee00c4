"""The router's pool weights across restarts (config ``pool_weights_file``).

``prfaas admin weight`` and ``prfaas admin rollout`` change weights in the router's memory. Without this file a
router restarted mid-upgrade would come back with the config's ``pools`` only: the canary's weight lost, and without
``pools`` the second fingerprint refused at registration (its instances stop). With it, every accepted change is
written (atomically: a temporary file, fsync, rename) before the router applies it, and a starting router layers
the file over the config's ``pools`` (the file is newer). A change that cannot be written is refused and not
applied; a file that cannot be read refuses the start, naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from prfaas.errors import InvalidRequest


def load(path: str) -> dict[str, float]:
    """The weights kept in ``path``; {} when no path is configured or nothing was kept yet."""
    if not path or not os.path.exists(path):
        return {}
    try:
        data = json.loads(Path(path).read_text())
        weights = data["weights"]
        if not isinstance(weights, dict):
            raise TypeError("weights is not a mapping")
        out = {str(k): float(v) for k, v in weights.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"pool_weights_file {path} cannot be read: {exc}; fix or remove it") from exc
    if any(w < 0 for w in out.values()):
        raise InvalidRequest(f"pool_weights_file {path}: every weight must be ≥ 0")
    return out


def save(path: str, weights: dict[str, float]) -> None:
    """Write ``weights`` to ``path`` so that a reader sees the old file or the new one, never half of one."""
    target = Path(path)
    part = target.with_name(f".{target.name}.part")
    try:
        with open(part, "w") as f:
            json.dump({"weights": weights}, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)  # a write that failed part-way leaves nothing behind

"""The acceptance matrix: which cells to run (prompt length × output length × concurrency × network condition),
how long each runs, the network conditions' parameters, and the acceptance criteria.

A matrix is a YAML file (``--matrix``); ``acceptance.yaml`` beside this module mirrors the source documents' table
and ``quick.yaml`` is the few-minute profile. Flags override the file's lists. Bad values raise ``InvalidRequest``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from prfaas.errors import InvalidRequest

CONDITIONS = ("normal", "delay", "loss", "cut")


@dataclass(frozen=True)
class Network:
    """Lab settings per condition: every cell runs on ``rate``; ``delay`` adds delay/jitter, ``loss`` adds loss,
    ``cut`` drops the WAN from ``cut_at_s`` for ``cut_s`` seconds of the cell, and again every ``cut_every_s``
    seconds after that when it is set (a long soak). ``delay_rate``, when set, is the rate of the delay cells only:
    the lab's user-space delayer cannot carry much more than 1 Gbit (CONTRACTS: keep delayed cells at most that)."""

    rate: str | None = "1gbit"
    delay_rate: str | None = None
    delay_ms: float = 10.0
    jitter_ms: float = 2.0
    loss: float = 0.01
    cut_at_s: float = 1.0
    cut_s: float = 2.0
    cut_every_s: float | None = None

    def __post_init__(self) -> None:
        if self.cut_every_s is not None and self.cut_every_s <= self.cut_s:
            raise InvalidRequest("network.cut_every_s must be longer than network.cut_s")


@dataclass(frozen=True)
class Acceptance:
    """Pass criteria per cell. TTFT: P50 and P99 at most the monolithic baseline's × (1 + ``ttft_overhead``);
    without a baseline, P99 at most ``ttft_p99_ms``."""

    ttft_overhead: float = 0.5
    ttft_p99_ms: float = 2000.0
    success_rate: float = 0.999
    transfer_success: float = 0.999
    retry_rate: float = 0.01
    degrade_rate: float = 0.01
    release_within_s: float = 60.0  # half the default TTL: a blob held longer risks expiring instead


@dataclass(frozen=True)
class Cell:
    input_len: int
    output_len: int
    concurrency: int
    network: str

    @property
    def key(self) -> str:
        return f"in{self.input_len}-out{self.output_len}-c{self.concurrency}-{self.network}"

    @property
    def load_key(self) -> str:
        """The cell without its network: what a baseline is matched on."""
        return f"in{self.input_len}-out{self.output_len}-c{self.concurrency}"


@dataclass(frozen=True)
class Matrix:
    input_lens: tuple[int, ...] = (1024,)
    output_lens: tuple[int, ...] = (64,)
    concurrency: tuple[int, ...] = (1,)
    networks: tuple[str, ...] = ("normal",)
    duration_s: float | None = 5.0
    requests: int | None = None
    request_timeout_s: float = 120.0
    vocab_low: int = 1000
    vocab_high: int = 20000
    network: Network = field(default_factory=Network)
    acceptance: Acceptance = field(default_factory=Acceptance)

    def __post_init__(self) -> None:
        bad = [n for n in self.networks if n not in CONDITIONS]
        if bad:
            raise InvalidRequest(f"unknown network conditions {bad}; known: {', '.join(CONDITIONS)}")
        if (self.duration_s is None) == (self.requests is None):
            raise InvalidRequest("a matrix needs exactly one of duration_s and requests")
        lengths = [*self.input_lens, *self.output_lens, *self.concurrency]
        if not lengths or min(lengths) < 1 or not self.networks:
            raise InvalidRequest("lengths and concurrency must be positive, and every list non-empty")

    def cells(self) -> list[Cell]:
        """Network outermost, so a condition is set once for all its cells."""
        return [Cell(i, o, c, n) for n, i, o, c in
                itertools.product(self.networks, self.input_lens, self.output_lens, self.concurrency)]

    def replace(self, **changes: Any) -> Matrix:
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_matrix(path: str | None = None, profile: str = "acceptance") -> Matrix:
    """Read ``path``, else the built-in profile (``acceptance`` or ``quick``)."""
    try:
        text = Path(path or Path(__file__).with_name(f"{profile}.yaml")).read_text()
        data = yaml.safe_load(text) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidRequest(f"cannot read matrix {path or profile}: {exc}") from exc
    return from_dict(data)


def from_dict(data: dict[str, Any]) -> Matrix:
    try:
        values = dict(data)
        values["network"] = Network(**(values.get("network") or {}))
        values["acceptance"] = Acceptance(**(values.get("acceptance") or {}))
        for key in ("input_lens", "output_lens", "concurrency", "networks"):
            if key in values:
                values[key] = tuple(values[key])
        if "requests" in values and "duration_s" not in values:
            values["duration_s"] = None
        return Matrix(**values)
    except TypeError as exc:
        raise InvalidRequest(f"matrix: {exc}") from exc

"""Regenerate docs/benchmarks.md from benchmarks/results/ (`make results`); `--check` exits 1 when it is stale."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prfaas.bench.results import render  # noqa: E402  (the repository root must be on the path first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    results = args.results.resolve()
    page = render(results, str(results.relative_to(ROOT)) if results.is_relative_to(ROOT) else str(results))
    if args.check:
        if not args.out.exists() or args.out.read_text() != page:
            print(f"{args.out} is stale: run `make results`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Nothing in prfaas deserialises with pickle, marshal, eval/exec or an unsafe YAML loader: every wire format is
msgpack, JSON or struct, and YAML is only ever ``yaml.safe_load``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "prfaas"
UNSAFE = re.compile(r"\bimport pickle\b|\bpickle\.|\bcPickle\b|\bdill\b|\bmarshal\.loads?\b|\bshelve\b|"
                    r"(?<![\w.])eval\(|(?<![\w.])exec\(|yaml\.load\(|yaml\.unsafe_load|yaml\.full_load|"
                    r"yaml\.Loader\b|torch\.load\(|numpy\.load\(.*allow_pickle=True|allow_pickle=True")


def test_no_unsafe_deserialisation_anywhere() -> None:
    hits = [f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}"
            for path in sorted(ROOT.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if UNSAFE.search(line)]
    assert not hits, "unsafe deserialisation:\n" + "\n".join(hits)


def test_the_grep_finds_what_it_should() -> None:
    for bad in ("import pickle", "x = pickle.loads(b)", "eval(s)", "yaml.load(f)", "torch.load(p)"):
        assert UNSAFE.search(bad), bad
    for fine in ("yaml.safe_load(f)", "self.evaluate(x)", "model.eval()", "json.loads(s)"):
        assert not UNSAFE.search(fine), fine

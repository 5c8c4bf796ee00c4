"""Every file the docs name exists: relative links and backticked repository paths in README.md and docs/*.md.

A moved or renamed module otherwise leaves the docs pointing at nothing, silently. Links resolve against the page's
own folder (as a Markdown viewer does); a backticked path such as `prfaas/kv/format.py` or `benchmarks/results/`
resolves against the repository root, as the docs write them; `prfaas/kv/format.py:BlobWriter.finish` must also
name a class, function or assignment defined there (docs/architecture.md cites code this way). Fenced code
blocks are left out: they hold commands and output, not references. The other way round, every page that a
docstring or comment in prfaas/ cites (`docs/x.md`, `NAME.md`) must exist too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A repository path in backticks: at least one slash, no spaces, and a file extension or a trailing slash.
CODE_PATH = re.compile(r"`((?:[\w.-]+/)+(?:[\w-]+(?:\.[\w]+)+)?)`")
CODE_NAME = re.compile(r"`((?:[\w.-]+/)+[\w-]+\.py):([\w.]+)`")
TOP = {p.name for p in ROOT.iterdir()}


def prose(page: Path) -> str:
    return FENCE.sub("", page.read_text())


def broken_links(page: Path) -> list[str]:
    targets = (t.split("#", 1)[0] for t in LINK.findall(prose(page)))
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")
            and not (page.parent / t).exists()]


def broken_paths(page: Path) -> list[str]:
    """Backticked paths under one of the repository's top-level entries that do not exist."""
    paths = (p for p in CODE_PATH.findall(prose(page)) if p.split("/", 1)[0] in TOP)
    return [p for p in paths if not (ROOT / p).exists()]


def defines(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The class, function or assignment called ``name`` in ``body``, if there is one."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
    return None


def defined(path: str, dotted: str) -> bool:
    """Whether the file at ``path`` defines ``dotted`` (``Class.method``: the method inside the class)."""
    file = ROOT / path
    if not file.exists():
        return False
    body = ast.parse(file.read_text()).body
    for part in dotted.split("."):
        node = defines(body, part)
        if node is None:
            return False
        body = getattr(node, "body", [])
    return True


def broken_names(page: Path) -> list[str]:
    """`file.py:Name.attr` references whose file is missing or does not define the dotted name."""
    return [f"{path}:{dotted}" for path, dotted in CODE_NAME.findall(prose(page)) if not defined(path, dotted)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_backticked_repository_path_exists(page: Path) -> None:
    assert broken_paths(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_function_is_defined_where_it_is_cited(page: Path) -> None:
    assert broken_names(page) == []


CODE_DOC = re.compile(r"(?<![\w/.-])(docs/[\w/-]+\.md|[A-Z][A-Z_-]*\.md)\b")


def missing_docs_cited_in_code() -> list[str]:
    """Pages that prfaas's own source cites (``docs/x.md``, ``NAME.md``) but the repository does not have."""
    return sorted({f"{path.relative_to(ROOT)}: {doc}" for path in (ROOT / "prfaas").rglob("*.py")
                   for doc in CODE_DOC.findall(path.read_text()) if not (ROOT / doc).exists()})


def test_every_page_the_code_cites_exists() -> None:
    assert missing_docs_cited_in_code() == []


def test_the_checks_see_what_they_claim_to(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](nothing.md) [web](https://example.com) `prfaas/no_such.py` "
                    "`prfaas/errors.py` `docs/` `/proc/cpuinfo` `prfaas/errors.py:PrfaasError.to_wire` "
                    "`prfaas/errors.py:PrfaasError.no_such` `prfaas/errors.py:nothing` `prfaas/gone.py:f`\n"
                    "```\n`prfaas/in_a_fence.py`\n```\n")
    assert broken_links(page) == ["nothing.md"]
    assert broken_paths(page) == ["prfaas/no_such.py"]
    assert broken_names(page) == ["prfaas/errors.py:PrfaasError.no_such", "prfaas/errors.py:nothing",
                                  "prfaas/gone.py:f"]

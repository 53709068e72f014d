"""Every document a docstring or comment cites is shipped, and every `docs/CONTRACTS.md §N` it cites is a section
there. Before (issue 25): 28 docstrings cited the internal spec (SPEC dot md), a file the repository does not hold."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from conftest import REPO

MD_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.md)\b")
SECTION = re.compile(r"docs/CONTRACTS\.md §(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?")
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", re.M)


def _python_files() -> list[Path]:
    files = [p for d in ("dspark", "tests", "scripts", "benchmarks") for p in (REPO / d).rglob("*.py")]
    return sorted(files + list(REPO.glob("*.py")))


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a Python file."""
    source = path.read_text()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def _citations() -> list[tuple[str, str]]:
    """(file:line, text) of every docstring / comment in the repo's Python files and config comments."""
    cited = [(f"{p.relative_to(REPO)}:{line}", text) for p in _python_files() for line, text in _prose(p)]
    for p in sorted((REPO / "configs").rglob("*.yaml")):
        cited += [(f"{p.relative_to(REPO)}:{i}", ln) for i, ln in enumerate(p.read_text().splitlines(), 1)
                  if ln.lstrip().startswith("#") or " # " in ln]
    return cited


def test_every_cited_markdown_file_is_in_the_repository():
    missing = [f"{where}: {name}" for where, text in _citations() for name in MD_PATH.findall(text)
               if not (REPO / name).is_file()]
    assert not missing, "cited but not shipped:\n" + "\n".join(missing)


def test_every_cited_contracts_section_exists():
    sections = set(HEADING.findall((REPO / "docs" / "CONTRACTS.md").read_text()))
    assert {"2", "2.1", "2.7", "2.8", "3", "7"} <= sections, sorted(sections)  # the heading pattern reads the file
    cited = [(where, s) for where, text in _citations() for m in SECTION.finditer(text) for s in m.groups() if s]
    assert cited, "no docstring cites a docs/CONTRACTS.md section"
    missing = [f"{where}: §{s}" for where, s in cited if s not in sections]
    assert not missing, "no such section in docs/CONTRACTS.md:\n" + "\n".join(missing)


def test_the_scanner_sees_docstrings_and_comments(tmp_path):
    """The helpers above find a citation in a docstring and in a comment, not in ordinary strings."""
    p = tmp_path / "m.py"
    p.write_text('"""See docs/a.md."""\nx = "docs/b.md"\n\n\ndef f():\n    """docs/c.md §2"""\n    return 1  # d.md\n')
    found = [name for _, text in _prose(p) for name in MD_PATH.findall(text)]
    assert sorted(found) == ["d.md", "docs/a.md", "docs/c.md"]

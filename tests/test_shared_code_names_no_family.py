"""Shared code reads what a family declares (its Config, its record, its serving adapter) and never names a family.

The modules below serve every family; each once branched on a family's kind or imported a family's module (issue 49
item 6). This test parses them and fails when one names a family in its code (docstrings aside, comments are not
code): imports a family's module (dspark/models/<family>.py, the serving module its record names) or a name defined
there, or holds a key-like string (no space, no `/`: not a message or a vLLM file path it cites) or an identifier
naming a family (its kind, a `<kind>_...` key, one of FAMILY_WORDS as a word).
"""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from dspark.models.registry import families

REPO = Path(__file__).resolve().parents[1]

SHARED = (
    "dspark/export/dflash_rules.py",
    "dspark/export/vocab.py",
    "dspark/training/flops.py",
    "dspark/targets/v41.py",
    "dspark/evaluation/compare.py",
    "dspark/evaluation/run_eval.py",
    "dspark/serving/tiny_dense.py",
)

# words that name a family (or its vLLM method / experiments) wherever they stand as a word of a string or name;
# the kinds themselves are added from the registry
# (targets' names such as deepseek_v41 / tiny_v41 are not a draft family's)
FAMILY_WORDS = {"xpress", "eagle3", "dflash2", "mtp", "hyv4", "dsv4"}
# words that are the project's or vLLM's name too ("dspark.eval", "dflash_config", a local `dflash` dict of vLLM's
# dflash_config): a family only as a whole string or a parameter (an experiment prefix, a flag choosing a family)
WHOLE_ONLY = {"dspark", "dflash"}
KEY_LIKE = re.compile(r"[^\s/]*")


def family_modules() -> set[str]:
    out = set()
    for record in families().values():
        out.add(record.draft.__module__)
        out.add(record.config.__module__)
        if record.serving:
            out.add(record.serving)
    return out


def family_words() -> set[str]:
    return FAMILY_WORDS | set(families())


def family_defined_names(modules: set[str]) -> set[str]:
    """Names a family module defines itself (its classes and functions), e.g. DSparkDenseConfig, hc_pre_delayed."""
    names = set()
    for mod in modules:
        for name, value in vars(importlib.import_module(mod)).items():
            if getattr(value, "__module__", None) == mod and not name.startswith("_"):
                names.add(name)
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _names_a_family(text: str, words: set[str], whole: bool = True) -> str | None:
    """The family word `text` holds as a word (delimited by anything but a letter or digit; `_` joins words, so
    `xpress_topc` holds xpress and `dspark_v4_tiny` holds dspark_v4), or (`whole`) the whole-only word it is."""
    if whole and text in WHOLE_ONLY:
        return text
    for word in words:
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", text):
            return word
    return None


def offences(source: str, modules: set[str], defined: set[str], words: set[str]) -> list[str]:
    """Where `source` names a family: 'line N: why' for each."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    out = []

    def family_module(name: str | None) -> bool:
        return bool(name) and any(name == m or name.startswith(m + ".") for m in modules)

    for node in ast.walk(tree):
        line = getattr(node, "lineno", "?")
        if isinstance(node, ast.Import):
            out += [f"line {line}: imports {a.name}" for a in node.names if family_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if family_module(node.module):
                out.append(f"line {line}: imports from {node.module}")
            out += [f"line {line}: imports {a.name}" for a in node.names
                    if a.name in defined or family_module(f"{node.module}.{a.name}")]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
              and KEY_LIKE.fullmatch(node.value)):
            word = _names_a_family(node.value, words)
            if word:
                out.append(f"line {line}: string {node.value[:60]!r} names {word}")
        else:
            ident = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                     else node.arg if isinstance(node, (ast.arg, ast.keyword)) else
                     node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None)
            if ident and (ident in defined or _names_a_family(ident, words, whole=isinstance(node, ast.arg))):
                out.append(f"line {line}: name {ident!r} names a family")
    return out


@pytest.fixture(scope="module")
def known():
    modules = family_modules()
    return modules, family_defined_names(modules), family_words()


@pytest.mark.parametrize("path", SHARED)
def test_shared_code_names_no_family(path, known):
    found = offences((REPO / path).read_text(), *known)
    assert not found, f"{path} names a family (read what the family declares instead): " + "; ".join(found)


@pytest.mark.parametrize("snippet, what", [
    ("from dspark.models.dspark_v41 import hc_collapse", "imports from dspark.models.dspark_v41"),
    ("from dspark.models import dspark_dense", "imports dspark_dense"),
    ("from dspark.models.dspark_dense import DSparkDenseConfig", "imports DSparkDenseConfig"),
    ("x = type(c) is DSparkDenseConfig", "name 'DSparkDenseConfig'"),
    ("ok = kind == 'dspark_v4'", "names dspark_v4"),
    ("ok = method == 'mtp'", "names mtp"),
    ("keys = ('xpress_topc',)", "names xpress"),
    ("name = f\"experiment={'dspark' if dspark else 'dflash'}_smollm2\"", "names dspark"),
    ("def newest_run(experiment='dspark_v4'): pass", "names dspark_v4"),
])
def test_the_check_finds_a_family_named(snippet, what, known):
    """Each way shared code once named a family is found (the check can fail)."""
    found = offences(snippet, *known)
    assert any(what in f for f in found), found


def test_the_check_passes_what_shared_code_may_say(known):
    """vLLM's keys and the project's own names are not a family's."""
    clean = ("import logging\nlog = logging.getLogger('dspark.eval')\nd = c.get('dflash_config') or {}\n"
             "k = 'eagle_aux_hidden_state_layer_ids'\nfrom dspark.models.contract import optional\n"
             "x = optional(cfg, 'FLOPS_COUNTED')\n")
    assert offences(clean, *known) == []

"""The import graph points one way: dspark/models/ (draft families, their inference path) imports nothing from the
layers built on it -- training/ and evaluation/ above all, nor export/, data/ or the entry-point modules. Checked by
parsing every import statement (function-local ones included), not by importing."""
from __future__ import annotations

import ast
from pathlib import Path

import dspark

PACKAGE = Path(dspark.__file__).resolve().parent
ABOVE_MODELS = ("dspark.training", "dspark.evaluation", "dspark.export", "dspark.data", "dspark.factory",
                "dspark.preflight", "dspark.pretrained")


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module an import statement of the file names (relative imports resolved against `package`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def test_models_import_nothing_from_training_or_evaluation():
    edges = sorted((str(path.relative_to(PACKAGE.parent)), module)
                   for path in (PACKAGE / "models").rglob("*.py")
                   for module in imported_modules(path, ".".join(path.relative_to(PACKAGE.parent).parts[:-1]))
                   if module.startswith(ABOVE_MODELS))
    assert not edges, f"dspark/models/ imports from the layers above it: {edges}"


def test_the_check_sees_function_local_and_relative_imports(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text("def g():\n    from dspark.evaluation.speculative import score\n    from ..training import blocks\n")
    assert {"dspark.evaluation.speculative", "dspark.training.blocks"} <= imported_modules(f, "dspark.models")

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


CONFIG_LIBRARIES = ("omegaconf", "hydra")  # Hydra's DictConfig is made plain above dspark/models/ (dspark.schema.plain)


def config_library_imports(folder: Path) -> list[tuple[str, str]]:
    """(file, module) for every import of a config library (OmegaConf, Hydra) under `folder`."""
    return sorted((str(path.relative_to(folder.parent)), module) for path in folder.rglob("*.py")
                  for module in imported_modules(path, "dspark.models")
                  if module.split(".")[0] in CONFIG_LIBRARIES)


def test_models_know_nothing_of_omegaconf():
    """dspark/models/ takes plain values (a draft group is a dict, a run's draft its family's Config): a DictConfig
    is converted above it, in dspark.schema / dspark.draft_resolve / dspark.factory (issue 49, item 1)."""
    found = config_library_imports(PACKAGE / "models")
    assert not found, f"dspark/models/ imports a config library: {found}"


def test_the_config_library_check_sees_an_import(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "probe.py").write_text("def g(x):\n    from omegaconf import OmegaConf\n    return x\n")
    assert config_library_imports(tmp_path / "models") == [("models/probe.py", "omegaconf"),
                                                           ("models/probe.py", "omegaconf.OmegaConf")]


def test_the_check_sees_function_local_and_relative_imports(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text("def g():\n    from dspark.evaluation.speculative import score\n    from ..training import blocks\n")
    assert {"dspark.evaluation.speculative", "dspark.training.blocks"} <= imported_modules(f, "dspark.models")


def module_graph() -> dict[str, set[str]]:
    """dspark module -> the dspark modules its import statements name (function-local ones included; `from a import
    b` counts as a.b when a.b is a module, else as a)."""
    files = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for module in imported_modules(path, package):
            while module and module not in files:
                module = module.rpartition(".")[0]
            if module and module != name and module != "dspark":
                deps.add(module)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    """No two dspark modules import each other, directly or around a circle (issue 36): a circle makes each of its
    modules unusable without all the others and hides which one owns what."""
    assert cycles(module_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# ---- every floor (docs/design.md, "The layers"): a module imports only its own floor and those below ---------------
FLOORS = (  # lowest first; a module belongs to the floor of its longest matching prefix
    ("ground", ("dspark.ops", "dspark.io", "dspark.integrity", "dspark.errors", "dspark.console", "dspark.cpu",
                "dspark.plotting")),
    ("families", ("dspark.models",)),
    ("targets", ("dspark.targets",)),
    ("data, config", ("dspark.data", "dspark.schema", "dspark.objective_keys", "dspark.draft_resolve")),
    # the client side of the vLLM worker (a process in vLLM's own venv) and the feature producer built on it: chosen
    # by the layer that plans a run's feature cache (dspark.training.cache_plan), never imported by data/
    ("vLLM client", ("dspark.serving.engine", "dspark.serving.vllm_target_view", "dspark.serving.vllm_features")),
    ("shared pieces", ("dspark.factory", "dspark.preflight", "dspark.cli")),
    ("the work", ("dspark.training", "dspark.evaluation", "dspark.export")),
    ("a run", ("dspark.training.run", "dspark.training.build", "dspark.evaluation.run_eval",
               "dspark.export.__main__")),
    ("serving", ("dspark.serving", "dspark.pretrained", "dspark.warm_start")),
    ("entry points", ("dspark.serve_check", "dspark.produce_features")),
)
# The imports that still run up a floor, each one side of a two-way dependency (issue 49, item 3). The list only
# shrinks: a new upward import fails below, and so does an entry here that no longer exists.
KNOWN_UPWARD = {
    ("dspark.training.run", "dspark.warm_start"),  # a run's draft.init_from reads a trained draft (pretrained)
}


def floor_of(module: str) -> int | None:
    best = None  # (floor, prefix length)
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, deps in graph.items() for b in deps
            if floor_of(a) is not None and floor_of(b) is not None and floor_of(b) > floor_of(a)}


def test_every_module_has_a_floor():
    assert sorted(m for m in module_graph() if m != "dspark" and floor_of(m) is None) == []


def test_no_import_runs_up_a_floor():
    up = upward_imports(module_graph())
    new = sorted(up - KNOWN_UPWARD)
    assert not new, "imports that run up a floor (docs/design.md, 'The layers'): " + ", ".join(
        f"{a} ({FLOORS[floor_of(a)][0]}) -> {b} ({FLOORS[floor_of(b)][0]})" for a, b in new)
    assert sorted(KNOWN_UPWARD - up) == [], "gone: remove them from KNOWN_UPWARD"


def test_the_floor_check_sees_an_upward_import():
    graph = {"dspark.models.x": {"dspark.ops.y", "dspark.training.z"}, "dspark.training.run": {"dspark.training.w"}}
    assert upward_imports(graph) == {("dspark.models.x", "dspark.training.z")}
    assert floor_of("dspark.training.run") > floor_of("dspark.training.objectives") > floor_of("dspark.schema")

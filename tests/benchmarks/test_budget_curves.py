"""benchmarks/budget_curves.py on hand-made run folders: the quarter rows, the ratio to DFlash, and the training compute
behind each quarter (the run's own FLOPs per step, else the given JSON's; none: no number)."""
from __future__ import annotations

import importlib.util
import json

from conftest import REPO


def _script():
    spec = importlib.util.spec_from_file_location("budget_curves", REPO / "benchmarks" / "budget_curves.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(root, name, steps, al_by_quarter, flops_per_step=None):
    run = root / name
    (run / "logs" / "version_0").mkdir(parents=True)
    (run / "logs" / "version_0" / "metrics.csv").write_text(
        "step,val/tau_prob,val/agree_0\n" + f"{steps - 1},1.5,0.25\n")
    throughput = {} if flops_per_step is None else {"flops_per_step": {"total": flops_per_step}}
    (run / "metrics.json").write_text(json.dumps({"global_step": steps, "throughput": throughput}))
    for quarter, al in al_by_quarter.items():
        reports = {b: {"mean_acceptance_length": al, "per_position_rate": [0.3, 0.1, 0.05],
                       "greedy_outputs_equal_target": None} for b in ("mt-bench", "gsm8k", "humaneval")}
        (run / f"eval_q{quarter}").mkdir()
        (run / f"eval_q{quarter}" / "summary.T0.g6.json").write_text(json.dumps({"reports": reports}))


def test_quarters_carry_their_training_compute(tmp_path):
    curves = _script()
    _run(tmp_path, "dflash", 400, {1: 1.2, 2: 1.5}, flops_per_step=2e9)
    _run(tmp_path, "eagle3", 800, {1: 1.8})  # no count of its own: the JSON's
    _run(tmp_path, "other", 400, {1: 1.3})  # neither: no compute column
    runs = curves.collect(tmp_path, {"eagle3": {"flops_per_step": 5e9}, "dflash": {"flops_per_step": 1.0}})
    tflop = {(name, e["quarter"]): e["train_tflop"] for name, r in runs.items() for e in r["evals"]}
    assert tflop[("dflash", 1)] == 100 * 2e9 / 1e12 and tflop[("dflash", 2)] == 200 * 2e9 / 1e12  # its own wins
    assert tflop[("eagle3", 1)] == 200 * 5e9 / 1e12 and tflop[("other", 1)] is None
    text = curves.markdown(runs)
    assert "| eagle3 | 1 | 1 | 1.800 / 1.800 / 1.800 | 1.800 | 1.500 |" in text  # 1.8 / DFlash's 1.2 at quarter 1
    assert "| other | 1 | - |" in text

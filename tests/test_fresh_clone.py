"""The README's path at tiny size, as a new user runs it: `python train.py experiment=dspark_v4 trainer.max_steps=...`
from the command line, `python eval.py run_dir=...` on the prompt sets shipped in the repository, then both notebooks
(executed with nbclient from notebooks/, as Jupyter starts them), finding the run by themselves."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, TINY_RUN

pytestmark = pytest.mark.slow  # two CLI runs + two notebook kernels: about a minute on 2 cores


def _cli(args: list[str], tmp_path) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSPARK_CACHE": os.environ["DSPARK_CACHE"]}
    r = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return out


def _execute(notebook: str, env: dict[str, str]) -> str:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(REPO / "notebooks" / notebook, as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this environment
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_train_eval_and_both_notebooks_from_the_command_line(tmp_path):
    runs = tmp_path / "runs"
    run = runs / "dspark_v4" / "20990101-000000"
    tiny = [o for o in TINY_RUN if not o.startswith(("trainer.max_steps", "trainer.enable_progress_bar"))]
    out = _cli(["train.py", "experiment=dspark_v4", "trainer.max_steps=5", *tiny, f"run_dir={run}"], tmp_path)
    assert json.loads((run / "metrics.json").read_text())["global_step"] == 5  # trainer.max_steps took effect
    for line in ("Seed set to 0", "`Trainer.fit` stopped: `max_steps=5` reached."):
        assert out.count(line) == 1, (line, out[-3000:])  # Hydra prints Lightning's lines, once
    assert "Training steps" in out and "5/5" in out  # steps done / max_steps
    assert "Epoch 0/-2" not in out and "v_num" not in out

    out = _cli(["eval.py", f"run_dir={run}", "num_prompts=1", "max_new_tokens=8", "plots=false", "sps_context=16"],
               tmp_path)
    summary = json.loads(next((run / "eval").glob("summary.*.json")).read_text())
    assert sorted(summary["reports"]) == ["gsm8k", "humaneval", "mt-bench"]  # the shipped sets, by default
    assert summary["reports"]["mt-bench"]["num_requests"] == 2  # both MT-Bench turns

    env = {"DSPARK_RUNS": str(runs), "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
    assert str(run) in _execute("training_curves.ipynb", env)  # found the newest dspark_v4 run by itself
    table = _execute("eval_reports.ipynb", env)
    assert "dspark_v4/20990101-000000" in table and "mt-bench" in table

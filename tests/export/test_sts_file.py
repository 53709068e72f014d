"""SGLang's DSpark confidence calibration file (dspark/export/sts.py, issue 38 item 4): what dspark writes from
eval.py's STS is what SGLang 0.5.23's own parser reads; a table for another gamma, non-positive temperatures and
missing keys are refused; every DSpark export of a run with an eval calibration writes it (`python -m dspark.export
dense` here).

SGLang's parser is its own file, sglang/srt/speculative/dspark_components/dspark_sts.py, unzipped alone from the
sglang==0.5.23 wheel into $DSPARK_SGLANG_SRC (default .cache/sglang-0.5.23-src) with msgspec, its one import besides
torch, installed: `bash scripts/fetch_sglang_src.sh` (CI runs it). Without them the tests that need it skip, saying
so, except under DSPARK_REQUIRE_VLLM=1 (.ci/run), where they fail. The file imports only torch and msgspec, so it is
loaded whole (no `ast` lifting as for vLLM's sources in test_vllm_source.py).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark.export.sts import STS_FILE, eval_calibration, read_sts, sts_from_confidence_report, validate_sts, write_sts

REPO = Path(__file__).resolve().parents[2]
SRC = Path(os.environ.get("DSPARK_SGLANG_SRC", REPO / ".cache" / "sglang-0.5.23-src"))  # scripts/fetch_sglang_src.sh
STS_PY = SRC / "sglang" / "srt" / "speculative" / "dspark_components" / "dspark_sts.py"


def sglang_sts():
    """SGLang 0.5.23's dspark_sts.py as a module; skips (fails under DSPARK_REQUIRE_VLLM=1) without it or msgspec."""
    why = None
    if not STS_PY.is_file():
        why = f"SGLang 0.5.23's dspark_sts.py not in {SRC}: run bash scripts/fetch_sglang_src.sh (or set " \
              "DSPARK_SGLANG_SRC)"
    elif importlib.util.find_spec("msgspec") is None:
        why = "msgspec (SGLang's STS parser's import) is not installed: run bash scripts/fetch_sglang_src.sh"
    if why is not None:
        if os.environ.get("DSPARK_REQUIRE_VLLM") == "1":
            pytest.fail(f"{why} (DSPARK_REQUIRE_VLLM=1: CI runs the SGLang parser checks, never skips them)")
        pytest.skip(why)
    name = "sglang_0_5_23_dspark_sts"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, STS_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # msgspec resolves the Struct's (string) annotations through its module
        spec.loader.exec_module(module)
    return sys.modules[name]


def confidence_report(g: int = 3, requests: int = 8, steps: int = 12, seed: int = 0) -> dict:
    """An eval confidence report as run_eval.py writes it ({**common, **analysis.confidence_report(...)}), from
    synthetic verify steps whose confidence logits predict acceptance (over-confidently: STS has work to do)."""
    from dspark.evaluation.analysis import confidence_report as analyse
    from dspark.evaluation.speculative import StepStats

    rng = np.random.default_rng(seed)
    per_request = []
    for _ in range(requests):
        rows = []
        for _ in range(steps):
            z = rng.normal(1.0, 2.0, g)
            accept = rng.random(g) < 1 / (1 + np.exp(-z / 3))  # true T = 3
            n = int(np.cumprod(accept).sum())
            rows.append(StepStats(anchor_pos=0, draft_tokens=[0] * g, num_accepted=n, next_token=0, conf=None,
                                  conf_logits=z.tolist()))
        per_request.append(rows)
    return {"gamma": g, "temperature": 0.0, "draft_weights": "/runs/r/draft/model.safetensors",
            **analyse([per_request], None)}


def write_eval(run: Path, report: dict, tag: str = "T0.g3") -> Path:
    (run / "eval").mkdir(parents=True, exist_ok=True)
    (run / "eval" / f"summary.{tag}.json").write_text(json.dumps({"engine": "dspark", "reports": {"mt-bench": {}}}))
    path = run / "eval" / f"confidence.{tag}.json"
    path.write_text(json.dumps(report))
    return path


def _calibration(g: int = 3) -> dict:
    return {"temperatures": [0.5, 1.0, 2.5][:g], "dataset": "unit", "num_samples": 40,
            "ece_before": [0.1, 0.2, 0.3][:g], "ece_after": [0.01, 0.02, 0.03][:g]}


# ---- SGLang 0.5.23's own parser ------------------------------------------------------------------------
def test_sglangs_schema_is_the_one_sts_py_cites():
    from dspark.export.sts import KEYS

    sg = sglang_sts()
    assert sg.DSparkStsCalibration.__struct_fields__ == KEYS
    only_temps = sg.DSparkStsCalibration(temperatures=[2.0])  # the others have defaults
    assert (only_temps.dataset, only_temps.num_samples, only_temps.ece_before, only_temps.ece_after) == ("", 0, [], [])
    lines = STS_PY.read_text().splitlines()  # the file:line citations of dspark/export/sts.py's docstring
    assert lines[8].startswith("class DSparkStsCalibration(msgspec.Struct, frozen=True, omit_defaults=True)")
    assert lines[9].strip() == "temperatures: list[float]" and lines[13].strip() == "ece_after: list[float] = []"
    assert lines[19].strip() == "if temperature <= 0:" and lines[33].startswith("def load_sts_calibration_from_path")


def test_written_file_is_read_by_sglangs_parser(tmp_path):
    sg = sglang_sts()
    report = confidence_report()
    cal = sts_from_confidence_report(report, dataset="dspark eval.py T0.g3 on mt-bench")
    path = write_sts(tmp_path / STS_FILE, cal, block_size=3)
    loaded = sg.load_sts_calibration_from_path(str(path))  # what --speculative-dspark-confidence-sts-path does
    assert isinstance(loaded, sg.DSparkStsCalibration)
    assert loaded.temperatures == report["calibration"]["temperatures"] and len(loaded.temperatures) == 3
    assert loaded.dataset == cal["dataset"] and loaded.num_samples == report["split"]["fit_blocks"] > 0
    assert loaded.ece_before == [p["ece_before"] for p in report["calibration"]["positions"]]
    assert loaded.ece_after == [p["ece_after"] for p in report["calibration"]["positions"]]
    assert sum(loaded.ece_after) < sum(loaded.ece_before)  # the fit calibrated something
    assert read_sts(path, 3) == {f: getattr(loaded, f) for f in sg.DSparkStsCalibration.__struct_fields__}
    # SGLang writes the same document for it (its own encoder, dspark_sts.py:26-27)
    assert json.loads(loaded.to_json()) == json.loads(path.read_text())


@pytest.mark.parametrize("edit", [
    {"temperatures": [1.0, 0.0, 2.0]}, {"temperatures": [1.0, -1.0, 2.0]}, {"temperatures": []},
    {"temperatures": [True, 1.0, 1.0]}, {"num_samples": 3.0}, {"ece_after": [0.1, None, 0.2]}, {"dataset": 7},
    "NaN", "Infinity"])
def test_what_sglang_refuses_is_refused(tmp_path, edit):
    """Every file SGLang's parser refuses, read_sts refuses too (it is stricter: gamma, missing keys, list lengths)."""
    sg = sglang_sts()
    if isinstance(edit, str):
        text = json.dumps(_calibration()).replace("0.5", edit, 1)  # a non-JSON constant for T_1
    else:
        text = json.dumps({**_calibration(), **edit})
    path = tmp_path / STS_FILE
    path.write_text(text)
    with pytest.raises(Exception):  # msgspec.ValidationError / DecodeError
        sg.load_sts_calibration_from_path(str(path))
    with pytest.raises(ValueError) as err:
        read_sts(path, 3)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


# ---- reading / writing ---------------------------------------------------------------------------------
def test_round_trip(tmp_path):
    cal = _calibration()
    path = write_sts(tmp_path / STS_FILE, cal, block_size=3)
    assert read_sts(path, 3) == cal == read_sts(path)
    assert json.loads(path.read_text()) == cal  # SGLang's five fields, nothing else


def test_another_gamma_is_refused(tmp_path):
    path = write_sts(tmp_path / STS_FILE, _calibration())
    with pytest.raises(ValueError, match=r"3 temperatures \(gamma 3\) but the draft's block_size is 4") as err:
        read_sts(path, 4)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="block_size is 2"):
        write_sts(tmp_path / "other.json", _calibration(), block_size=2)
    assert not (tmp_path / "other.json").exists()


@pytest.mark.parametrize("edit,match", [
    ({"temperatures": [0.5, 0.0, 2.5]}, "finite and > 0"), ({"temperatures": [0.5, -1.0, 2.5]}, "finite and > 0"),
    ({"ece_before": [0.1]}, "ece_before must be 3"), ({"num_samples": -1}, "num_samples"),
])
def test_bad_values_are_refused(edit, match):
    with pytest.raises(ValueError, match=match):
        validate_sts({**_calibration(), **edit}, 3)


@pytest.mark.parametrize("key", ["temperatures", "dataset", "num_samples", "ece_before", "ece_after"])
def test_missing_keys_are_refused(tmp_path, key):
    cal = _calibration()
    del cal[key]
    (tmp_path / STS_FILE).write_text(json.dumps(cal))
    with pytest.raises(ValueError, match=f"missing key {key} ") as err:
        read_sts(tmp_path / STS_FILE, 3)
    assert "\n" not in str(err.value)


def test_eval_calibration_picks_the_newest_report_at_the_drafts_gamma(tmp_path):
    run = tmp_path / "run"
    assert "has no eval confidence report" in eval_calibration(run, 3)
    old = write_eval(run, confidence_report(seed=1), tag="T1.g3")
    new = write_eval(run, confidence_report(seed=2), tag="T0.g3")
    os.utime(old, (1, 1))
    cal, path = eval_calibration(run, 3)
    assert path == new and cal["temperatures"] == json.loads(new.read_text())["calibration"]["temperatures"]
    assert cal["dataset"].startswith("dspark eval.py T0.g3 on mt-bench")
    why = eval_calibration(run, 4)  # both fitted at gamma 3
    assert isinstance(why, str) and "fitted at gamma 3, the draft's block_size is 4" in why and "eval.py" in why
    ckpt = {**confidence_report(g=4), "draft_weights": str(run / "checkpoints" / "last.ckpt")}
    write_eval(run, ckpt, tag="T0.g4")
    assert "not the run's draft/" in eval_calibration(run, 4)


# ---- python -m dspark.export: a tiny dense DSpark run ------------------------------------------------------
@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """A dense DSpark run (Markov + confidence head, block_size 3) against a tiny HF Llama target, as
    test_export_dense.py's CLI test builds it."""
    from conftest import tiny_dense_dspark_run

    _, _, draft, run = tiny_dense_dspark_run(tmp_path_factory.mktemp("sts_dense"))
    assert draft.confidence_head is not None
    return run


def test_dense_export_writes_the_sts_file_from_the_runs_eval(dense_run, tmp_path, capsys):
    from dspark.export.__main__ import main as export_main
    from dspark.export.verify import verify_folder
    from dspark.integrity import read_manifest

    # no eval yet: the export says how to get the calibration, and writes none
    out = tmp_path / "plain"
    assert export_main(["dense", "--run-dir", str(dense_run), "--out", str(out), "--dtype", "float32"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    hint = next(ln for ln in lines if "--speculative-dspark-confidence-sts-path" in ln)
    assert hint.startswith("SGLang STS calibration (--speculative-dspark-confidence-sts-path) not written: ")
    assert f"python eval.py run_dir={dense_run}" in hint and "confidence=true" in hint
    assert not (out / STS_FILE).exists() and lines[-2].startswith("OK ") and lines[-1].startswith("next: vllm serve")

    report = confidence_report()
    report["draft_weights"] = str(dense_run / "draft" / "model.safetensors")
    write_eval(dense_run, report)
    try:
        out = tmp_path / "calibrated"
        assert export_main(["dense", "--run-dir", str(dense_run), "--out", str(out), "--dtype", "float32"]) == 0
    finally:
        for f in (dense_run / "eval").iterdir():
            f.unlink()
    lines = capsys.readouterr().out.strip().splitlines()
    sts = out / STS_FILE
    assert any(ln.startswith(f"wrote {sts}: the confidence head's STS temperatures [") for ln in lines), lines
    assert lines[-2].startswith("OK ") and lines[-1].startswith("next: vllm serve <target>")
    assert lines[-1].endswith(f"; SGLang reads the confidence calibration with "
                              f"--speculative-dspark-confidence-sts-path {sts}")
    cal = read_sts(sts, 3)
    assert cal["temperatures"] == report["calibration"]["temperatures"]
    assert cal["num_samples"] == report["split"]["fit_blocks"]
    assert STS_FILE in read_manifest(out) and verify_folder(out).ok  # sealed with the export

"""The DSpark confidence head's STS calibration as SGLang 0.5.23 reads it (`--speculative-dspark-confidence-sts-path`),
written from eval.py's calibration (dspark/evaluation/calibration.py, RUN/eval/confidence.<tag>.json) and checked
on read. Every `python -m dspark.export` of a draft with a confidence head calls `export_sts` once (__main__.py).

SGLang 0.5.23's schema and use (file:line in the sglang==0.5.23 wheel; scripts/fetch_sglang_src.sh unzips the first):
  sglang/srt/speculative/dspark_components/dspark_sts.py
    :9-14   `DSparkStsCalibration(msgspec.Struct, frozen=True, omit_defaults=True)`: temperatures: list[float]
            (required), dataset: str = "", num_samples: int = 0, ece_before: list[float] = [],
            ece_after: list[float] = []. No gamma / block-size field: gamma is len(temperatures).
    :16-24  validation: at least one temperature, every temperature > 0 (ValueError otherwise).
    :30-36  `load_sts_calibration_from_path`: msgspec.json.decode(..., type=DSparkStsCalibration): strict JSON (no
            NaN / Infinity), typed (an int for num_samples, no bools, no nulls; ints are accepted as floats),
            unknown keys ignored.
  sglang/srt/speculative/dspark_components/dspark_planner.py
    :92-114 read only when the draft has a confidence head (otherwise a warning, :120-127); refused (ValueError)
            when len(temperatures) != the runtime gamma (:107-112); else installed as the head's sts_temperatures.
  sglang/srt/speculative/dspark_components/dspark_config.py
    :295-297 the draft's gamma is its config's dspark_block_size (V4 / V4.1) or block_size (dense, dflash_config);
    :101-116 `--speculative-num-draft-tokens` (= gamma + 1), when given, overrides it (so the served gamma must be
            the draft's block_size for a table fitted at that block size).
  sglang/srt/models/dspark.py
    :461-462 `apply_sts`: conf_k = sigmoid(logit_k / T_k), per position k (temperatures [gamma] broadcast over
            [batch, gamma] confidence logits, :481-482); the scheduler takes survival = cumprod_k conf_k
            (dspark_planner.py:1025).
  sglang/benchmark/dspark_sts_fit.py
    :48-110 SGLang's own fit: position by position, T_k minimising the ECE of cumprod sigmoid(logit_j / T_j) against
            the accepted-prefix mask, earlier positions fixed: the same Sequential Temperature Scaling as
            dspark.evaluation.calibration.fit_sequential_temperature_scaling (dspark's grid: 81 values in
            [0.05, 20]; SGLang's: 41 in [0.1, 10]);
    :164-171 the file it writes: dataset = the data glob, num_samples = the number of fitted blocks, ece_before /
            ece_after per position (on the fitted blocks).
  sglang/srt/arg_groups/fields/spec.py:90-97 the flag `--speculative-dspark-confidence-sts-path`.

What dspark writes (`sts_from_confidence_report`): temperatures = the eval's fitted T_k (fit on half the requests),
num_samples = the blocks they were fitted on, ece_before / ece_after = the per-position ECE of the survival on the
held-out half (T = 1 / fitted T; SGLang's fit reports them on its fit data), dataset = which eval (benchmarks, tag,
report file). Reading (`read_sts`) is stricter than SGLang: all five keys must be present, the ECE lists must
have one value per position, and len(temperatures) must equal the draft's block_size (SGLang refuses that at
server start, after the model has loaded).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dspark.errors import UserError
from dspark.integrity import MANIFEST_NAME, digest_file
from dspark.io import atomic_write_bytes, atomic_write_json
from dspark.models.contract import optional
from dspark.training.draft_dir import DRAFT_DIR, WEIGHTS_FILE

STS_FILE = "dspark_sts.json"  # SGLang takes any path; this name sits in the export folder
SGLANG_FLAG = "--speculative-dspark-confidence-sts-path"
KEYS = ("temperatures", "dataset", "num_samples", "ece_before", "ece_after")  # dspark_sts.py:10-14
_EVAL_HINT = "run `python eval.py run_dir={run}` (confidence=true, the default; at least 2 requests), then export again"


def _strict_json(text: str, where: str) -> Any:
    """JSON as msgspec decodes it: NaN / Infinity are not JSON (dspark_sts.py:31 would refuse them)."""
    def refuse(const: str):
        raise UserError(f"{where}: {const} is not JSON (SGLang's parser refuses it)")

    try:
        return json.loads(text, parse_constant=refuse)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: not JSON ({err})") from None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_sts(data: Any, block_size: int | None, where: str = "STS calibration") -> dict:
    """The calibration dict when SGLang 0.5.23 would load it for a draft of `block_size` drafts per block (None: any);
    UserError (a ValueError), one line naming `where`, otherwise. Unknown keys are ignored, as SGLang does."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object with {', '.join(KEYS)}, got {type(data).__name__}")
    missing = [k for k in KEYS if k not in data]
    if missing:
        raise UserError(f"{where}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)} (a "
                        f"DSparkStsCalibration has {', '.join(KEYS)})")
    temps = data["temperatures"]
    if not isinstance(temps, list) or not temps:
        raise UserError(f"{where}: temperatures must be a non-empty list of numbers > 0, got {temps!r}")
    if not all(_is_number(t) and math.isfinite(t) and t > 0 for t in temps):
        raise UserError(f"{where}: temperatures must all be finite and > 0, got {temps}")
    gamma = len(temps)
    if block_size is not None and gamma != int(block_size):
        raise UserError(f"{where}: {gamma} temperatures (gamma {gamma}) but the draft's block_size is {block_size}; "
                        f"SGLang refuses a table fitted for another gamma: re-run eval.py at gamma {block_size}")
    if not isinstance(data["dataset"], str):
        raise UserError(f"{where}: dataset must be a string, got {data['dataset']!r}")
    n = data["num_samples"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise UserError(f"{where}: num_samples must be an integer >= 0, got {n!r}")
    for key in ("ece_before", "ece_after"):
        v = data[key]
        if not isinstance(v, list) or len(v) != gamma or not all(_is_number(e) and math.isfinite(e) for e in v):
            raise UserError(f"{where}: {key} must be {gamma} finite numbers (one per position), got {v!r}")
    return {"temperatures": [float(t) for t in temps], "dataset": data["dataset"], "num_samples": int(n),
            "ece_before": [float(e) for e in data["ece_before"]], "ece_after": [float(e) for e in data["ece_after"]]}


def sts_json(calibration: dict, block_size: int | None = None) -> str:
    """The file's text: exactly SGLang's five fields, validated first (`validate_sts`)."""
    return json.dumps(validate_sts(calibration, block_size), indent=2, allow_nan=False) + "\n"


def write_sts(path: Path, calibration: dict, block_size: int | None = None) -> Path:
    """Writes `calibration` (the five keys) to `path` atomically, after `validate_sts`."""
    atomic_write_bytes(Path(path), sts_json(calibration, block_size).encode())
    return Path(path)


def read_sts(path: Path, block_size: int | None = None) -> dict:
    """A calibration file, checked as `validate_sts` (the draft's block_size when given)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    return validate_sts(_strict_json(path.read_text(encoding="utf-8"), str(path)), block_size, str(path))


# ---- from eval.py's report ----------------------------------------------------------------------------
def sts_from_confidence_report(report: dict, dataset: str = "") -> dict:
    """The calibration (five keys) of an eval confidence report (confidence.<tag>.json: run_eval.py writes
    analysis.confidence_report); KeyError / TypeError when it has no STS."""
    cal = report["calibration"]
    positions = sorted(cal["positions"], key=lambda p: p["k"])
    return {"temperatures": [float(t) for t in cal["temperatures"]], "dataset": dataset,
            "num_samples": int(report["split"]["fit_blocks"]),
            "ece_before": [float(p["ece_before"]) for p in positions],
            "ece_after": [float(p["ece_after"]) for p in positions]}


def _of_run_draft(report: dict) -> bool:
    """Whether the report evaluated the run's final draft (draft/model.safetensors), not a training checkpoint."""
    w = report.get("draft_weights")
    return w is None or Path(str(w)).parts[-2:] == (DRAFT_DIR, WEIGHTS_FILE)


def eval_calibration(run_dir: Path, block_size: int) -> tuple[dict, Path] | str:
    """(calibration, report path) from the newest eval confidence report under RUN/eval/ that has STS for the run's
    draft at gamma = block_size; otherwise why not (one line, saying how to get one)."""
    run_dir = Path(run_dir)
    hint = _EVAL_HINT.format(run=run_dir)
    reports = sorted((run_dir / "eval").glob("confidence.*.json"), key=lambda p: (p.stat().st_mtime, p.name),
                     reverse=True)
    skipped: list[str] = []
    for path in reports:
        try:
            report = json.loads(path.read_text())
            calibration = sts_from_confidence_report(report)
        except (OSError, ValueError, KeyError, TypeError):
            skipped.append(f"{path.name} holds no STS")
            continue
        if not _of_run_draft(report):
            skipped.append(f"{path.name} evaluated {report['draft_weights']}, not the run's draft/")
            continue
        if len(calibration["temperatures"]) != block_size:
            skipped.append(f"{path.name} was fitted at gamma {len(calibration['temperatures'])}, the draft's "
                           f"block_size is {block_size} (eval.py without num_drafts= uses it)")
            continue
        summary = path.with_name(path.name.replace("confidence.", "summary.", 1))
        try:
            benchmarks = ",".join(json.loads(summary.read_text())["reports"])
        except (OSError, ValueError, KeyError, TypeError):
            benchmarks = "?"
        tag = path.name.removeprefix("confidence.").removesuffix(".json")
        calibration["dataset"] = f"dspark eval.py {tag} on {benchmarks} ({path})"
        try:
            validate_sts(calibration, block_size, str(path))
        except UserError as err:
            skipped.append(str(err))
            continue
        return calibration, path
    if not reports:
        return f"{run_dir}/eval has no eval confidence report; {hint}"
    return f"no usable eval calibration in {run_dir}/eval ({'; '.join(skipped)}); {hint}"


def _add_to_manifest(folder: Path, name: str) -> None:
    """Lists one more file in the folder's checksum manifest (dspark.integrity), hashing that file only (a merged
    target checkpoint is not re-hashed); a folder without a manifest is left without one."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return
    manifest = json.loads(path.read_text())
    manifest["files"][name] = digest_file(Path(folder) / name)
    atomic_write_json(path, manifest)


def export_sts(run_dir: Path, out: Path, draft) -> tuple[Path | None, str | None]:
    """The export hook: for a draft with a confidence head, writes OUT/dspark_sts.json from the run's newest eval
    calibration (and lists it in OUT's manifest). -> (the file or None, the line to print; None for a draft without a
    confidence head)."""
    if optional(draft, "confidence_head") is None:
        return None, None
    cfg = draft.config
    block_size = int(getattr(cfg, type(cfg).DRAFTS_KEY))
    found = eval_calibration(Path(run_dir), block_size)
    if isinstance(found, str):
        return None, f"SGLang STS calibration ({SGLANG_FLAG}) not written: {found}"
    calibration, report = found
    path = write_sts(Path(out) / STS_FILE, calibration, block_size)
    _add_to_manifest(Path(out), STS_FILE)
    temps = ", ".join(f"{t:.3g}" for t in calibration["temperatures"])
    return path, f"wrote {path}: the confidence head's STS temperatures [{temps}] from {report}"


__all__ = ["KEYS", "SGLANG_FLAG", "STS_FILE", "eval_calibration", "export_sts", "read_sts",
           "sts_from_confidence_report", "sts_json", "validate_sts", "write_sts"]

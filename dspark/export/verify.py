"""`python -m dspark.export verify PATH`: an exported folder against what vLLM 0.33.0 loads from it.

The folder's format is found by asking each serving adapter (dspark.export.adapter) whether the folder holds it
(`read`); the adapter derives, from the folder's own config alone, the tensor set vLLM loads (names, shapes, dtypes:
`expected`) and vLLM's serving rules (`serving_problems`, each with its vLLM 0.33.0 file:line; docs/verification.md maps
every rule to the test that breaks it). The expected set never comes from a draft or from the exporter's name map, so
this check of an export stays independent of how it was written. Tensors are read from the safetensors headers only
(no tensor data). A folder written with `dspark_not_for_vllm` (CLI --not-for-vllm, or a speculators config with a head
vLLM does not have) gets the serving rules as notes, not problems. Besides the layout, the folder must match its
checksum manifest: one without a manifest (an export killed before it was sealed, a hand-made folder) is not OK.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dspark.errors import IntegrityError
from dspark.export._io import stale_staging
from dspark.export.adapter import NOT_FOR_VLLM, adapter_for_folder
from dspark.export.dflash_rules import missing_confidence_lines
from dspark.export.mtp import CONFIG_NAME, mtp_formats
from dspark.integrity import MANIFEST_NAME, check_manifest, unlisted_files
from dspark.io import TMP_SUFFIX

_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "I64": 8, "BOOL": 1}


@dataclass
class Report:
    kind: str
    n_tensors: int = 0
    n_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # serving rules of a dspark_not_for_vllm folder, advisories

    @property
    def ok(self) -> bool:
        return not self.problems


def _headers(folder: Path) -> tuple[dict[str, tuple[tuple[int, ...], str]], list[str]]:
    """{name: (shape, safetensors dtype)} from the file headers, plus index problems."""
    problems: list[str] = []
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, ["model.safetensors"]
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for fname in files:
        path = folder / fname
        if not path.is_file():
            problems.append(f"missing file: {fname}")
            continue
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in found:
                problems.append(f"duplicate tensor: {name} (also in another shard)")
            found[name] = (tuple(info["shape"]), info["dtype"])
            if weight_map is not None and weight_map.get(name) != fname:
                problems.append(f"index: {name} is in {fname} but the index says {weight_map.get(name)}")
    if weight_map is not None:
        for name in sorted(set(weight_map) - set(found)):
            problems.append(f"index: {name} listed in {weight_map[name]} but not stored there")
    return found, problems


def verify_folder(path) -> Report:
    """The folder's layout against its config (names, shapes, dtypes, serving rules), plus its checksum manifest."""
    folder = Path(path)
    if not folder.is_dir():
        return Report("missing", problems=[_missing_folder(folder)])
    report = _verify_layout(folder)
    report.problems += _integrity_problems(folder)
    report.notes += _stale_tmp_notes(folder)
    return report


def _missing_folder(folder: Path) -> str:
    staged = stale_staging(folder)
    if staged:
        return (f"{folder}: no such folder; {staged[0].name} beside it is an unfinished export (its process is gone, "
                "e.g. killed): re-run the export (it removes the leftover)")
    return f"{folder}: no such folder"


def _integrity_problems(folder: Path) -> list[str]:
    """A dspark-written folder must match its manifest and hold nothing unlisted. The manifest is written last, so a
    folder without one is an unfinished export (killed before it was sealed) or one dspark did not write (by hand, an
    older dspark, a released checkpoint): never OK on its layout alone; `python -m dspark.integrity seal` records the
    checksums of one the user trusts."""
    try:
        if not check_manifest(folder, required=False, hint="re-export it", since="export"):
            return [f"integrity: no {MANIFEST_NAME}: an unfinished export (killed before it was sealed) or a folder "
                    "dspark did not write; re-export it, or if you trust it, "
                    f"`python -m dspark.integrity seal {folder}`"]
    except IntegrityError as err:
        return [f"integrity: {err}"]
    return [f"integrity: {name} is not in {MANIFEST_NAME} (added after the export?)" for name in unlisted_files(folder)]


def _stale_tmp_notes(folder: Path) -> list[str]:
    """Temp files of interrupted atomic writes (dspark.io) inside the folder: vLLM reads none of them."""
    return [f"{p.relative_to(folder)}: temp file of an interrupted write (not part of the export, vLLM does not read "
            "it); delete it" for p in sorted(folder.rglob(f".*{TMP_SUFFIX}")) if p.is_file()]


def _unknown(folder: Path) -> Report:
    """A folder no adapter claims: say what it holds instead."""
    if (folder / CONFIG_NAME).is_file():
        fmt = json.loads((folder / CONFIG_NAME).read_text()).get("dspark_format")
        return Report(str(fmt), problems=[f"{CONFIG_NAME}: dspark_format {fmt!r} is not one of {mtp_formats()}"])
    if not (folder / "config.json").is_file():
        return Report("unknown", problems=[f"{folder}: no dspark_config.json or config.json"])
    arch = (json.loads((folder / "config.json").read_text()).get("architectures") or [None])[0]
    return Report(str(arch), problems=[f"config.json: unknown architecture {arch!r} (no serving adapter reads it)"])


def _verify_layout(folder: Path) -> Report:
    try:
        found_adapter = adapter_for_folder(folder)
        if found_adapter is None:
            return _unknown(folder)
        adapter, config = found_adapter
        expected, optional = adapter.expected(config)
    except (ValueError, TypeError, KeyError) as err:
        return Report("config", problems=[str(err)])
    found, problems = _headers(folder)
    found = {k: v for k, v in found.items() if adapter.is_draft_tensor(config, k)}
    report = Report(adapter.label(config), n_tensors=len(found), problems=problems)
    serving = [f"serving: {line}" for line in adapter.serving_problems(config)]
    (report.notes if config.get(NOT_FOR_VLLM) else report.problems).extend(serving)
    report.notes += adapter.notes(config)
    present_optional = {k: v for k, v in optional.items() if k in found and k not in expected}
    report = _compare(report, {**expected, **present_optional}, found)
    report.problems += missing_confidence_lines(adapter.confidence_034, expected, found)  # 0.34.0: a random head
    if "d2t" in found and not report.problems:  # names and shapes right: the reduced-vocabulary map's values
        report.problems += _vocab_map_problems(folder, config)
    return report


def _vocab_map_problems(folder: Path, config: dict) -> list[str]:
    """A reduced vocabulary's d2t (vLLM: target id = draft id + d2t[draft id]) must map the Vd draft ids to strictly
    increasing target ids in [0, vocab_size); t2d, where shipped, must mark exactly those ids."""
    import torch
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    tensors = {}
    for fname in files:
        with safe_open(str(folder / fname), framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in ("d2t", "t2d") if k in fh.keys()})
    v = int(config.get("vocab_size") or 0)
    ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v or not bool((ids[1:] > ids[:-1]).all())):
        return [f"d2t: draft id + d2t must be strictly increasing target ids in [0, vocab_size={v}); got range "
                f"[{int(ids.min())}, {int(ids.max())}]{'' if bool((ids[1:] > ids[:-1]).all()) else ', not increasing'}"]
    if "t2d" in tensors:
        mark = torch.zeros(v, dtype=torch.bool)
        mark[ids] = True
        if not torch.equal(mark, tensors["t2d"].bool()):
            return ["t2d: does not mark exactly the target ids d2t maps to (the two maps disagree)"]
    return []


def _compare(report: Report, expected: dict, found: dict) -> Report:
    """Missing / unexpected / shape / dtype problems of `found` against `expected` (both {name: (shape, dtype)})."""
    for name in sorted(set(expected) - set(found)):
        report.problems.append(f"missing: {name} {list(expected[name][0])} {expected[name][1]}")
    for name in sorted(set(found) - set(expected)):
        report.problems.append(f"unexpected: {name} {list(found[name][0])} {found[name][1]} (no draft parameter)")
    for name in sorted(set(found) & set(expected)):
        (fs, fd), (es, ed) = found[name], expected[name]
        if fs != es:
            report.problems.append(f"shape: {name} is {list(fs)}, expected {list(es)}")
        if fd != ed:
            report.problems.append(f"dtype: {name} is {fd}, expected {ed}")
    report.n_bytes = sum(_SIZES.get(d, 0) * _numel(s) for s, d in found.values())
    return report


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main_verify(path) -> int:
    report = verify_folder(path)
    if report.ok:
        print(f"OK {path}: {report.kind}, {report.n_tensors} tensors, {report.n_bytes / 2**20:.1f} MiB, "
              "names/shapes/dtypes and the vLLM 0.33.0 serving rules match the config")
    else:
        print(f"FAILED {path}: {report.kind}, {len(report.problems)} problem(s)")
        for line in report.problems:
            print(f"  {line}")
    for line in report.notes:
        print(f"  note: {line}")
    return 0 if report.ok else 1

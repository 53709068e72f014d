"""Every DSpark export path writes `enable_confidence_head` exactly when it writes the confidence head's tensors.

vLLM 0.33.0 dropped a confidence head the checkpoint had no weights for; 0.34.0 keeps it randomly initialised and ranks
the draft slots of adaptive verification by it (each format's adapter's confidence_034, docs/serving.md). So the
flag, as vLLM reads it (dense: default false; DeepSeek-V4 / V4.1: default true), must be on <=> confidence_head.*
tensors are in the folder; the exporters write the key explicitly. A folder mutated to the flag on without the tensors
fails `python -m dspark.export verify`, citing the 0.34.0 file:line of its layout; flag off with the tensors fails too.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, reseal
from dspark.export.adapter import primary_adapter
from dspark.export.verify import _headers, verify_folder
from test_export import _dense_cfg, _randomise, _v4_draft
from test_export_dense import _reduced
from test_export_quant import _v4_draft as _v4_quant_draft
from test_export_v41 import _draft as _v41_draft, _tiny_target_draft as _v41_target_draft


def _dense(markov_rank: int, confidence_head: bool = True, seed: int = 0):
    from dataclasses import replace

    from dspark.models.dspark_dense import DSparkDenseDraft

    draft = DSparkDenseDraft(replace(_dense_cfg(markov_rank), confidence_head=confidence_head))
    _randomise(draft, seed)
    g = torch.Generator().manual_seed(100)
    draft.share_target_weights(torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g))
    return draft


def _v4_merged(tmp: Path) -> Path:
    from transformers import AutoConfig

    from dspark.export.dspark_v4 import merge_v4_into_target
    from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    cfg = DSparkV4Config.from_target_config(AutoConfig.from_pretrained(TINY_V4_DIR), num_layers=2, block_size=4,
                                            mask_token_id=4, target_layer_ids=[1, 2], markov_rank=8)
    draft = DSparkV4Draft(cfg)
    _randomise(draft, 9)
    target = tmp / "target"
    shutil.copytree(TINY_V4_DIR, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "enable_confidence_head": False}))  # a stale flag
    return merge_v4_into_target(draft, target, tmp / "out", dtype=torch.float32)


def _export(path: str, tmp: Path) -> tuple[Path, str, str, bool]:
    """(folder, config file, kind, does vLLM's flag default to on) of one export path."""
    from dspark.export.dense import export_dense
    from dspark.export.dspark_v4 import export_v4_sidecar
    from dspark.export.dspark_v41 import export_v41_sidecar, merge_v41_into_target

    out = tmp / "out"
    if path == "dense_dspark":
        return export_dense(_dense(6), out), "config.json", "dspark_dense", False
    if path == "dense_dspark_no_head":
        return export_dense(_dense(6, confidence_head=False), out), "config.json", "dspark_dense", False
    if path == "dense_dflash":
        return export_dense(_dense(0), out), "config.json", "dspark_dense", False
    if path == "dense_reduced_vocab":
        return export_dense(_reduced()[1], out), "config.json", "dspark_dense", False
    if path == "speculators_dspark":
        return export_dense(_dense(6), out, fmt="speculators", verifier="t"), "config.json", "dspark_dense", False
    if path == "speculators_dspark_no_head":
        return (export_dense(_dense(6, confidence_head=False), out, fmt="speculators", verifier="t"), "config.json",
                "dspark_dense", False)
    if path == "speculators_dflash":
        return export_dense(_dense(0), out, fmt="speculators", verifier="t"), "config.json", "dspark_dense", False
    if path == "v4_sidecar":
        return export_v4_sidecar(_v4_draft(), out), "dspark_config.json", "dspark_v4", True
    if path == "v4_sidecar_fp8":
        return export_v4_sidecar(_v4_quant_draft(1), out, quant="fp8"), "dspark_config.json", "dspark_v4", True
    if path == "v4_merged":
        return _v4_merged(tmp), "config.json", "dspark_v4", True
    if path == "v41_sidecar":
        return export_v41_sidecar(_v41_draft(), out), "dspark_config.json", "dspark_v41", True
    if path == "v41_merged":
        draft, target_dir = _v41_target_draft()
        return merge_v41_into_target(draft, target_dir, out, dtype=torch.float32), "config.json", "dspark_v41", True
    raise AssertionError(path)


PATHS = ["dense_dspark", "dense_dspark_no_head", "dense_dflash", "dense_reduced_vocab", "speculators_dspark",
         "speculators_dspark_no_head", "speculators_dflash", "v4_sidecar", "v4_sidecar_fp8", "v4_merged", "v41_sidecar",
         "v41_merged"]


def _confidence_names(folder: Path) -> list[str]:
    return sorted(n for n in _headers(folder)[0] if "confidence_head." in n)


def _set_flag(folder: Path, config_name: str, value) -> None:
    path = folder / config_name
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "enable_confidence_head": value}))
    reseal(folder)


def _drop_confidence(folder: Path) -> None:
    """The folder without its confidence_head.* tensors (only the shards holding them are rewritten: a merged
    export's other shards may be hard links to the target's files)."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    for fname in files:
        tensors = load_file(str(folder / fname))
        kept = {k: t for k, t in tensors.items() if "confidence_head." not in k}
        if len(kept) != len(tensors):
            (folder / fname).unlink()
            save_file(kept, str(folder / fname), metadata={"format": "pt"})
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if "confidence_head." not in k}
        index.write_text(json.dumps(data))
    reseal(folder)


def _verify_cli_in_process(folder: Path, capsys) -> tuple[int, str]:
    from dspark.export.__main__ import main

    status = main(["verify", str(folder)])
    return status, capsys.readouterr().out


@pytest.mark.parametrize("path", PATHS)
def test_the_flag_is_written_exactly_with_the_head(tmp_path, path, capsys):
    folder, config_name, kind, default_on = _export(path, tmp_path)
    assert verify_folder(folder).ok, verify_folder(folder).problems
    written = json.loads((folder / config_name).read_text())
    if written.get("speculators_model_type"):  # what vLLM reads: the translation (dense.translate_speculators)
        from dspark.export.dense import read_dense_config

        written = read_dense_config(folder)
    is_dflash = kind == "dspark_dense" and not written.get("markov_rank")  # DFlashDraftModel: no head at all
    assert is_dflash or "enable_confidence_head" in written, f"{path}: the flag is left to vLLM's default"
    names = _confidence_names(folder)
    flag = written.get("enable_confidence_head", default_on)  # as vLLM reads it
    assert flag is bool(names), (path, flag, names)
    if names:  # flag on, tensors gone: what vLLM 0.34.0 would serve with a random head
        _drop_confidence(folder)
        status, out = _verify_cli_in_process(folder, capsys)
        assert status == 1 and "enable_confidence_head is on but the folder has no" in out, out
        assert primary_adapter(kind).confidence_034.split(" of 0.34.0")[0] in out and "vLLM 0.34.0 serves the randomly" in out, out
        _set_flag(folder, config_name, False)  # flag off without tensors: what the exporters write for no head
        assert verify_folder(folder).ok, verify_folder(folder).problems
    else:  # tensors without the flag are not loaded (no parameter); the flag without tensors is the 0.34 hazard
        _set_flag(folder, config_name, True)
        report = verify_folder(folder)
        if is_dflash:
            assert report.ok  # DFlash: vLLM's DFlashDraftModel builds no confidence head whatever the flag
        else:
            assert any(p.startswith("serving: enable_confidence_head is on") for p in report.problems), report.problems


def test_python_m_dspark_export_verify_cites_the_034_line(tmp_path):
    """The command itself (a subprocess), on a V4 sidecar whose head was removed."""
    from dspark.export.dspark_v4 import export_v4_sidecar

    folder = export_v4_sidecar(_v4_draft(), tmp_path / "v4")
    _drop_confidence(folder)
    proc = subprocess.run([sys.executable, "-m", "dspark.export", "verify", str(folder)], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "vllm/models/deepseek_v4/nvidia/dspark.py:175-180 of 0.34.0" in proc.stdout, proc.stdout
    assert "missing: mtp.2.confidence_head.proj.weight" in proc.stdout

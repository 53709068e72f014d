"""The export folder is written whole or not at all (dspark.export._io.sealed): a folder that already holds files is
refused unless --overwrite, which replaces it whole; a kill -9 mid-export leaves the old folder as it was, and
`verify` says what a folder without its manifest is. Before (issue 25): a second export into a folder kept the old
config.json / tokenizer / README beside the new tensors, its manifest sealed them all and verify said OK; a folder
without a manifest verified OK."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, compose, wait_until
from dspark import factory
from dspark.errors import UserError
from dspark.export.__main__ import main as export_main
from dspark.export.dspark_v4 import export_v4_sidecar, merge_v4_into_target
from dspark.export.verify import main_verify, verify_folder
from dspark.integrity import MANIFEST_NAME, read_manifest
from dspark.targets.tiny_v4 import TINY_V4_DIR

SIDECAR = ["dspark_config.json", MANIFEST_NAME, "model.safetensors"]


@pytest.fixture(scope="module")
def v4_run(tmp_path_factory):
    """A training run's draft/ folder for the embedded tiny_v4 target (what train.py leaves), and its draft."""
    from dspark.training.run import export_draft

    cfg = compose(["experiment=dspark_v4", "draft.num_layers=2"])
    draft = factory.build_draft(cfg.draft, factory.build_target(cfg.target, cfg.draft))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01)
    run = tmp_path_factory.mktemp("export_folder") / "run"
    export_draft(draft, cfg.draft, cfg.target, run / "draft")
    return run, draft


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith(".tmp"))


def test_cli_refuses_a_folder_holding_an_export_before_loading_then_overwrite_replaces_it(v4_run, tmp_path, capsys,
                                                                                          monkeypatch):
    run, draft = v4_run
    out = tmp_path / "out"
    merge_v4_into_target(draft, TINY_V4_DIR, out)  # a merged export: config.json, tokenizer, README, target shards
    before = _snapshot(out)
    assert {"config.json", "tokenizer.json", "README.md", "model.safetensors.index.json"} <= set(before)

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the folder was refused")

    with monkeypatch.context() as m:
        m.setattr(factory, "build_target", refuse)
        with pytest.raises(SystemExit) as exit_info:
            export_main(["v4", "--run-dir", str(run), "--out", str(out), "--dtype", "float32"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m dspark.export: error: {out}: the folder already holds "
                                               "files") and "--overwrite" in err[0], err
    assert _snapshot(out) == before  # untouched

    assert export_main(["v4", "--run-dir", str(run), "--out", str(out), "--dtype", "float32", "--overwrite"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-2].startswith(f"OK {out}")
    assert _listing(out) == SIDECAR  # nothing of the merged export survives
    assert sorted(read_manifest(out)) == [n for n in SIDECAR if n != MANIFEST_NAME]
    assert verify_folder(out).ok and _leftovers(tmp_path) == []


@pytest.mark.parametrize("first", ["merged", "sidecar"])
def test_overwrite_replaces_the_folder_whole(v4_run, tmp_path, first):
    _, draft = v4_run
    out = tmp_path / "out"
    if first == "merged":
        merge_v4_into_target(draft, TINY_V4_DIR, out)
    else:
        export_v4_sidecar(draft, out)
    (out / "notes").mkdir()
    (out / "notes" / "README.md").write_text("the user's own notes\n")
    with pytest.raises(UserError, match=rf"^{out}: the folder already holds files .*--overwrite"):
        (export_v4_sidecar(draft, out) if first == "merged" else merge_v4_into_target(draft, TINY_V4_DIR, out))
    if first == "merged":
        export_v4_sidecar(draft, out, overwrite=True)
        want = SIDECAR
    else:
        merge_v4_into_target(draft, TINY_V4_DIR, out, overwrite=True)
        want = sorted([*(p.name for p in TINY_V4_DIR.iterdir() if p.is_file()), MANIFEST_NAME,
                       "model-dspark-mtp.safetensors", "model.safetensors.index.json"])
    assert _listing(out) == want
    assert sorted(read_manifest(out)) == [n for n in want if n != MANIFEST_NAME]
    assert verify_folder(out).ok and _leftovers(tmp_path) == []


def test_a_merge_never_replaces_its_own_target(v4_run, tmp_path):
    _, draft = v4_run
    target = tmp_path / "target"
    shutil.copytree(TINY_V4_DIR, target)
    before = _snapshot(target)
    with pytest.raises(UserError, match="must differ from the target checkpoint"):
        merge_v4_into_target(draft, target, target, overwrite=True)
    with pytest.raises(UserError, match="replacing it would delete the target"):
        merge_v4_into_target(draft, target, tmp_path, overwrite=True)  # the target lies inside the folder
    assert _snapshot(target) == before


def test_a_new_or_empty_folder_needs_no_overwrite_and_stale_temp_files_do_not_count(v4_run, tmp_path):
    _, draft = v4_run
    empty = tmp_path / "empty"
    empty.mkdir()
    export_v4_sidecar(draft, empty)
    assert _listing(empty) == SIDECAR and oct(empty.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
    killed = tmp_path / "killed"  # an older export killed mid-write left only a temp file
    killed.mkdir()
    (killed / ".model.safetensors.abc123.tmp").write_bytes(b"\0" * 100)
    export_v4_sidecar(draft, killed)
    assert _listing(killed) == SIDECAR and verify_folder(killed).ok
    export_v4_sidecar(draft, tmp_path / "new" / "deeper")
    assert _listing(tmp_path / "new" / "deeper") == SIDECAR


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_verify_says_an_export_without_its_manifest_is_unfinished_or_hand_made(v4_run, tmp_path, capsys):
    _, draft = v4_run
    out = export_v4_sidecar(draft, tmp_path / "out")
    (out / MANIFEST_NAME).unlink()
    (out / ".model.safetensors.x1y2.tmp").write_bytes(b"\0" * 10)
    assert main_verify(out) == 1
    text = capsys.readouterr().out
    assert text.startswith(f"FAILED {out}") and f"integrity: no {MANIFEST_NAME}: an unfinished export" in text, text
    assert "note: .model.safetensors.x1y2.tmp: temp file of an interrupted write" in text, text
    assert main_verify(tmp_path / "nothing") == 1 and "nothing: no such folder" in capsys.readouterr().out


# ---- kill -9 during an export, at a moment chosen from what it has done --------------------------------
# The child blocks at the chosen moment and says so in a marker file; the test kills it only once the marker is
# there (the 600 s limit is a safety net, never the trigger).
_CHILD = r"""
import os, pathlib, sys, time
import dspark.integrity
from test_export import _v4_draft
from dspark.export.dspark_v4 import export_v4_sidecar

out, marker, moment, overwrite = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"

def reached(what):
    marker.write_text(what)
    while True:  # the test kills us here
        time.sleep(1)

if moment == "tensor_write":  # model.safetensors fully in its temp file, not yet renamed
    real_replace = os.replace
    def replace(src, dst, *a, **k):
        if pathlib.Path(dst).name == "model.safetensors":
            reached(str(src))
        return real_replace(src, dst, *a, **k)
    os.replace = replace
else:  # every file written, the manifest not yet
    dspark.integrity.write_manifest = lambda folder, names=None: reached(str(folder))
export_v4_sidecar(_v4_draft(), out, overwrite=overwrite)
"""


@pytest.mark.parametrize("moment,old_export", [("tensor_write", False), ("before_manifest", True)])
def test_kill_9_during_an_export_leaves_the_folder_as_it_was(tmp_path, moment, old_export):
    from test_export import _v4_draft

    out, marker = tmp_path / "out", tmp_path / "reached"
    if old_export:
        export_v4_sidecar(_v4_draft(seed=7), out)
        before = _snapshot(out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), str(REPO / "tests" / "export")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(out), str(marker), moment, "1" if old_export else "0"],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(proc, f"the export reached {moment}", marker.is_file, lambda: proc.stderr.read())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    staged = [p for p in tmp_path.iterdir() if p.name.startswith(".out.export-") and p.name.endswith(".tmp")]
    assert len(staged) == 1 and staged[0].is_dir(), _listing(tmp_path)
    held = _listing(staged[0])
    if moment == "tensor_write":  # the tensor file is still its temp file
        assert len(held) == 1 and held[0].startswith(".model.safetensors.") and held[0].endswith(".tmp"), held
    else:
        assert held == ["dspark_config.json", "model.safetensors"], held

    if old_export:  # the old export is whole: same files, its manifest still matches
        assert _snapshot(out) == before and verify_folder(out).ok
    else:
        report = verify_folder(out)
        assert not report.ok and report.problems == [
            f"{out}: no such folder; {staged[0].name} beside it is an unfinished export (its process is gone, e.g. "
            "killed): re-run the export (it removes the leftover)"]
    report = verify_folder(staged[0])  # the unfinished folder itself: never OK without its manifest
    assert not report.ok and any(p.startswith(f"integrity: no {MANIFEST_NAME}: an unfinished export")
                                 for p in report.problems), report.problems
    if moment == "tensor_write":
        assert any("temp file of an interrupted write" in n for n in report.notes), report.notes

    export_v4_sidecar(_v4_draft(seed=8), out, overwrite=old_export)  # the next export removes the leftover
    assert _leftovers(tmp_path) == [] and _listing(out) == SIDECAR and verify_folder(out).ok
    assert json.loads((out / "dspark_config.json").read_text())["dspark_format"] == "deepseek_v4_mtp"

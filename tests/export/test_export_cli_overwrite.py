"""`python -m dspark.export <format> --overwrite` replaces a folder that already holds an export, for every format the
CLI writes (the base adapter's run_cli passes --overwrite on to every family's writer), and a used folder is refused
without it. Before (issue 51 item 2): `v41` dropped the flag, so the CLI's own folder check let the folder through and
the sealed writer then refused it ("already holds files ... pass --overwrite")."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import compose, tiny_dense_dspark_run
from dspark import factory
from dspark.export.__main__ import main as export_main
from dspark.export.adapter import claimants, cli_commands
from dspark.integrity import MANIFEST_NAME

# one tiny run per `python -m dspark.export` command (None: conftest's tiny dense DSpark run); a command missing here
# fails test_every_export_command_is_covered, so a new adapter's CLI gets this test too
EXPERIMENTS = {"dense": None, "dflash2": "dflash2_tiny", "xpress": "xpress_tiny", "eagle3": "eagle3_tiny",
               "v4": "dspark_v4", "v41": "dspark_v41", "mtp": "dsv4_mtp"}


def _run(root: Path, experiment: str | None) -> Path:
    """RUN/draft/ as train.py leaves it (target.json with the target's fingerprint), for a tiny target."""
    from dspark.training.run import export_draft

    if experiment is None:
        return tiny_dense_dspark_run(root)[3]
    cfg = compose([f"experiment={experiment}"])
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01)
    export_draft(draft, cfg.draft, cfg.target, root / "run" / "draft", target.fingerprint())
    return root / "run"


def test_every_export_command_is_covered():
    assert sorted(cli_commands()) == sorted(EXPERIMENTS)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("cmd", sorted(EXPERIMENTS))
def test_overwrite_replaces_a_used_folder_for_every_format(tmp_path, cmd, capsys, monkeypatch):
    """Every command (the base adapter's plumbing, issue 49 item 5): the export ends with the next-step line and
    carries exactly one format's marker; a used OUT is refused in one line before any model loads, and left as it
    was; with --overwrite it is replaced whole."""
    run = _run(tmp_path, EXPERIMENTS[cmd])
    out = tmp_path / "out"
    args = [cmd, "--run-dir", str(run), "--out", str(out), "--dtype", "float32", "--no-verify"]
    assert export_main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert f"wrote {out}" in lines and lines[-1].startswith("next: ") and "--speculative-config" in lines[-1]
    assert [cls.cli for cls, _ in claimants(out)] == [cmd]
    (out / "stale.txt").write_text("from an earlier export")
    used = _snapshot(out)

    with monkeypatch.context() as m:
        m.setattr(factory, "build_target", lambda *a, **k: pytest.fail("a model loaded before OUT was refused"))
        with pytest.raises(SystemExit) as refused:
            export_main(args)
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(err.splitlines()) == 1, err
    assert "already holds files" in err and "--overwrite" in err
    assert _snapshot(out) == used

    assert export_main(args + ["--overwrite"]) == 0, capsys.readouterr().err
    assert not (out / "stale.txt").exists()  # replaced whole
    assert (out / MANIFEST_NAME).is_file()

"""The export plumbing every adapter shares lives in the base adapter (issue 49 item 5), and a folder's format is found
by an exclusive marker per format.

Before: each family's adapter repeated its CLI plumbing (out folder, --overwrite, --dtype, quant report, next-step line)
in its own run_cli, and they drifted: V4.1's dropped `overwrite=` and never printed the quant report of `--quant`.
Detection took the first adapter whose `read` accepted a folder, so DeepSeek-V4's had to know V4.1's formats to leave
them alone. Now a family declares its writer (`cli_writer`) and the base adapter hands it every shared option the
command offers (a writer without one fails instead of dropping it); each format declares `markers`, and a folder the
markers of two formats claim is refused in one line. --overwrite for every command: test_export_cli_overwrite.py."""
from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark.export import adapter as ad
from dspark.export.__main__ import main as export_main
from dspark.export.dense import DSPARK_ARCH, DenseAdapter
from dspark.export.marker import Marker
from dspark.export.verify import verify_folder
from dspark.integrity import read_manifest
from test_export_cli_overwrite import EXPERIMENTS, _run


def _parser(cls: type[ad.ServingAdapter], name: str) -> argparse.ArgumentParser:
    """The subcommand as `python -m dspark.export` builds it."""
    return cls.add_cli_parser(argparse.ArgumentParser().add_subparsers(), name)


def _args(cls, name: str, *extra: str) -> argparse.Namespace:
    args = _parser(cls, name).parse_args(["--run-dir", "RUN", "--out", "OUT", *extra])
    args.cmd = name
    return args


def _offers(cls, name: str) -> set[str]:
    return {a.dest for a in _parser(cls, name)._actions}


# ---- the shared options reach every family's writer -----------------------------------------------------------
# every command as a sidecar export, and merged into the target where the command offers --merge-into
WRITER_CASES = [(cmd, merged) for cmd in sorted(ad.cli_commands()) for merged in (False, True)
                if not merged or "merge_into" in _offers(ad.cli_commands()[cmd], cmd)]


@pytest.mark.parametrize("cmd,merged", WRITER_CASES)
def test_every_writer_takes_every_shared_option_its_command_offers(cmd, merged):
    """No family can drop an option again: for every command (sidecar and --merge-into where offered), its draft hook
    reads only the options the command has, and the writer its adapter picks takes draft, out_dir, dtype and, where
    the command offers them, --not-for-vllm / --quant / --merge-into; the sealed writers all take overwrite."""
    cls = ad.cli_commands()[cmd]
    offers = _offers(cls, cmd)
    args = _args(cls, cmd, *(["--merge-into", "TARGET"] if merged else []))
    target = SimpleNamespace(layers=[None] * 3, tokenizer=None)
    assert cls.cli_draft(target, "DRAFT", args) == "DRAFT"  # the command's defaults write the run's draft
    writer, own = cls.cli_writer(target, "DRAFT", args)
    takes = set(inspect.signature(writer).parameters)
    wanted = {"draft", "out_dir", "dtype"} | {arg for arg, opt in ad._OFFERED.items() if opt in offers}
    if not merged:
        wanted -= {"target_dir"}
    assert wanted <= takes, f"{cmd}: {writer.__name__} drops {sorted(wanted - takes)}"
    assert "overwrite" in inspect.signature(writer, follow_wrapped=False).parameters  # @sealed: written whole
    assert not set(own) & {"draft", "out_dir", "dtype", "overwrite", "for_vllm", "quant", "target_dir"}


class _Recorder(ad.ServingAdapter):
    """A format whose writer records what it is called with (no model: a unit test of run_cli)."""

    kind, cli, format, what = "recorder_kind", "recorder", "recorder-format", "recorder"
    calls: list = []

    @classmethod
    def add_cli_args(cls, p) -> None:
        ad.add_not_for_vllm(p)
        p.add_argument("--quant", choices=("fp8",), default=None)
        p.add_argument("--knob", type=int, default=7)

    @classmethod
    def cli_writer(cls, target, draft, args):
        def write(draft, out_dir, dtype, max_shard_bytes, for_vllm, quant, knob, overwrite=False):
            cls.calls.append(("write", dict(draft=draft, out_dir=out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes,
                                            for_vllm=for_vllm, quant=quant, knob=knob, overwrite=overwrite)))
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / "config.json").write_text("{}")

        return write, {"knob": args.knob}

    @classmethod
    def report_quant(cls, draft, out: Path) -> None:
        cls.calls.append(("report", out))
        (out / "quant_report.json").write_text("{}")


def test_run_cli_hands_the_shared_options_to_the_writer_and_reports_quant(tmp_path):
    _Recorder.calls = []
    args = _args(_Recorder, "recorder", "--dtype", "float16", "--max-shard-gb", "0.5", "--not-for-vllm", "--overwrite",
                 "--quant", "fp8", "--knob", "3")
    args.out = tmp_path / "out"
    _Recorder.run_cli(None, "DRAFT", args)
    (what, got), report = _Recorder.calls
    assert what == "write" and got == dict(draft="DRAFT", out_dir=tmp_path / "out", dtype=torch.float16,
                                           max_shard_bytes=2**29, for_vllm=False, quant="fp8", knob=3, overwrite=True)
    assert report == ("report", tmp_path / "out")
    assert "quant_report.json" in read_manifest(tmp_path / "out")  # the report joins the sealed files

    _Recorder.calls = []
    args = _args(_Recorder, "recorder")
    args.out = tmp_path / "plain"
    _Recorder.run_cli(None, "DRAFT", args)
    assert [c[0] for c in _Recorder.calls] == ["write"]  # no --quant: no report
    assert _Recorder.calls[0][1]["for_vllm"] is True and _Recorder.calls[0][1]["overwrite"] is False
    assert _Recorder.calls[0][1]["dtype"] is torch.bfloat16


def test_a_writer_without_an_offered_option_fails_instead_of_dropping_it(tmp_path):
    class Forgetful(_Recorder):
        @classmethod
        def cli_writer(cls, target, draft, args):
            def write(draft, out_dir, dtype, overwrite=False):  # takes no for_vllm / quant
                raise AssertionError("not reached")

            return write, {}

    args = _args(Forgetful, "forgetful")
    args.out = tmp_path / "out"
    with pytest.raises(TypeError, match="takes no argument for --not-for-vllm, --quant"):
        Forgetful.run_cli(None, "DRAFT", args)


# ---- the quant report and the next-step line, through the command line -----------------------------------------
QUANT_COMMANDS = sorted(cmd for cmd, cls in ad.cli_commands().items() if "quant" in _offers(cls, cmd))


def test_the_quant_commands_are_the_deepseek_ones():
    assert QUANT_COMMANDS == ["v4", "v41"]  # a new --quant command is tested below by this list


@pytest.mark.parametrize("cmd", QUANT_COMMANDS)
def test_every_quant_command_prints_and_seals_its_quant_report(tmp_path, cmd, capsys):
    """--quant: the base adapter prints the family's quant report and seals it with the folder (V4.1 skipped both)."""
    run = _run(tmp_path, EXPERIMENTS[cmd])
    out = tmp_path / "out"
    assert export_main([cmd, "--run-dir", str(run), "--out", str(out), "--quant", "fp8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads((out / "quant_report.json").read_text())
    assert report["quant"] == "fp8" and report["tensors"] and "logits" in report  # the re-import was compared
    assert any(line.startswith(f"fp8: {len(report['tensors'])} quantised tensors") for line in lines), lines
    assert "quant_report.json" in read_manifest(out) and verify_folder(out).ok
    assert lines[-1].startswith("next: ")


# ---- detection: one exclusive marker per format ------------------------------------------------------------------
def _marked_folder(root: Path, marker: Marker) -> Path:
    """A folder holding only what `marker` asks for."""
    folder = root / f"{marker.file}-{marker.key}-{marker.values[0]}".replace("/", "_")
    folder.mkdir()
    value = [marker.values[0]] if marker.key == "architectures" else marker.values[0]
    (folder / marker.file).write_text(json.dumps({marker.key: value, **{k: 1 for k in marker.with_keys}}))
    return folder


OWNED = [(cls, marker) for cls in ad.format_owners() for marker in cls.markers]


def test_every_registered_format_declares_markers():
    owners = ad.format_owners()
    formats = [cls.format for cls in owners]
    assert len(formats) == len(set(formats))
    assert {cls.kind for cls in owners} == {cls.kind for cls in ad.adapters()}  # every family's formats are found
    assert all(isinstance(m, Marker) for _, m in OWNED)


@pytest.mark.parametrize("owner,marker", OWNED, ids=[f"{c.__name__}:{m}" for c, m in OWNED])
def test_each_marker_claims_its_folder_alone(tmp_path, owner, marker):
    """A folder carrying one format's marker is claimed by that format only (V4 no longer excludes V4.1 by name:
    their markers simply differ)."""
    assert ad.claimants(_marked_folder(tmp_path, marker)) == [(owner, marker)]


def test_v4_and_v41_folders_are_told_apart_by_their_own_markers(tmp_path):
    from dspark.export.dspark_v4 import V4DSparkAdapter
    from dspark.export.dspark_v41 import V41DSparkAdapter

    for fmt, owner in (("deepseek_v4_mtp", V4DSparkAdapter), ("deepseek_v41_mtp", V41DSparkAdapter)):
        sidecar = tmp_path / fmt
        sidecar.mkdir()
        (sidecar / "dspark_config.json").write_text(json.dumps({"dspark_format": fmt, "dspark_block_size": 4}))
        assert [cls for cls, _ in ad.claimants(sidecar)] == [owner]
    for model_type, owner in (("deepseek_v4", V4DSparkAdapter), ("deepseek_v41", V41DSparkAdapter)):
        merged = tmp_path / model_type
        merged.mkdir()
        (merged / "config.json").write_text(json.dumps({"model_type": model_type, "dspark_block_size": 4}))
        assert [cls for cls, _ in ad.claimants(merged)] == [owner]
    plain = tmp_path / "plain_v4_target"  # a V4 target without the dspark keys: no draft format
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    assert ad.adapter_for_folder(plain) is None


def test_a_folder_two_formats_claim_is_refused_in_one_line(tmp_path):
    class Clash(ad.ServingAdapter):
        kind, cli, format, what = "clash_kind", "clash", "clash-format", "clash"
        markers = (Marker("config.json", "architectures", (DSPARK_ARCH,)),)

    folder = tmp_path / "dense_like"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [DSPARK_ARCH]}))
    assert ad.adapter_for_folder(folder)[0].__class__ is DenseAdapter
    with ad.temporary_adapter(Clash):
        with pytest.raises(ad.AmbiguousFolderError) as err:
            ad.adapter_for_folder(folder)
        message = str(err.value)
        assert "\n" not in message and f"vllm: {DenseAdapter.markers[0]};" in message
        assert "clash-format: config.json architectures='Qwen3DSparkModel')" in message
        report = verify_folder(folder)  # the verifier reports it as the folder's one layout problem
        assert not report.ok and report.problems[0] == message
    assert ad.adapter_for_folder(folder)[0].__class__ is DenseAdapter


def test_an_adapter_that_inherits_its_markers_writes_its_parents_format(tmp_path):
    """A test family's adapter on DenseAdapter (tests/test_toy_family.py) declares no markers: its folders are the
    dense format's, found as DenseAdapter's, not claimed twice."""
    class Inheriting(DenseAdapter):
        kind, cli, what = "inheriting_kind", "inheriting", "inheriting"

    folder = tmp_path / "dense"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": [DSPARK_ARCH]}))
    with ad.temporary_adapter(Inheriting):
        assert Inheriting not in ad.format_owners() and Inheriting.read(folder) is not None
        assert type(ad.adapter_for_folder(folder)[0]) is DenseAdapter


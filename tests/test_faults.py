"""Faults and bad input, tried as a user would against the default tiny run: damaged files are refused naming
the file, a killed run resumes onto the same result, a second run cannot share a run_dir, bad configs fail
before any model loads (docs/verification.md, "Faults and bad input")."""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_RUN, compose, wait_until, compose_eval as _eval_cfg
from dspark import factory
from dspark.errors import ConfigError, IntegrityError, RunDirBusy
from dspark.integrity import check_file, sidecar_path
from dspark.training import draft_dir
from dspark.training.run import run_training
from dspark.training.run_dir import LOCK_NAME, RunLock

# a limit on a stuck subprocess only: no test here decides when to act (or passes) by the machine's speed
SAFETY_NET_S = 600.0


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # one flipped byte in the middle of the payload: same size, other content
        data[len(data) * 2 // 3] ^= 0x40
        path.write_bytes(bytes(data))


# a checksum cannot tell a truncation from an edit: any difference is "changed since ..." with both sizes
EXPECTED = {"truncate": r"changed since it was written \(\d+ bytes now, \d+ recorded\)",
            "flip": r"changed since it was written \((\d+) bytes now, \1 recorded; sha256"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("faults") / "run"
    run_training(compose(TINY_RUN + [f"run_dir={run}"]))
    return run


@pytest.fixture
def run_copy(finished_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(finished_run, dst)
    return dst


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fails the test if anything tries to load the target model (bad input must be refused before)."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(factory, "load_hf_target", refuse)


# ---- checkpoints ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_checkpoint_is_refused_before_loading_naming_it(run_copy, how, no_model_loads):
    ckpt = run_copy / "checkpoints" / "last.ckpt"
    _damage(ckpt, how)
    with pytest.raises(IntegrityError, match=rf"last\.ckpt: {EXPECTED[how]}.*resume=<path"):
        run_training(compose(TINY_RUN + [f"run_dir={run_copy}", "resume=last"]))


def test_every_checkpoint_carries_a_valid_checksum(finished_run):
    ckpts = sorted((finished_run / "checkpoints").glob("*.ckpt"))
    names = sorted(p.name for p in ckpts)  # last + the newest step (top_k 1) + the best by val/tau_prob
    assert len(ckpts) == 3 and names[0].startswith("best-step") and names[1] == "last.ckpt", names
    assert names[2].startswith("step")
    for p in ckpts:
        check_file(p, hint="-")
        assert sidecar_path(p).is_file()
    # a rotated-out step checkpoint takes its checksum file with it
    assert sorted(p.name for p in (finished_run / "checkpoints").iterdir() if p.name.endswith(".sha256.json")) == \
        sorted(p.name + ".sha256.json" for p in ckpts)


def test_a_pickle_payload_checkpoint_never_runs(run_copy, monkeypatch, tmp_path):
    """Even with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1: unsealed it is refused by its (missing) checksum; sealed by a
    careless user it still only unpickles with weights_only=True, which refuses code."""
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    ckpt = run_copy / "checkpoints" / "last.ckpt"
    torch.save({"state_dict": {}, "x": Payload()}, ckpt)
    sidecar_path(ckpt).unlink()
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(IntegrityError, match="no checksum file"):
        run_training(compose(TINY_RUN + [f"run_dir={run_copy}", "resume=last"]))
    from dspark.integrity import main as integrity_main

    assert integrity_main(["seal", str(ckpt)]) == 0
    import pickle

    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        run_training(compose(TINY_RUN + [f"run_dir={run_copy}", "resume=last"]))
    assert not marker.exists()


def test_disk_full_during_a_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    import dspark.io as dio

    real, seen = dio.atomic_write_bytes, []

    def failing(path, data):
        if Path(path).suffix == ".ckpt":
            seen.append(Path(path).name)
            if len(seen) >= 5:  # step 3's checkpoint (each step writes stepNNN + last)
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    run = tmp_path / "run"
    monkeypatch.setattr(dio, "atomic_write_bytes", failing)
    with pytest.raises(OSError, match="No space left"):
        run_training(compose(TINY_RUN + [f"run_dir={run}"]))
    monkeypatch.setattr(dio, "atomic_write_bytes", real)
    last = run / "checkpoints" / "last.ckpt"
    check_file(last, hint="-")  # the previous last.ckpt is intact and still matches its checksum
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    summary = run_training(compose(TINY_RUN + [f"run_dir={run}", "resume=last"]))
    assert summary["global_step"] == 6


# ---- the trained draft ------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_draft_is_refused_by_eval_and_export(run_copy, how, capsys, no_model_loads):
    from dspark.evaluation.run_eval import draft_source
    from dspark.export.__main__ import main as export_main

    _damage(run_copy / "draft" / "model.safetensors", how)
    with pytest.raises(IntegrityError, match=rf"model\.safetensors: {EXPECTED[how]}.*resume=last"):
        draft_source(_eval_cfg(f"run_dir={run_copy}"))
    with pytest.raises(SystemExit) as exit_info:
        export_main(["v4", "--run-dir", str(run_copy), "--out", str(run_copy / "export")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors" in err[0] and re.search(EXPECTED[how], err[0]), err
    assert not (run_copy / "export").exists()


def test_a_draft_checkpoint_for_eval_is_checked_too(run_copy, no_model_loads):
    from dspark.evaluation.run_eval import draft_source

    ckpt = run_copy / "checkpoints" / "last.ckpt"
    _damage(ckpt, "flip")
    with pytest.raises(IntegrityError, match=r"last\.ckpt: changed since it was written"):
        draft_source(_eval_cfg(f"draft_ckpt={ckpt}"))


def test_verify_and_import_refuse_an_altered_export(finished_run, tmp_path):
    from dspark.export.__main__ import main as export_main
    from dspark.export.dspark_v4 import import_v4_sidecar
    from dspark.export.verify import verify_folder

    out = tmp_path / "export"
    assert export_main(["v4", "--run-dir", str(finished_run), "--out", str(out), "--dtype", "float32"]) == 0
    assert verify_folder(out).ok
    (out / "notes.safetensors").write_bytes(b"x")  # something the manifest does not list
    assert any("notes.safetensors is not in" in p for p in verify_folder(out).problems)
    (out / "notes.safetensors").unlink()
    _damage(out / "model.safetensors", "flip")
    report = verify_folder(out)
    assert not report.ok and any("integrity" in p and "changed since export" in p for p in report.problems)
    cfg = compose(TINY_RUN)
    target = factory.build_target(cfg.target, cfg.draft)
    with pytest.raises(IntegrityError, match="changed since export"):
        import_v4_sidecar(out, factory.build_draft(cfg.draft, target))


@pytest.mark.parametrize("edit", ["shorter", "same_size"])
def test_verify_says_a_hand_edited_config_changed_since_export(tmp_path, edit):
    """Before: a config one byte shorter was "truncated (872 bytes, checksum file says 873)", which it is not."""
    from dspark.export.dspark_v4 import CONFIG_NAME, export_v4_sidecar
    from dspark.export.verify import verify_folder
    from test_export import _v4_draft

    out = export_v4_sidecar(_v4_draft(), tmp_path / "v4")
    config = out / CONFIG_NAME
    text, size = config.read_text(), config.stat().st_size
    old, new = ('"bfloat16"', '"float16"') if edit == "shorter" else ('"bfloat16"', '"bfloat61"')
    config.write_text(text.replace(old, new, 1))
    now = config.stat().st_size
    assert (now < size) if edit == "shorter" else (now == size)
    detail = "" if edit == "shorter" else r"; sha256 \w{12}\.\.\. does not match its checksum file"
    problems = [p for p in verify_folder(out).problems if p.startswith("integrity")]
    assert len(problems) == 1 and re.fullmatch(
        rf"integrity: {re.escape(str(config))}: changed since export \({now} bytes now, {size} recorded{detail}\); "
        r"re-export it", problems[0]), problems


def test_a_crash_after_training_keeps_the_draft_and_resume_finishes_the_run(tmp_path, monkeypatch):
    from dspark.targets.hf_target import FrozenTarget

    run = tmp_path / "run"
    real = FrozenTarget.fingerprint

    def crash(self, *a, **k):
        raise RuntimeError("simulated crash after training")

    monkeypatch.setattr(FrozenTarget, "fingerprint", crash)
    with pytest.raises(RuntimeError, match="simulated crash after training"):
        run_training(compose(TINY_RUN + [f"run_dir={run}"]))
    weights = load_file(run / "draft" / "model.safetensors")  # written before the step that crashed
    with pytest.raises(IntegrityError, match="no dspark_manifest.json"):
        draft_dir.check(run / "draft")  # incomplete: eval and export refuse it
    monkeypatch.setattr(FrozenTarget, "fingerprint", real)
    summary = run_training(compose(TINY_RUN + [f"run_dir={run}", "resume=last"]))
    assert summary["global_step"] == 6  # nothing retrained
    draft_dir.check(run / "draft")
    again = draft_dir.load_state(run / "draft")
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    assert json.loads((run / "draft" / "target.json").read_text())["fingerprint"]


# ---- one run per run_dir ----------------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_run_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(RunDirBusy, match=rf"another run is using it \(pid {os.getpid()}"):
        RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    second = RunLock(tmp_path)
    second.acquire()  # stale: the holder is gone
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    second.release()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "another-machine"}))
    with pytest.raises(RunDirBusy, match="another-machine.*delete"):
        RunLock(tmp_path).acquire()  # another host: cannot tell, so refuse and say how to override
    (tmp_path / LOCK_NAME).write_text("{half a lock")  # killed while creating it
    third = RunLock(tmp_path)
    third.acquire()
    third.release()


def test_a_second_run_on_the_same_run_dir_is_refused(run_copy, no_model_loads):
    holder = RunLock(run_copy)
    holder.acquire()
    try:
        with pytest.raises(RunDirBusy, match="another run is using it"):
            run_training(compose(TINY_RUN + [f"run_dir={run_copy}", "resume=last"]))
    finally:
        holder.release()
    with pytest.raises(ConfigError, match=r"run_dir: .* already holds a run .*resume=last"):
        run_training(compose(TINY_RUN + [f"run_dir={run_copy}"]))  # fresh start over a finished run


def test_stale_temp_files_are_removed_on_start(run_copy):
    stale = [run_copy / "checkpoints" / ".step0000007.ckpt.abc123.tmp", run_copy / "draft" / ".model.safetensors.x.tmp"]
    for p in stale:
        p.write_bytes(b"\0" * 1000)
    (run_copy / LOCK_NAME).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    assert run_training(compose(TINY_RUN + [f"run_dir={run_copy}", "resume=last"]))["global_step"] == 6
    assert not any(p.exists() for p in stale) and not (run_copy / LOCK_NAME).exists()


# ---- bad configs fail before any model loads -------------------------------------------------------------
def _malformed_jsonl(tmp_path: Path) -> Path:
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    p.write_text(f"{good}\n{{not json\n")
    return p


@pytest.mark.parametrize("overrides,key", [
    (["train.lr=-0.001"], r"train\.lr: must be > 0"),
    (["train.lr=nan"], r"train\.lr: must be finite"),
    (["train.weight_decay=-1"], r"train\.weight_decay"),
    (["train.betas=[0.9,1.5]"], r"train\.betas"),
    (["train.warmup_ratio=2"], r"train\.warmup_ratio"),
    (["train.num_anchors=500"], r"train\.num_anchors: 500 anchors cannot fit .*max_length=128"),
    (["train.batch_size=0"], r"train\.batch_size"),
    (["train.loss_weights.ce=-1"], r"train\.loss_weights"),
    (["draft.block_size=0"], r"draft\.block_size"),
    (["draft.target_layer_ids=[0,99]"], r"draft\.target_layer_ids: .*bad: \[99\]"),
    (["draft.mask_token_id=999999"], r"draft\.mask_token_id"),
    (["draft.markov_head_type=lstm"], r"markov_head_type"),
    (["data.val_examples=0"], r"data\.val_examples"),
    (["target=hf", "target.path=/no/such/model"], r"target\.path: '/no/such/model' is not a folder"),
    (["data.source=jsonl", "data.path=/no/such.jsonl"], r"data\.path"),
    (["data.source=jsonl", "data.strict=true", "data.path=MALFORMED"], r"bad\.jsonl:2"),
])
def test_bad_config_fails_before_any_model_loads(tmp_path, overrides, key, no_model_loads):
    overrides = [o.replace("MALFORMED", str(_malformed_jsonl(tmp_path))) for o in overrides]
    with pytest.raises(ValueError, match=key):  # before any model loads: no_model_loads (not a wall-time limit)
        run_training(compose(TINY_RUN + [f"run_dir={tmp_path / 'run'}", *overrides]))


def test_cli_prints_one_line_and_exits_2(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "train.lr=-0.001", f"run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=SAFETY_NET_S, cwd=REPO)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1] == "train.py: error: train.lr: must be > 0, got -0.001" and "Traceback" not in r.stderr


@pytest.mark.parametrize("content", [b"{not json\n", b'{"messages": [{"role": "user", "content": "\xff"}]}\n'])
def test_malformed_jsonl_in_strict_mode_is_one_line_exit_2(tmp_path, content):
    """train.py data.strict=true on a bad line (invalid JSON / an invalid UTF-8 byte): refused in preflight, before any
    model loads. Before: a traceback and exit 1 (JsonlFormatError was no UserError; the byte: a UnicodeDecodeError)."""
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(good.encode() + b"\n" + content)
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "data.source=jsonl", f"data.path={bad}",
                        "data.strict=true", f"run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=SAFETY_NET_S, cwd=REPO)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"train.py: error: {bad}:2: malformed prompt line"), lines


# ---- kill -9 at moments chosen from what the run has done ------------------------------------------------
KILL_RUN = TINY_RUN + ["trainer.max_steps=40", "trainer.val_check_interval=20"]


def _train_cmd(run: Path, resume: str | None) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *KILL_RUN, f"run_dir={run}",
            *([f"resume={resume}"] if resume else [])]


def _resume_arg(run: Path) -> str | None:
    """resume=last once any checkpoint exists (last.ckpt, or only step 1's stepNNNNNNN.ckpt when the kill landed
    between the two writes of step 1: resume=last takes the newest); fresh when there is no checkpoint at all."""
    folder = run / "checkpoints"
    return "last" if folder.is_dir() and any(folder.glob("*.ckpt")) else None


def test_resume_last_takes_the_newest_training_state(tmp_path):
    """last.ckpt unless a step checkpoint holds a later step; a last.ckpt whose step cannot be read is still the
    one chosen (its damage must be reported, not skipped); no checkpoint: None."""
    from dspark.training.run import newest_checkpoint

    folder = tmp_path / "checkpoints"
    assert newest_checkpoint(folder) is None
    folder.mkdir()
    save = lambda name, step: torch.save({"global_step": step}, folder / name)  # noqa: E731
    save("step0000001.ckpt", 1)
    assert newest_checkpoint(folder) == folder / "step0000001.ckpt"  # killed before step 1's last.ckpt
    save("last.ckpt", 1)
    assert newest_checkpoint(folder) == folder / "last.ckpt"  # a tie: last.ckpt
    save("step0000002.ckpt", 2)
    assert newest_checkpoint(folder) == folder / "step0000002.ckpt"  # killed between step 2's two writes
    save("last.ckpt", 2)
    assert newest_checkpoint(folder) == folder / "last.ckpt"
    (folder / "last.ckpt").write_bytes(b"not a checkpoint")
    assert newest_checkpoint(folder) == folder / "last.ckpt"


def _newest_step(run: Path) -> int:
    steps = [int(p.stem[4:11]) for p in (run / "checkpoints").glob("step*.ckpt")] \
        if (run / "checkpoints").is_dir() else []  # stepNNNNNNN.ckpt
    return max(steps, default=-1)


def _log_count(run: Path, text: str) -> int:
    """How often `text` is in the run's train.log (Hydra's job log, appended by every start)."""
    try:
        return (run / "train.log").read_text(errors="replace").count(text)
    except OSError:
        return 0


def _lock_pid(run: Path) -> int | None:
    try:
        return int(json.loads((run / LOCK_NAME).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):  # absent, or caught while being written
        return None


def _loss_rows(run: Path) -> int:
    """Rows with a train/loss in every CSV log version so far (a file being created counts as empty)."""
    import csv

    n = 0
    for version in (run / "logs").glob("version_*"):
        try:
            with open(version / "metrics.csv") as fh:
                n += sum(1 for row in csv.DictReader(fh) if row.get("train/loss"))
        except (OSError, csv.Error):
            pass
    return n


def _writing_checkpoint(run: Path) -> bool:
    """A checkpoint is being replaced: a temp file in checkpoints/, or last.ckpt's sidecar accepting two digests."""
    folder = run / "checkpoints"
    if any(folder.glob(".*.tmp")):
        return True
    try:
        return len(json.loads(sidecar_path(folder / "last.ckpt").read_text())["accept"]) > 1
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _kill_moment(kind: str, run: Path, proc: subprocess.Popen) -> tuple[str, object]:
    """(what, condition) of one kill moment, read from what the run (re)started as `proc` has written."""
    start_logs, rows, step = _log_count(run, "draft parameters:"), _loss_rows(run), _newest_step(run)
    data_logs = _log_count(run, "chat dataset")
    return {
        "lock": ("the run holds its lock (startup, before any model loads)", lambda: _lock_pid(run) == proc.pid),
        "data": ("the dataset is loaded (startup)", lambda: _log_count(run, "chat dataset") > data_logs),
        "built": ("target, draft and trainer are built (startup)",
                  lambda: _log_count(run, "draft parameters:") > start_logs),
        "checkpoint": ("a new checkpoint is on disk", lambda: _newest_step(run) > step),
        "row": ("a new train/loss row is logged", lambda: _loss_rows(run) > rows),
        # inside a checkpoint write when the poll catches one, else once the next-but-one checkpoint is there
        "writing": ("a checkpoint is being written (or the second new one is on disk)",
                    lambda: (_newest_step(run) > step and _writing_checkpoint(run)) or _newest_step(run) > step + 1),
    }[kind]


@pytest.mark.slow
def test_kill_9_at_chosen_moments_then_resume_matches_an_uninterrupted_run(tmp_path):
    """A run (checkpoint every step) killed with SIGKILL 12 times, each time restarted with resume=last (the newest
    checkpoint, last.ckpt or a later step file), or fresh when no checkpoint exists yet. Each kill moment is an event the run has produced (seeded choice): during
    startup (its lock taken, its dataset loaded, its models built), a new checkpoint on disk, a new train/loss row
    logged, or a checkpoint write in progress; wall time never picks it (before: a kill "at 0.1-0.9 x the measured
    start-up time" could land after a loaded machine's run had ended). Every checkpoint on disk always passes its
    checksum and loads; the finished run equals the uninterrupted one (every step's logged loss, and the weights):
    a kill between a checkpoint and its step's log row loses nothing (LogsFollowCheckpoints)."""
    from test_train_e2e import train_losses

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ref_dir, run, rng = tmp_path / "reference", tmp_path / "killed", random.Random(16)
    ref = subprocess.run(_train_cmd(ref_dir, None), env=env, capture_output=True, text=True, cwd=REPO,
                         timeout=SAFETY_NET_S)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "held-out expected acceptance length tau_prob" in ref.stdout and str(ref_dir) in ref.stdout
    kinds = ["lock", "data", "built", "checkpoint", "checkpoint", "row", "writing"]
    moments = []
    for i in range(12):
        resume = _resume_arg(run)
        log = tmp_path / f"launch{i}.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(_train_cmd(run, resume), env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            what, cond = _kill_moment(rng.choice(kinds), run, proc)
            wait_until(proc, what, cond, log.read_text, SAFETY_NET_S)
            moments.append(f"{what}: newest checkpoint step {_newest_step(run)}")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        for ckpt in (run / "checkpoints").glob("*.ckpt") if (run / "checkpoints").is_dir() else []:
            check_file(ckpt, hint="-")
            torch.load(ckpt, weights_only=True, map_location="cpu")
    final = subprocess.run(_train_cmd(run, _resume_arg(run)), env=env,
                           capture_output=True, text=True, cwd=REPO, timeout=SAFETY_NET_S)
    assert final.returncode == 0, final.stderr[-3000:]
    a, b = train_losses(ref_dir), train_losses(run)
    assert sorted(a) == sorted(b) == list(range(40)), moments
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, moments)
    wa, wb = draft_dir.load_state(ref_dir / "draft"), draft_dir.load_state(run / "draft")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)
    assert not [p for p in run.rglob("*.tmp")] and not (run / LOCK_NAME).exists()

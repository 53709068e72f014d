"""Faults and bad input, tried as a user would against the default tiny run: damaged files are refused naming
the file, a killed run resumes onto the same result, a second run cannot share a run_dir, bad configs fail
before any model loads (docs/verification.md, "Faults and bad input")."""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_RUN, compose
from dspark import factory
from dspark.errors import ConfigError, IntegrityError, RunDirBusy
from dspark.integrity import check_file, sidecar_path
from dspark.training import draft_dir
from dspark.training.run import run_training
from dspark.training.run_dir import LOCK_NAME, RunLock


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:  # one flipped byte in the middle of the payload: same size, other content
        data[len(data) * 2 // 3] ^= 0x40
        path.write_bytes(bytes(data))


EXPECTED = {"truncate": "truncated", "flip": "content altered"}


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
def _eval_cfg(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name="eval", overrides=list(overrides))


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
    assert len(err) == 1 and "model.safetensors" in err[0] and EXPECTED[how] in err[0]
    assert not (run_copy / "export").exists()


def test_a_draft_checkpoint_for_eval_is_checked_too(run_copy, no_model_loads):
    from dspark.evaluation.run_eval import draft_source

    ckpt = run_copy / "checkpoints" / "last.ckpt"
    _damage(ckpt, "flip")
    with pytest.raises(IntegrityError, match=r"last\.ckpt: content altered"):
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
    assert not report.ok and any("integrity" in p and "content altered" in p for p in report.problems)
    cfg = compose(TINY_RUN)
    target = factory.build_target(cfg)
    with pytest.raises(IntegrityError, match="content altered"):
        import_v4_sidecar(out, factory.build_draft(cfg, target))


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
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=key):
        run_training(compose(TINY_RUN + [f"run_dir={tmp_path / 'run'}", *overrides]))
    assert time.perf_counter() - t0 < 10


def test_cli_prints_one_line_and_exits_2(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "train.lr=-0.001", f"run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1] == "train.py: error: train.lr: must be > 0, got -0.001" and "Traceback" not in r.stderr


# ---- kill -9 at random moments ---------------------------------------------------------------------------
KILL_RUN = TINY_RUN + ["trainer.max_steps=40", "trainer.val_check_interval=20"]


def _train_cmd(run: Path, resume: bool) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *KILL_RUN, f"run_dir={run}", *(["resume=last"] if resume else [])]


def _newest_step(run: Path) -> int:
    steps = [int(p.stem[4:11]) for p in (run / "checkpoints").glob("step*.ckpt")] \
        if (run / "checkpoints").is_dir() else []  # stepNNNNNNN.ckpt
    return max(steps, default=-1)


def _wait(proc: subprocess.Popen, until, timeout: float = 300.0) -> None:
    t0 = time.perf_counter()
    while proc.poll() is None and not until() and time.perf_counter() - t0 < timeout:
        time.sleep(0.01)


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_matches_an_uninterrupted_run(tmp_path):
    """A run (checkpoint every step) killed with SIGKILL at 12 random moments, each time restarted with
    resume=last (or fresh when no checkpoint exists yet): during startup, or a random 0-300 ms after a new
    checkpoint appeared (inside the next step or the next checkpoint write). Every checkpoint on disk always
    passes its checksum and loads; the finished run equals the uninterrupted one (every step's logged loss, and the
    weights): a kill between a checkpoint and its step's log row loses nothing (LogsFollowCheckpoints)."""
    from test_train_e2e import train_losses

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ref_dir, run, rng = tmp_path / "reference", tmp_path / "killed", random.Random(16)
    t0 = time.perf_counter()
    ref = subprocess.Popen(_train_cmd(ref_dir, False), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, cwd=REPO)
    _wait(ref, lambda: _newest_step(ref_dir) >= 1)
    startup = time.perf_counter() - t0  # until the first checkpoint is on disk
    out, err = ref.communicate(timeout=600)
    assert ref.returncode == 0, err[-3000:]
    assert "held-out expected acceptance length tau_prob" in out and str(ref_dir) in out
    moments = []
    for _ in range(12):
        resume = (run / "checkpoints" / "last.ckpt").is_file()
        proc = subprocess.Popen(_train_cmd(run, resume), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, cwd=REPO)
        if rng.random() < 0.3:
            delay = rng.uniform(0.1, 0.9) * startup
            moments.append(f"startup+{delay:.1f}s")
            _wait(proc, lambda: False, timeout=delay)
        else:
            before, delay = _newest_step(run), rng.uniform(0.0, 0.3)
            _wait(proc, lambda: _newest_step(run) > before)
            step = _newest_step(run)
            moments.append(f"after step {step} +{delay * 1000:.0f}ms")
            time.sleep(delay)
        assert proc.poll() is None, f"the run finished before kill {len(moments)} ({moments})"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for ckpt in (run / "checkpoints").glob("*.ckpt") if (run / "checkpoints").is_dir() else []:
            check_file(ckpt, hint="-")
            torch.load(ckpt, weights_only=True, map_location="cpu")
    final = subprocess.run(_train_cmd(run, (run / "checkpoints" / "last.ckpt").is_file()), env=env,
                           capture_output=True, text=True, cwd=REPO, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    a, b = train_losses(ref_dir), train_losses(run)
    assert sorted(a) == sorted(b) == list(range(40)), moments
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, moments)
    wa, wb = draft_dir.load_state(ref_dir / "draft"), draft_dir.load_state(run / "draft")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)
    assert not [p for p in run.rglob("*.tmp")] and not (run / LOCK_NAME).exists()

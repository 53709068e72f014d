"""FSDP2 (trainer=fsdp2, dspark.training.sharding): the strategy from the config, sharded checkpoints that resume,
and 2 CPU processes (gloo) on the same global batch equal to one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_RUN, compose
from dspark.errors import ConfigError
from dspark.training.run import resolve_resume
from dspark.training.sharding import FSDP2Strategy
from dspark.training.trainer import make_trainer
from test_train_e2e import train_losses


def test_trainer_fsdp2_builds_the_fsdp2_strategy(tmp_path):
    cfg = compose([f"run_dir={tmp_path}", "trainer=fsdp2", "trainer.accelerator=cpu", "trainer.devices=2",
                   "trainer.precision=32-true"])
    trainer = make_trainer(cfg, [], [])
    assert type(trainer.strategy) is FSDP2Strategy and trainer.strategy._save_distributed_checkpoint
    full = make_trainer(compose([f"run_dir={tmp_path}", "trainer=fsdp2", "trainer.accelerator=cpu",
                                 "trainer.devices=2", "trainer.strategy=fsdp2_full_checkpoint"]), [], [])
    assert type(full.strategy) is FSDP2Strategy and not full.strategy._save_distributed_checkpoint


def _sharded_folder(folder, step: int, complete: bool = True):
    """A stand-in sharded checkpoint folder: two ranks' shards, .metadata, meta.pt; sealed when `complete`."""
    from dspark.training.sharding import seal_sharded_checkpoint

    folder.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        (folder / name).write_bytes(name.encode())
    torch.save({"global_step": step}, folder / "meta.pt")
    if complete:
        seal_sharded_checkpoint(folder)
    return folder


def test_resume_last_takes_the_newest_complete_sharded_checkpoint_and_skips_an_unsealed_one(tmp_path, caplog):
    ckpts = tmp_path / "checkpoints"
    last = ckpts / "last.ckpt"
    last.mkdir(parents=True)
    (last / "__0_0.distcp").write_bytes(b"")  # what an in-place write interrupted by a crash left (issue 40)
    with pytest.raises(ConfigError, match=r"holds no complete checkpoint to resume"):
        resolve_resume("last", tmp_path)
    step4 = _sharded_folder(ckpts / "step0000004.ckpt", 4)
    _sharded_folder(ckpts / "step0000008.ckpt", 8, complete=False)  # killed while writing: no completion record
    with caplog.at_level("INFO", logger="dspark.train"):
        assert resolve_resume("last", tmp_path) == str(step4)
    assert "last.ckpt has no completion record" in caplog.text and "step0000008.ckpt has no completion" in caplog.text
    assert "resume=last: step0000004.ckpt (step 4, the newest complete checkpoint)" in caplog.text
    assert "holds an older step" not in caplog.text  # the unsealed last.ckpt/ holds no step to compare
    # an explicit incomplete folder is refused naming the complete alternative
    with pytest.raises(ConfigError, match=rf"step0000008.ckpt' is incomplete .* resume={step4}$"):
        resolve_resume(str(ckpts / 'step0000008.ckpt'), tmp_path)
    # a complete folder whose files changed since: refused naming the file
    (step4 / "__1_0.distcp").write_bytes(b"altered")
    from dspark.errors import IntegrityError

    with pytest.raises(IntegrityError, match=r"__1_0\.distcp"):
        resolve_resume(str(step4), tmp_path)
    # last.ckpt complete at the same step as a step folder: last.ckpt
    import shutil

    shutil.rmtree(last)
    _sharded_folder(last, 4)
    (step4 / "__1_0.distcp").write_bytes(b"__1_0.distcp")
    assert resolve_resume("last", tmp_path) == str(last)


def _train_py(args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(REPO / "train.py"), *args], env=env, cwd=REPO, timeout=timeout,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_fsdp2_two_processes_match_one_process_and_resume_from_a_sharded_checkpoint(tmp_path):
    """One process on batches of 4 vs FSDP2 on 2 gloo ranks x 2 (the same global batches), the sharded run stopped
    after step 2 and resumed from its sharded last.ckpt/ to step 3: the same loss curve, the same final draft
    and the same export as the unsharded run."""
    common = TINY_RUN + ["trainer.val_check_interval=3", "callbacks.last_checkpoint.every_n_train_steps=2",
                         "data.num_workers=0"]
    one, two = tmp_path / "one", tmp_path / "two"
    from dspark.training.run import run_training

    # the reference takes the same path: 2 steps, then extended to 3 (an extension continues the lr decay from
    # where the finished run stopped, README "resume"), unsharded, in one process
    run_training(compose(common + [f"run_dir={one}", "train.batch_size=4", "trainer.max_steps=2"]))
    run_training(compose(common + [f"run_dir={one}", "train.batch_size=4", "trainer.max_steps=3", "resume=last",
                                   "resume_override=[trainer.max_steps]"]))
    sharded = common + [f"run_dir={two}", "train.batch_size=2", "trainer=fsdp2", "trainer.accelerator=cpu",
                        "trainer.devices=2", "trainer.precision=32-true", "trainer.enable_progress_bar=false"]
    _train_py(sharded + ["trainer.max_steps=2"])
    last = two / "checkpoints" / "last.ckpt"
    assert last.is_dir() and sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    import torch.distributed.checkpoint as dcp

    keys = list(dcp.FileSystemReader(str(last)).read_metadata().state_dict_metadata)
    draft_keys = {k.removeprefix("state_dict.") for k in keys if k.startswith("state_dict.")}
    w_first = load_file(two / "draft" / "model.safetensors")
    assert draft_keys == {f"draft.{k}" for k in w_first}  # the draft only: no target tensor is saved
    trained = {k for k, v in w_first.items() if k != "layers.0.ffn.gate.bias"}  # (the selection bias is frozen)
    moments = {k.removeprefix("optimizer_0.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optimizer_0.state.")}
    assert moments == {f"draft.{k}" for k in trained}  # AdamW holds the draft's trainable weights, nothing else
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 2

    _train_py(sharded + ["trainer.max_steps=3", "resume=last"])
    a, b = train_losses(one), train_losses(two)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in a:  # the ranks' losses are averaged in the log; the global normaliser makes them the same loss
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
    w1, w2 = load_file(one / "draft" / "model.safetensors"), load_file(two / "draft" / "model.safetensors")
    # Adam moves each weight by ~lr (3e-3) per step; reduce-scatter / reduction-order noise is ~1e-5.
    assert sorted(w1) == sorted(w2)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-4)
    assert max((w2[k] - w_first[k]).abs().max().item() for k in trained) > 1e-4  # the resumed step trained
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
    assert m1["global_step"] == m2["global_step"] == 3
    assert m2["final"]["val/tau_prob"] == pytest.approx(m1["final"]["val/tau_prob"], rel=1e-4)

    from dspark.export.__main__ import main as export_main

    for d in (one, two):
        assert export_main(["v4", "--run-dir", str(d), "--out", str(d / "export"), "--dtype", "float32"]) == 0
    e1, e2 = (load_file(next((d / "export").glob("*.safetensors"))) for d in (one, two))
    assert sorted(e1) == sorted(e2)
    for k in e1:
        torch.testing.assert_close(e2[k], e1[k], rtol=0, atol=1e-4)


# ---- issue 40: sharded checkpoints are crash-safe -------------------------------------------------------------------
def _fsdp2_cmd(run, max_steps: int, resume: bool) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), *TINY_RUN, f"run_dir={run}", f"trainer.max_steps={max_steps}",
            "train.batch_size=2", "trainer=fsdp2", "trainer.accelerator=cpu", "trainer.devices=2",
            "trainer.precision=32-true", "trainer.enable_progress_bar=false", "data.num_workers=0",
            "trainer.val_check_interval=4", "callbacks.last_checkpoint.every_n_train_steps=2",
            *(["resume=last"] if resume else [])]


def _launch_and_kill_when(cmd, log, what: str, cond) -> None:
    """Starts a 2-rank job in its own process group and SIGKILLs every rank once `cond` (a file the job wrote)
    holds; never a wall-clock moment."""
    import signal

    from conftest import wait_until

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(proc, what, cond, log.read_text, 900)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_fsdp2_killed_mid_write_and_after_a_write_resumes_onto_the_uninterrupted_run(tmp_path):
    """A 2-rank FSDP2 run (checkpoint every 2 steps, 8 steps) killed -9 twice: (b) while step 4's checkpoint is being
    written (its staging folder is there, or it is already complete), then (a) right after step 6's checkpoint is
    complete, with last.ckpt/ replaced by what an in-place write interrupted by a crash leaves (only the ranks'
    .distcp shards). Each time resume=last takes the newest complete checkpoint (the unsealed last.ckpt/ is skipped
    with a warning); the finished draft equals the uninterrupted run's."""
    import shutil

    ref, run = tmp_path / "reference", tmp_path / "killed"
    r = subprocess.run(_fsdp2_cmd(ref, 8, False), env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpts = run / "checkpoints"
    for name in ("step0000004.ckpt", "step0000006.ckpt"):  # final names appear only when complete
        assert not (ref / "checkpoints" / f".{name}.partial").exists()
    # (b) inside step 4's checkpoint write
    _launch_and_kill_when(_fsdp2_cmd(run, 8, False), tmp_path / "b.log", "step 4's checkpoint write",
                          lambda: (ckpts / ".step0000004.ckpt.partial").exists() or (ckpts / "step0000004.ckpt").exists())
    for folder in [p for p in ckpts.glob("*.ckpt") if p.is_dir()]:  # every visible folder is complete
        assert (folder / "dspark_manifest.json").is_file() and (folder / "meta.pt").is_file(), folder
    # (a) right after step 6's checkpoint is complete; last.ckpt/ as an interrupted in-place write leaves it
    _launch_and_kill_when(_fsdp2_cmd(run, 8, True), tmp_path / "a.log", "step 6's complete checkpoint",
                          lambda: (ckpts / "step0000006.ckpt" / "dspark_manifest.json").is_file())
    shutil.rmtree(ckpts / "last.ckpt", ignore_errors=True)
    (ckpts / "last.ckpt").mkdir()
    for shard in (ckpts / "step0000006.ckpt").glob("*.distcp"):
        shutil.copy(shard, ckpts / "last.ckpt" / shard.name)
    r = subprocess.run(_fsdp2_cmd(run, 8, True), env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    said = r.stdout + r.stderr + (run / "train.log").read_text()
    assert "last.ckpt has no completion record" in said and "resume: continuing from step 6 to 8" in said, said[-3000:]
    w_ref, w_run = load_file(ref / "draft" / "model.safetensors"), load_file(run / "draft" / "model.safetensors")
    assert sorted(w_ref) == sorted(w_run)
    for k in w_ref:  # same ranks, shapes and threads on both sides: equal up to fp32 reduction noise at most
        torch.testing.assert_close(w_run[k], w_ref[k], rtol=0, atol=1e-6)
    assert not list(ckpts.glob(".*.partial")) and not list(ckpts.glob(".*.old"))


@pytest.mark.slow
def test_a_rank_killed_mid_run_ends_the_job_in_one_line_naming_it_and_the_resume_command(tmp_path):
    """kill -9 of rank 1 of 2 once training has written its step-2 checkpoint: rank 0 ends with exit 2 and one line naming rank 1,
    how it ended, and the command that resumes the run; the run dir's lock is released."""
    import signal

    from conftest import wait_until
    from dspark.training.run_dir import LOCK_NAME

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "job.log"
    with open(log, "w") as out, open(tmp_path / "err.log", "w") as err:
        proc = subprocess.Popen(_fsdp2_cmd(run, 200, False), env=env, cwd=REPO, stdout=out, stderr=err,
                                start_new_session=True)
    try:
        wait_until(proc, "step 2's checkpoint", lambda: (run / "checkpoints" / "step0000002.ckpt").is_dir(), 900)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ranks = [int(p) for p in children if "LOCAL_RANK=1" in open(f"/proc/{p}/environ", "rb").read().decode(
            errors="replace").replace("\0", " ")]
        assert len(ranks) == 1, children
        os.kill(ranks[0], signal.SIGKILL)
        rc = proc.wait(timeout=600)  # a safety net: rank 0 ends on its own once its peer is gone
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = (tmp_path / "err.log").read_text()
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"train.py: error: rank 1 of 2 (pid {ranks[0]}, killed by SIGKILL) "
                                                    "died during training"), lines
    assert lines[0].split("resume it from its newest complete checkpoint: ")[1].startswith("python train.py ")
    assert "resume=last" in lines[0] and f"run_dir={run}" in lines[0]
    assert not (run / LOCK_NAME).exists()


def test_a_deepspeed_folder_is_refused_with_what_to_use_instead(tmp_path):
    folder = tmp_path / "checkpoints" / "last.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    with pytest.raises(ConfigError, match=r"is a DeepSpeed checkpoint folder .* train with trainer=fsdp2"):
        resolve_resume(str(folder), tmp_path)

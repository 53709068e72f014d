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


def test_an_incomplete_sharded_checkpoint_is_refused_before_any_model_loads(tmp_path):
    folder = tmp_path / "checkpoints" / "last.ckpt"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"resume.*meta\.pt"):
        resolve_resume(compose([f"run_dir={tmp_path}", "resume=last"]), tmp_path)
    torch.save({"global_step": 2}, folder / "meta.pt")
    assert resolve_resume(compose([f"run_dir={tmp_path}", "resume=last"]), tmp_path) == str(folder)


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

    run_training(compose(common + [f"run_dir={one}", "train.batch_size=4", "trainer.max_steps=3"]))
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

"""Two nodes x one process on 127.0.0.1: two torchrun agents (`--nnodes=2`, static rendezvous), Lightning's DDP over
gloo. The run trains, checkpoints, resumes, and ends with the weights of one process on the same global batches.

The launch a cluster uses is the same command on every node (README "More than one machine"):
    torchrun --nnodes=2 --nproc-per-node=G --node-rank=R --master-addr=HOST0 --master-port=PORT \
        train.py trainer=ddp trainer.num_nodes=2 trainer.devices=G ...
(under SLURM, `srun` with Lightning's SLURMEnvironment instead of torchrun: trainer.num_nodes / devices as above).
"""
from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_RUN, compose
from test_ddp_graph import run_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_localhost_nodes_train_checkpoint_and_resume(tmp_path):
    common = TINY_RUN + ["trainer.val_check_interval=3", "callbacks.last_checkpoint.every_n_train_steps=2",
                         "data.num_workers=0"]
    one, two = tmp_path / "one", tmp_path / "two"
    from dspark.training.run import run_training

    # the reference takes the same path: 2 steps, then extended to 3 (an extension continues the lr decay from
    # where the finished run stopped, README "resume"), unsharded, in one process
    run_training(compose(common + [f"run_dir={one}", "train.batch_size=4", "trainer.max_steps=2"]))
    run_training(compose(common + [f"run_dir={one}", "train.batch_size=4", "trainer.max_steps=3", "resume=last",
                                   "resume_override=[trainer.max_steps]"]))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    nodes = common + [f"run_dir={two}", "train.batch_size=2", "trainer=ddp", "trainer.accelerator=cpu",
                      "trainer.devices=1", "trainer.num_nodes=2", "trainer.precision=32-true"]

    def launch(extra):
        port = _free_port()
        return lambda rank: [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                             f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
                             str(REPO / "train.py"), *nodes, *extra]

    run_ranks(launch(["trainer.max_steps=2"]), 2, env, safety_s=900)
    assert torch.load(two / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    run_ranks(launch(["trainer.max_steps=3", "resume=last"]), 2, env, safety_s=900)
    w1, w2 = load_file(one / "draft" / "model.safetensors"), load_file(two / "draft" / "model.safetensors")
    # Adam moves each weight by ~lr (3e-3) per step; reduction-order noise is ~1e-5 (as the 2-process DDP test).
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-4)

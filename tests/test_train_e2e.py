"""End to end on the embedded default: a tiny run writes its outputs; a crashed run resumes onto the
same loss curve; bad config fails fast naming the key; 2-process DDP equals one process."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import REPO, TINY_RUN, compose
from dspark import factory
from dspark.factory import ConfigError
from dspark.training.run import run_training


def train_losses(run_dir) -> dict[int, float]:
    """step -> train/loss from every CSV log version of a run (later versions win)."""
    out = {}
    for version in sorted((run_dir / "logs").glob("version_*")):
        if not (version / "metrics.csv").is_file():  # a start killed before its logger wrote anything
            continue
        with open(version / "metrics.csv") as fh:
            for row in csv.DictReader(fh):
                if row.get("train/loss"):
                    out[int(row["step"])] = float(row["train/loss"])
    return out


def val_taus(run_dir) -> list[float]:
    out = []
    for version in sorted((run_dir / "logs").glob("version_*")):
        if not (version / "metrics.csv").is_file():  # a start killed before its logger wrote anything
            continue
        with open(version / "metrics.csv") as fh:
            out += [float(r["val/tau_prob"]) for r in csv.DictReader(fh) if r.get("val/tau_prob") and int(r["step"])]
    return out


def test_tiny_run_writes_checkpoint_metrics_and_draft(tmp_path):
    cfg = compose(TINY_RUN + [f"run_dir={tmp_path}", "validate_at_start=true"])
    summary = run_training(cfg)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    weights = load_file(tmp_path / "draft" / "model.safetensors")
    assert "main_proj.weight" in weights and not any("embed" in k or "lm_head" in k for k in weights)
    pinned = json.loads((tmp_path / "draft" / "target.json").read_text())  # eval refuses other target weights
    assert pinned["kind"] == "tiny_v4" and pinned["fingerprint"] == factory.build_target(cfg.target, cfg.draft).fingerprint()
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["global_step"] == 6 == summary["global_step"]
    for part in ("step0", "final"):
        assert 1.0 <= saved[part]["val/tau_prob"] <= 1.0 + cfg.draft.block_size
    assert saved["throughput"]["tokens_per_s"] > 0
    from dspark.targets.health import degenerate_warning  # the trained tiny target is a real one: no warning

    health = saved["target_health"]
    assert health["positions"] > 0 and health["entropy"] < 0.9 * health["ln_vocab"] and health["top_token_share"] < 0.5
    assert degenerate_warning(health) is None
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert all(k.startswith("draft.") for k in ckpt["state_dict"])  # the frozen target is not saved
    assert ckpt["ChatDataModule"]["batches_consumed"] == 6
    # the resolved config travels with every checkpoint and logger
    assert ckpt["hyper_parameters"]["trainer"]["max_steps"] == 6 and ckpt["hyper_parameters"]["run_dir"] == str(tmp_path)
    hparams = OmegaConf.load(next((tmp_path / "logs").glob("version_*/hparams.yaml")))
    assert hparams.draft.kind == cfg.draft.kind and hparams.trainer.val_check_interval == 3
    best = list((tmp_path / "checkpoints").glob("best-step*-tau*.ckpt"))  # top-1 by val/tau_prob (max)
    assert len(best) == 1
    tau = float(best[0].stem.split("-tau")[1])
    assert tau == pytest.approx(max(r for r in val_taus(tmp_path)), abs=1e-4)
    # the run's draft exports to the serving mtp.* form, verifies independently, and re-imports exactly
    from dspark.export.__main__ import main as export_main

    assert export_main(["v4", "--run-dir", str(tmp_path),  # the target: draft/target.json
                        "--out", str(tmp_path / "export"), "--dtype", "float32"]) == 0
    from dspark.export.verify import verify_folder
    from dspark.export.dspark_v4 import import_v4_sidecar

    assert verify_folder(tmp_path / "export").ok
    target = factory.build_target(cfg.target, cfg.draft)
    fresh = import_v4_sidecar(tmp_path / "export", factory.build_draft(cfg.draft, target))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, weights[k]), k


class Crash(L.Callback):
    def __init__(self, at_step):
        self.at_step = at_step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.at_step:
            raise RuntimeError("simulated crash")


def test_resume_continues_the_same_loss_curve(tmp_path, capsys):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_training(compose(TINY_RUN + [f"run_dir={straight}"]))
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(compose(TINY_RUN + [f"run_dir={crashed}"]), callbacks=(Crash(4),))
    ckpt = torch.load(crashed / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert 1 <= ckpt["global_step"] < 6
    capsys.readouterr()
    run_training(compose(TINY_RUN + [f"run_dir={crashed}", "resume=last"]))
    assert f"resume: continuing from step {ckpt['global_step']} to 6" in capsys.readouterr().out
    a, b = train_losses(straight), train_losses(crashed)
    assert sorted(a) == sorted(b) and len(a) == 6
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    wa = load_file(straight / "draft" / "model.safetensors")
    wb = load_file(crashed / "draft" / "model.safetensors")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def _logged_steps(run_dir) -> dict[str, list[int]]:
    """metric -> the steps its rows carry, over every CSV log version of a run (each step once)."""
    out: dict[str, set[int]] = {}
    for version in sorted((run_dir / "logs").glob("version_*")):
        with open(version / "metrics.csv") as fh:
            for row in csv.DictReader(fh):
                for name in ("train/loss", "val/tau_prob", "lr-AdamW"):
                    if row.get(name):
                        out.setdefault(name, set()).add(int(row["step"]))
    return {k: sorted(v) for k, v in out.items()}


def test_a_finished_run_resumed_for_more_steps_logs_where_a_straight_run_does(tmp_path):
    """A run that ended (its last step validated, its last checkpoint written after that) resumed with a larger
    trainer.max_steps logs every row at the step a run that never stopped logs it (Lightning alone logs them one
    step too high: dspark.training.run.LogsFollowCheckpoints)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_training(compose(TINY_RUN + [f"run_dir={straight}"]))
    run_training(compose(TINY_RUN + [f"run_dir={resumed}", "trainer.max_steps=3"]))
    run_training(compose(TINY_RUN + [f"run_dir={resumed}", "resume=last", "resume_override=[trainer.max_steps]"]))
    want = _logged_steps(straight)
    assert want["train/loss"] == list(range(6)) and want["val/tau_prob"] == [2, 5]
    assert _logged_steps(resumed) == want


@pytest.mark.parametrize(
    "override,key",
    [
        ("draft.target_layer_ids=[1,2,9]", "target_layer_ids"),
        ("+draft.arch.hidden_size=96", "draft.arch.hidden_size"),
        ("draft.mask_token_id=999999", "draft.mask_token_id"),
        ("data.val_examples=0", "data.val_examples"),
        ("draft.markov_head_type=lstm", "markov_head_type"),
    ],
)
def test_bad_config_fails_fast_naming_the_key(tmp_path, override, key):
    with pytest.raises((ConfigError, ValueError), match=key.replace(".", r"\.")):
        run_training(compose(TINY_RUN + [f"run_dir={tmp_path}", override]))


def test_unknown_experiment_is_refused():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="no_such_experiment"):
        compose(["experiment=no_such_experiment"])


def test_malformed_jsonl_lines_are_counted_or_refused(tmp_path, caplog):
    data = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "Say something about the sea."},
                                    {"role": "assistant", "content": "The sea is wide and deep and blue, " * 6}]})
    data.write_text("\n".join([good] * 40 + ["{not json", good] + [good] * 20) + "\n")
    base = TINY_RUN + [f"run_dir={tmp_path / 'run'}", "data.source=jsonl", f"data.path={data}",
                       "trainer.max_steps=1"]
    run_training(compose(base))
    assert "skipped 1 malformed line(s) (lines 41" in caplog.text  # counted and named, not silent
    with pytest.raises(ValueError, match=r"chat\.jsonl:41: malformed"):
        run_training(compose(base + ["data.strict=true"]))


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["dspark_v4", "dsv4_mtp"])
def test_ddp_two_processes_match_one_process(tmp_path, experiment):
    """2-process DDP (gloo, CPU) on the same global batch gives the same weights as one process (DSpark: global
    sum of loss weights; MTP: global scored rows per step; the ranks' shards score different numbers of rows)."""
    common = [f"experiment={experiment}"] + TINY_RUN + [
        "trainer.max_steps=3", "trainer.val_check_interval=3", "callbacks.last_checkpoint.every_n_train_steps=3",
        "train.num_anchors=4", "data.num_workers=0"]
    one, two, half = tmp_path / "one", tmp_path / "two", tmp_path / "half"
    run_training(compose(common + [f"run_dir={one}", "train.batch_size=4"]))
    run_training(compose(common + [f"run_dir={half}", "train.batch_size=2"]))  # rank 0's share alone
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(REPO / "train.py"), *common, f"run_dir={two}", "train.batch_size=2",
                        "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
                        "trainer.enable_progress_bar=false"],
                       env=env, cwd=REPO, timeout=600, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    w1, w2, wh = (load_file(d / "draft" / "model.safetensors") for d in (one, two, half))
    # Adam moves each weight by ~lr (3e-3) per step; reduction-order noise is ~1e-5.
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-4)
    assert max((wh[k] - w1[k]).abs().max().item() for k in w1) > 1e-3  # the check can tell batches apart
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (one, two))
    assert m1["global_step"] == m2["global_step"] == 3
    s1, s2 = m1["final"], m2["final"]
    assert s2["val/tau_prob"] == pytest.approx(s1["val/tau_prob"], rel=1e-4)


def test_trained_tiny_dspark_draft_decodes_exactly_like_the_target(tmp_path):
    """A (briefly) trained DSpark draft through eval.py on the shipped tiny V4 target: both turns of two
    conversations batched together, outputs == plain greedy decoding, and drafts do get accepted (the
    acceptance path is exercised, not only rejections)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from dspark.evaluation.run_eval import run_eval

    run_training(compose(TINY_RUN + [f"run_dir={tmp_path}", "trainer.max_steps=12"]))
    data = tmp_path / "bench"
    data.mkdir()
    (data / "chat.jsonl").write_text('{"turns": ["How do I make a good cup of tea?", "And coffee?"]}\n'
                                     '{"turns": ["Write a short poem about the sea."]}\n')
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = hydra_compose(config_name="eval", overrides=[f"run_dir={tmp_path}", f"data_dir={data}",
                                                           "benchmarks=[chat]", "max_new_tokens=24", "plots=false"])
    r = run_eval(cfg)["chat"]
    assert r["greedy_outputs_equal_target"] == "3/3" and r["num_requests"] == 3
    assert r["num_accepted_tokens"] > 0

"""End to end, CI-sized: `experiment=dsv4_mtp` trains on the shipped tiny DeepSeek-V4 target through
run_training (checkpoint, metrics, exported draft), eval.py's run_eval reports its real acceptance with
outputs equal to plain greedy decoding, and MTP-specific config errors name the key."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_RUN, compose, compose_eval as _eval_cfg
from dspark.factory import ConfigError
from dspark.training.run import run_training


def test_dsv4_mtp_tiny_run_trains_and_evaluates(tmp_path):
    cfg = compose(["experiment=dsv4_mtp"] + TINY_RUN + [f"run_dir={tmp_path}", "validate_at_start=true"])
    summary = run_training(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["global_step"] == 6 == summary["global_step"] and saved["experiment"] == "dsv4_mtp"
    k = cfg.draft.num_steps
    for part in ("step0", "final"):
        m = saved[part]
        assert 1.0 <= m["val/tau_prob"] <= 1.0 + k
        assert {f"val/agree_{i}" for i in range(k)} <= set(m) and {"val/ce", "val/kl", "val/l1"} <= set(m)
    assert saved["final"]["val/loss"] < saved["step0"]["val/loss"]  # 6 steps at lr 3e-3 do learn something
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["state_dict"] and all(n.startswith("draft.layers.0.") for n in ckpt["state_dict"])
    weights = load_file(tmp_path / "draft" / "model.safetensors")
    from dspark.export.dsv4_mtp import from_serving_names, to_serving_names

    serving = to_serving_names(weights)
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wkv.weight"} <= set(serving)
    assert set(from_serving_names(serving)) == set(weights)

    from dspark.evaluation.run_eval import run_eval

    data = tmp_path / "bench"
    data.mkdir()
    (data / "chat.jsonl").write_text('{"turns": ["How do I make a good cup of tea?"]}\n')
    reports = run_eval(_eval_cfg(f"run_dir={tmp_path}", f"data_dir={data}", "benchmarks=[chat]", "num_prompts=1",
                                 "max_new_tokens=12"))
    r = reports["chat"]
    assert r["draft_kind"] == "dsv4_mtp" and r["gamma"] == k and len(r["per_position_rate"]) == k
    assert r["greedy_outputs_equal_target"] == "1/1"
    assert r["mean_acceptance_length"] == 1 + r["num_accepted_tokens"] / r["num_drafts"]


def test_mtp_config_errors_name_the_key(tmp_path):
    from dspark.preflight import check_training_config

    with pytest.raises(ConfigError, match="train.mtp_loss_weights"):  # before any model loads (dspark.preflight)
        check_training_config(compose(["experiment=dsv4_mtp", "+train.mtp_loss_weights.l1=1.0"]), [])
    with pytest.raises(ConfigError, match="draft.num_steps"):
        check_training_config(compose(["experiment=dsv4_mtp", "draft.num_steps=0"]), [])
    with pytest.raises(ConfigError, match="data.feature_cache"):
        run_training(compose(["experiment=dsv4_mtp"] + TINY_RUN + [f"run_dir={tmp_path}", "data.feature_cache=auto"]))


"""End to end, CI-sized: `experiment=hyv4_mtp` trains on the shipped tiny HY V4 target through the same
MTP module and run_training, and eval.py's run_eval reports its real acceptance with outputs equal to plain
greedy decoding."""
from __future__ import annotations

from safetensors.torch import load_file

from conftest import TINY_RUN, compose
from dspark.training.run import run_training
from test_mtp_train_e2e import _eval_cfg


def test_hyv4_mtp_tiny_run_trains_and_evaluates(tmp_path):
    cfg = compose(["experiment=hyv4_mtp"] + TINY_RUN + [f"run_dir={tmp_path}", "validate_at_start=true"])
    saved = run_training(cfg)
    k = cfg.draft.num_steps
    assert saved["global_step"] == 6 and saved["experiment"] == "hyv4_mtp"
    for part in ("step0", "final"):
        assert 1.0 <= saved[part]["val/tau_prob"] <= 1.0 + k and f"val/agree_{k - 1}" in saved[part]
    assert saved["final"]["val/loss"] < saved["step0"]["val/loss"]
    weights = load_file(tmp_path / "draft" / "model.safetensors")
    assert weights and not any("embed" in n or "lm_head" in n for n in weights)

    from dspark.evaluation.run_eval import run_eval

    data = tmp_path / "bench"
    data.mkdir()
    (data / "chat.jsonl").write_text('{"turns": ["What is the capital of France?"]}\n')
    r = run_eval(_eval_cfg(f"run_dir={tmp_path}", "target=tiny_hy_v4", f"data_dir={data}", "benchmarks=[chat]",
                           "num_prompts=1", "max_new_tokens=12"))["chat"]
    assert r["draft_kind"] == "hyv4_mtp" and r["gamma"] == k
    assert r["greedy_outputs_equal_target"] == "1/1"

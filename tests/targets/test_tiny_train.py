"""The tiny-target builders' shared steps (scripts/tiny_train.py, beside the builders), on the shipped tiny_v4 model.

The builders themselves take 10+ minutes; these check the shared pieces they call, fast."""

import argparse
import json
import random
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))  # the builders import it as their sibling
from tiny_train import (  # noqa: E402
    add_build_args,
    build_info,
    build_log,
    evaluate,
    finish_build,
    readme_training,
    replay_command,
    save_reload_sample,
    train_heldout_windows,
)
from dspark.targets.tiny_v4 import load_tiny_v4  # noqa: E402


def test_add_build_args_defaults_and_overrides(tmp_path):
    ap = argparse.ArgumentParser()
    add_build_args(ap, out=tmp_path / "x", steps=123, max_minutes=4.5)
    args = ap.parse_args(["--stop-at-step", "7"])
    assert (args.out, args.steps, args.max_minutes, args.stop_at_step) == (tmp_path / "x", 123, 4.5, 7)
    assert ap.parse_args(["--steps", "9"]).steps == 9


def test_build_log_and_readme_training_line(capsys):
    build_log("build_x")("hello")
    out = capsys.readouterr().out
    assert out.startswith("[build_x ") and out.endswith("] hello\n")
    info = {"steps": 4, "scheduled_steps": 10, "batch_size": 2, "seq_len": 16, "train_tokens": 4 * 2 * 16,
            "lr": 0.003, "seed": 7, "train_seconds": 12.4, "threads": 2}
    assert " ".join(readme_training(info).split()) == ("- Training: 4 steps (of a 10-step warmup + cosine schedule) "
                                                        "x batch 2 x 16 tokens (128 tokens), AdamW lr 0.003, seed 7, "
                                                        "12 s on 2 CPU threads.")


def test_replay_command_adds_stop_at_step_only_when_time_capped():
    capped = {"stopped_by_time_cap": True, "steps": 17}
    assert replay_command("scripts/b.py", ["--seed", "3"], capped) == \
        "python scripts/b.py --seed 3 --stop-at-step 17 --max-minutes 0"
    assert replay_command("scripts/b.py", [], {"stopped_by_time_cap": False, "steps": 17}) == "python scripts/b.py"


def test_save_reload_measure_and_finish(tmp_path):
    model, tok = load_tiny_v4()
    recs = [{"messages": [{"role": "user", "content": f"hello number {i} " * 40},
                          {"role": "assistant", "content": "sure " * 60}]} for i in range(4)]
    windows, heldout_windows = train_heldout_windows(recs, recs[:2], tok, 16, random.Random(0))
    # train windows: one start per record (+ a later one for some); held-out: start + a later one each (prob 1.0)
    assert len(heldout_windows) == 4 and all(len(w) == 17 for w in windows + heldout_windows)
    assert heldout_windows[0] == tok(tok.apply_chat_template(recs[0]["messages"], tokenize=False),
                                     add_special_tokens=False)["input_ids"][:17]

    logs = []
    out = tmp_path / "tiny"
    fp32 = evaluate(model, heldout_windows, tok.pad_token_id, 8)
    tmp, model2, tok2, heldout, sample = save_reload_sample(model, tok, out, heldout_windows, logs.append)
    assert tmp == tmp_path / "tiny.tmp" and (tmp / "model.safetensors").is_file()
    assert all(p.dtype == torch.float32 for p in model2.parameters())
    # the stored weights are bf16: the reloaded copy matches fp32 up to rounding, not exactly
    assert heldout["tokens"] == fp32["tokens"] and heldout["loss"] == pytest.approx(fp32["loss"], rel=0.05)
    assert isinstance(sample, str) and any("greedy sample" in m for m in logs)

    args = argparse.Namespace(steps=10, batch_size=2, seq_len=16, lr=1e-3, seed=0, threads=1)
    result = {"steps": 4, "stopped_by_time_cap": True, "train_loss_ema": 2.5}

    class Stats:
        def summary(self):
            return "s"

    info = build_info(script="scripts/b.py", argv=[], args=args, result=result, tokenizer=tok2, config=model2.config,
                      n_params=5, train_seconds=1.0, heldout=heldout, heldout_records=2, sample=sample, stats=Stats(),
                      extra={"x": 1})
    assert info["train_tokens"] == 4 * 2 * 16 and info["x"] == 1 and info["command"].endswith("--stop-at-step 4 --max-minutes 0")
    finish_build(tmp, out, info, 0.0, lambda d, i: (d / "README.md").write_text("r"), logs.append)
    assert not tmp.exists() and (out / "README.md").read_text() == "r"
    saved = json.loads((out / "build_info.json").read_text())
    assert "config" not in saved and saved["steps"] == 4 and saved["build_seconds"] > 0

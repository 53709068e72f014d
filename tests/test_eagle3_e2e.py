"""End to end, CI-sized: EAGLE-3 on the tiny dense target as a user runs it. `python train.py experiment=eagle3_tiny`
(run_training), `python eval.py run_dir=RUN` (run_eval: greedy speculative outputs equal the plain target's),
`python -m dspark.export eagle3` in both formats, `python -m dspark.export verify`, and the export imported back into
a draft built from the folder's own config scores exactly as the trained draft; a finished run trains on when asked;
bad EAGLE-3 keys are refused in one line, naming the key, before any model loads. (vLLM serving the export:
tests/serving/test_vllm_parity.py.)"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, compose, compose_eval as _eval_cfg
from dspark.errors import ConfigError
from dspark.schema import eval_config
from dspark.training.run import run_training

# the experiment's own keys, shortened: 6 steps, held-out validation at 3 and 6, a checkpoint every step
EAGLE3_RUN = ["experiment=eagle3_tiny", "trainer.max_steps=6", "trainer.val_check_interval=3",
              "callbacks.last_checkpoint.every_n_train_steps=1", "trainer.log_every_n_steps=1",
              "trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished experiment=eagle3_tiny run (6 steps)."""
    run_dir = tmp_path_factory.mktemp("eagle3") / "run"
    summary = run_training(compose(EAGLE3_RUN + [f"run_dir={run_dir}", "validate_at_start=true"]))
    assert summary["global_step"] == 6
    return run_dir


def _chain_logits(draft, feats, ids) -> list[torch.Tensor]:
    """Target-vocabulary logits of every training-time-test step over `ids` (the served chain, teacher-forced)."""
    from dspark.models.mtp_common import teacher_forced_chain

    with torch.no_grad():
        outs = teacher_forced_chain(draft, draft.context_hidden(feats), ids, draft.config.num_steps)
        return [draft.logits(o) for o in outs]


def test_train_eval_export_verify_and_import_back(run, tmp_path):
    from dspark.evaluation import run_eval as ev
    from dspark.export.__main__ import main as export_main
    from dspark.export.adapter import adapter_for_folder
    from dspark.export.eagle3 import Eagle3Adapter, Eagle3SpeculatorsAdapter, import_eagle3
    from dspark.export.verify import verify_folder
    from dspark.models.eagle3 import Eagle3Draft

    # train.py: the run's outputs
    saved = json.loads((run / "metrics.json").read_text())
    assert saved["global_step"] == 6 and saved["experiment"] == "eagle3_tiny"
    for part in ("step0", "final"):
        m = saved[part]
        assert 1.0 <= m["val/tau_prob"] <= 1.0 + 3  # num_steps 3 drafts + the bonus token
        assert {f"val/agree_{i}" for i in range(3)} <= set(m)
    weights = load_file(run / "draft" / "model.safetensors")
    assert "fc.weight" in weights and "layers.0.self_attn.q_proj.weight" in weights
    assert not any("embed" in k or "lm_head" in k for k in weights)  # the target's, shared: never trained or saved
    pinned = json.loads((run / "draft" / "target.json").read_text())
    assert pinned["kind"] == "tiny_llama"
    assert (run / "checkpoints" / "last.ckpt").is_file()

    # eval.py run_dir=RUN: the target from the run's record; greedy speculative output = the plain target's
    from conftest import tiny_chat_bench

    bench = tiny_chat_bench(tmp_path)
    cfg = ev.with_run_target(eval_config(_eval_cfg(f"run_dir={run}", f"data_dir={bench}", "benchmarks=[chat]",
                                                   "max_new_tokens=24", "plots=false", "confidence=false")), run)
    assert cfg.target.kind == "tiny_llama"
    r = ev.run_eval(cfg)["chat"]
    assert r["draft_kind"] == "eagle3" and r["gamma"] == 3 and len(r["per_position_rate"]) == 3
    assert r["num_requests"] == 3 and r["greedy_outputs_equal_target"] == "3/3"
    assert r["mean_acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])

    # python -m dspark.export eagle3 (the target from draft/target.json), both formats, float32; verify passes
    folders = {"vllm": tmp_path / "export", "speculators": tmp_path / "export_speculators"}
    for fmt, folder in folders.items():
        assert export_main(["eagle3", "--run-dir", str(run), "--out", str(folder), "--dtype", "float32",
                            "--format", fmt]) == 0
        assert verify_folder(folder).ok
        assert export_main(["verify", str(folder)]) == 0
    assert json.loads((folders["vllm"] / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert json.loads((folders["speculators"] / "config.json").read_text())["speculators_model_type"] == "eagle3"

    # imported back into a draft built from the folder's own config: the trained draft's config, and its logits
    target, trained, *_ = ev.build(cfg)
    ids = torch.tensor([target.tokenizer.encode("The quick brown fox jumps over the lazy dog. It was a sunny day.")])
    with torch.no_grad():
        feats = target.features(ids)
    want = _chain_logits(trained, feats, ids)
    assert len(want) == 3 and tuple(want[0].shape) == (1, ids.shape[1] - 1, 2048)
    for fmt, cls in (("vllm", Eagle3Adapter), ("speculators", Eagle3SpeculatorsAdapter)):
        adapter, config = adapter_for_folder(folders[fmt])
        assert type(adapter) is cls, fmt
        draft_cfg = adapter.draft_config(config)
        assert draft_cfg == trained.config, fmt
        imported = Eagle3Draft(draft_cfg)
        imported.share_target_weights(target.embed_weight, target.lm_head_weight)
        import_eagle3(folders[fmt], imported).eval()
        for k, v in imported.state_dict().items():
            assert torch.equal(v, trained.state_dict()[k]), (fmt, k)
        got = _chain_logits(imported, feats, ids)
        for step, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), (fmt, step)
        # the drafts eval.py proposes after a prefix: the same tokens
        a = 9
        p_want = trained.propose(feats.prefix(a), ids[0, : a + 1], num_drafts=3)
        p_got = imported.propose(feats.prefix(a), ids[0, : a + 1], num_drafts=3)
        assert torch.equal(p_got.tokens, p_want.tokens) and torch.equal(p_got.logits, p_want.logits), fmt


def test_a_finished_run_trains_on_with_a_larger_max_steps(tmp_path, monkeypatch, capsys):
    """resume=last of a finished run: refused (naming resume_override) before any model loads unless the larger
    trainer.max_steps is asked for; then it continues from the last step, not from scratch."""
    import dspark.factory as factory

    run_dir = tmp_path / "run"
    base = EAGLE3_RUN + [f"run_dir={run_dir}", "trainer.max_steps=2", "trainer.val_check_interval=2",
                         "validate_at_start=false"]
    run_training(compose(base))
    before = load_file(run_dir / "draft" / "model.safetensors")
    with monkeypatch.context() as m:
        m.setattr(factory, "load_hf_target", lambda *a, **k: pytest.fail("the target loaded"))
        with pytest.raises(ConfigError, match=r"^resume: this run finished at step 2 .*resume_override="
                                              r"\[trainer.max_steps\] to train on to step 4$"):
            run_training(compose(base + ["trainer.max_steps=4", "resume=last"]))
    capsys.readouterr()
    summary = run_training(compose(base + ["trainer.max_steps=4", "resume=last",
                                           "resume_override=[trainer.max_steps]"]))
    assert "resume: continuing from step 2 to 4" in capsys.readouterr().out
    assert summary["global_step"] == 4
    assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == 4
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == 4 and ckpt["hyper_parameters"]["trainer"]["max_steps"] == 4
    versions = sorted((run_dir / "logs").glob("version_*"))
    assert len(versions) == 2  # the resumed start logs into a new version: steps 3-4 only
    logged = [[int(row["step"]) for row in csv.DictReader(open(v / "metrics.csv")) if row.get("train/loss")]
              for v in versions]
    # two new optimizer steps, logged after the first start's (Lightning numbers them 3, 4 rather than 2, 3 when the
    # finished run validated at its last step: the restored loop counts that step once more; the run's steps are 4)
    assert logged[0] == [0, 1] and len(logged[1]) == 2 and min(logged[1]) > 1, logged
    after = load_file(run_dir / "draft" / "model.safetensors")
    assert set(after) == set(before) and any(not torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("override,message", [
    ("draft.target_layer_ids=[0,5]", "draft.target_layer_ids: [0, 5]: ids must be 0-based layer indices in [0, 2] "
                                     "of the target (4 layers; EAGLE-3 cannot tap the last layer"),
    ("draft.draft_vocab_size=99999", "draft.draft_vocab_size: Eagle3Config.draft_vocab_size must be in "
                                     "[1, vocab_size=2048]"),
], ids=["target_layer_ids", "draft_vocab_size"])
def test_bad_eagle3_keys_are_one_line_before_any_model_loads(tmp_path, override, message):
    """The real command line: exit 2, one line naming the key, no traceback, no run dir, no weights loaded (the
    check reads the shipped tiny target's config.json)."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "train.py", "experiment=eagle3_tiny", override, f"run_dir={run_dir}"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"train.py: error: {message}"), r.stderr
    assert "Traceback" not in r.stderr + r.stdout and "Loading weights" not in r.stderr + r.stdout
    assert not run_dir.exists()

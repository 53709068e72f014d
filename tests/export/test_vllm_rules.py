"""vLLM 0.33.0's loading / serving rules (issue 17): every mismatch and refusal, each shown failing on the broken
case. File:line references are into the vllm==0.33.0 wheel; docs/verification.md tabulates rule -> test."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import reseal, tiny_v4_config
from dspark.integrity import MANIFEST_NAME
from dspark.export.dense import export_dense
from dspark.export.dspark_v4 import export_v4_sidecar, import_v4_sidecar, merge_v4_into_target
from dspark.export.mtp import export_mtp
from dspark.export.verify import verify_folder
from dspark.models.dspark_dense import DSparkDenseConfig
from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft
from dspark.models.hy_v4_mtp import HYV4MTPConfig
from test_export import _dense_cfg, _dense_draft, _randomise, _v4_draft


def _edit_config(folder, name: str, **changes) -> None:
    path = folder / name
    c = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            c.pop(key, None)
        else:
            c[key] = value
    path.write_text(json.dumps(c))
    if (folder / MANIFEST_NAME).is_file():
        reseal(folder)  # hand-edited: only the serving rules should object, not the checksum


def _serving(folder) -> list[str]:
    return [p for p in verify_folder(folder).problems if p.startswith("serving:")]


def _tiny_target_copy(tmp_path):
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    target = tmp_path / "target"
    shutil.copytree(TINY_V4_DIR, target)
    return target


def _draft_for_tiny_target(seed: int = 0, **keys) -> DSparkV4Draft:
    """A DSpark V4 draft sized like the shipped tiny target (what a default run trains)."""
    from transformers import AutoConfig

    from dspark.targets.tiny_v4 import TINY_V4_DIR

    hf = AutoConfig.from_pretrained(str(TINY_V4_DIR))
    values = dict(num_layers=2, block_size=4, mask_token_id=4, target_layer_ids=[1, 2], markov_rank=8)
    values.update(keys)
    draft = DSparkV4Draft(DSparkV4Config.from_target_config(hf, **values))
    _randomise(draft, seed)
    return draft


# ---- mismatch 1: dense DSpark sample_from_anchor --------------------------------------------------------
def test_dense_dspark_export_keeps_sample_from_anchor_out_of_dflash_config(tmp_path):
    out = export_dense(_dense_draft(6), tmp_path / "d")
    c = json.loads((out / "config.json").read_text())
    assert "sample_from_anchor" not in c["dflash_config"] and c["sample_from_anchor"] is True
    assert verify_folder(out).ok
    # what the exporter wrote before: vLLM's DFlash constructor (run first by DSpark's) raises on it
    _edit_config(out, "config.json", dflash_config={**c["dflash_config"], "sample_from_anchor": True})
    assert _serving(out) and "dflash_config.sample_from_anchor=true" in _serving(out)[0]


def test_speculators_dflash_translation_puts_sample_from_anchor_in_dflash_config(tmp_path):
    """vLLM's update_dflash writes sample_from_anchor INTO dflash_config (algos.py:118-126): true would raise."""
    out = export_dense(_dense_draft(0), tmp_path / "s", fmt="speculators")
    assert verify_folder(out).ok
    _edit_config(out, "config.json", sample_from_anchor=True)
    assert any("dflash_config.sample_from_anchor=true" in p for p in _serving(out))


# ---- mismatch 2: DeepSeek-V4 gate bias under topk_method ----------------------------------------------
def test_tiny_target_config_carries_topk_method_noaux_tc():
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    assert json.loads((TINY_V4_DIR / "config.json").read_text())["topk_method"] == "noaux_tc"


def test_draft_routing_follows_the_target_topk_method_and_norm_topk_prob():
    """vLLM builds e_score_correction_bias only for topk_method noaux_tc (nvidia/model.py:301-309) and
    renormalises the top-k weights iff norm_topk_prob (model.py:251, 432)."""
    base = tiny_v4_config()
    with_bias = DSparkV4Draft(DSparkV4Config.from_target_config(base, block_size=2, mask_token_id=3,
                                                            target_layer_ids=[0], markov_rank=2, num_layers=1))
    plain_cfg = tiny_v4_config(topk_method=None, norm_topk_prob=False)
    plain = DSparkV4Draft(DSparkV4Config.from_target_config(plain_cfg, block_size=2, mask_token_id=3,
                                                        target_layer_ids=[0], markov_rank=2, num_layers=1))
    assert "layers.0.ffn.gate.bias" in dict(with_bias.named_parameters())
    assert "layers.0.ffn.gate.bias" not in dict(plain.named_parameters())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, base.hidden_size, generator=g)
    for draft in (with_bias, plain):
        draft.layers[0].ffn.gate.weight.data = torch.randn(2, base.hidden_size, generator=g)
    with_bias.layers[0].ffn.gate.weight.data = plain.layers[0].ffn.gate.weight.data.clone()
    with_bias.layers[0].ffn.gate.bias.data = torch.tensor([100.0, 0.0])  # forces expert 0 when used
    w_b, idx_b = with_bias.layers[0].ffn.gate(x)
    w_p, idx_p = plain.layers[0].ffn.gate(x)
    scores = torch.nn.functional.softplus(x @ plain.layers[0].ffn.gate.weight.t()).sqrt()  # [N, E]
    assert (idx_b == 0).all()  # top-1 of scores + bias
    assert torch.equal(idx_p[:, 0], scores.argmax(-1))  # no bias: top-1 of the scores
    assert not torch.equal(idx_b, idx_p)  # the two routings differ on this input
    scale = plain.config.routed_scaling_factor
    torch.testing.assert_close(w_p[:, 0], scores.gather(-1, idx_p)[:, 0] * scale)  # not renormalised
    torch.testing.assert_close(w_b[:, 0], torch.full_like(w_b[:, 0], scale))  # top-1 renormalised = 1


def test_merge_refuses_a_target_without_noaux_tc_and_the_verifier_catches_it(tmp_path):
    target = _tiny_target_copy(tmp_path)
    draft = _draft_for_tiny_target(1)
    merged = merge_v4_into_target(draft, target, tmp_path / "ok", dtype=torch.float32)
    assert verify_folder(merged).ok, verify_folder(merged).problems
    _edit_config(target, "config.json", topk_method=None)  # what the shipped tiny target had before
    with pytest.raises(ValueError, match="topk_method: draft 'noaux_tc' vs target None"):
        merge_v4_into_target(draft, target, tmp_path / "refused")
    # a folder merged before the fix: vLLM's loader has no e_score_correction_bias to put ffn.gate.bias into
    _edit_config(merged, "config.json", topk_method=None)
    problems = verify_folder(merged).problems
    assert problems and all(p.startswith("unexpected: mtp.") and ".ffn.gate.bias" in p for p in problems)
    assert len(problems) == 2  # one per draft layer


def test_no_noaux_tc_draft_exports_without_gate_bias(tmp_path):
    hf_cfg = tiny_v4_config(topk_method=None)
    nobias = DSparkV4Draft(DSparkV4Config.from_target_config(hf_cfg, block_size=4, mask_token_id=3,
                                                         target_layer_ids=[0, 1], markov_rank=4, num_layers=1))
    out = export_v4_sidecar(nobias, tmp_path / "nb")
    assert not any(n.endswith("ffn.gate.bias") for n in load_file(str(out / "model.safetensors")))
    assert json.loads((out / "dspark_config.json").read_text())["topk_method"] is None
    assert verify_folder(out).ok, verify_folder(out).problems
    back = DSparkV4Draft(nobias.config)
    import_v4_sidecar(out, back)  # strict: no bias on either side


# ---- mismatch 3: HY V4 model.layers.{N+i} naming -------------------------------------------------------
def test_hy_layers_naming_with_two_layers_is_refused_and_caught(tmp_path):
    from test_export_mtp import _hy_draft

    two = _hy_draft(1)  # num_layers 2
    with pytest.raises(ValueError, match="max\\(num_nextn_predict_layers - 1, 1\\)"):
        export_mtp(two, tmp_path / "x", layer_names="layers")
    out = export_mtp(two, tmp_path / "hy", dtype=torch.float32)  # model.mtp_layers.{i}: every layer loads
    assert verify_folder(out).ok
    # what the exporter wrote before: model.layers.{N+i} names for 2 layers
    path = out / "model.safetensors"
    t = load_file(str(path))
    save_file({k.replace("model.mtp_layers.0.", "model.layers.3.").replace("model.mtp_layers.1.", "model.layers.4."): v
               for k, v in t.items()}, str(path))
    _edit_config(out, "mtp_config.json", mtp_layer_names="layers")
    serving = _serving(out)
    assert len(serving) == 1 and "mtp_layer_names 'layers' with num_nextn_predict_layers=2" in serving[0]


# ---- refusals: V4 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,word,note", [
    ({"markov_head_type": "gated"}, "markov_head_type 'gated'", "markov head type 'gated'"),
    ({"markov_head_type": "rnn"}, "markov_head_type 'rnn'", "markov head type 'rnn'"),
    ({"confidence_bias": True}, "confidence_bias", "dspark_confidence_bias")])
def test_v4_heads_vllm_lacks_are_refused_unless_not_for_vllm(tmp_path, change, word, note):
    draft = DSparkV4Draft(replace(_v4_draft().config, **change))
    _randomise(draft, 3)
    with pytest.raises(ValueError, match=word):
        export_v4_sidecar(draft, tmp_path / "refused")
    out = export_v4_sidecar(draft, tmp_path / "own", for_vllm=False)
    report = verify_folder(out)
    assert report.ok and len(report.notes) == 1 and note in report.notes[0], report.notes
    _edit_config(out, "dspark_config.json", dspark_not_for_vllm=None)  # without the marker: a problem
    assert _serving(out)


def test_v4_mask_layout_writes_sample_from_anchor_false(tmp_path):
    """vLLM's DSpark speculator defaults to the anchor layout (dspark/speculator.py:49-55)."""
    draft = _v4_draft()
    out = export_v4_sidecar(DSparkV4Draft(replace(draft.config, layout="mask")), tmp_path / "m")
    assert json.loads((out / "dspark_config.json").read_text())["sample_from_anchor"] is False
    anchor = export_v4_sidecar(draft, tmp_path / "a")
    assert json.loads((anchor / "dspark_config.json").read_text())["sample_from_anchor"] is True
    # window + block a multiple of 64: the non-causal index list (window + N, padded to 64) misses one key
    edge = DSparkV4Draft(replace(draft.config, sliding_window=60, block_size=4))
    with pytest.raises(ValueError, match="layout 'mask' with sliding_window \\+ block_size = 64"):
        export_v4_sidecar(DSparkV4Draft(replace(edge.config, layout="mask")), tmp_path / "edge")
    export_v4_sidecar(edge, tmp_path / "edge_anchor")  # the anchor layout has N queries: fits
    _edit_config(out, "dspark_config.json", sliding_window=60, dspark_block_size=4)
    assert any("sample_from_anchor=false with sliding_window + dspark_block_size = 64" in p for p in _serving(out))


def test_unsorted_target_layer_ids_are_refused():
    """vLLM concatenates the taps in layer order (nvidia/model.py:993-1014, models/interfaces.py:1640-1650)."""
    with pytest.raises(ValueError, match="DSparkV4Config.target_layer_ids must be ascending"):
        replace(_v4_draft().config, target_layer_ids=[1, 0]).validate()
    with pytest.raises(ValueError, match="target_layer_ids must be ascending"):
        replace(_dense_cfg(6), target_layer_ids=[1, 0]).validate()


def test_verifier_catches_unsorted_taps(tmp_path):
    out = export_v4_sidecar(_v4_draft(), tmp_path / "v4")
    _edit_config(out, "dspark_config.json", dspark_target_layer_ids=[1, 0])
    assert any("dspark_target_layer_ids [1, 0] not ascending" in p for p in _serving(out))
    dense = export_dense(_dense_draft(6), tmp_path / "d")
    c = json.loads((dense / "config.json").read_text())
    _edit_config(dense, "config.json", dflash_config={**c["dflash_config"], "target_layer_ids": [1, 0]})
    assert any("target_layer_ids [1, 0] not ascending" in p for p in _serving(dense))


def test_merge_refuses_a_draft_rope_theta_other_than_the_targets(tmp_path):
    """vLLM's draft layers take the target's rope_theta, no YaRN (deepseek_v4/common/rope.py:28-42)."""
    target = _tiny_target_copy(tmp_path)
    draft = DSparkV4Draft(replace(_draft_for_tiny_target().config, rope_theta=50000.0))
    with pytest.raises(ValueError, match="rope_theta: draft 50000.0 vs target 10000.0"):
        merge_v4_into_target(draft, target, tmp_path / "m")
    ok = merge_v4_into_target(_draft_for_tiny_target(), target, tmp_path / "ok", dtype=torch.float32)
    assert verify_folder(ok).ok
    _edit_config(ok, "config.json", dspark_rope_theta=50000.0)
    assert any("dspark_rope_theta 50000.0 != rope_theta 10000.0" in p for p in _serving(ok))


@pytest.mark.parametrize("key,value", [("mask_token_id", 7), ("block_size", 9),
                                       ("eagle_aux_hidden_state_layer_ids", [1]),
                                       ("dflash_config", {"mask_token_id": 7}),
                                       ("dflash_config", {"target_layer_ids": [0]}),
                                       ("is_causal", True)])
def test_merge_refuses_target_keys_vllm_reads_first(tmp_path, key, value):
    target = _tiny_target_copy(tmp_path)
    _edit_config(target, "config.json", **{key: value})
    shown = key if key != "dflash_config" else f"dflash_config.{next(iter(value))}"
    with pytest.raises(ValueError, match=shown.replace(".", "\\.")):
        merge_v4_into_target(_draft_for_tiny_target(), target, tmp_path / "m")


def test_verifier_catches_target_keys_vllm_reads_first(tmp_path):
    ok = merge_v4_into_target(_draft_for_tiny_target(), _tiny_target_copy(tmp_path), tmp_path / "ok",
                              dtype=torch.float32)
    for key, value in (("mask_token_id", 7), ("block_size", 9), ("eagle_aux_hidden_state_layer_ids", [1])):
        _edit_config(ok, "config.json", **{key: value})
        assert any(p.startswith(f"serving: {key}=") for p in _serving(ok)), key
        _edit_config(ok, "config.json", **{key: None})
    assert verify_folder(ok).ok


def test_merged_config_makes_vllm_run_the_block_bidirectionally(tmp_path):
    """The tiny target's layers are all sliding_attention: vLLM would then run the draft block causally
    (qwen3_dflash.py:62-81 via dspark/utils.py:102) unless dflash_config.causal is false."""
    ok = merge_v4_into_target(_draft_for_tiny_target(), _tiny_target_copy(tmp_path), tmp_path / "ok",
                              dtype=torch.float32)
    c = json.loads((ok / "config.json").read_text())
    assert set(c["layer_types"]) == {"sliding_attention"} and c["dflash_config"] == {"causal": False}
    assert c["sample_from_anchor"] is True and verify_folder(ok).ok
    _edit_config(ok, "config.json", dflash_config=None)  # a merge without the key
    assert any("run the draft block causally" in p for p in _serving(ok))


# ---- refusals: dense ------------------------------------------------------------------------------------
def test_dense_sliding_window_draft_is_refused_for_vllm(tmp_path):
    from dspark.models.dspark_dense import DSparkDenseDraft

    draft = DSparkDenseDraft(DSparkDenseConfig(**{**_dense_cfg(6).__dict__, "sliding_window": 8}))
    with pytest.raises(ValueError, match="sliding_window 8"):
        export_dense(draft, tmp_path / "d")


def test_verifier_catches_a_causal_dense_block(tmp_path):
    out = export_dense(_dense_draft(6), tmp_path / "d")
    _edit_config(out, "config.json", layer_types=["sliding_attention"] * 2)
    assert any("causally" in p for p in _serving(out))
    _edit_config(out, "config.json", layer_types=["sliding_attention", "full_attention"])  # one non-causal layer
    assert verify_folder(out).ok


# ---- HY V4: vLLM's own HYV4Config ---------------------------------------------------------------------
def test_hy_gated_mla_false_is_refused_and_missing_layer_types_means_no_indexer():
    from transformers import HYV4Config

    keys = dict(num_hidden_layers=3, hidden_size=16, vocab_size=40, num_attention_heads=2, q_lora_rank=8,
                kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=3,
                num_experts_per_tok=2, moe_intermediate_size=5, intermediate_size=12, index_topk=2,
                index_head_dim=6, index_n_heads=2)
    hf = HYV4Config(**keys)
    assert all(t == "indexed_attention" for t in hf.layer_types)  # transformers' default
    assert HYV4MTPConfig.from_target_config(hf).use_indexer  # ... which the transformers object alone implies
    # vLLM's HYV4Config keeps layer_types None: no sparse layer, no indexer (attention.py:322-341)
    assert not HYV4MTPConfig.from_target_config(hf, config_json=dict(keys)).use_indexer
    raw = dict(keys, layer_types=["full_attention", "full_attention", "sparse_attention"])
    assert HYV4MTPConfig.from_target_config(hf, config_json=raw).use_indexer  # entry N padded with the last
    with pytest.raises(ValueError, match="gated_mla=false"):
        HYV4MTPConfig.from_target_config(hf, config_json=dict(keys, gated_mla=False))


def test_verifier_derives_the_hy_indexer_and_gate_from_the_served_config(tmp_path):
    from test_export_mtp import _hy_draft

    out = export_mtp(_hy_draft(4, num_layers=1, use_indexer=True), tmp_path / "hy", dtype=torch.float32)
    assert verify_folder(out).ok
    _edit_config(out, "mtp_config.json", layer_types=["sparse_attention"] * 3)
    assert verify_folder(out).ok  # entry 3 padded with the last: sparse
    _edit_config(out, "mtp_config.json", layer_types=["sparse_attention", "full_attention", "full_attention"])
    problems = verify_folder(out).problems
    assert problems and all(p.startswith("unexpected: model.mtp_layers.0.self_attn.indexer.") for p in problems)
    _edit_config(out, "mtp_config.json", layer_types=None, gated_mla=False)
    assert verify_folder(out).problems == [
        "unexpected: model.mtp_layers.0.self_attn.linear_gate.weight [12, 16] F32 (no draft parameter)"]


# ---- the GPU half (scripts/vllm_serve_check.py): what can be checked without a GPU ---------------------
def test_vllm_serve_check_plans_compose(tmp_path):
    """Every case's training overrides compose into a valid config (the GPU run itself needs CUDA + vLLM)."""
    import importlib.util

    from conftest import REPO, compose

    spec = importlib.util.spec_from_file_location("vllm_serve_check", REPO / "scripts" / "vllm_serve_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for case in mod.CASES:
        plan = mod.case_plan(case, tmp_path, steps=5)
        cfg = compose([o for o in plan["train"] if not o.startswith("run_dir=")])
        assert cfg.trainer.accelerator == "gpu" and cfg.trainer.max_steps == 5
        g = cfg.draft.get("block_size") or cfg.draft.get("num_steps")
        assert plan["spec"]["num_speculative_tokens"] == plan["g"] == g, case
    assert (tmp_path / "dense_target" / "config.json").is_file()


def test_dsv4_mtp_gate_bias_follows_topk_method_too(tmp_path):
    """The DeepSeek-V4 MTP block is a DeepseekV4DecoderLayer (nvidia/mtp.py:139-146): same gate-bias rule."""
    from conftest import compose
    from dspark import factory
    from dspark.export.mtp import merge_mtp_into_target

    cfg = compose(["experiment=dsv4_mtp"])
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    assert draft.config.topk_method == "noaux_tc"  # from the shipped tiny target's config
    target_dir = _tiny_target_copy(tmp_path)
    _edit_config(target_dir, "config.json", topk_method=None)
    with pytest.raises(ValueError, match="topk_method: draft 'noaux_tc' vs target None"):
        merge_mtp_into_target(draft, target_dir, tmp_path / "m")
    out = export_mtp(draft, tmp_path / "side", dtype=torch.float32)
    assert verify_folder(out).ok
    _edit_config(out, "mtp_config.json", topk_method=None)
    problems = verify_folder(out).problems
    assert problems == ["unexpected: mtp.0.ffn.gate.bias [4] F32 (no draft parameter)"]

"""DeepSeek-V4.1 DSpark export as the target's `mtp.*` (sidecar and merged), import, and one test per vLLM 0.33.0
loader rule that fails on a broken export (rules and file:line in dspark/export/dspark_v41.py, docs/v41.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import reseal, tiny_v4_config
from dspark.export.dspark_v4 import probe_logits
from dspark.export.dspark_v41 import (MERGED_SHARD, V41DSparkAdapter, export_v41_sidecar, import_v41,
                                      load_v41_drafter, merge_v41_into_target, v41_config_from_folder)
from dspark.export.verify import verify_folder
from dspark.models.dspark_v41 import DSparkV41Config, DSparkV41Draft


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0)).to(p.dtype))


def _draft(seed=0, hf_keys=None, **keys) -> DSparkV41Draft:
    hf = tiny_v4_config(n_routed_experts=4, num_experts_per_tok=2, **(hf_keys or {}))
    base = dict(num_layers=3, block_size=4, mask_token_id=3, target_layer_ids=[0, 1], markov_rank=4,
                n_routed_experts=2, num_experts_per_tok=1)  # a draft MoE narrower than the target's
    draft = DSparkV41Draft(DSparkV41Config.from_target_config(hf, **{**base, **keys}))
    _randomise(draft, seed)
    g = torch.Generator().manual_seed(100)
    c = draft.config
    draft.share_target_weights(torch.randn(c.vocab_size, c.hidden_size, generator=g),
                               torch.randn(c.vocab_size, c.hidden_size, generator=g))
    return draft


def _edit_tensors(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))
    reseal(folder)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "dspark_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    reseal(folder)


def test_sidecar_round_trip_names_and_v41_keys(tmp_path):
    src = _draft()
    out = export_v41_sidecar(src, tmp_path / "s", dtype=torch.float32)
    report = verify_folder(out)
    assert report.ok, report.problems
    assert report.kind == V41DSparkAdapter.format
    names = set(load_file(str(out / "model.safetensors")))
    assert {"mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight", "mtp.2.confidence_head.proj.weight",
            "mtp.0.main_proj.weight", "mtp.2.norm.weight"} <= names
    assert not [n for n in names if "hc_head" in n or "markov_w" in n]
    assert {n for n in names if ".ffn.experts." in n and n.startswith("mtp.0.")} == {
        f"mtp.0.ffn.experts.{e}.w{k}.weight" for e in range(2) for k in (1, 2, 3)}
    config = json.loads((out / "dspark_config.json").read_text())
    assert config["dspark_target_layer_ids"] == [1, 2]  # entry-stream ids = target_layer_ids + 1
    assert (config["dspark_n_routed_experts"], config["dspark_num_experts_per_tok"]) == (2, 1)
    assert config["model_type"] == "deepseek_v41" and config["n_mtp_layers"] == 3
    back = DSparkV41Draft(v41_config_from_folder(out))
    assert back.config == src.config
    back.share_target_weights(src._embed_weight, src._lm_head_weight)
    import_v41(out, back)
    assert torch.equal(probe_logits(src), probe_logits(back))


def _corrupt(folder, how):
    if how == "markov_v4_name":  # V4's markov_w1 name: vLLM's V4.1 remap expects markov_head.embed
        _edit_tensors(folder, lambda t: t.__setitem__("mtp.2.markov_head.markov_w1.weight",
                                                       t.pop("mtp.2.markov_head.embed.weight")))
        return "unexpected: mtp.2.markov_head.markov_w1.weight"
    if how == "hc_head":  # V4.1 has no hc_head parameter: a V4 export's hc_head is a KeyError in load_weights
        _edit_tensors(folder, lambda t: t.__setitem__("mtp.2.hc_head_fn", torch.zeros(2, 32)))
        return "unexpected: mtp.2.hc_head_fn"
    if how == "expert_count":  # the target's expert count instead of dspark_n_routed_experts
        _edit_config(folder, dspark_n_routed_experts=4)
        return "missing: mtp.0.ffn.experts.2.w1.weight"
    if how == "stage_count":  # n_mtp_layers 2: mtp.2.* has no layer to load into
        _edit_config(folder, n_mtp_layers=2, num_nextn_predict_layers=2)
        return "unexpected: mtp.2.attn.wq_a.weight"
    if how == "main_proj_shape":  # one tap fewer than the tensor holds
        _edit_config(folder, dspark_target_layer_ids=[2])
        return "shape: mtp.0.main_proj.weight"
    if how == "confidence_disabled":  # enable_confidence_head false: no parameter for the tensor
        _edit_config(folder, enable_confidence_head=False)
        return "unexpected: mtp.2.confidence_head.proj.weight"
    if how == "tap_zero":  # entry-stream id 0 is the embedding
        _edit_config(folder, dspark_target_layer_ids=[0, 1])
        return "serving: dspark_target_layer_ids [0, 1]"
    if how == "tap_past_end":
        _edit_config(folder, dspark_target_layer_ids=[3, 4], num_hidden_layers=3)  # as a merged config has it
        return "serving: dspark_target_layer_ids [3, 4]"
    if how == "model_type":
        _edit_config(folder, model_type="deepseek_v4")
        return "serving: model_type 'deepseek_v4'"
    if how == "compress_ratios":  # layer 3 = draft layer 0 would get a compressor
        _edit_config(folder, compress_ratios=[0, 0, 0, 2], num_hidden_layers=3)
        return "serving: compress_ratios gives draft layers [3]"
    if how == "confidence_bias":
        _edit_config(folder, dspark_confidence_bias=True)
        return "serving: dspark_confidence_bias"
    if how == "unsorted_taps":
        _edit_config(folder, dspark_target_layer_ids=[2, 1])
        return "serving: dspark_target_layer_ids"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["markov_v4_name", "hc_head", "expert_count", "stage_count", "main_proj_shape",
                                 "confidence_disabled", "tap_zero", "tap_past_end", "model_type", "compress_ratios",
                                 "confidence_bias", "unsorted_taps"])
def test_each_loader_rule_fails_on_a_broken_export(tmp_path, how):
    out = export_v41_sidecar(_draft(), tmp_path / "s")
    assert verify_folder(out).ok
    word = _corrupt(out, how)
    problems = verify_folder(out).problems
    assert any(p.startswith(word) for p in problems), problems


def test_confidence_head_goes_with_its_flag(tmp_path):
    """vLLM 0.33.0 dropped a confidence head without weights (dspark.py:485-486); 0.34.0 serves it randomly
    initialised (dspark.py:543-544 there): enabled without its tensor fails, disabled without it is fine."""
    out = export_v41_sidecar(_draft(), tmp_path / "s")
    _edit_tensors(out, lambda t: t.pop("mtp.2.confidence_head.proj.weight"))
    assert any(p.startswith("serving: enable_confidence_head is on") and "0.34.0" in p
               for p in verify_folder(out).problems)
    _edit_config(out, enable_confidence_head=False)
    assert verify_folder(out).ok
    _edit_config(out, enable_confidence_head=True)
    _edit_tensors(out, lambda t: t.__setitem__("mtp.2.confidence_head.proj.weight", torch.zeros(1, 20, dtype=torch.bfloat16)))
    assert any(p.startswith("dtype: mtp.2.confidence_head.proj.weight is BF16")
               for p in verify_folder(out).problems)  # the head is float32 (qwen3_dspark.py:181)


@pytest.mark.parametrize("quant", ["fp8", "fp4"])
def test_quantised_sidecar_scales_and_import(tmp_path, quant):
    src = _draft(hf_keys=dict(hidden_size=32, moe_intermediate_size=32))  # FP4 groups of 32 inputs
    out = export_v41_sidecar(src, tmp_path / quant, quant=quant)
    assert verify_folder(out).ok, verify_folder(out).problems
    tensors = load_file(str(out / "model.safetensors"))
    lin_scale = torch.float8_e8m0fnu if quant == "fp4" else torch.float32
    assert tensors["mtp.0.attn.wq_a.scale"].dtype == lin_scale
    expert = tensors["mtp.0.ffn.experts.0.w1.weight"]
    assert expert.dtype == (torch.int8 if quant == "fp4" else torch.float8_e4m3fn)
    assert tensors["mtp.2.markov_head.embed.weight"].dtype == torch.bfloat16  # not a quantised linear
    back = DSparkV41Draft(v41_config_from_folder(out))
    back.share_target_weights(src._embed_weight, src._lm_head_weight)
    import_v41(out, back)  # dequantised
    a, b = probe_logits(src), probe_logits(back)
    assert (a - b).norm() / a.norm() < 0.2
    _edit_tensors(out, lambda t: t.__setitem__("mtp.0.attn.wq_a.scale", t["mtp.0.attn.wq_a.scale"].float()
                                               if quant == "fp4" else t["mtp.0.attn.wq_a.scale"].to(torch.bfloat16)))
    assert any(p.startswith("dtype: mtp.0.attn.wq_a.scale") for p in verify_folder(out).problems)


# ---- merged into the tiny V4.1 target; shipped drafter import ----------------------------------------------
def _tiny_target_draft(seed=0):
    from transformers import AutoConfig

    from dspark.targets import register_v41
    from dspark.targets.tiny_v41 import TINY_V41_DIR

    register_v41()
    hf = AutoConfig.from_pretrained(TINY_V41_DIR)
    cfg = DSparkV41Config.from_target_config(hf, num_layers=3, block_size=4, mask_token_id=4,
                                             target_layer_ids=[1, 2, 3], markov_rank=8)
    draft = DSparkV41Draft(cfg)
    _randomise(draft, seed)
    return draft, TINY_V41_DIR


def test_merge_into_the_tiny_v41_target_then_import_gives_identical_proposals(tmp_path):
    from dspark.targets.hf_target import load_hf_target

    draft, target_dir = _tiny_target_draft()
    target = load_hf_target(str(target_dir), [1, 2, 3])
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    out = merge_v41_into_target(draft, target_dir, tmp_path / "merged", dtype=torch.float32)
    report = verify_folder(out)
    assert report.ok and report.kind == V41DSparkAdapter.format, report.problems
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["dspark_target_layer_ids"] == [2, 3, 4]
    assert (out / MERGED_SHARD).is_file()
    shipped = load_v41_drafter(out, target.embed_weight, target.lm_head_weight)  # as a shipped V4.1 checkpoint
    ids = torch.tensor([[5, 17, 33, 9, 120, 64, 7, 300]])
    feats = target.features(ids)
    args = dict(num_drafts=4, temperature=0.0)
    mine = draft.propose_blocks([feats.aux[:, :7]], [int(ids[0, 7])], **args)[0]
    theirs = shipped.propose_blocks([feats.aux[:, :7]], [int(ids[0, 7])], **args)[0]
    assert torch.equal(mine.tokens, theirs.tokens) and torch.equal(mine.logits, theirs.logits)
    assert torch.equal(mine.conf, theirs.conf)


def test_merge_refuses_a_v4_target_and_other_sizes(tmp_path):
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    draft, target_dir = _tiny_target_draft()
    with pytest.raises(ValueError, match="model_type 'deepseek_v4'"):
        merge_v41_into_target(draft, TINY_V4_DIR, tmp_path / "m4")
    hf = draft.config
    other = DSparkV41Draft(DSparkV41Config(**{**hf.__dict__, "sliding_window": 32}))
    with pytest.raises(ValueError, match="sliding_window"):
        merge_v41_into_target(other, target_dir, tmp_path / "m")


def test_init_from_a_shipped_v41_checkpoint_starts_from_its_drafter(tmp_path):
    """draft.init_from=<V4.1 checkpoint>: the draft a run starts from is the checkpoint's drafter (export -> import
    -> identical parameters and proposals on the tiny target); another family's folder or sizes are refused."""
    from conftest import compose

    from dspark import factory
    from dspark.errors import ConfigError
    from dspark.warm_start import init_from

    cfg = compose(["experiment=dspark_v41"])
    target = factory.build_target(cfg.target, cfg.draft)
    src = factory.build_draft(cfg.draft, target)
    _randomise(src, 5)
    shipped = merge_v41_into_target(src, target_dir=factory.target_folder(cfg.target), out_dir=tmp_path / "ckpt",
                                    dtype=torch.float32)
    started = factory.build_draft(cfg.draft, target)
    init_from(started, str(shipped))  # what training.run does with draft.init_from
    for (name, a), (_, b) in zip(src.named_parameters(), started.named_parameters()):
        assert torch.equal(a, b), name
    ids = torch.tensor([[5, 17, 33, 9, 120, 64, 7, 300]])
    aux = target.features(ids).aux[:, :7]
    p, r = (d.propose_blocks([aux], [300], num_drafts=4)[0] for d in (src, started))
    assert torch.equal(p.tokens, r.tokens) and torch.equal(p.logits, r.logits)
    with pytest.raises(ConfigError, match="draft.init_from"):
        init_from(factory.build_draft(cfg.draft, target), str(tmp_path))
    small = compose(["experiment=dspark_v41", "draft.num_layers=2"])
    with pytest.raises(ConfigError, match="draft.init_from"):
        init_from(factory.build_draft(small.draft, target), str(shipped))


@pytest.mark.slow
def test_train_export_merged_and_verify_end_to_end(tmp_path):
    """`python train.py experiment=dspark_v41` on the tiny default (2 steps), then the CLI's merged export verifies."""
    import subprocess
    import sys

    from conftest import REPO

    run = tmp_path / "run"
    env_cmd = [sys.executable, "train.py", "experiment=dspark_v41", "trainer.max_steps=2", f"run_dir={run}"]
    done = subprocess.run(env_cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (run / "draft" / "model.safetensors").is_file()
    out = tmp_path / "merged"
    cli = subprocess.run([sys.executable, "-m", "dspark.export", "v41", "--run-dir", str(run), "--out", str(out),
                          "--merge-into", str(REPO / "dspark/assets/tiny_v41")], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert cli.returncode == 0 and "OK " in cli.stdout, cli.stdout[-2000:] + cli.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["dspark_target_layer_ids"] == [2, 3, 4]

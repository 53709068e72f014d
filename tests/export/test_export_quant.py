"""FP8 block / FP4 expert quantisation of the DeepSeek-V4 export: exact values on hand-made blocks, error
bounds, quantised sidecar + merge round trips, the verifier on quantised sets, real-size plan on meta."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from conftest import REPO, reseal, tiny_v4_config
from dspark.export import quant as q
from dspark.export.dspark_v4 import (QUANT_REPORT, export_v4_sidecar, import_v4_sidecar, merge_v4_into_target,
                                     probe_logits, quant_report, v4_config_from_folder, v4_config_json,
                                     v4_export_plan)
from dspark.export.dspark_v4 import v4_expected as _v4_expected, v4_optional as _v4_optional
from dspark.export.verify import verify_folder
from dspark.models.registry import config_values as draft_fields
from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft
from test_export import _cli, _randomise, tiny_v4_run


def _naive_exponent(amax: float, qmax: float) -> int:
    """Smallest e with amax / 2^e <= qmax, by counting (no frexp)."""
    if amax == 0:
        return 0
    e = math.ceil(math.log2(amax / qmax)) - 2
    while amax / 2.0 ** e > qmax:
        e += 1
    return e


def _naive_e2m1(x: float) -> float:
    """Nearest e2m1 value by distance; on a tie the value with the even index (mantissa bit 0)."""
    vals = q.E2M1_VALUES
    d = [abs(abs(x) - v) for v in vals]
    best = min(range(8), key=lambda i: (d[i], i % 2))
    return math.copysign(vals[best], x) if vals[best] else 0.0


# ---- FP8 128x128 blocks -----------------------------------------------------------------------------
def test_fp8_exact_for_representable_blocks_and_pow2_scales():
    # [130, 256]: blocks (0,0) (0,1) full, (1,0) (1,1) two rows only; each block has its own amax.
    g = torch.Generator().manual_seed(0)
    mant = torch.tensor([1.0, 1.125, 1.25, 1.5, 1.75, 1.875])  # exactly representable in e4m3 (3 mantissa bits)
    base = mant[torch.randint(0, 6, (130, 256), generator=g)] * torch.randint(-3, 4, (130, 256), generator=g).sign()
    block_scale = {(0, 0): 2.0 ** -9, (0, 1): 2.0 ** 3, (1, 0): 1.0, (1, 1): 2.0 ** -1}
    w = base.clone()
    for (i, j), s in block_scale.items():
        w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= 256 * s  # values up to 1.875 * 256 = 480 > 448
    qw, scale = q.quantize_fp8_block(w)
    assert qw.dtype == torch.float8_e4m3fn and qw.shape == (130, 256)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 2)
    for (i, j) in block_scale:
        amax = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max().item()
        want = 2.0 ** _naive_exponent(amax, 448.0)
        assert scale[i, j].float().item() == want, (i, j, amax)
        assert amax / want <= 448.0 < amax / want * 2 or amax == 0
    assert torch.equal(q.dequantize_fp8_block(qw, scale), w)  # every value is e4m3 * a power of two
    qw32, scale32 = q.quantize_fp8_block(w, scale_dtype=torch.float32)
    assert scale32.dtype == torch.float32 and torch.equal(scale32, scale.float()) and torch.equal(qw32, qw)


def test_fp8_error_bound_and_zero_block():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-3, 1, 300)  # mixed magnitudes per column
    w[128:, :128] = 0.0  # an all-zero block
    qw, scale = q.quantize_fp8_block(w)
    back = q.dequantize_fp8_block(qw, scale)
    s = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    # half an e4m3 ulp: 2^-4 relative for normals, 2^-10 * scale in the subnormal range
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2 ** -4, s * 2 ** -10)).all()
    assert (back[128:, :128] == 0).all()
    with pytest.raises(ValueError, match="block grid"):
        q.dequantize_fp8_block(qw, scale[:, :1])


# ---- FP4 e2m1 ----------------------------------------------------------------------------------------
def test_fp4_exact_values_nibble_order_and_scale():
    vals = torch.tensor(q.E2M1_VALUES + tuple(-v for v in q.E2M1_VALUES[1:]) + (0.0,) * 17)  # 32 inputs
    w = torch.stack([vals * 2.0 ** -3, vals.roll(5) * 2.0 ** 4])  # [2, 32], one group per row
    packed, scale = q.quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (2, 16)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 1)
    assert scale.float().flatten().tolist() == [2.0 ** -3, 2.0 ** 4]  # amax 6 * 2^e -> exactly 2^e
    assert torch.equal(q.dequantize_fp4(packed, scale), w)
    # element 0 (0.0 -> code 0) in the low nibble, element 1 (0.5 -> code 1) in the high nibble
    assert packed.view(torch.uint8)[0, 0].item() == 0x10
    one_neg_two, _ = q.quantize_fp4(torch.tensor([[1.0, -2.0] + [0.0] * 30]) * 1.0)
    # 1.0 -> code 2 (low), -2.0 -> 0x8 | 4 = 12 (high); amax 2 -> scale 2^-1 -> 1.0 is 2.0 (code 4), -2 is -4 (code 14)
    assert one_neg_two.view(torch.uint8)[0, 0].item() == (14 << 4) | 4


def test_fp4_rounds_to_nearest_e2m1_ties_to_even():
    g = torch.Generator().manual_seed(2)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.75, -5.0]
    x = torch.cat([torch.tensor(ties), torch.rand(22, generator=g) * 12 - 6])
    x[-1] = 6.0  # amax exactly 6 -> scale 1, so x itself is what gets rounded
    packed, scale = q.quantize_fp4(x[None])
    assert scale.float().item() == 1.0
    got = q.dequantize_fp4(packed, scale)[0].tolist()
    assert got == [_naive_e2m1(v) for v in x.tolist()]
    assert got[:7] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_fp4_error_bound_and_bad_width():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 128, generator=g) * torch.logspace(-2, 1, 128)
    packed, scale = q.quantize_fp4(w)
    back = q.dequantize_fp4(packed, scale)
    s = scale.float().repeat_interleave(32, 1)
    assert ((back - w).abs() <= 0.25 * w.abs() + 0.25 * s).all()
    for grp in range(4):  # each group's amax maps to <= 6 and > 3 (the covering power of two)
        amax = w[:, grp * 32:(grp + 1) * 32].abs().amax(1)
        ratio = amax / scale[:, grp].float()
        assert ((ratio <= 6) & (ratio > 3)).all()
    with pytest.raises(ValueError, match="multiple of the FP4 group size 32"):
        q.quantize_fp4(torch.randn(4, 48))


def test_dequantize_tensors_pairs_and_raw_byte_scales():
    g = torch.Generator().manual_seed(4)
    w8, w4 = torch.randn(130, 64, generator=g), torch.randn(8, 64, generator=g)
    a, sa = q.quantize_fp8_block(w8)
    b, sb = q.quantize_fp4(w4)
    out = q.dequantize_tensors({"x.weight": a, "x.scale": sa, "e.weight": b, "e.scale": sb.view(torch.uint8),
                                "n.weight": torch.ones(3)})
    assert set(out) == {"x.weight", "e.weight", "n.weight"}
    assert torch.equal(out["x.weight"], q.dequantize_fp8_block(a, sa))
    assert torch.equal(out["e.weight"], q.dequantize_fp4(b, sb))  # vLLM-style uint8 exponent bytes
    with pytest.raises(ValueError, match="x.scale is missing"):
        q.dequantize_tensors({"x.weight": a})
    with pytest.raises(ValueError, match="has no matching .weight"):
        q.dequantize_tensors({"x.scale": sa})


# ---- V4 sidecar / merge with quantisation ------------------------------------------------------------
def _v4_draft(seed: int) -> DSparkV4Draft:
    # hidden and moe_intermediate multiples of 32 (FP4 groups); 3 layers, 2 experts, shared expert
    hf = tiny_v4_config(hidden_size=32, moe_intermediate_size=32, q_lora_rank=16)
    cfg = DSparkV4Config.from_target_config(hf, num_layers=3, block_size=4, mask_token_id=3, target_layer_ids=[0, 1],
                                        markov_rank=4)
    draft = DSparkV4Draft(cfg)
    _randomise(draft, seed)
    draft.set_dtype(torch.bfloat16)
    g = torch.Generator().manual_seed(100)
    draft.share_target_weights(torch.randn(cfg.vocab_size, 32, generator=g), torch.randn(cfg.vocab_size, 32, generator=g))
    return draft


@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_quantised_sidecar_round_trip(tmp_path, mode):
    src = _v4_draft(1)
    out = export_v4_sidecar(src, tmp_path / mode, quant=mode)
    tensors = load_file(str(out / "model.safetensors"))
    plan = v4_export_plan(src, quant=mode)
    assert {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()} == plan
    lin_scale = torch.float8_e8m0fnu if mode == "fp4" else torch.float32
    assert tensors["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["mtp.0.main_proj.scale"].dtype == lin_scale and tensors["mtp.0.main_proj.scale"].shape == (1, 1)
    assert tensors["mtp.1.attn.wo_b.scale"].dtype == lin_scale
    assert tensors["mtp.2.ffn.shared_experts.w2.weight"].dtype == torch.float8_e4m3fn
    expert = tensors["mtp.1.ffn.experts.1.w2.weight"]
    if mode == "fp4":
        assert expert.dtype == torch.int8 and expert.shape == (32, 16)
        assert tensors["mtp.1.ffn.experts.1.w2.scale"].shape == (32, 1)
    else:
        assert expert.dtype == torch.float8_e4m3fn and tensors["mtp.1.ffn.experts.1.w2.scale"].shape == (1, 1)
    for kept in ("mtp.0.ffn.gate.weight", "mtp.2.markov_head.markov_w2.weight"):
        assert tensors[kept].dtype == torch.bfloat16 and kept.removesuffix(".weight") + ".scale" not in tensors
    assert tensors["mtp.2.confidence_head.proj.weight"].dtype == torch.float32
    cfg = json.loads((out / "dspark_config.json").read_text())
    assert cfg["expert_dtype"] == mode and cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["quantization_config"]["scale_fmt"] == ("ue8m0" if mode == "fp4" else "float")
    assert verify_folder(out).ok, verify_folder(out).problems

    dst = import_v4_sidecar(out, _v4_draft(2))
    deq = q.dequantize_tensors(tensors)
    assert torch.equal(dst.main_proj.weight, deq["mtp.0.main_proj.weight"].to(torch.bfloat16))
    assert torch.equal(dst.layers[1].ffn.experts[1].w2.weight, deq["mtp.1.ffn.experts.1.w2.weight"].to(torch.bfloat16))
    assert torch.equal(dst.layers[0].ffn.gate.weight, src.layers[0].ffn.gate.weight)  # unquantised: bit-exact
    rel = (src.main_proj.weight.float() - dst.main_proj.weight.float()).norm() / src.main_proj.weight.float().norm()
    assert 0 < rel < (0.05 if mode == "fp8" else 0.05)
    a, b = probe_logits(src), probe_logits(dst)
    assert 0 < (a - b).norm() / a.norm() < (0.05 if mode == "fp8" else 0.2)

    rep = quant_report(src, out)
    saved = json.loads((out / QUANT_REPORT).read_text())
    assert saved["quant"] == mode and saved["logits"]["max_abs_diff"] == pytest.approx((a - b).abs().max().item())
    w = src.main_proj.weight.float()
    want = q.error_stats(w, q.dequantize_tensors(tensors)["mtp.0.main_proj.weight"])
    assert rep["tensors"]["mtp.0.main_proj.weight"] == pytest.approx(want)
    assert len(rep["tensors"]) == sum(1 for k in tensors if k.endswith(".scale"))


def test_verifier_on_quantised_sets(tmp_path):
    out = export_v4_sidecar(_v4_draft(3), tmp_path / "fp4", quant="fp4")
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    tensors["mtp.0.attn.wq_b.weight"] = tensors["mtp.0.attn.wq_b.weight"].float().to(torch.bfloat16)  # unquantised
    tensors["mtp.1.ffn.experts.0.w1.scale"] = tensors["mtp.1.ffn.experts.0.w1.scale"][:, :0].contiguous()
    del tensors["mtp.2.attn.wkv.scale"]
    tensors["mtp.2.ffn.gate.scale"] = torch.ones(1, 1)
    save_file(tensors, str(path))
    reseal(path.parent)  # hand-edited: only the layout checks should object
    assert sorted(verify_folder(out).problems) == sorted([
        "dtype: mtp.0.attn.wq_b.weight is BF16, expected F8_E4M3",
        "missing: mtp.2.attn.wkv.scale [1, 1] F8_E8M0",
        "shape: mtp.1.ffn.experts.0.w1.scale is [32, 0], expected [32, 1]",
        "unexpected: mtp.2.ffn.gate.scale [1, 1] F32 (no draft parameter)",
    ])


def test_merge_quant_must_match_the_target(tmp_path):
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    target = tmp_path / "target"
    shutil.copytree(TINY_V4_DIR, target)
    hf = json.loads((target / "config.json").read_text())
    keys = {k: hf[k] for k in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "head_dim",
                               "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok",
                               "hc_mult", "sliding_window")}
    src = DSparkV4Draft(DSparkV4Config.from_target_config(tiny_v4_config(**keys), num_layers=1, block_size=4,
                                                      mask_token_id=4, target_layer_ids=[1, 2], markov_rank=8))
    _randomise(src, 9)
    with pytest.raises(ValueError, match="no quantization_config"):
        merge_v4_into_target(src, target, tmp_path / "m0", quant="fp8")
    hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                 "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}  # V4-Flash: no expert_dtype
    (target / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"expert_dtype 'fp4'.*quant='fp4'"):
        merge_v4_into_target(src, target, tmp_path / "m1")  # a BF16 draft into an FP8 checkpoint
    with pytest.raises(ValueError, match=r"quant='fp4'.*got 'fp8'"):
        merge_v4_into_target(src, target, tmp_path / "m2", quant="fp8")
    out = merge_v4_into_target(src, target, tmp_path / "m3", quant="fp4")
    assert verify_folder(out).ok, verify_folder(out).problems
    assert load_file(str(out / "model-dspark-mtp.safetensors"))["mtp.0.ffn.experts.3.w2.weight"].dtype == torch.int8
    # "start from a released draft": config from the checkpoint's config.json, FP8/FP4 tensors dequantised
    cfg = v4_config_from_folder(out)
    assert cfg == src.config
    back = import_v4_sidecar(out, DSparkV4Draft(cfg))
    rel = (back.main_proj.weight - src.main_proj.weight).norm() / src.main_proj.weight.norm()
    assert 0 < rel < 0.05
    # vLLM builds the draft layers from the target config: a draft with other sizes is refused
    other = DSparkV4Draft(DSparkV4Config.from_dict({**src.config.__dict__, "sliding_window": 32}))
    with pytest.raises(ValueError, match="sliding_window: draft 32 vs target 64"):
        merge_v4_into_target(other, target, tmp_path / "m4", quant="fp4")


def test_v4_config_from_a_sidecar(tmp_path):
    src = _v4_draft(6)
    out = export_v4_sidecar(src, tmp_path / "s", quant="fp8")
    assert v4_config_from_folder(out) == src.config


# ---- real size on the meta device --------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_flash_quantised_plan_on_meta_matches_the_verifier(mode):
    cfg = DSparkV4Config.from_dict(draft_fields(OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "draft" / "dspark_v4_flash.yaml"), resolve=True)))
    with torch.device("meta"):
        draft = DSparkV4Draft(cfg.validate())
    plan = v4_export_plan(draft, quant=mode)
    lin_scale = torch.float8_e8m0fnu if mode == "fp4" else torch.float32
    assert plan["mtp.0.main_proj.weight"] == ((4096, 12288), torch.float8_e4m3fn)
    assert plan["mtp.0.main_proj.scale"] == ((32, 96), lin_scale)
    assert plan["mtp.1.attn.wq_b.scale"][1] == lin_scale
    if mode == "fp4":
        assert plan["mtp.1.ffn.experts.255.w1.weight"] == ((2048, 2048), torch.int8)
        assert plan["mtp.1.ffn.experts.255.w1.scale"] == ((2048, 128), torch.float8_e8m0fnu)
        assert plan["mtp.1.ffn.experts.255.w2.weight"] == ((4096, 1024), torch.int8)
    else:
        assert plan["mtp.1.ffn.experts.255.w1.scale"] == ((16, 32), torch.float32)
    assert plan["mtp.0.ffn.gate.weight"] == ((256, 4096), torch.bfloat16) and "mtp.0.ffn.gate.scale" not in plan
    assert plan["mtp.2.markov_head.markov_w2.weight"] == ((129280, 256), torch.bfloat16)
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
             torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8"}
    c = json.loads(json.dumps(v4_config_json(cfg, quant=mode)))
    expected = {**_v4_expected(c), **_v4_optional(c)}  # the confidence head is optional for vLLM
    assert {k: (s, names[d]) for k, (s, d) in plan.items()} == expected


def test_cli_quantised_export_of_a_tiny_v4_run(tmp_path):
    from dspark import factory

    cfg, target, draft, _ = tiny_v4_run(tmp_path, num_layers=1)
    out = tmp_path / "out"
    res = _cli("v4", "--run-dir", str(tmp_path / "run"), "--out", str(out), "--quant", "fp4")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[-2].startswith("OK ") and lines[-1].startswith("next: ") and any(l.startswith("fp4: ") and "top-1 agreement" in l for l in lines)
    rep = json.loads((out / QUANT_REPORT).read_text())
    assert rep["logits"]["top1_agreement"] > 0.5 and rep["max_rel_err"] < 0.2
    back = import_v4_sidecar(out, factory.build_draft(cfg.draft, target))
    a, b = probe_logits(draft), probe_logits(back)
    assert (a - b).abs().max().item() == pytest.approx(rep["logits"]["max_abs_diff"], rel=1e-5)

"""The DeepSeek-V4 decoder block as vLLM 0.33.0 serves it, shared by the two V4 adapters (DSpark: dspark_v4.py,
native MTP: dsv4_mtp.py): its config keys (DeepseekV4Config names), its checkpoint tensors and the float32 set."""
from __future__ import annotations

import torch

from dspark.export.adapter import Expected
from dspark.models.dspark_v4 import FP32_PARAM_RE

# DeepseekV4Config key -> draft config field, for every block size vLLM builds the draft / MTP layers from
BLOCK_KEYS: dict[str, str] = {k: k for k in (
    "hidden_size", "vocab_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups",
    "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
    "routed_scaling_factor", "swiglu_limit", "scoring_func", "topk_method", "norm_topk_prob", "hc_mult",
    "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "sliding_window", "rope_theta")} | {"qk_rope_head_dim": "rope_head_dim"}


def block_config_json(cfg) -> dict:
    """The V4 block sizes and the MTP layer count under DeepseekV4Config key names (a DSpark V4 or a DeepSeek-V4
    MTP draft config: both carry the V4 block fields)."""
    return {"n_mtp_layers": cfg.num_layers, "num_nextn_predict_layers": cfg.num_layers,
            **{key: getattr(cfg, field) for key, field in BLOCK_KEYS.items()}}


def keeps_float32(name: str) -> bool:
    """V4's float32 set (hc_*, norms, attn_sink, gate bias, confidence head), as the released checkpoints store it."""
    return FP32_PARAM_RE.search(name) is not None


def export_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a V4 draft parameter is written in: float32 for the fp32 set, `dtype` otherwise."""
    return torch.float32 if keeps_float32(name) else dtype


def block_expected(p: str, c: dict, wide: str) -> Expected:
    """One DeepSeek-V4 decoder block under prefix p (sliding-window attention, no compressor / indexer), from the
    config alone; the gate bias only under topk_method "noaux_tc" (models/deepseek_v4/nvidia/model.py:301-309)."""
    f32 = "F32"
    H, nh, D = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    ql, G, R = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    E, I, hc = c["n_routed_experts"], c["moe_intermediate_size"], c["hc_mult"]
    shared = c.get("n_shared_experts", 1)
    mix = (2 + hc) * hc
    exp: Expected = {
        p + "attn.wq_a.weight": ((ql, H), wide),
        p + "attn.q_norm.weight": ((ql,), f32),
        p + "attn.wq_b.weight": ((nh * D, ql), wide),
        p + "attn.wkv.weight": ((D, H), wide),
        p + "attn.kv_norm.weight": ((D,), f32),
        p + "attn.wo_a.weight": ((G * R, nh * D // G), wide),
        p + "attn.wo_b.weight": ((H, G * R), wide),
        p + "attn.attn_sink": ((nh,), f32),
        p + "attn_norm.weight": ((H,), f32),
        p + "ffn_norm.weight": ((H,), f32),
        p + "ffn.gate.weight": ((E, H), wide),
    }
    if c.get("topk_method") == "noaux_tc":
        exp[p + "ffn.gate.bias"] = ((E,), f32)
    for which in ("attn", "ffn"):
        exp[f"{p}hc_{which}_fn"] = ((mix, hc * H), f32)
        exp[f"{p}hc_{which}_base"] = ((mix,), f32)
        exp[f"{p}hc_{which}_scale"] = ((3,), f32)
    experts = [(f"ffn.experts.{e}.", I) for e in range(E)]
    if shared:
        experts.append(("ffn.shared_experts.", I * shared))
    for stem, inter in experts:
        exp[p + stem + "w1.weight"] = ((inter, H), wide)
        exp[p + stem + "w2.weight"] = ((H, inter), wide)
        exp[p + stem + "w3.weight"] = ((inter, H), wide)
    return exp


def hc_head_expected(p: str, H: int, hc: int) -> Expected:
    """hc_head_{fn,base,scale} + norm of one head stack under prefix p (float32)."""
    return {p + "norm.weight": ((H,), "F32"), p + "hc_head_fn": ((hc, hc * H), "F32"), p + "hc_head_base": ((hc,), "F32"),
            p + "hc_head_scale": ((1,), "F32")}


__all__ = ["BLOCK_KEYS", "block_config_json", "block_expected", "export_dtype", "hc_head_expected", "keeps_float32"]

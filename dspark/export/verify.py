"""Independent checker for exported serving folders (`python -m dspark.export verify PATH`).

Deliberately shares nothing with the exporters or the draft modules: it re-derives the tensor set
the serving loader expects from the folder's own config JSON and the naming rules in SPEC.md 4/5,
then compares with the safetensors headers (no tensor data is read).

DeepSeek-V4 (dspark_config.json, or a config.json carrying dspark_* keys):
  mtp.{i}.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b}.weight, mtp.{i}.attn.attn_sink,
  mtp.{i}.{attn_norm,ffn_norm}.weight, mtp.{i}.hc_{attn,ffn}_{fn,base,scale},
  mtp.{i}.ffn.gate.{weight,bias}, mtp.{i}.ffn.experts.{e}.w{1,2,3}.weight, mtp.{i}.ffn.shared_experts.w{1,2,3}.weight
  mtp.0.main_proj.weight, mtp.0.main_norm.weight
  mtp.{N-1}.norm.weight, mtp.{N-1}.hc_head_{fn,base,scale}, mtp.{N-1}.markov_head.*, mtp.{N-1}.confidence_head.proj.*
  float32: hc_*, *norm.weight, attn_sink, gate.bias, confidence_head.*; the rest torch_dtype.
  Quantised sets (the config has a DeepSeek-V4 `quantization_config`; expert_dtype from the config, default
  "fp4" as in vLLM): main_proj, attn.{wq_a,wkv,wq_b,wo_a,wo_b}, shared_experts.w{1,2,3} (and the routed
  experts when expert_dtype is "fp8") are F8_E4M3 `.weight` + `.scale` [ceil(N/b), ceil(K/b)] (F8_E8M0 when
  expert_dtype is "fp4", else F32); routed experts under "fp4" are I8 [N, K/2] + F8_E8M0 `.scale` [N, K/32].
Dense (config.json with architectures Qwen3DSparkModel / DFlashDraftModel, or a speculators "dspark" /
  "dflash" config, translated as vLLM does: target layer = aux id - 1): fc, hidden_norm,
  layers.{i}.{input_layernorm,post_attention_layernorm}, self_attn.{q,k,v,o}_proj + q_norm/k_norm,
  mlp.{gate,up,down}_proj, norm, and for DSpark markov_head.markov_w1 [V, r] / markov_w2 [Vd, r]
  (+ confidence_head.proj.{weight,bias} when enable_confidence_head, width H + r with
  confidence_head_with_markov else H, as vLLM builds it). Reduced vocab (draft_vocab_size < vocab_size):
  lm_head.weight [Vd, H] and d2t [Vd] I64 required, t2d [V] BOOL allowed; embed_tokens allowed.
MTP sidecars (mtp_config.json, `dspark_format`):
  "deepseek_v4_mtp_native": per layer i < num_nextn_predict_layers, mtp.{i}.{enorm,hnorm,norm}.weight [H] F32,
  mtp.{i}.{e_proj,h_proj}.weight [H, H], mtp.{i}.hc_head_{fn [hc, hc*H], base [hc], scale [1]} F32, and the V4
  block tensors above (attn.*, ffn.*, attn_norm, ffn_norm, hc_attn_*, hc_ffn_*) with the same dtype rules.
  "hy_v4_mtp": per layer i, prefix model.mtp_layers.{i}. (mtp_layer_names "layers": model.layers.{N+i}.,
  N = num_hidden_layers): enorm, hnorm, final_layernorm, input_layernorm, post_attention_layernorm [H],
  eh_proj [H, 2H], self_attn.{q_a_proj [ql, H], q_a_layernorm [ql], q_b_proj [nh*(nope+rope), ql],
  kv_a_proj_with_mqa [kvl+rope, H], kv_a_layernorm [kvl], kv_b_proj [nh*(nope+v), kvl], o_proj [H, nh*v],
  linear_gate [nh*v (elementwise) | nh (headwise), H]}, self_attn.learnable_sink_param [nh] F32 (learnable_sink),
  self_attn.indexer.{wq_b [n*d, ql], wk [d, H], k_norm.{weight,bias} [d], weights_proj [n, H]} when
  mtp_layer_type is sparse; MoE (mtp_mlp_layer_type "sparse"): mlp.gate.weight [E, H] F32,
  mlp.gate.e_score_correction_bias [E] F32, mlp.experts.gate_up_proj [E, 2I, H] + down_proj [E, H, I] (or split
  per expert when mtp_split_experts), mlp.shared_experts.{gate,up,down}_proj (I * n_shared); dense:
  mlp.{gate,up,down}_proj (intermediate_size). Everything not marked F32 is torch_dtype.
  mtp_merged: true (a target checkpoint with the draft merged in): only the MTP tensors (mtp.* / HY V4
  model.mtp_layers.* and model.layers.{>=N}.*) are judged, and the keys vLLM reads from the target config.json
  (num_nextn_predict_layers, layer_types, gated_mla, topk_method, ...) override the sidecar's.

vLLM 0.33.0 loading / serving rules encoded here (file:line in the vllm==0.33.0 wheel; docs/verification.md
has the table with the test that breaks each one):
  V4 DSpark: gate bias iff topk_method == "noaux_tc" (models/deepseek_v4/nvidia/model.py:301-309); n_mtp_layers
    stages, default 3, anything else is a KeyError (nvidia/dspark.py:106, 572-600); confidence head optional,
    never a bias (dspark.py:175-180, 567-568); only markov_w1/w2; ascending dspark_target_layer_ids
    (model.py:993-1014); keys read before the dspark_* ones (mask_token_id, dflash_config.*, block_size,
    eagle_aux_hidden_state_layer_ids); the draft block's causality from layer_types (qwen3_dflash.py:62-81);
    dspark_rope_theta == rope_theta (common/rope.py:28-42); the 1+N layout's non-causal window width
    (v1/attention/backends/mla/compressor_utils.py:22-28).
  Dense: no "model." prefix (qwen3_dspark.py:312-330); reduced vocab needs lm_head + d2t (qwen3_dspark.py:
    341-358); confidence head per enable_confidence_head / confidence_head_with_markov (qwen3_dspark.py:
    219-231); only markov_w1/w2; dflash_config.sample_from_anchor never true (dflash/speculator.py:80-88);
    ascending target layers (models/interfaces.py:1640-1650); a non-causal block (qwen3_dflash.py:62-81).
  DeepSeek-V4 MTP: num_nextn_predict_layers layers (deepseek_v4/nvidia/mtp.py:218-238), gate bias iff
    noaux_tc; >= 2 layers run vLLM's multi-module MTP speculator (config/speculative.py:2188-2194), a note.
  HY V4 MTP: max(num_nextn_predict_layers, 1) layers built (hy_v4/nvidia/mtp.py:414-417); model.layers.{N+i}
    names load only for i < max(num_nextn_predict_layers - 1, 1) (mtp.py:57-72); linear_gate iff gated_mla
    (default true, transformers_utils/configs/hy_v4.py:125; hy_v4/nvidia/attention.py:464-485); indexer iff the
    MTP layer's extended layer_types entry is sparse and layer_types exists (attention.py:322-341, mtp.py:
    343-356, 391-398); default RoPE only (the draft has no YaRN).
A folder written with `dspark_not_for_vllm` (CLI --not-for-vllm, or a speculators config with a head vLLM does
not have) gets the serving rules as notes, not problems.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}
_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "I64": 8, "BOOL": 1}
_V4_FP8_STEMS = ("main_proj", "attn.wq_a", "attn.wkv", "attn.wq_b", "attn.wo_a", "attn.wo_b",
                 "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")
DENSE_ARCHS = ("Qwen3DSparkModel", "DFlashDraftModel")


@dataclass
class Report:
    kind: str
    n_tensors: int = 0
    n_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # serving rules of a dspark_not_for_vllm folder, advisories

    @property
    def ok(self) -> bool:
        return not self.problems


NOT_FOR_VLLM = "dspark_not_for_vllm"


def _serving(report: Report, cfg: dict, lines: list[str]) -> None:
    """Add `serving:` lines: problems, or notes when the folder says it is not for vLLM."""
    target = report.notes if cfg.get(NOT_FOR_VLLM) else report.problems
    target.extend(f"serving: {line}" for line in lines)


def _v4_expected(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    wide = _DTYPES[c.get("dspark_torch_dtype") or c.get("torch_dtype") or "bfloat16"]
    f32 = "F32"
    H, V, hc = c["hidden_size"], c["vocab_size"], c["hc_mult"]
    r = c["dspark_markov_rank"]
    n_layers = c.get("n_mtp_layers") or 3  # vLLM: getattr(config, "n_mtp_layers", None) or 3 (dspark.py:106)
    n_ctx = len(c["dspark_target_layer_ids"])
    exp: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(n_layers):
        exp.update(_v4_block(f"mtp.{i}.", c, wide))
    exp["mtp.0.main_proj.weight"] = ((H, n_ctx * H), wide)
    exp["mtp.0.main_norm.weight"] = ((H,), f32)
    last = f"mtp.{n_layers - 1}."
    exp[last + "norm.weight"] = ((H,), f32)
    exp[last + "hc_head_fn"] = ((hc, hc * H), f32)
    exp[last + "hc_head_base"] = ((hc,), f32)
    exp[last + "hc_head_scale"] = ((1,), f32)
    exp.update(_markov(last + "markov_head.", c.get("dspark_markov_head_type", "vanilla"), V, V, r, H, wide))
    if c.get("dspark_confidence_bias"):
        exp[last + "confidence_head.proj.bias"] = ((1,), f32)
    qc = c.get("quantization_config")
    if qc:
        _v4_quantised(exp, qc, c.get("expert_dtype") or qc.get("expert_dtype") or "fp4")
    return exp


def _v4_optional(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """The V4 confidence head: built when enable_confidence_head (default true), dropped by the loader when the
    checkpoint has none (nvidia/dspark.py:175-180, 567-568); Linear(H + r -> 1, no bias, float32)."""
    if c.get("enable_confidence_head", True) is False:
        return {}
    last = f"mtp.{(c.get('n_mtp_layers') or 3) - 1}."
    return {last + "confidence_head.proj.weight": ((1, c["hidden_size"] + c["dspark_markov_rank"]), "F32")}


def _v4_block(p: str, c: dict, wide: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """One DeepSeek-V4 decoder block under prefix p (sliding-window attention, no compressor / indexer); the
    gate bias only under topk_method "noaux_tc" (models/deepseek_v4/nvidia/model.py:301-309)."""
    f32 = "F32"
    H, nh, D = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    ql, G, R = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    E, I, hc = c["n_routed_experts"], c["moe_intermediate_size"], c["hc_mult"]
    shared = c.get("n_shared_experts", 1)
    mix = (2 + hc) * hc
    exp: dict[str, tuple[tuple[int, ...], str]] = {}
    exp.update({
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
    })
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


MTP_CONFIG = "mtp_config.json"
MTP_FORMATS = ("hy_v4_mtp", "deepseek_v4_mtp_native")


def _need(c: dict, *keys: str) -> list:
    missing = [k for k in keys if k not in c]
    if missing:
        raise ValueError(f"{MTP_CONFIG}: missing keys {missing}")
    return [c[k] for k in keys]


def _dsv4_mtp_expected(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """DeepSeek-V4 native MTP: mtp.{i}.* = layer-level tensors + one V4 block."""
    _need(c, "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
          "n_routed_experts", "moe_intermediate_size", "hc_mult", "torch_dtype")
    wide = _DTYPES[c["torch_dtype"]]
    H, hc = c["hidden_size"], c["hc_mult"]
    n_layers = c.get("num_nextn_predict_layers") or c.get("n_mtp_layers")
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"{MTP_CONFIG}: num_nextn_predict_layers must be a positive int, got {n_layers!r}")
    exp: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(n_layers):
        p = f"mtp.{i}."
        exp.update(_v4_block(p, c, wide))
        for norm in ("enorm", "hnorm", "norm"):
            exp[f"{p}{norm}.weight"] = ((H,), "F32")
        exp[p + "e_proj.weight"] = ((H, H), wide)
        exp[p + "h_proj.weight"] = ((H, H), wide)
        exp[p + "hc_head_fn"] = ((hc, hc * H), "F32")
        exp[p + "hc_head_base"] = ((hc,), "F32")
        exp[p + "hc_head_scale"] = ((1,), "F32")
    return exp


def _hy_mtp_expected(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """HY V4 MTP: model.mtp_layers.{i}.* (or model.layers.{N+i}.*), flat block names (SPEC.md 6)."""
    H, nh, ql, kvl, nope, rope, vd, n_layers, dt = _need(
        c, "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers", "torch_dtype")
    wide = _DTYPES[dt]
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"{MTP_CONFIG}: num_nextn_predict_layers must be a positive int, got {n_layers!r}")
    layout = c.get("mtp_layer_names", "mtp_layers")
    if layout == "layers":
        start = c.get("num_hidden_layers")
        if not isinstance(start, int) or start < 1:
            raise ValueError(f"{MTP_CONFIG}: mtp_layer_names 'layers' needs num_hidden_layers >= 1, got {start!r}")
    elif layout != "mtp_layers":
        raise ValueError(f"{MTP_CONFIG}: mtp_layer_names {layout!r} is not 'mtp_layers' or 'layers'")
    gating = c.get("gating_type", "elementwise")
    if gating not in ("elementwise", "headwise"):
        raise ValueError(f"{MTP_CONFIG}: gating_type {gating!r} is not 'elementwise' or 'headwise'")
    mlp = c.get("mtp_mlp_layer_type", "sparse")
    if mlp not in ("sparse", "dense"):
        raise ValueError(f"{MTP_CONFIG}: mtp_mlp_layer_type {mlp!r} is not 'sparse' or 'dense'")
    exp: dict[str, tuple[tuple[int, ...], str]] = {}
    for i in range(n_layers):
        p = f"model.mtp_layers.{i}." if layout == "mtp_layers" else f"model.layers.{c['num_hidden_layers'] + i}."
        for norm in ("enorm", "hnorm", "final_layernorm", "input_layernorm", "post_attention_layernorm"):
            exp[f"{p}{norm}.weight"] = ((H,), wide)
        exp[p + "eh_proj.weight"] = ((H, 2 * H), wide)
        a = p + "self_attn."
        exp.update({
            a + "q_a_proj.weight": ((ql, H), wide),
            a + "q_a_layernorm.weight": ((ql,), wide),
            a + "q_b_proj.weight": ((nh * (nope + rope), ql), wide),
            a + "kv_a_proj_with_mqa.weight": ((kvl + rope, H), wide),
            a + "kv_a_layernorm.weight": ((kvl,), wide),
            a + "kv_b_proj.weight": ((nh * (nope + vd), kvl), wide),
            a + "o_proj.weight": ((H, nh * vd), wide),
        })
        if c.get("gated_mla", True):  # vLLM HYV4Config default true (configs/hy_v4.py:125; attention.py:464-485)
            exp[a + "linear_gate.weight"] = ((nh * (vd if gating == "elementwise" else 1), H), wide)
        if c.get("learnable_sink", True):
            exp[a + "learnable_sink_param"] = ((nh,), "F32")
        if _hy_mtp_layer_sparse(c, i):
            n, d = _need(c, "index_n_heads", "index_head_dim")
            exp.update({
                a + "indexer.wq_b.weight": ((n * d, ql), wide),
                a + "indexer.wk.weight": ((d, H), wide),
                a + "indexer.k_norm.weight": ((d,), wide),
                a + "indexer.k_norm.bias": ((d,), wide),
                a + "indexer.weights_proj.weight": ((n, H), wide),
            })
        m = p + "mlp."
        if mlp == "dense":
            (inter,) = _need(c, "intermediate_size")
            exp.update(_swiglu(m, H, inter, wide))
            continue
        E, I = _need(c, "n_routed_experts", "moe_intermediate_size")
        exp[m + "gate.weight"] = ((E, H), "F32")
        exp[m + "gate.e_score_correction_bias"] = ((E,), "F32")
        if c.get("mtp_split_experts"):
            for e in range(E):
                exp.update(_swiglu(f"{m}experts.{e}.", H, I, wide))
        else:
            exp[m + "experts.gate_up_proj"] = ((E, 2 * I, H), wide)
            exp[m + "experts.down_proj"] = ((E, H, I), wide)
        shared = c.get("n_shared_experts", 1)
        if shared:
            exp.update(_swiglu(m + "shared_experts.", H, I * shared, wide))
    return exp


_HY_SPARSE = ("sparse_attention", "sparse", "indexed_attention", "deepseek_sparse_attention")  # attention.py:51-57


def _hy_mtp_layer_sparse(c: dict, i: int) -> bool:
    """Whether vLLM builds MTP layer i (model layer N + i) with the DSA indexer: only when the config HAS
    layer_types (vLLM's own HYV4Config leaves it None, unlike transformers' which defaults to all indexed;
    configs/hy_v4.py:154-160) and its entry N + i, padded with the last entry (mtp.py:391-398), is sparse
    (attention.py:322-341). A sidecar records the draft's own choice as mtp_layer_type."""
    if "layer_types" not in c:
        return c.get("mtp_layer_type", "full_attention") in _HY_SPARSE
    types = c["layer_types"]
    if not types:
        return False
    idx = int(c.get("num_hidden_layers") or 0) + i
    return (types[idx] if idx < len(types) else types[-1]) in _HY_SPARSE


def _swiglu(p: str, H: int, inter: int, dt: str) -> dict[str, tuple[tuple[int, ...], str]]:
    return {p + "gate_proj.weight": ((inter, H), dt), p + "up_proj.weight": ((inter, H), dt),
            p + "down_proj.weight": ((H, inter), dt)}


def _v4_quantised(exp: dict, qc: dict, expert_dtype: str) -> None:
    """Rewrite the expected set in place for a quantised checkpoint (weight dtype/shape + `.scale`)."""
    if expert_dtype not in ("fp8", "fp4"):
        raise ValueError(f"config: expert_dtype {expert_dtype!r} is neither 'fp8' nor 'fp4'")
    bn, bk = qc.get("weight_block_size") or (128, 128)
    lin_scale = "F8_E8M0" if expert_dtype == "fp4" else "F32"
    for name in list(exp):
        parts = name.split(".", 2)  # mtp, i, rest
        if len(parts) < 3 or not parts[2].endswith(".weight"):
            continue
        stem = parts[2].removesuffix(".weight")
        is_expert = stem.startswith("ffn.experts.")
        if stem not in _V4_FP8_STEMS and not is_expert:
            continue
        (n, k), _ = exp[name]
        scale_name = name.removesuffix(".weight") + ".scale"
        if is_expert and expert_dtype == "fp4":
            exp[name] = ((n, k // 2), "I8")
            exp[scale_name] = ((n, k // 32), "F8_E8M0")
        else:
            exp[name] = ((n, k), "F8_E4M3")
            exp[scale_name] = ((-(-n // bn), -(-k // bk)), lin_scale)


def _markov(p: str, kind: str, V: int, Vd: int, r: int, H: int, dt: str) -> dict:
    out = {p + "markov_w1.weight": ((V, r), dt), p + "markov_w2.weight": ((Vd, r), dt)}
    if kind == "gated":
        out[p + "gate_proj.weight"] = ((r, H + r), dt)
        out[p + "gate_proj.bias"] = ((r,), dt)
    elif kind == "rnn":
        out[p + "joint_proj.weight"] = ((3 * r, 2 * r + H), dt)
        out[p + "joint_proj.bias"] = ((3 * r,), dt)
    elif kind not in (None, "vanilla"):
        raise ValueError(f"unknown markov head type {kind!r}")
    return out


def _dense_expected(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    dt = _DTYPES[c.get("torch_dtype", "bfloat16")]
    H, I, nh, nkv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or H // nh
    n_ctx = len(c["dflash_config"]["target_layer_ids"])
    exp = {"fc.weight": ((H, n_ctx * H), dt), "hidden_norm.weight": ((H,), dt), "norm.weight": ((H,), dt)}
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        exp.update({
            p + "input_layernorm.weight": ((H,), dt),
            p + "post_attention_layernorm.weight": ((H,), dt),
            p + "self_attn.q_proj.weight": ((nh * hd, H), dt),
            p + "self_attn.k_proj.weight": ((nkv * hd, H), dt),
            p + "self_attn.v_proj.weight": ((nkv * hd, H), dt),
            p + "self_attn.o_proj.weight": ((H, nh * hd), dt),
            p + "self_attn.q_norm.weight": ((hd,), dt),
            p + "self_attn.k_norm.weight": ((hd,), dt),
            p + "mlp.gate_proj.weight": ((I, H), dt),
            p + "mlp.up_proj.weight": ((I, H), dt),
            p + "mlp.down_proj.weight": ((H, I), dt),
        })
    r = int(c.get("markov_rank") or 0)
    V = c["vocab_size"]
    Vd = c.get("draft_vocab_size") or V
    if Vd < V:  # vLLM Qwen3DSpark / DFlash: a reduced draft must ship its lm_head rows and d2t
        exp["lm_head.weight"] = ((Vd, H), dt)
        exp["d2t"] = ((Vd,), "I64")
    if r > 0:
        exp.update(_markov("markov_head.", c.get("markov_head_type") or "vanilla", V, Vd, r, H, dt))
        if c.get("enable_confidence_head", False):  # vLLM's default: off
            width = H + r if c.get("confidence_head_with_markov", False) else H
            exp["confidence_head.proj.weight"] = ((1, width), dt)
            exp["confidence_head.proj.bias"] = ((1,), dt)
    return exp


def _dense_optional(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensors a dense folder may hold without being required: t2d (vLLM skips it), own embeddings."""
    V, H = c["vocab_size"], c["hidden_size"]
    dt = _DTYPES[c.get("torch_dtype", "bfloat16")]
    out = {"embed_tokens.weight": ((V, H), dt)}
    if (c.get("draft_vocab_size") or V) < V:
        out["t2d"] = ((V,), "BOOL")
    return out


def _from_speculators(c: dict) -> dict:
    """A speculators-format config in vLLM's key names (vLLM update_dspark / update_dflash rules)."""
    algo = c["speculators_model_type"]
    if algo not in ("dspark", "dflash"):
        raise ValueError(f"speculators_model_type {algo!r} is not 'dspark' or 'dflash'")
    for key in ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id"):
        if key not in c:
            raise ValueError(f"speculators config without {key}")
    spec = c.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    if "speculative_tokens" not in methods[0] or "name_or_path" not in (spec.get("verifier") or {}):
        raise ValueError("speculators_config needs proposal_methods[0].speculative_tokens and verifier.name_or_path")
    out = dict(c["transformer_layer_config"])
    out["architectures"] = ["Qwen3DSparkModel" if algo == "dspark" else "DFlashDraftModel"]
    out["dflash_config"] = {"target_layer_ids": [i - 1 for i in c["aux_hidden_state_layer_ids"]]}
    if algo == "dflash":  # update_dflash (speculators/algos.py:118-126): these two live in dflash_config
        out["dflash_config"]["sample_from_anchor"] = c.get("sample_from_anchor", False)
        out["dflash_config"]["causal"] = not c.get("sliding_window_non_causal", True)
    else:  # update_dspark (algos.py:187-189): top level, default false
        out["sample_from_anchor"] = c.get("sample_from_anchor", False)
    for key in ("draft_vocab_size", "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov", "torch_dtype", NOT_FOR_VLLM):
        if c.get(key) is not None:
            out[key] = c[key]
    return out


def _precedence_lines(c: dict, dense: bool) -> list[str]:
    """Keys vLLM 0.33.0 reads before the draft's own ones."""
    out = []
    dflash = c.get("dflash_config") or {}
    if dflash.get("sample_from_anchor") is True:
        out.append("dflash_config.sample_from_anchor=true: the DFlash speculator constructor (run first by the DSpark "
                   "one) raises on it (v1/worker/gpu/spec_decode/dflash/speculator.py:80-88); sample_from_anchor "
                   "belongs at the top level (dspark/speculator.py:49-55)")
    if dense:
        return out
    for key, where in (("mask_token_id", "v1/worker/gpu/spec_decode/utils.py:92-109"),
                       ("block_size", "config/speculative.py:1592-1599"),
                       ("eagle_aux_hidden_state_layer_ids", "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:113-135")):
        if c.get(key) is not None:
            out.append(f"{key}={c[key]!r}: vLLM reads it before the dspark_* keys ({where})")
    for key in ("mask_token_id", "target_layer_ids"):
        if key in dflash:
            out.append(f"dflash_config.{key}={dflash[key]!r}: vLLM reads it before the dspark_* keys "
                       "(spec_decode/utils.py:92-109, eagle/eagle3_utils.py:113-135)")
    return out


def _block_causal(c: dict, n_layers: int) -> bool:
    """vLLM's rule for the DFlash / DSpark draft block (qwen3_dflash.py:62-81): causal iff every layer is causal;
    per layer: is_causal, else dflash_config.causal, else layer_types[i] == "sliding_attention" (no layer_types:
    non-causal). Qwen3 configs without layer_types get sliding layers from use_sliding_window (transformers)."""
    if c.get("is_causal") is not None:
        return bool(c["is_causal"])
    dflash = c.get("dflash_config") or {}
    if dflash.get("causal") is not None:
        return bool(dflash["causal"])
    types = c.get("layer_types")
    if types is None and c.get("use_sliding_window"):
        start = int(c.get("max_window_layers", n_layers))
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
    if not types or n_layers < 1:
        return False
    return all(i < len(types) and types[i] == "sliding_attention" for i in range(n_layers))


def _markov_line(kind: str | None) -> list[str]:
    if kind in (None, "vanilla"):
        return []
    return [f"markov head type {kind!r}: vLLM 0.33.0's DSparkMarkovHead has only markov_w1 / markov_w2 (vanilla; "
            f"qwen3_dspark.py:48-93) and has no parameter for the {'gate_proj' if kind == 'gated' else 'joint_proj'} "
            "tensors"]


def _sorted_line(key: str, ids) -> list[str]:
    ids = list(ids or [])
    if ids == sorted(ids):
        return []
    return [f"{key} {ids} not ascending: vLLM concatenates the target taps in layer order (models/deepseek_v4/nvidia/"
            "model.py:993-1014, models/interfaces.py:1640-1650), so the draft's input blocks would be permuted"]


def _v4_serving(c: dict) -> list[str]:
    """DeepSeek-V4 DSpark (sidecar dspark_config.json or a merged target config.json)."""
    out = _markov_line(c.get("dspark_markov_head_type") if c.get("dspark_markov_rank") else None)
    if c.get("dspark_confidence_bias"):
        out.append("dspark_confidence_bias: vLLM 0.33.0's DeepSeek-V4 DSpark confidence head has no bias parameter "
                   "(DSparkConfidenceHead(bias=False), nvidia/dspark.py:175-180)")
    out += _sorted_line("dspark_target_layer_ids", c.get("dspark_target_layer_ids"))
    out += _precedence_lines(c, dense=False)
    n_target = c.get("num_hidden_layers")
    if isinstance(n_target, int) and _block_causal(c, n_target):
        out.append("the target's layer_types / dflash_config.causal / is_causal make vLLM run the draft block causally "
                   "(qwen3_dflash.py:62-81 via dspark/utils.py:102); the draft is trained bidirectional: set "
                   "dflash_config.causal=false")
    theta, own = c.get("rope_theta"), c.get("dspark_rope_theta")
    if theta is not None and own is not None and float(theta) != float(own):
        out.append(f"dspark_rope_theta {own} != rope_theta {theta}: vLLM's draft layers use the target's rope_theta "
                   "without scaling (models/deepseek_v4/common/rope.py:28-42)")
    window, block = c.get("sliding_window"), c.get("dspark_block_size")
    if c.get("sample_from_anchor") is False and isinstance(window, int) and isinstance(block, int) \
            and (window + block) % 64 == 0:
        out.append(f"sample_from_anchor=false with sliding_window + dspark_block_size = {window + block} (a multiple of "
                   "64): vLLM's non-causal window index list holds window + num_speculative_tokens keys "
                   "(v1/attention/backends/mla/compressor_utils.py:22-28), one fewer than the 1+N block needs")
    return out


def _dense_serving(c: dict) -> list[str]:
    out = _markov_line(c.get("markov_head_type") if c.get("markov_rank") else None)
    out += _sorted_line("dflash_config.target_layer_ids", (c.get("dflash_config") or {}).get("target_layer_ids"))
    out += _precedence_lines(c, dense=True)
    if _block_causal(c, int(c.get("num_hidden_layers") or 0)):
        out.append("layer_types / dflash_config.causal / is_causal make vLLM run the draft block causally "
                   "(qwen3_dflash.py:62-81); dspark's dense drafts are trained bidirectional")
    return out


def _mtp_serving(c: dict, fmt: str) -> tuple[list[str], list[str]]:
    """(serving problems, notes) of an MTP folder."""
    problems, notes = [], []
    n = c.get("num_nextn_predict_layers")
    if fmt == "hy_v4_mtp":
        if c.get("mtp_layer_names") == "layers" and isinstance(n, int) and n >= 2:
            problems.append(f"mtp_layer_names 'layers' with num_nextn_predict_layers={n}: vLLM maps model.layers.{{N+i}} "
                            f"only for i < max(num_nextn_predict_layers - 1, 1) = {max(n - 1, 1)} (hy_v4/nvidia/"
                            "mtp.py:57-72) and serves the other layers' random init; write model.mtp_layers.{i}")
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            problems.append(f"rope_parameters.rope_type {rope.get('rope_type')!r}: vLLM's MTP layer uses the target's "
                            "scaled RoPE; the draft is trained with default RoPE")
    if isinstance(n, int) and n >= 2:
        notes.append(f"num_nextn_predict_layers={n}: with num_speculative_tokens >= 2 vLLM runs its multi-module MTP "
                     "speculator (config/speculative.py:2188-2194), a recursion dspark neither trains nor evaluates; "
                     "eval.py's numbers hold for num_speculative_tokens 1")
    return problems, notes


def _headers(folder: Path) -> tuple[dict[str, tuple[tuple[int, ...], str]], list[str]]:
    """{name: (shape, safetensors dtype)} from the file headers, plus index problems."""
    problems: list[str] = []
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, ["model.safetensors"]
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for fname in files:
        path = folder / fname
        if not path.is_file():
            problems.append(f"missing file: {fname}")
            continue
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in found:
                problems.append(f"duplicate tensor: {name} (also in another shard)")
            found[name] = (tuple(info["shape"]), info["dtype"])
            if weight_map is not None and weight_map.get(name) != fname:
                problems.append(f"index: {name} is in {fname} but the index says {weight_map.get(name)}")
    if weight_map is not None:
        for name in sorted(set(weight_map) - set(found)):
            problems.append(f"index: {name} listed in {weight_map[name]} but not stored there")
    return found, problems


def verify_folder(path) -> Report:
    """The folder's layout against its config (names, shapes, dtypes), plus its checksum manifest."""
    report = _verify_layout(path)
    report.problems += _integrity_problems(Path(path))
    return report


def _integrity_problems(folder: Path) -> list[str]:
    """A dspark-written folder must match its manifest and hold nothing unlisted; a folder without a manifest
    (a released checkpoint, an older export) is judged by its layout only."""
    from dspark.errors import IntegrityError
    from dspark.integrity import MANIFEST_NAME, check_manifest, unlisted_files

    try:
        if not check_manifest(folder, required=False, hint="re-export it"):
            return []
    except IntegrityError as err:
        return [f"integrity: {err}"]
    return [f"integrity: {name} is not in {MANIFEST_NAME} (added after the export?)" for name in unlisted_files(folder)]


def _verify_layout(path) -> Report:
    folder = Path(path)
    if (folder / MTP_CONFIG).is_file():
        return _verify_mtp(folder)
    if (folder / "dspark_config.json").is_file():
        cfg, kind = json.loads((folder / "dspark_config.json").read_text()), "deepseek_v4 dspark (mtp.*)"
    elif (folder / "config.json").is_file():
        cfg = json.loads((folder / "config.json").read_text())
        if "speculators_model_type" in cfg:
            try:
                cfg = _from_speculators(cfg)
            except (ValueError, TypeError) as err:
                return Report("speculators", problems=[f"config.json: {err}"])
        arch = (cfg.get("architectures") or [None])[0]
        kind = "deepseek_v4 dspark (mtp.*)" if "dspark_block_size" in cfg else str(arch)
    else:
        return Report("unknown", problems=[f"{folder}: no dspark_config.json or config.json"])
    is_v4 = kind.startswith("deepseek_v4")
    if is_v4:
        expected, optional = _v4_expected(cfg), _v4_optional(cfg)
    elif kind in DENSE_ARCHS:
        expected, optional = _dense_expected(cfg), _dense_optional(cfg)
    else:
        return Report(str(kind), problems=[f"config.json: unknown architecture {kind!r} (expected {DENSE_ARCHS})"])
    found, problems = _headers(folder)
    if is_v4:  # a merged target checkpoint also holds the target's own tensors
        found = {k: v for k, v in found.items() if k.startswith("mtp.")}
    report = Report(kind, n_tensors=len(found), problems=problems)
    _serving(report, cfg, _v4_serving(cfg) if is_v4 else _dense_serving(cfg))
    present_optional = {k: v for k, v in optional.items() if k in found and k not in expected}
    return _compare(report, {**expected, **present_optional}, found)


def _verify_mtp(folder: Path) -> Report:
    """An MTP sidecar: every tensor named, shaped and typed as mtp_config.json implies, nothing more or less."""
    try:
        cfg = json.loads((folder / MTP_CONFIG).read_text())
        if cfg.get("mtp_merged") is True and (folder / "config.json").is_file():
            # vLLM reads the target config.json: its keys win over the sidecar's copy
            served = json.loads((folder / "config.json").read_text())
            cfg = {**cfg, **{k: v for k, v in served.items() if k not in ("torch_dtype", "dtype")}}
        fmt = cfg.get("dspark_format")
        if fmt not in MTP_FORMATS:
            return Report(str(fmt), problems=[f"{MTP_CONFIG}: dspark_format {fmt!r} is not one of {MTP_FORMATS}"])
        if cfg.get("torch_dtype") not in _DTYPES:
            raise ValueError(f"{MTP_CONFIG}: torch_dtype {cfg.get('torch_dtype')!r} is not one of {sorted(_DTYPES)}")
        expected = _hy_mtp_expected(cfg) if fmt == "hy_v4_mtp" else _dsv4_mtp_expected(cfg)
    except (ValueError, TypeError, KeyError) as err:
        return Report("mtp", problems=[str(err)])
    found, problems = _headers(folder)
    if cfg.get("mtp_merged") is True:  # a target checkpoint with the draft merged in: judge the MTP tensors only
        start = cfg.get("num_hidden_layers") or 0
        found = {k: v for k, v in found.items() if _is_mtp_tensor(k, fmt, start)}
    report = Report(fmt, n_tensors=len(found), problems=problems)
    serving, notes = _mtp_serving(cfg, fmt)
    _serving(report, cfg, serving)
    report.notes += notes
    return _compare(report, expected, found)


def _is_mtp_tensor(name: str, fmt: str, start: int) -> bool:
    if fmt != "hy_v4_mtp":
        return name.startswith("mtp.")
    parts = name.split(".")
    if name.startswith("model.mtp_layers."):
        return True
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and start > 0 \
        and int(parts[2]) >= start


def _compare(report: Report, expected: dict, found: dict) -> Report:
    """Missing / unexpected / shape / dtype problems of `found` against `expected` (both {name: (shape, dtype)})."""
    for name in sorted(set(expected) - set(found)):
        report.problems.append(f"missing: {name} {list(expected[name][0])} {expected[name][1]}")
    for name in sorted(set(found) - set(expected)):
        report.problems.append(f"unexpected: {name} {list(found[name][0])} {found[name][1]} (no draft parameter)")
    for name in sorted(set(found) & set(expected)):
        (fs, fd), (es, ed) = found[name], expected[name]
        if fs != es:
            report.problems.append(f"shape: {name} is {list(fs)}, expected {list(es)}")
        if fd != ed:
            report.problems.append(f"dtype: {name} is {fd}, expected {ed}")
    report.n_bytes = sum(_SIZES.get(d, 0) * _numel(s) for s, d in found.values())
    return report


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main_verify(path) -> int:
    report = verify_folder(path)
    if report.ok:
        print(f"OK {path}: {report.kind}, {report.n_tensors} tensors, {report.n_bytes / 2**20:.1f} MiB, "
              "names/shapes/dtypes and the vLLM 0.33.0 serving rules match the config")
    else:
        print(f"FAILED {path}: {report.kind}, {len(report.problems)} problem(s)")
        for line in report.problems:
            print(f"  {line}")
    for line in report.notes:
        print(f"  note: {line}")
    return 0 if report.ok else 1

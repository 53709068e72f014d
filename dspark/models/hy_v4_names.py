"""HY V4 (Hy4) MTP block tensor names: the draft's (= the serving checkpoint's below the layer prefix) <->
transformers `hy_v4`'s, for starting a draft from the target's layers (HYV4MTPDraft.init_from_target) and for the
tests against transformers' layer. The serving names (model.mtp_layers.{i}.X, split / fused experts) are the
serving adapter's (dspark.export.hy_v4_mtp).

A draft layer `mtp_layers.{i}` holds the layer-level tensors (enorm, hnorm, eh_proj, final_layernorm) and the block
tensors (input_layernorm, post_attention_layernorm, self_attn.{q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, linear_gate, learnable_sink_param,
indexer.{wq_b, wk, k_norm, weights_proj}}, mlp.{gate.weight, gate.e_score_correction_bias,
experts.gate_up_proj, experts.down_proj, shared_experts.{gate,up,down}_proj} or, for a dense MLP,
mlp.{gate,up,down}_proj).

transformers `hy_v4` renames two block tensors on load (conversion_mapping "hy_v4"):
`self_attn.linear_gate` -> `self_attn.gate_proj`, `self_attn.learnable_sink_param` -> `self_attn.sinks`,
and carries the iHC tensors `attn_hc.*` / `ffn_hc.*` that an MTP block (iHC off) does not have.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

LAYER_LEVEL = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.")

# draft / checkpoint name fragment -> transformers HYV4DecoderLayer name fragment
_TO_HF = ((".self_attn.linear_gate.", ".self_attn.gate_proj."), (".self_attn.learnable_sink_param", ".self_attn.sinks"))
_HF_IHC = ("attn_hc.", "ffn_hc.")


def block_to_hf(block_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Block tensors (draft / checkpoint names, no layer prefix) -> transformers HYV4DecoderLayer names."""
    out = {}
    for name, tensor in block_state.items():
        key = "." + name
        for src, dst in _TO_HF:
            key = key.replace(src, dst)
        out[key[1:]] = tensor
    return out


def block_from_hf(hf_layer_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers HYV4DecoderLayer state_dict -> block tensors with checkpoint names (iHC tensors dropped)."""
    out = {}
    for name, tensor in hf_layer_state.items():
        if name.startswith(_HF_IHC):
            continue
        key = "." + name
        for dst, src in _TO_HF:
            key = key.replace(src, dst)
        out[key[1:]] = tensor
    return out


__all__ = ["LAYER_LEVEL", "block_to_hf", "block_from_hf"]

"""HY V4 (Hy4) MTP tensor names: draft state_dict <-> serving checkpoint <-> transformers `hy_v4`.

The draft's own parameter names ARE the checkpoint names below the layer prefix:

    draft state_dict            mtp_layers.{i}.X
    serving checkpoint          model.mtp_layers.{i}.X      (also accepted: model.layers.{N+i}.X, N = target layers)

with X one of the layer-level tensors (enorm, hnorm, eh_proj, final_layernorm) or a block tensor
(input_layernorm, post_attention_layernorm, self_attn.{q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, linear_gate, learnable_sink_param,
indexer.{wq_b, wk, k_norm, weights_proj}}, mlp.{gate.weight, gate.e_score_correction_bias,
experts.gate_up_proj, experts.down_proj, shared_experts.{gate,up,down}_proj} or, for a dense MLP,
mlp.{gate,up,down}_proj). Routed experts are stored fused ([E, 2I, H] / [E, H, I], the layout
transformers loads); the split per-expert layout `mlp.experts.{e}.{gate,up,down}_proj.weight`
(both accepted by vLLM) is written with `split_experts=True` and read back automatically.

transformers `hy_v4` renames two block tensors on load (conversion_mapping "hy_v4"):
`self_attn.linear_gate` -> `self_attn.gate_proj`, `self_attn.learnable_sink_param` -> `self_attn.sinks`,
and carries the iHC tensors `attn_hc.*` / `ffn_hc.*` that an MTP block (iHC off) does not have.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

LAYER_LEVEL = ("enorm.", "hnorm.", "eh_proj.", "final_layernorm.")
_DRAFT = re.compile(r"^mtp_layers\.(\d+)\.(.+)$")
_SERVING_MTP = re.compile(r"^model\.mtp_layers\.(\d+)\.(.+)$")
_SERVING_LAYERS = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SPLIT_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# checkpoint copies of the shared embedding / head that vLLM skips (the draft uses the target's)
_SHARED_COPIES = ("embed_tokens.", "shared_head.")

# draft / checkpoint name fragment -> transformers HYV4DecoderLayer name fragment
_TO_HF = ((".self_attn.linear_gate.", ".self_attn.gate_proj."), (".self_attn.learnable_sink_param", ".self_attn.sinks"))
_HF_IHC = ("attn_hc.", "ffn_hc.")


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


__all__ = ["LAYER_LEVEL", "to_serving_names", "from_serving_names", "block_to_hf", "block_from_hf"]

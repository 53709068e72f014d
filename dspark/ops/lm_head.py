"""The LM head as vLLM 0.33.0 computes it: in the model dtype, or in float32 when the config's head dtype says so.

vLLM: `ModelConfig.head_dtype` (config/model.py:2108-2133, `_get_head_dtype` :2521-2542) reads `head_dtype` off the
HF config ("model" -> the model dtype, a dtype name -> that dtype, absent -> the model dtype for generation models);
vLLM's own HYV4Config fills `head_dtype = "float32"` when `enable_lm_head_fp32` (default True) and nothing pinned it
(transformers_utils/configs/hy_v4.py:120, :162-168). LogitsProcessor._get_logits' projection
(model_executor/layers/logits_processor.py:140-177) then multiplies hidden states and weight cast to float32
(on CUDA: torch.mm(out_dtype=float32) on the model-dtype operands, the same products accumulated in float32).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

HY_V4_MODEL_TYPES = ("hy_v4", "hy_v4_vl_text")


def vllm_head_fp32(hf_config: Any) -> bool:
    """Whether vLLM runs this config's LM head in float32 (module docstring)."""
    head = getattr(hf_config, "head_dtype", None)
    if head is not None:
        return str(head).lower().removeprefix("torch.") in ("float32", "float")
    if getattr(hf_config, "model_type", None) in HY_V4_MODEL_TYPES:
        return bool(getattr(hf_config, "enable_lm_head_fp32", True))
    return False


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, fp32: bool) -> torch.Tensor:
    """hidden [..., H], weight [V, H] -> logits [..., V]: hidden in the weight's dtype, then either that dtype's
    F.linear or (fp32) both operands in float32 and a float32 result."""
    x = hidden.to(weight.dtype)
    return F.linear(x.float(), weight.float()) if fp32 else F.linear(x, weight)

"""A DeepSeek-V4.1 target for training and eval: transformers' DeepseekV4 decoder with V4.1's mHC.

transformers has no DeepSeek-V4.1. What the draft reads from a V4.1 target differs from V4 in the residual streams
themselves (docs/v41.md): every sublayer collapses its input with the PREVIOUS sublayer's pre-mix (vLLM 0.33.0
vllm/models/deepseek_v41/nvidia/model.py:522-524, 486-662; reference kernels/mhc/torch.py:6-45), and the final
hidden is the last stream collapsed with the last FFN's pre-mix, then `norm` (model.py:1146-1149; no hc_head).
Attention, MoE (V4.1's MoE is V4's, model.py:78-80, 129-160) and norms are transformers' DeepseekV4 modules as they
are. The taps (hc-means of the stream after layer i, model.py:1187-1211) are what FrozenTarget's hooks capture.

Registered with transformers' Auto classes under model_type "deepseek_v41" (a flat config.json: vLLM's
DeepseekV41Config flattens a nested text_config onto the top level, transformers_utils/configs/deepseek_v41.py:26-44,
so a flat file is read the same way), so `AutoConfig` / `AutoModelForCausalLM.from_pretrained` load a V4.1 folder.
Not modelled (training does not need them, docs/v41.md): Engram, compressed / indexed attention, vision routing.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV4Config, DeepseekV4ForCausalLM

from dspark.ops.mhc import HcSettings, hc_collapse, hc_pre_delayed


class _Carry:
    """The pre-mix carried from one sublayer to the next during one forward (reset when the model's forward starts)."""

    pre: torch.Tensor | None = None


class DelayedHyperConnection(nn.Module):
    """transformers' DeepseekV4HyperConnection contract (streams [B, S, hc, H] -> post, comb, collapsed) with V4.1's
    delayed pre-mix; same parameters (fn, base, scale), so the checkpoint names are unchanged."""

    def __init__(self, original: nn.Module, carry: _Carry, config):
        super().__init__()
        self.fn, self.base, self.scale = original.fn, original.base, original.scale
        self.carry = carry
        self.settings = HcSettings.of(config)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y, post, comb, pre = hc_pre_delayed(streams, self.carry.pre, self.fn, self.base, self.scale, self.settings)
        self.carry.pre = pre
        return post, comb, y


class CarriedCollapse(nn.Module):
    """V4.1's final collapse (no parameters): streams [B, S, hc, H] -> sum_j pre_j x_j with the last FFN pre-mix."""

    def __init__(self, carry: _Carry):
        super().__init__()
        self.carry = carry

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        if self.carry.pre is None:
            raise RuntimeError("V4.1 final collapse: no pre-mix carried (the model ran no decoder layer)")
        return hc_collapse(streams, self.carry.pre)


class DeepseekV41Config(DeepseekV4Config):
    model_type = "deepseek_v41"


class DeepseekV41ForCausalLM(DeepseekV4ForCausalLM):
    """DeepseekV4ForCausalLM with V4.1's mHC (module docstring); no hc_head parameters."""

    config_class = DeepseekV41Config

    def __init__(self, config):
        super().__init__(config)
        carry = _Carry()
        base = self.model
        for layer in base.layers:
            layer.attn_hc = DelayedHyperConnection(layer.attn_hc, carry, config)
            layer.ffn_hc = DelayedHyperConnection(layer.ffn_hc, carry, config)
        base.hc_head = CarriedCollapse(carry)
        base.register_forward_pre_hook(lambda *_: setattr(carry, "pre", None))


AutoConfig.register("deepseek_v41", DeepseekV41Config, exist_ok=True)
AutoModelForCausalLM.register(DeepseekV41Config, DeepseekV41ForCausalLM, exist_ok=True)

__all__ = ["CarriedCollapse", "DeepseekV41Config", "DeepseekV41ForCausalLM", "DelayedHyperConnection"]

"""Rotary position embedding, the one every draft uses.

Frequencies come from transformers' rope initialisation (`ROPE_INIT_FUNCTIONS`: linear, dynamic, yarn, longrope,
llama3, ... with their attention scaling; "default" = theta^(-2i/dim)), and the dynamic / longrope updates are
transformers' own (`dynamic_rope_update`), so a draft rotates exactly as its target does.

    cos, sin = RotaryEmbedding(rope_parameters, dim)(positions [B, T])      [B, T, dim/2] fp32 (scaled)
    apply_rope(x [..., D], cos, sin, interleaved=...)                       rotates the LAST dim channels of x

Pairing: `interleaved` rotates (x_{2i}, x_{2i+1}) (DeepSeek-V4, vLLM's HY V4); otherwise (x_i, x_{i+dim/2})
(Llama / Qwen "rotate half", transformers' HY V4).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)


def _rope_config(rope_parameters: dict, dim: int, max_position_embeddings: int):
    """A transformers config carrying what the rope initialisation functions read (head_dim = the rotary dim)."""
    from transformers import PretrainedConfig

    config = PretrainedConfig()
    config.rope_parameters = dict(rope_parameters)
    config.head_dim, config.hidden_size, config.num_attention_heads = dim, dim, 1
    config.max_position_embeddings = max_position_embeddings
    return config


def default_inverse_frequencies(theta: float, dim: int) -> torch.Tensor:
    """[dim/2] fp32: theta^(-2i/dim), the unscaled RoPE."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class RotaryEmbedding(nn.Module):
    """cos / sin of positions * inverse frequencies for `dim` rotary channels (buffers, not in any state_dict)."""

    def __init__(self, rope_parameters: dict, dim: int, max_position_embeddings: int = 32768):
        super().__init__()
        rope_type = rope_parameters.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not one of {ROPE_TYPES}")
        if dim % 2:
            raise ValueError(f"RoPE rotates pairs: dim must be even, got {dim}")
        # the attributes transformers' dynamic_rope_update reads
        self.config = _rope_config(rope_parameters, dim, max_position_embeddings)
        self.rope_type = rope_type
        self.max_seq_len_cached = self.original_max_seq_len = max_position_embeddings
        if rope_type == "default":
            inv_freq, self.attention_scaling = default_inverse_frequencies(rope_parameters["rope_theta"], dim), 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        """Moving the draft moves the frequencies; casting it (bf16, DeepSpeed) keeps them float32, as computed."""
        kept = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if before is not None and after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        return self

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> cos, sin [B, T, dim/2] fp32, attention scaling applied (`x` gives the device)."""
        angles = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the LAST 2 * cos.shape[-1] channels of x; the leading channels pass through.

    x [B, T, ..., D]; cos, sin [B, T, R/2], broadcast over the axes between T and D (heads). `inverse` rotates
    by -angle. fp32 math, output in x.dtype.
    """
    half = cos.shape[-1]
    while cos.dim() < x.dim():  # [B, T, 1, .., R/2]
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    nope, rot = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half :]
    rf = rot.float()
    if interleaved:
        a, b = rf[..., 0::2], rf[..., 1::2]
        rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = rf[..., :half], rf[..., half:]
        rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1) if nope.shape[-1] else rotated.to(x.dtype)


__all__ = ["ROPE_TYPES", "RotaryEmbedding", "apply_rope", "default_inverse_frequencies"]

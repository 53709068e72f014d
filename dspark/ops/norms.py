"""RMS norms shared by every draft: fp32 math, output cast back to the input dtype."""
from __future__ import annotations

import torch
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last axis, in fp32, cast back. [..., D] -> [..., D]."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMS norm with an fp32 weight (as the serving checkpoints store norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * unweighted_rms_norm(x.float(), self.eps)).to(x.dtype)

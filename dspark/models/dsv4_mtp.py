"""DeepSeek-V4 native MTP draft (docs/CONTRACTS.md §4, last paragraph; vLLM `DeepSeekV4MTP`).

One MTP layer i (checkpoint prefix `mtp.{i}.`) applied to a sequence:

    e    = embed(ids)                          [B, S, H]   (zeroed at position 0, as vLLM does)
    x_in = h_proj(hnorm(h)) + e_proj(enorm(e))  [B, S, hc, H]   hnorm / h_proj per stream, e broadcast over hc
    x    = V4 block(x_in)                       [B, S, hc, H]   mHC + shared-KV MQA (causal sliding window, sink) + MoE
    logits = head(norm(hc_head(x)))             [B, S, V]       head = the target's LM head (shared, frozen)

`h` is the main model's pre-hc_head stream (the last decoder layer's raw output) for step 0 and the
previous step's block output `x` for later steps (chain drafting, step k uses layer k % num_layers).
Row p combines the hidden of position p with the token at p + 1 and predicts the token at p + 2.

The block is dspark.models.dspark_v4.DSparkV4Layer (serving names `attn.*`, `ffn.*`, `attn_norm`,
`ffn_norm`, `hc_attn_*`, `hc_ffn_*`) run with no context KV and a causal sliding-window mask.
Serving names (dspark.export.dsv4_mtp): `layers.{i}.block.X` <-> `mtp.{i}.X`, `layers.{i}.Y` <-> `mtp.{i}.Y` for the
layer-level tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.common import FieldError, SharedTargetWeights, field_error
from dspark.models.dspark_v4 import (
    V4_BLOCK_FIELDS,
    DSparkV4Config,
    DSparkV4Layer,
    V4BlockSizes,
    _hc_params,
    _normal_linear,
    _reset_hc,
    cast_compute_weights,
)
from dspark.models.mtp_common import MTP_TOKENS_NOTE, ChainDraft
from dspark.models.registry import register
from dspark.models.v4_names import load_hf_layer_into
from dspark.ops.mhc import hc_head
from dspark.ops.norms import RMSNorm

# Fields of the V4 block, read from the target config (V4BlockSizes: the same as DSparkV4Config's).
BLOCK_FIELDS = V4_BLOCK_FIELDS
# DSparkV4Config keys that a single decoder layer never reads (block drafting / Markov head only).
_DSPARK_ONLY = {"block_size": 1, "mask_token_id": 0, "target_layer_ids": [0], "markov_rank": 1}


@dataclass(kw_only=True)
class DSV4MTPConfig(V4BlockSizes):
    """Sizes of a DeepSeek-V4 MTP draft; block sizes (V4BlockSizes) are the target's."""

    GROUP_KEYS: ClassVar[tuple[str, ...]] = ("num_layers", "num_steps", "mask_first_embedding")
    DRAFTS_KEY: ClassVar[str] = "num_steps"
    DEFAULT_TARGET: ClassVar[str | None] = "tiny_v4"  # target kind (configs/target) when a run records none
    vllm_method: ClassVar[str] = "mtp"  # vLLM's target_dependent_ar MTP speculator
    VLLM_TOKENS_NOTE: ClassVar[str] = MTP_TOKENS_NOTE  # vLLM's default num_speculative_tokens for it

    kind: str = "dsv4_mtp"
    num_layers: int = 1  # MTP layers (mtp.0 ... mtp.{n-1}); step k uses layer k % num_layers
    num_steps: int = 3  # K: training depth and default number of drafts per verify step
    mask_first_embedding: bool = True  # vLLM zeroes the token embedding at position 0

    @property
    def block_size(self) -> int:
        """Drafts per verify step (eval's default gamma), = num_steps."""
        return self.num_steps

    def block_config(self) -> DSparkV4Config:
        """The DSparkV4Config of one V4 block (the DSpark-only keys get inert values a layer never reads)."""
        values = {k: getattr(self, k) for k in BLOCK_FIELDS}
        return DSparkV4Config(num_layers=1, **values, **_DSPARK_ONLY)

    def validate(self) -> "DSV4MTPConfig":
        """Raise FieldError naming the offending key; returns self."""
        if self.kind != "dsv4_mtp":
            raise field_error(self, "kind", f"must be 'dsv4_mtp', got {self.kind!r}")
        for key in ("num_layers", "num_steps"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise field_error(self, key, f"must be a positive int, got {value!r}")
        try:
            self.block_config().validate()
        except FieldError as e:
            raise FieldError(e.field, str(e).replace("DSparkV4Config.", "DSV4MTPConfig.")) from None
        return self


    @classmethod
    def from_target_config(cls, hf_cfg: Any, **keys: Any) -> "DSV4MTPConfig":
        """Block sizes from a transformers DeepseekV4Config (its rope_theta, topk_method and norm_topk_prob, as vLLM
        builds the MTP block from the target config; YaRN is not modelled),
        num_layers from `num_nextn_predict_layers` when the config has MTP layers; `keys` override."""
        model_type = getattr(hf_cfg, "model_type", None)
        if model_type != "deepseek_v4":
            raise FieldError("kind", f"dsv4_mtp needs a DeepSeek-V4 target, got {model_type!r}")
        block = DSparkV4Config.from_target_config(hf_cfg, **_DSPARK_ONLY)
        values: dict[str, Any] = {k: getattr(block, k) for k in BLOCK_FIELDS}
        n_mtp = getattr(hf_cfg, "num_nextn_predict_layers", 0) or 0
        if n_mtp > 0:
            values["num_layers"] = int(n_mtp)
        values.update(keys)
        return cls.from_dict(values)


def causal_window_mask(position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """position_ids [B, S] -> bool [B, S, S]: key j visible to query i iff j <= i and pos_i - window < pos_j."""
    s = position_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()  # [S, S]
    gap = position_ids[:, :, None] - position_ids[:, None, :]  # [B, S, S] pos_i - pos_j
    return causal & (gap < window)


class DSV4MTPLayer(nn.Module):
    """One `mtp.{i}`: enorm/hnorm/e_proj/h_proj, the V4 block, and its own hc_head + norm."""

    def __init__(self, cfg: DSV4MTPConfig):
        super().__init__()
        self.cfg = cfg
        h, hc = cfg.hidden_size, cfg.hc_mult
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.block = DSparkV4Layer(cfg.block_config())
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _hc_params(hc, h, hc, 1)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.initializer_range
        self.enorm.reset_parameters()
        self.hnorm.reset_parameters()
        self.norm.reset_parameters()
        _normal_linear(self.e_proj, std)
        _normal_linear(self.h_proj, std)
        self.block.reset_parameters(std)
        _reset_hc(self.hc_head_fn, self.hc_head_base, self.hc_head_scale, std)

    def combine(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb [B, S, H], hidden [B, S, hc, H] -> h_proj(hnorm(hidden)) + e_proj(enorm(emb)) [B, S, hc, H]."""
        return self.h_proj(self.hnorm(hidden)) + self.e_proj(self.enorm(emb)).unsqueeze(-2)

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hc, H] -> norm(hc_head(x)) [..., H]."""
        c = self.cfg
        return self.norm(hc_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps))


@register("dsv4_mtp", config=DSV4MTPConfig, objective="mtp", serving="dspark.export.dsv4_mtp")
class DSV4MTPDraft(ChainDraft, SharedTargetWeights, nn.Module):
    """DeepSeek-V4 MTP draft; the MTP-draft interface is in docs/CONTRACTS.md ("MTP drafts")."""

    # FrozenTarget must capture the last layer's raw output (dspark.models.registry.build_draft sets it).
    needs_pre_head = True

    def __init__(self, config: DSV4MTPConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.layers = nn.ModuleList([DSV4MTPLayer(config) for _ in range(config.num_layers)])

    def reset_parameters(self) -> None:
        for layer in self.layers:
            layer.reset_parameters()

    def set_dtype(self, dtype: torch.dtype) -> "DSV4MTPDraft":
        """Cast the compute weights to `dtype`, keeping mHC, norms, sinks and the gate bias in fp32."""
        return cast_compute_weights(self, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].e_proj.weight.dtype

    @torch.no_grad()
    def init_from_target(self, hf_model: nn.Module) -> "DSV4MTPDraft":
        """Start every MTP layer from the target: its last decoder layer into the block (compressor / indexer
        tensors dropped, see v4_names), its hc_head into hc_head_*, its final norm into norm. enorm / hnorm /
        e_proj / h_proj keep their init."""
        base = getattr(hf_model, "model", hf_model)
        head = base.hc_head
        for layer in self.layers:
            load_hf_layer_into(layer.block, base.layers[-1].state_dict())
            layer.hc_head_fn.copy_(head.hc_fn)
            layer.hc_head_base.copy_(head.hc_base)
            layer.hc_head_scale.copy_(head.hc_scale)
            layer.norm.weight.copy_(base.norm.weight)
        return self

    # -- interface ---------------------------------------------------------------------------------
    def context_hidden(self, feats) -> torch.Tensor:
        """TargetFeatures -> the main model's pre-hc_head stream [B, S, hc, H] (step 0's hidden)."""
        h = getattr(feats, "pre_head", None)
        if h is None:
            raise ValueError("DSV4MTPDraft needs TargetFeatures.pre_head (the last layer's raw output): "
                             "call target.features(..., pre_head=True) or set target.capture_pre_head")
        c = self.config
        if h.dim() != 4 or tuple(h.shape[-2:]) != (c.hc_mult, c.hidden_size):
            raise ValueError(f"pre_head must be [B, S, {c.hc_mult}, {c.hidden_size}], got {tuple(h.shape)}")
        return h.to(self.dtype)

    @property
    def attention_window(self) -> int:
        """The MTP block is a sliding-window layer (vLLM: compress_ratio 1 past num_hidden_layers,
        models/deepseek_v4/attention.py:236-242): key j is visible to query i iff pos_i - window < pos_j <= pos_i."""
        return self.config.sliding_window

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
             layer_idx: int) -> torch.Tensor:
        """One MTP application over a sequence (causal): input_ids [B, S], hidden [B, S, hc, H],
        position_ids [B, S] -> the block output [B, S, hc, H] (pre-hc_head; fed to the next step)."""
        mask = causal_window_mask(position_ids, self.config.sliding_window)  # [B, S, S]
        return self.step_rows(input_ids, hidden, position_ids, layer_idx, None, mask)[0]

    def step_rows(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, layer_idx: int,
                  past: torch.Tensor | None, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New rows (input_ids [B, T], hidden [B, T, hc, H], position_ids [B, T]) attending to `past` rows' KV
        [B, P, D] (K == V, as an earlier call returned it) and to themselves per `mask` [B, T, P+T]
        -> (block output [B, T, hc, H], the new rows' KV [B, T, D] = RoPE(kv_norm(wkv(attn_norm(hc_pre(x))))))."""
        b, s = input_ids.shape
        if tuple(hidden.shape[:2]) != (b, s) or tuple(position_ids.shape) != (b, s):
            raise ValueError(f"step: input_ids {tuple(input_ids.shape)}, hidden {tuple(hidden.shape)} and "
                             f"position_ids {tuple(position_ids.shape)} must share [B, S]")
        layer = self.layers[layer_idx % len(self.layers)]
        emb = F.embedding(input_ids, self._shared("embed_weight")).to(self.dtype)  # [B, S, H]
        if self.config.mask_first_embedding:
            emb = emb.masked_fill((position_ids == 0).unsqueeze(-1), 0.0)
        x = layer.combine(emb, hidden.to(self.dtype))  # [B, S, hc, H]
        kv = layer.block.attn.project_kv(layer.block.attn_input(x), position_ids)  # [B, S, D]
        ctx = x.new_zeros(b, 0, self.config.head_dim) if past is None else past
        return layer.block(x, position_ids, ctx, mask), kv

    def logits(self, hidden_out: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        """hidden_out [..., hc, H] -> head(norm(hc_head(.))) [..., V] with layer `layer_idx % num_layers`'s head stack."""
        w = self._shared("lm_head_weight")
        h = self.layers[layer_idx % len(self.layers)].collapse(hidden_out)  # [..., H]
        return F.linear(h.to(w.dtype), w)


__all__ = ["DSV4MTPConfig", "DSV4MTPDraft", "DSV4MTPLayer", "causal_window_mask", "BLOCK_FIELDS"]

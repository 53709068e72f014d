"""HY V4 (Tencent Hy4) MTP draft (docs/CONTRACTS.md §6; vLLM `HYV4MTP`, seeds/hy_v4_mtp_vllm.txt).

One MTP layer i (checkpoint prefix `model.mtp_layers.{i}.`) applied to a sequence, row p:

    e    = Emb(t_{p+1}), zeroed where position == 0 (vLLM; flag zero_position0_embedding)   [B, S, H]
    x    = eh_proj(cat[enorm(e), hnorm(h_p)])                        Linear 2H -> H          [B, S, H]
    y    = HY V4 decoder block(x), iHC off (plain pre-norm residual):                        [B, S, H]
             x1 = x + MLA(input_layernorm(x));  y = x1 + MLP(post_attention_layernorm(x1))
    out  = final_layernorm(y)          <- returned by step() and fed to the next step        [B, S, H]
    logits = target lm_head(out)                                                              [B, S, V]

h_p is the target's FINAL hidden (after hc_head and the final norm, TargetFeatures.final) for step 0
and the previous step's `out` for step k >= 1 (vLLM reuses one layer for all steps: layer k % num_layers).

Block = MLA (q_a_proj | kv_a_proj_with_mqa run as one GEMM, q/kv latent norms, RoPE on the rope slice,
optional DSA lightning indexer restricting each query to its top-k keys, per-head learnable sink in the
softmax, sigmoid output gate `linear_gate`) + MoE (sigmoid router with expert_bias
`e_score_correction_bias` for selection only, top-k renormalised and scaled, clamped-SwiGLU routed
experts + an unclamped shared expert) or a dense SwiGLU MLP.

Conventions where transformers `hy_v4` and vLLM differ are config fields (defaults = vLLM serving):
  rope_interleave (vLLM: interleaved pairs; transformers: rotate-half before 5.25, interleaved from 5.25), lora_norm_eps (vLLM: rms_norm_eps;
  transformers: 1e-6), index_norm_eps (vLLM: 1e-6; transformers: rms_norm_eps). Not modelled: YaRN RoPE,
  sharing step 0's indexer top-k with steps >= 1 (vLLM index_share_for_mtp_iteration: refused by the merge and
  flagged by the verifier, dspark/export/hy_v4_mtp.py), FP8. The LM head runs in float32 when vLLM's does
  (enable_lm_head_fp32, default True: `lm_head_fp32`, dspark.ops.lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models import hy_v4_names
from dspark.models.common import DraftConfig, FieldError, SharedTargetWeights, field_error, raw_config_json
from dspark.models.mtp_common import MTP_TOKENS_NOTE, ChainDraft
from dspark.models.registry import register
from dspark.ops.lm_head import lm_head_logits, vllm_head_fp32
from dspark.ops.norms import RMSNorm
from dspark.ops.rope import RotaryEmbedding, apply_rope

# vLLM _SPARSE_LAYER_TYPES (vllm/models/hy_v4/nvidia/attention.py:51-57)
SPARSE_ATTENTION_TYPES = ("indexed_attention", "sparse_attention", "sparse", "deepseek_sparse_attention")


@dataclass(kw_only=True)
class HYV4MTPConfig(DraftConfig):
    """Sizes of a HY V4 MTP draft; block sizes are the target's (from_target_config)."""

    GROUP_KEYS: ClassVar[tuple[str, ...]] = ("num_layers", "num_steps")
    DRAFTS_KEY: ClassVar[str] = "num_steps"
    DEFAULT_TARGET: ClassVar[str | None] = "tiny_hy_v4"  # target kind (configs/target) when a run records none
    vllm_method: ClassVar[str] = "mtp"  # vLLM's target_dependent_ar MTP speculator
    VLLM_TOKENS_NOTE: ClassVar[str] = MTP_TOKENS_NOTE  # vLLM's default num_speculative_tokens for it

    kind: str = "hyv4_mtp"
    num_layers: int = 1  # MTP layers (model.mtp_layers.0 .. n-1); step k uses layer k % num_layers
    num_steps: int = 3  # K: training depth and default number of drafts per verify step
    zero_position0_embedding: bool = True  # vLLM zeroes Emb(t_{p+1}) where position == 0
    mtp_start_layer: int = 0  # target num_hidden_layers: checkpoints may name MTP layer i model.layers.{N+i}
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    gating_type: str = "elementwise"  # output gate per value element ("elementwise") or per head ("headwise")
    learnable_sink: bool = True
    learnable_sink_init: float = 0.0
    use_indexer: bool = False  # DSA lightning indexer (vLLM: when the MTP layer's layer type is sparse)
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 16
    index_norm_eps: float = 1e-6
    mlp_type: str = "sparse"  # "sparse" (MoE) or "dense"
    intermediate_size: int = 0  # dense MLP only
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 1
    moe_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0  # routed-expert clamp; <= 0 disables
    rms_norm_eps: float = 1e-5
    lora_norm_eps: float | None = None  # q_a_layernorm / kv_a_layernorm eps; None = rms_norm_eps (vLLM)
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # vLLM is_neox_style=False
    initializer_range: float = 0.006
    lm_head_fp32: bool = True  # vLLM HYV4Config enable_lm_head_fp32 (default True): the head in float32

    @property
    def block_size(self) -> int:
        """Drafts per verify step (eval's default gamma), = num_steps."""
        return self.num_steps

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self) -> "HYV4MTPConfig":
        """Raise FieldError naming the offending key; returns self."""

        def bad(key: str, why: str) -> FieldError:
            return field_error(self, key, f"{why}, got {getattr(self, key)!r}")

        if self.kind != "hyv4_mtp":
            raise bad("kind", "must be 'hyv4_mtp'")
        positive = ["num_layers", "num_steps", "hidden_size", "vocab_size", "num_attention_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        if self.use_indexer:
            positive += ["index_topk", "index_head_dim", "index_n_heads"]
        positive += (["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"] if self.mlp_type == "sparse"
                     else ["intermediate_size"])
        for key in positive:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(key, "must be a positive int")
        if self.mtp_start_layer < 0:
            raise bad("mtp_start_layer", "must be >= 0")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        if self.gating_type not in ("elementwise", "headwise"):
            raise bad("gating_type", "must be 'elementwise' or 'headwise'")
        if self.mlp_type not in ("sparse", "dense"):
            raise bad("mlp_type", "must be 'sparse' or 'dense'")
        if self.mlp_type == "sparse":
            if self.num_experts_per_tok > self.n_routed_experts:
                raise bad("num_experts_per_tok", f"must be <= n_routed_experts={self.n_routed_experts}")
            if self.n_shared_experts < 0:
                raise bad("n_shared_experts", "must be >= 0")
        if self.use_indexer and not self.qk_rope_head_dim <= self.index_head_dim:
            raise bad("index_head_dim", f"must be >= qk_rope_head_dim={self.qk_rope_head_dim}")
        for key in ("rms_norm_eps", "index_norm_eps", "rope_theta", "initializer_range"):
            if not getattr(self, key) > 0:
                raise bad(key, "must be > 0")
        if self.lora_norm_eps is not None and not self.lora_norm_eps > 0:
            raise bad("lora_norm_eps", "must be > 0 or null")
        return self


    @classmethod
    def from_target_config(cls, hf_config: Any, config_json: Mapping[str, Any] | None = None,
                           **overrides: Any) -> "HYV4MTPConfig":
        """Block sizes from a transformers HYV4Config (or vLLM's hy_v4 config); `overrides` win.

        The MTP layer's attention / MLP type is the target's entry at index num_hidden_layers, padded with the
        last entry when the lists are shorter (vLLM `_extend_layer_types`, vllm/models/hy_v4/nvidia/mtp.py:343-356,
        391-398 of vLLM 0.33.0); num_layers = num_nextn_predict_layers when the config has MTP layers.
        `config_json` (the target's raw config.json; default: the one in the folder hf_config was loaded from)
        applies vLLM's own HYV4Config where it differs from transformers': without `layer_types` vLLM builds no indexer (its config leaves layer_types None,
        transformers_utils/configs/hy_v4.py:154-160; attention.py:322-341), while transformers defaults every layer
        to indexed attention. A target with gated_mla false is refused (vLLM then builds no output gate,
        attention.py:464-485; the draft always has one).
        """
        c = hf_config
        if getattr(c, "model_type", "hy_v4") not in ("hy_v4", "hy_v4_vl_text"):
            raise FieldError("kind", f"hyv4_mtp needs a HY V4 target, got {c.model_type!r}")
        config_json = raw_config_json(c) if config_json is None else config_json
        gated = (config_json or {}).get("gated_mla", getattr(c, "gated_mla", True))
        if gated is False:
            raise ValueError("target gated_mla=false: vLLM builds the MTP attention without linear_gate "
                             "(vllm/models/hy_v4/nvidia/attention.py:464-485); the HY V4 MTP draft always gates")
        rope = dict(getattr(c, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"target rope_parameters.rope_type={rope.get('rope_type')!r}: only 'default' RoPE is "
                             "modelled by the HY V4 MTP draft")
        for key in ("n_group", "topk_group"):
            if int(getattr(c, key, 1) or 1) != 1:
                raise ValueError(f"target {key}={getattr(c, key)}: HY V4 routes globally (1 group) only")
        if getattr(c, "hidden_act", "silu") != "silu":
            raise ValueError(f"target hidden_act={c.hidden_act!r}: only silu is supported")
        n = int(c.num_hidden_layers)

        def mtp_entry(name: str, fallback: str) -> str:
            raw = config_json.get(name) if config_json is not None else getattr(c, name, None)
            types = list(raw or [])
            return str(types[n] if len(types) > n else (types[-1] if types else fallback))

        values: dict[str, Any] = {k: getattr(c, k) for k in (
            "hidden_size", "vocab_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "intermediate_size", "n_routed_experts", "num_experts_per_tok",
            "n_shared_experts", "moe_intermediate_size", "routed_scaling_factor", "norm_topk_prob", "swiglu_limit",
            "rms_norm_eps", "learnable_sink_init", "initializer_range", "index_topk", "index_head_dim",
            "index_n_heads") if hasattr(c, k)}
        values["rope_theta"] = float(rope.get("rope_theta", 10000.0))
        values["use_indexer"] = hasattr(c, "index_topk") and mtp_entry("layer_types", "full_attention") in \
            SPARSE_ATTENTION_TYPES
        values["mlp_type"] = mtp_entry("mlp_layer_types", "sparse")
        values["gating_type"] = str(getattr(c, "gating_type", "elementwise"))
        values["learnable_sink"] = bool(getattr(c, "learnable_sink", True))
        values["mtp_start_layer"] = n
        values["lm_head_fp32"] = vllm_head_fp32(c)  # dspark.ops.lm_head: transformers_utils/configs/hy_v4.py:162-168
        n_mtp = int(getattr(c, "num_nextn_predict_layers", 0) or 0)
        if n_mtp > 0:
            values["num_layers"] = n_mtp
        values.update(overrides)
        return cls.from_dict(values)


def causal_mask(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """bool [B, S, S]: key j visible to query i iff j <= i (rows are one sequence, in order)."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).tril().expand(batch, seq, seq)


# ---- attention ------------------------------------------------------------------------------------
class HyIndexer(nn.Module):
    """DSA lightning indexer: per query, the top-k keys by sum_h w_h * relu(q_h . k) (names as the checkpoint)."""

    def __init__(self, cfg: HYV4MTPConfig):
        super().__init__()
        self.cfg = cfg
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=cfg.index_norm_eps)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> the rows' indexer keys [B, T, d] (normed, RoPE on the last rope dims)."""
        k = self.k_norm(self.wk(x).float()).to(x.dtype).unsqueeze(2)  # [B, T, 1, d]
        return apply_rope(k, cos, sin, self.cfg.rope_interleave)[:, :, 0]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                allowed: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """x [B, S, H], q_resid [B, S, q_lora], allowed bool [B, S, T], k [B, T, d] (every key row's indexer key)
        -> selected bool [B, S, T] (subset of allowed)."""
        c = self.cfg
        b, s, _ = x.shape
        q = self.wq_b(q_resid).view(b, s, c.index_n_heads, c.index_head_dim)  # [B, S, n, d]
        q = apply_rope(q, cos, sin, c.rope_interleave)  # RoPE on the LAST rope dims of each head (checkpoint layout)
        scores = F.relu(torch.einsum("bsnd,btd->bsnt", q.float(), k.float()))  # [B, S, n, T]
        w = self.weights_proj(x).float() * (c.index_n_heads ** -0.5) * (c.index_head_dim ** -0.5)  # [B, S, n]
        index = torch.einsum("bsn,bsnt->bst", w, scores)  # [B, S, T]
        index = index.masked_fill(~allowed, torch.finfo(index.dtype).min)
        top = index.topk(min(c.index_topk, index.shape[-1]), dim=-1).indices  # [B, S, k]
        selected = torch.zeros_like(allowed).scatter(-1, top, True)
        return selected & allowed


class HyMLA(nn.Module):
    """Multi-head latent attention with a fused q_a|kv_a down-projection, sink logits and a sigmoid output gate."""

    def __init__(self, cfg: HYV4MTPConfig):
        super().__init__()
        self.cfg = cfg
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        lora_eps = cfg.rms_norm_eps if cfg.lora_norm_eps is None else cfg.lora_norm_eps
        self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, lora_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, lora_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, h, bias=False)
        gate_per_head = cfg.v_head_dim if cfg.gating_type == "elementwise" else 1
        self.linear_gate = nn.Linear(h, nh * gate_per_head, bias=False)
        if cfg.learnable_sink:
            self.learnable_sink_param = nn.Parameter(torch.full((nh,), cfg.learnable_sink_init, dtype=torch.float32))
        else:
            self.learnable_sink_param = None
        self.indexer = HyIndexer(cfg) if cfg.use_indexer else None
        self.scaling = cfg.qk_head_dim ** -0.5
        self.rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": cfg.rope_theta}, cfg.qk_rope_head_dim)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] (normed), position_ids [B, S] -> [B, S, H]; causal over the S rows."""
        b, s, _ = x.shape
        return self.attend(x, position_ids, None, causal_mask(b, s, x.device))[0]

    def attend(self, x: torch.Tensor, position_ids: torch.Tensor, past: tuple | None,
               mask: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """New rows x [B, T, H] (normed) at position_ids [B, T], attending to `past` rows (the kv tuple an earlier
        call returned, P rows, or None) and to themselves as `mask` [B, T, P+T] bool allows (keys: past rows then
        the T new rows). -> (out [B, T, H], kv of the T new rows: (k [B,T,nh,dq], v [B,T,nh,v], indexer k | None))."""
        c = self.cfg
        b, s, _ = x.shape
        nh, r = c.num_attention_heads, c.qk_rope_head_dim
        # q_a | kv_a as one GEMM (vLLM fused_qkv_a_proj); the checkpoint keeps the two weights separate
        qkv_a = F.linear(x, torch.cat([self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight], dim=0))
        q_c, kv_a = qkv_a.split([c.q_lora_rank, c.kv_lora_rank + r], dim=-1)
        q_resid = self.q_a_layernorm(q_c)  # [B, S, q_lora]
        q = self.q_b_proj(q_resid).view(b, s, nh, c.qk_head_dim)  # [B, S, nh, dq]
        kv_c, k_rot = kv_a.split([c.kv_lora_rank, r], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_c)).view(b, s, nh, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [B, S, nh, *]

        cos, sin = self.rotary(x, position_ids)  # [B, S, r/2]
        q = apply_rope(q, cos, sin, c.rope_interleave)  # rope on the last r dims of each head
        k_rot = apply_rope(k_rot.unsqueeze(2), cos, sin, c.rope_interleave)  # [B, S, 1, r] shared by all heads
        k = torch.cat([k_nope, k_rot.expand(b, s, nh, r)], dim=-1)  # [B, S, nh, dq]
        idx_k = self.indexer.keys(x, cos, sin) if self.indexer is not None else None  # [B, S, d]
        new = (k, v, idx_k)
        k_all, v_all, idx_all = new if past is None else tuple(
            None if n is None else torch.cat([p, n], dim=1) for p, n in zip(past, new))  # [B, P+S, ...]
        if tuple(mask.shape) != (b, s, k_all.shape[1]):
            raise ValueError(f"attend: mask must be [{b}, {s}, {k_all.shape[1]}], got {tuple(mask.shape)}")

        allowed = mask  # [B, S, T]
        if self.indexer is not None:
            allowed = self.indexer(x, q_resid, cos, sin, allowed, idx_all)
        scores = torch.einsum("bshd,bthd->bhst", q, k_all) * self.scaling  # [B, nh, S, T]
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        if self.learnable_sink_param is not None:  # an extra logit per head that absorbs probability mass
            sink = self.learnable_sink_param.to(scores.dtype).view(1, nh, 1, 1).expand(b, nh, s, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhst,bthd->bshd", probs.to(v_all.dtype), v_all)  # [B, S, nh, v]
        gate = torch.sigmoid(self.linear_gate(x)).view(b, s, nh, -1)  # [B, S, nh, v | 1]
        return self.o_proj((out * gate).reshape(b, s, nh * c.v_head_dim)), new


# ---- feed-forward ---------------------------------------------------------------------------------
class HySwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no clamp (dense layers and shared experts)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HyRouter(nn.Module):
    """Sigmoid router: experts chosen by sigmoid(logit) + e_score_correction_bias, weighted by sigmoid(logit)."""

    def __init__(self, cfg: HYV4MTPConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        # load-balancing bias (vLLM `expert_bias`): selection only, never trained by gradient
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] fp32, expert ids [N, k])."""
        c = self.cfg
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [N, E]
        ids = torch.topk(scores + self.e_score_correction_bias, c.num_experts_per_tok, dim=-1).indices  # [N, k]
        w = scores.gather(-1, ids)
        if c.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * c.routed_scaling_factor, ids


class HyExperts(nn.Module):
    """Routed experts, fused weights gate_up_proj [E, 2I, H] and down_proj [E, H, I]; clamped SwiGLU."""

    def __init__(self, cfg: HYV4MTPConfig):
        super().__init__()
        self.cfg = cfg
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights / ids [N, k] -> sum_k weights * expert_ids(x) [N, H]."""
        limit = self.cfg.swiglu_limit
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = torch.where(ids == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
            if limit > 0:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[tok, slot, None].to(x.dtype)
            out = out.index_add(0, tok, y)
        return out


class HyMoE(nn.Module):
    """Routed experts + shared expert(s): names gate / experts / shared_experts (checkpoint layout)."""

    def __init__(self, cfg: HYV4MTPConfig):
        super().__init__()
        self.gate = HyRouter(cfg)
        self.experts = HyExperts(cfg)
        self.shared_experts = (HySwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts > 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] -> [B, S, H]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, ids = self.gate(flat)
        out = self.experts(flat, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)


# ---- block and MTP layer --------------------------------------------------------------------------
class HyBlock(nn.Module):
    """HY V4 decoder layer with iHC off: pre-norm residual MLA + (MoE | dense MLP)."""

    def __init__(self, cfg: HYV4MTPConfig):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = HyMLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = HyMoE(cfg) if cfg.mlp_type == "sparse" else HySwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def block(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, H], position_ids [B, S] -> residual stream after attention and MLP [B, S, H] (causal rows)."""
        b, s, _ = x.shape
        return self.block_rows(x, position_ids, None, causal_mask(b, s, x.device))[0]

    def block_rows(self, x: torch.Tensor, position_ids: torch.Tensor, past: tuple | None,
                   mask: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """New rows x [B, T, H] attending to `past` rows and themselves per `mask` [B, T, P+T] (HyMLA.attend)
        -> (residual stream [B, T, H], the new rows' kv)."""
        a, kv = self.self_attn.attend(self.input_layernorm(x), position_ids, past, mask)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class HyMTPLayer(HyBlock):
    """`model.mtp_layers.{i}`: enorm / hnorm / eh_proj / final_layernorm around the block (flat names, as stored)."""

    def __init__(self, cfg: HYV4MTPConfig):
        super().__init__(cfg)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("learnable_sink_param"):
                nn.init.constant_(p, self.cfg.learnable_sink_init)
            elif isinstance(self.get_submodule(name.rsplit(".", 1)[0]), (RMSNorm, nn.LayerNorm)):
                nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=std)
        for name, buf in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                nn.init.zeros_(buf)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, past: tuple | None,
                mask: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """emb, hidden [B, T, H], position_ids [B, T], past rows' kv | None, mask [B, T, P+T] ->
        (final_layernorm(block(eh_proj([enorm e; hnorm h]))) [B, T, H], the new rows' kv)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))  # [B, T, H]
        y, kv = self.block_rows(x, position_ids, past, mask)
        return self.final_layernorm(y), kv


# ---- the draft ------------------------------------------------------------------------------------
def _indexer_donor(layers: nn.ModuleList) -> int | None:
    """The last target layer that runs its own DSA indexer (a layer reusing an earlier layer's top-k has none)."""
    return next((i for i in reversed(range(len(layers))) if getattr(layers[i].self_attn, "indexer", None) is not None),
                None)


@register("hyv4_mtp", config=HYV4MTPConfig, objective="mtp", serving="dspark.export.hy_v4_mtp")
class HYV4MTPDraft(ChainDraft, SharedTargetWeights, nn.Module):
    """HY V4 MTP draft; the MTP-draft interface is in docs/CONTRACTS.md (HY V4 (Hy4))."""

    needs_pre_head = False  # consumes TargetFeatures.final (after hc_head and the final norm)

    def __init__(self, config: HYV4MTPConfig):
        super().__init__()
        config.validate()
        self.config = config
        self.mtp_layers = nn.ModuleList([HyMTPLayer(config) for _ in range(config.num_layers)])

    def reset_parameters(self) -> None:
        for layer in self.mtp_layers:
            layer.reset_parameters()

    @property
    def dtype(self) -> torch.dtype:
        return self.mtp_layers[0].eh_proj.weight.dtype

    @torch.no_grad()
    def init_from_target(self, hf_model: nn.Module) -> "HYV4MTPDraft":
        """Copy the target's last decoder layer (block tensors; iHC dropped) into every MTP layer, the indexer from
        the last target layer that has one, and the target's final norm into final_layernorm."""
        layers = hf_model.model.layers
        hf_state = hy_v4_names.block_from_hf(layers[-1].state_dict())
        if self.config.use_indexer and not any(k.startswith("self_attn.indexer.") for k in hf_state):
            donor = _indexer_donor(layers)
            if donor is not None:
                hf_state.update({f"self_attn.indexer.{k}": v
                                 for k, v in layers[donor].self_attn.indexer.state_dict().items()})
        hf_state["final_layernorm.weight"] = hf_model.model.norm.weight
        own = self.mtp_layers[0].state_dict()
        wanted = [k for k in own if not k.startswith(("enorm.", "hnorm.", "eh_proj."))]
        missing = [k for k in wanted if k not in hf_state]
        if self.config.use_indexer and all(k.startswith("self_attn.indexer.") for k in missing):
            missing = []  # a target without any indexer: the draft's indexer keeps its init
        bad = missing + [k for k in wanted if k in hf_state and hf_state[k].shape != own[k].shape]
        if bad:
            raise ValueError(f"init_from_target: the target's last layer does not match the MTP block "
                             f"(mlp_type={self.config.mlp_type!r}, use_indexer={self.config.use_indexer}); "
                             f"missing or mis-shaped: {bad}")
        for layer in self.mtp_layers:
            layer_state = layer.state_dict()
            for k in wanted:
                if k in hf_state:
                    layer_state[k].copy_(hf_state[k])
        return self

    @staticmethod
    def init_reads(cfg: HYV4MTPConfig, hf_model: nn.Module) -> list[str]:
        """The target modules init_from_target copies (registry.init_reads): the last decoder layer, the indexer of
        the last layer that has one when the last layer has none and the MTP block has one, and the final norm."""
        layers = hf_model.model.layers
        names = [f"model.layers.{len(layers) - 1}"]
        donor = _indexer_donor(layers)
        if cfg.use_indexer and getattr(layers[-1].self_attn, "indexer", None) is None and donor is not None:
            names.append(f"model.layers.{donor}.self_attn.indexer")
        return names + ["model.norm"]

    # -- interface ---------------------------------------------------------------------------------
    def context_hidden(self, feats) -> torch.Tensor:
        """TargetFeatures -> the target's final hidden (after hc_head and the final norm) [B, S, H]."""
        h = feats.final
        if h.dim() != 3 or h.shape[-1] != self.config.hidden_size:
            raise ValueError(f"TargetFeatures.final must be [B, S, {self.config.hidden_size}], got {tuple(h.shape)}")
        return h.to(self.dtype)

    attention_window = None  # HY V4 MTP attention sees the whole sequence (MLA, optional DSA top-k)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
             layer_idx: int) -> torch.Tensor:
        """One MTP application over a sequence (causal). input_ids [B, S] (row p: token t_{p+1}), hidden [B, S, H]
        (row p: h_p), position_ids [B, S] -> out [B, S, H] after final_layernorm (what vLLM feeds the next step)."""
        b, s = input_ids.shape
        return self.step_rows(input_ids, hidden, position_ids, layer_idx, None, causal_mask(b, s, input_ids.device))[0]

    def step_rows(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, layer_idx: int,
                  past: tuple | None, mask: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """New rows (input_ids [B, T], hidden [B, T, H], position_ids [B, T]) attending to `past` rows (the kv an
        earlier call returned) and to themselves per `mask` [B, T, P+T] -> (out [B, T, H], the new rows' kv)."""
        b, s = input_ids.shape
        if tuple(hidden.shape) != (b, s, self.config.hidden_size) or tuple(position_ids.shape) != (b, s):
            raise ValueError(f"step: input_ids {tuple(input_ids.shape)}, hidden {tuple(hidden.shape)} and "
                             f"position_ids {tuple(position_ids.shape)} must be [B, S], [B, S, H], [B, S]")
        emb = F.embedding(input_ids, self._shared("embed_weight")).to(self.dtype)  # [B, S, H]
        if self.config.zero_position0_embedding:
            emb = emb.masked_fill((position_ids == 0).unsqueeze(-1), 0.0)
        layer = self.mtp_layers[layer_idx % len(self.mtp_layers)]
        return layer(emb, hidden.to(self.dtype), position_ids, past, mask)

    def logits(self, hidden_out: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        """hidden_out [..., H] (already final_layernorm'ed by step) -> target lm_head logits [..., V]. Every HY V4 MTP
        layer scores with the target's head (vLLM's shared_head is the identity), whatever `layer_idx`; in float32 when
        config.lm_head_fp32 (vLLM's HYV4Config enable_lm_head_fp32, default True: dspark.ops.lm_head)."""
        return lm_head_logits(hidden_out, self._shared("lm_head_weight"), self.config.lm_head_fp32)


__all__ = ["HYV4MTPConfig", "HYV4MTPDraft", "HyMTPLayer", "HyBlock", "HyMLA", "HyIndexer", "HyMoE", "HyRouter",
           "HyExperts", "HySwiGLU", "causal_mask",
           "SPARSE_ATTENTION_TYPES"]

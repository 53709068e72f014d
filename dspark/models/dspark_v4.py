"""DeepSeek-V4 DSpark draft model (SPEC sections 2 and 4).

The draft reads the target's layer outputs, builds per-layer sliding-window context KV from them,
and runs a block of gamma tokens [x0, m, ..., m] through N DeepSeek-V4 decoder layers (mHC + shared-KV
MQA with a sink + MoE), then hc_head gives the PRE-norm hidden h. Base logits are lm_head(norm(h)) with
the target's (frozen, shared) lm_head; a Markov head and a confidence head sit on top.

Parameter names are the serving checkpoint's (vLLM `_remap_dspark_name`), so export is a prefix map:
model level `main_proj`, `main_norm`, `norm`, `hc_head_{fn,base,scale}`, `markov_head.*`,
`confidence_head.*`; per layer `layers.{i}.{attn.*, ffn.*, attn_norm, ffn_norm, hc_attn_*, hc_ffn_*}`.
"""

from __future__ import annotations

import re
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.block_draft import BlockDraft, check_block_fields
from dspark.models.common import DraftConfig, FieldError, SharedTargetWeights, field_error
from dspark.models.heads import ConfidenceHead, build_markov_head
from dspark.models.registry import register
from dspark.models.v4_names import init_draft_layers_from_target  # re-exported for callers of this module
from dspark.ops.attention import masked_attention
from dspark.ops.mhc import HcSettings, hc_head, hc_post, hc_pre
from dspark.ops.norms import RMSNorm, unweighted_rms_norm
from dspark.ops.rope import RotaryEmbedding, apply_rope

SCORING_FUNCS = ("sqrtsoftplus",)

M = TypeVar("M", bound=nn.Module)

# Parameters kept in float32 whatever the compute dtype (as in the serving checkpoint / reference).
FP32_PARAM_RE = re.compile(r"(^|\.)(hc_\w+|\w*norm\.weight|attn_sink|gate\.bias|confidence_head\.proj\.\w+)$")


def cast_compute_weights(module: M, dtype: torch.dtype) -> M:
    """Cast `module`'s parameters to `dtype` in place, except those FP32_PARAM_RE keeps in float32; returns it."""
    for name, param in module.named_parameters():
        if not FP32_PARAM_RE.search(name):
            param.data = param.data.to(dtype)
    return module


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class V4BlockSizes(DraftConfig):
    """Sizes of one DeepSeek-V4 decoder block (attention / MoE / mHC): the target's. Shared by every V4 draft config."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    scoring_func: str = "sqrtsoftplus"
    # Routing as vLLM builds it from the target config (vllm/models/deepseek_v4/nvidia/model.py:251,301-309 of
    # vLLM 0.33.0): the gate has a selection bias (`ffn.gate.bias`, vLLM `e_score_correction_bias`) only when
    # topk_method == "noaux_tc"; top-k weights are renormalised iff norm_topk_prob.
    topk_method: str | None = "noaux_tc"
    norm_topk_prob: bool = True
    hc_mult: int
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    sliding_window: int = 128
    initializer_range: float = 0.02


# The block-size keys, in declaration order (what a V4 draft config copies from the target config).
V4_BLOCK_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(V4BlockSizes))


@dataclass(kw_only=True)
class DSparkV4Config(V4BlockSizes):
    """Sizes of a DeepSeek-V4 DSpark draft. Attention / MoE / mHC sizes (V4BlockSizes) are the target's."""

    # draft-group keys at the top level of configs/draft/*.yaml (the rest sits under `arch`)
    GROUP_KEYS: ClassVar[tuple[str, ...]] = ("num_layers", "block_size", "mask_token_id", "target_layer_ids",
                                             "markov_rank", "markov_head_type", "sliding_window", "layout")
    DRAFTS_KEY: ClassVar[str] = "block_size"  # the group key of the drafts per verify step
    DEFAULT_TARGET: ClassVar[str | None] = "tiny_v4"  # target kind (configs/target) when a run records none
    # the block mask's window rule (dspark.ops.attention.WINDOW_RULES): each block sees the sliding_window context
    # keys before its anchor and its whole block
    window_rule: ClassVar[str] = "block"

    num_layers: int = 3
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    markov_rank: int
    markov_head_type: str = "vanilla"
    confidence_bias: bool = False
    layout: str = "anchor"  # block layout: anchor (DSpark, sample_from_anchor) | mask (DFlash 1+N)

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]

    @property
    def vllm_method(self) -> str:
        """vLLM's speculative_config method for this draft."""
        return "dspark"

    def validate(self) -> "DSparkV4Config":
        """Raise FieldError naming the offending key; returns self so calls can be chained."""
        bad = lambda key, why: field_error(self, key, why)  # noqa: E731
        positive = (
            "hidden_size vocab_size num_layers num_attention_heads head_dim rope_head_dim q_lora_rank o_groups "
            "o_lora_rank n_routed_experts num_experts_per_tok moe_intermediate_size hc_mult hc_sinkhorn_iters "
            "sliding_window block_size markov_rank"
        ).split()
        for key in positive:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(key, f"must be a positive int, got {value!r}")
        if self.n_shared_experts < 0:
            raise bad("n_shared_experts", f"must be >= 0, got {self.n_shared_experts}")
        if self.rope_head_dim > self.head_dim or self.rope_head_dim % 2:
            raise bad("rope_head_dim", f"({self.rope_head_dim}) must be even and <= head_dim ({self.head_dim})")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise bad("o_groups", f"({self.o_groups}) must divide num_attention_heads * head_dim "
                                  f"({self.num_attention_heads * self.head_dim})")
        if self.num_attention_heads % self.o_groups:
            raise bad("o_groups", f"({self.o_groups}) must divide num_attention_heads ({self.num_attention_heads})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise bad("num_experts_per_tok", f"({self.num_experts_per_tok}) exceeds n_routed_experts "
                                             f"({self.n_routed_experts})")
        floats = ("routed_scaling_factor", "swiglu_limit", "hc_eps", "rms_norm_eps", "rope_theta", "initializer_range")
        for key in floats:
            if not float(getattr(self, key)) > 0:
                raise bad(key, f"must be > 0, got {getattr(self, key)!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise bad("scoring_func", f"must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        check_block_fields(self)
        return self

    @classmethod
    def from_target_config(cls, hf_cfg: Any, **draft_keys: Any) -> "DSparkV4Config":
        """Attention / MoE / mHC sizes from a transformers DeepseekV4Config (the target's); refuses another target.

        DSpark keys come from `draft_keys`, falling back to the target config's `dspark_*` keys
        (dspark_block_size, dspark_noise_token_id, dspark_target_layer_ids, dspark_markov_rank,
        n_mtp_layers) when the checkpoint config carries them. rope_theta, topk_method and norm_topk_prob are the
        target's, as vLLM builds the draft layers from the target config.
        """
        if not getattr(hf_cfg, "hc_mult", 0):
            raise FieldError("kind", "dspark_v4 needs a DeepSeek-V4 target (config has no hc_mult); dense targets take "
                                     "draft.kind=dspark_dense")
        rope_dim = getattr(hf_cfg, "qk_rope_head_dim", None) or hf_cfg.head_dim * hf_cfg.partial_rotary_factor
        values: dict[str, Any] = {
            "hidden_size": hf_cfg.hidden_size,
            "vocab_size": hf_cfg.vocab_size,
            "num_attention_heads": hf_cfg.num_attention_heads,
            "head_dim": hf_cfg.head_dim,
            "rope_head_dim": int(rope_dim),
            "q_lora_rank": hf_cfg.q_lora_rank,
            "o_groups": hf_cfg.o_groups,
            "o_lora_rank": hf_cfg.o_lora_rank,
            "n_routed_experts": hf_cfg.n_routed_experts,
            "num_experts_per_tok": hf_cfg.num_experts_per_tok,
            "n_shared_experts": getattr(hf_cfg, "n_shared_experts", 1),
            "moe_intermediate_size": hf_cfg.moe_intermediate_size,
            "routed_scaling_factor": hf_cfg.routed_scaling_factor,
            "swiglu_limit": hf_cfg.swiglu_limit,
            "scoring_func": hf_cfg.scoring_func,
            "topk_method": getattr(hf_cfg, "topk_method", None),
            "norm_topk_prob": bool(getattr(hf_cfg, "norm_topk_prob", True)),
            # draft layers are sliding-window layers: vLLM gives them the target's rope_theta, no YaRN
            # (vllm/models/deepseek_v4/common/rope.py:28-42)
            "rope_theta": float(getattr(hf_cfg, "rope_theta", 10000.0)),
            "hc_mult": hf_cfg.hc_mult,
            "hc_sinkhorn_iters": hf_cfg.hc_sinkhorn_iters,
            "hc_eps": hf_cfg.hc_eps,
            "rms_norm_eps": hf_cfg.rms_norm_eps,
            "sliding_window": hf_cfg.sliding_window,
            "initializer_range": getattr(hf_cfg, "initializer_range", 0.02),
        }
        from_target = {
            "block_size": "dspark_block_size",
            "mask_token_id": "dspark_noise_token_id",
            "target_layer_ids": "dspark_target_layer_ids",
            "markov_rank": "dspark_markov_rank",
            "num_layers": "n_mtp_layers",
        }
        for key, hf_key in from_target.items():
            if getattr(hf_cfg, hf_key, None) is not None:
                values[key] = getattr(hf_cfg, hf_key)
        values.update(draft_keys)
        return cls.from_dict(values)


# ------------------------------------------------------------------------------------------------
# Small building blocks
# ------------------------------------------------------------------------------------------------
def _normal_linear(linear: nn.Linear, std: float) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


# ------------------------------------------------------------------------------------------------
# Attention: shared-KV MQA, sink, inverse RoPE, grouped low-rank output
# ------------------------------------------------------------------------------------------------
class DSparkV4Attention(nn.Module):
    def __init__(self, cfg: DSparkV4Config):
        super().__init__()
        self.cfg = cfg
        h, d, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
        self.n_heads, self.head_dim = nh, d
        self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, nh * d, bias=False)
        self.wkv = nn.Linear(h, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        # Grouped projection: group g maps its nh*d/G channels to o_lora_rank with rows
        # [g*R, (g+1)*R) of this weight ([G*R, nh*d/G], as in the checkpoint).
        self.wo_a = nn.Linear(nh * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, h, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(nh, dtype=torch.float32))
        # interleaved RoPE on the last rope_head_dim channels; vLLM's draft layers use the target's rope_theta,
        # no YaRN (vllm/models/deepseek_v4/common/rope.py:28-42)
        self.rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": cfg.rope_theta}, cfg.rope_head_dim)

    def reset_parameters(self, std: float) -> None:
        for lin in (self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b):
            _normal_linear(lin, std)
        self.q_norm.reset_parameters()
        self.kv_norm.reset_parameters()
        nn.init.zeros_(self.attn_sink)

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, L, H], positions [B, L] -> RoPE(kv_norm(wkv(x))) [B, L, D] (K == V)."""
        cos, sin = self.rotary(x, positions)  # [B, L, R/2]
        return apply_rope(self.kv_norm(self.wkv(x)), cos, sin, interleaved=True)

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Context KV from the combined target features (no attn_norm, no mHC): [B, S, H] -> [B, S, D]."""
        return self.project_kv(main_x, positions)

    def _grouped_out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, T, nh, D] -> wo_b(grouped wo_a(o)) [B, T, H]."""
        b, t = o.shape[:2]
        groups, rank = self.cfg.o_groups, self.cfg.o_lora_rank
        o = o.reshape(b, t, groups, -1)  # [B, T, G, nh*D/G]
        w = self.wo_a.weight.view(groups, rank, -1)  # [G, R, nh*D/G]
        low = torch.einsum("btgi,gri->btgr", o, w)  # [B, T, G, R]
        return self.wo_b(low.reshape(b, t, groups * rank))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """x [B, T, H] (after attn_norm); positions [B, T]; ctx_kv [B, S, D]; mask [B, T, S+T] -> [B, T, H]."""
        b, t, _ = x.shape
        cos, sin = self.rotary(x, positions)  # [B, T, R/2]
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(b, t, self.n_heads, self.head_dim)  # [B, T, nh, D]
        q = apply_rope(unweighted_rms_norm(q, self.cfg.rms_norm_eps), cos, sin, interleaved=True)
        kv_block = apply_rope(self.kv_norm(self.wkv(x)), cos, sin, interleaved=True)  # [B, T, D]
        kv = torch.cat([ctx_kv.to(kv_block.dtype), kv_block], dim=1).unsqueeze(1)  # [B, 1, S+T, D]
        o = masked_attention(
            q.transpose(1, 2), kv, kv, mask, scale=self.head_dim**-0.5, sink=self.attn_sink
        )  # [B, nh, T, D]
        o = apply_rope(o.transpose(1, 2), cos, sin, interleaved=True, inverse=True)  # [B, T, nh, D]
        return self._grouped_out(o)


# ------------------------------------------------------------------------------------------------
# MoE: sqrt-softplus gate with bias-corrected top-k, clamped SwiGLU experts, shared expert
# ------------------------------------------------------------------------------------------------
class DSparkV4Expert(nn.Module):
    """w2(silu(clamp(w1 x, max=L)) * clamp(w3 x, -L, L))."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def reset_parameters(self, std: float) -> None:
        for lin in (self.w1, self.w2, self.w3):
            _normal_linear(lin, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> [N, H]."""
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class DSparkV4Gate(nn.Module):
    """Learned router: s = sqrt(softplus(x W^T)) (fp32), top-k on s (+ bias under topk_method "noaux_tc"),
    weights = s of the chosen experts (normalised when norm_topk_prob) * routed_scaling_factor."""

    def __init__(self, cfg: DSparkV4Config):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.scaling = cfg.routed_scaling_factor
        self.renormalize = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # Bias-based load balancing (selection only, no gradient reaches it through top-k); vLLM builds it only
        # for topk_method "noaux_tc" (vllm/models/deepseek_v4/nvidia/model.py:301-309).
        self.bias = (nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False)
                     if cfg.topk_method == "noaux_tc" else None)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] fp32, expert ids [N, k])."""
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()  # [N, E]
        select = scores if self.bias is None else scores + self.bias.float()
        idx = torch.topk(select, self.top_k, dim=-1, sorted=False).indices  # [N, k]
        w = scores.gather(-1, idx)
        if self.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


class DSparkV4MoE(nn.Module):
    def __init__(self, cfg: DSparkV4Config):
        super().__init__()
        h, inter, limit = cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        self.n_experts = cfg.n_routed_experts
        self.gate = DSparkV4Gate(cfg)
        self.experts = nn.ModuleList([DSparkV4Expert(h, inter, limit) for _ in range(cfg.n_routed_experts)])
        self.shared_experts = (
            DSparkV4Expert(h, inter * cfg.n_shared_experts, limit) if cfg.n_shared_experts > 0 else None
        )

    def reset_parameters(self, std: float) -> None:
        self.gate.reset_parameters(std)
        for expert in self.experts:
            expert.reset_parameters(std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights/idx [N, k] -> sum_k weights * expert_idx(x) [N, H] (sort-by-expert dispatch)."""
        k = idx.shape[-1]
        flat_e = idx.reshape(-1)  # [N*k]
        order = torch.argsort(flat_e)
        token = order // k  # token row of each sorted assignment
        counts = torch.bincount(flat_e, minlength=self.n_experts).tolist()
        pieces = x[token].split(counts)
        # Every expert runs, an empty piece too (a [0, H] matmul: zero gradient, no work). Skipping the experts no
        # token chose left their weights out of the autograd graph on that rank only; under DDP that rank then never
        # launched the gradient bucket holding them while the other ranks did, and the ranks deadlocked (rank 0 at
        # the next barrier, another in backward; tests/training/test_ddp_graph.py).
        outs = [self.experts[e](piece) for e, piece in enumerate(pieces)]
        y = torch.cat(outs, dim=0).float() * weights.reshape(-1)[order].unsqueeze(-1)  # [N*k, H]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, token, y).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] (after ffn_norm) -> [B, T, H]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, idx = self.gate(flat)
        out = self._routed(flat, weights, idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)


# ------------------------------------------------------------------------------------------------
# Decoder layer and the draft
# ------------------------------------------------------------------------------------------------
def _hc_params(hc: int, hidden: int, n_mix: int, n_scale: int) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """(fn [n_mix, hc*H], base [n_mix], scale [n_scale]) in fp32, to be initialised by reset."""
    return (
        nn.Parameter(torch.empty(n_mix, hc * hidden, dtype=torch.float32)),
        nn.Parameter(torch.zeros(n_mix, dtype=torch.float32)),
        nn.Parameter(torch.ones(n_scale, dtype=torch.float32)),
    )


def _reset_hc(fn: nn.Parameter, base: nn.Parameter, scale: nn.Parameter, std: float) -> None:
    nn.init.normal_(fn, mean=0.0, std=std)
    nn.init.zeros_(base)
    nn.init.ones_(scale)


class DSparkV4Layer(nn.Module):
    """One DeepSeek-V4 block without compressor/indexer: mHC -> attn_norm -> MQA -> mHC -> ffn_norm -> MoE."""

    def __init__(self, cfg: DSparkV4Config):
        super().__init__()
        self.cfg = cfg
        hc, h = cfg.hc_mult, cfg.hidden_size
        self.attn = DSparkV4Attention(cfg)
        self.ffn = DSparkV4MoE(cfg)
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _hc_params(hc, h, (2 + hc) * hc, 3)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _hc_params(hc, h, (2 + hc) * hc, 3)
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None) -> None:
        std = self.cfg.initializer_range if std is None else std
        self.attn.reset_parameters(std)
        self.ffn.reset_parameters(std)
        self.attn_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        _reset_hc(self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, std)
        _reset_hc(self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, std)

    def _pre(self, x: torch.Tensor, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fn, base, scale = (getattr(self, f"hc_{which}_{p}") for p in ("fn", "base", "scale"))
        return hc_pre(x, fn, base, scale, HcSettings.of(self.cfg))

    def attn_input(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised attention input attn_norm(hc_pre(x)) [B, T, H] for x [B, T, hc, H]."""
        return self.attn_norm(self._pre(x, "attn")[0])

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """x [B, T, hc, H]; positions [B, T]; ctx_kv [B, S, D]; mask [B, T, S+T] bool -> [B, T, hc, H]."""
        y, post, comb = self._pre(x, "attn")
        x = hc_post(self.attn(self.attn_norm(y), positions, ctx_kv, mask), x, post, comb)
        y, post, comb = self._pre(x, "ffn")
        return hc_post(self.ffn(self.ffn_norm(y)), x, post, comb)


@register("dspark_v4", config=DSparkV4Config, objective="block", serving="dspark.export.dspark_v4")
class DSparkV4Draft(BlockDraft, SharedTargetWeights, nn.Module):
    """DeepSeek-V4 DSpark draft; interface in docs/CONTRACTS.md."""

    context_seq_dim = 1  # context_kv rows (eval's draft-side cache, block_draft.BlockContextCache): [B, S, D]
    layer_class: ClassVar[type[nn.Module]] = DSparkV4Layer
    has_hc_head: ClassVar[bool] = True  # V4 collapses the last streams with hc_head_* (V4.1 has none)

    def __init__(self, cfg: DSparkV4Config):
        super().__init__()
        cfg.validate()
        self.config = cfg
        h, hc = cfg.hidden_size, cfg.hc_mult
        self.main_proj = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.main_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([self.layer_class(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        if self.has_hc_head:
            self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _hc_params(hc, h, hc, 1)
        self.markov_head = build_markov_head(cfg.vocab_size, cfg.vocab_size, cfg.markov_rank, h, cfg.markov_head_type)
        self.confidence_head = ConfidenceHead(h + cfg.markov_rank, bias=cfg.confidence_bias)
        self.reset_parameters()

    # -- init / dtype ------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        _normal_linear(self.main_proj, std)
        self.main_norm.reset_parameters()
        self.norm.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters(std)
        if self.has_hc_head:
            _reset_hc(self.hc_head_fn, self.hc_head_base, self.hc_head_scale, std)
        self.markov_head.reset_parameters(std)
        self.confidence_head.reset_parameters(std)

    def set_dtype(self, dtype: torch.dtype) -> "DSparkV4Draft":
        """Cast the compute weights to `dtype`, keeping mHC, norms, sinks, gate bias, confidence in fp32."""
        return cast_compute_weights(self, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.main_proj.weight.dtype

    # -- interface ---------------------------------------------------------------------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, S, n*H] (target layer outputs, hc-averaged, concatenated) -> main_x [B, S, H]."""
        return self.main_norm(self.main_proj(aux.to(self.dtype)))

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """main_x [B, S, H], positions [B, S] -> per layer RoPE(kv_norm_i(wkv_i(main_x))) [B, S, D]."""
        return [layer.attn.context_kv(main_x, positions) for layer in self.layers]

    def empty_context(self, batch: int, device: torch.device | str | None = None) -> list[torch.Tensor]:
        """Context KV of length 0 for every layer: list of [B, 0, D]."""
        return [torch.zeros(batch, 0, self.config.head_dim, dtype=self.dtype, device=device) for _ in self.layers]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> shared target embedding [B, T, H] in the draft dtype."""
        return F.embedding(ids, self._shared("embed_weight")).to(self.dtype)

    def backbone(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        ctx: Sequence[torch.Tensor],
        attn_mask: torch.Tensor,
    ) -> torch.Tensor:
        """block_ids [B, T], block_positions [B, T], ctx per-layer [B, S, D], attn_mask [B, T, S+T] bool
        -> PRE-norm hidden h [B, T, H]."""
        if len(ctx) != len(self.layers):
            raise ValueError(f"backbone: expected {len(self.layers)} context KV tensors, got {len(ctx)}")
        b, t = block_ids.shape
        s = ctx[0].shape[1]
        if tuple(attn_mask.shape) != (b, t, s + t):
            raise ValueError(f"backbone: attn_mask must be [{b}, {t}, {s + t}], got {tuple(attn_mask.shape)}")
        x = self.embed(block_ids).unsqueeze(-2).repeat(1, 1, self.config.hc_mult, 1)  # [B, T, hc, H]
        return self.run_layers(x, block_positions, ctx, attn_mask)

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: Sequence[torch.Tensor], attn_mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, hc, H] (the embedded block on every stream) -> h [B, T, H]: the layers, then hc_head."""
        for layer, kv in zip(self.layers, ctx):
            x = layer(x, positions, kv, attn_mask)
        c = self.config
        return hc_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.hc_eps, c.rms_norm_eps)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] (pre-norm) -> norm(h) [..., H], the rows the shared LM head scores (the fused loss takes them)."""
        return self.norm(h)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] (pre-norm) -> U = lm_head(norm(h)) [..., V]."""
        w = self._shared("lm_head_weight")
        return F.linear(self.head_input(h).to(w.dtype), w)

    def confidence_logit(self, h: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """h [..., H] (pre-norm), feat [..., r] -> logit [...] (fp32); sigmoid gives c_k."""
        return self.confidence_head(h, feat)


__all__ = [
    "DSparkV4Config",
    "DSparkV4Attention",
    "DSparkV4MoE",
    "DSparkV4Layer",
    "DSparkV4Draft",
    "RMSNorm",
    "FP32_PARAM_RE",
    "V4BlockSizes",
    "V4_BLOCK_FIELDS",
    "cast_compute_weights",
    "init_draft_layers_from_target",
]

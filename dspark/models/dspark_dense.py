"""Dense DSpark / DFlash draft (docs/CONTRACTS.md §5): Qwen3-style decoder layers over a block of tokens.

    main_x = hidden_norm(fc(concat of target layer outputs))                 [B, S, H]
    per layer: context k = RoPE_ctxpos(k_norm(k_proj(main_x))), v = v_proj(main_x)   (no input norm)
               block tokens: pre-norm GQA attention over [context ; block] + SwiGLU MLP
    h = last layer output (pre-norm); U = lm_head(norm(h)) with the target's LM head
DSpark adds the Markov head and a confidence head (Linear(H + r -> 1) with bias on the NORMED hidden,
as in DeepSpec's dense drafts). DFlash (`markov_rank: 0`) has neither and is trained with CE only.
Reduced vocabulary (`draft_vocab_size` < vocab_size, vLLM / EAGLE-3 convention): the draft scores only
Vd target tokens, draft id d <-> target id d + d2t[d] (buffer `d2t` [Vd] long; `t2d` [V] bool marks the
kept target ids). Its LM head is the target's rows at those ids, markov_w2 is [Vd, r]; base_logits and
the Markov bias are scattered back to target ids ([.., V], -inf / 0 elsewhere), so propose and verify
keep working in target ids. Trained reduced (dspark.training.draft_vocab picks the ids from the training data;
the fused loss scores the kept rows only) or pruned from a full-vocab draft at export (dspark.export.vocab).
Parameter names follow vLLM's Qwen3 DSpark / DFlash drafts (fc, hidden_norm, layers.{i}.self_attn.*,
layers.{i}.mlp.*, norm, markov_head.*, confidence_head.proj).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.block_draft import BlockDraft, check_block_fields
from dspark.models.common import DraftConfig, FieldError, SharedTargetWeights, config_from_dict, field_error
from dspark.models.draft_vocab import DraftVocab
from dspark.models.heads import ConfidenceHead, build_markov_head
from dspark.models.registry import register
from dspark.models.vllm_targets import refuse_unserved_target, served_window
from dspark.ops.attention import WINDOW_RULES, masked_attention
from dspark.ops.norms import RMSNorm
from dspark.ops.rope import ROPE_TYPES, RotaryEmbedding, apply_rope

log = logging.getLogger("dspark.models.dspark_dense")


@dataclass(kw_only=True)
class DenseLayerSizes(DraftConfig):
    """The sizes of a Llama / Qwen3-style decoder layer, the target's (every dense draft builds its layers from them)."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    # the TARGET's positions: its transformers `rope_parameters` (rope_type default / linear / dynamic / yarn /
    # longrope / llama3 with their keys) and max_position_embeddings; the draft rotates with the same frequencies
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 32768

    @staticmethod
    def sizes_of(hf) -> dict:
        """These fields from a dense HF config (Llama, Qwen2/3, SmolLM2, ...); a target whose logits or embeddings the
        shared head / embedding would misread is refused (refuse_unshareable_target), and so is one vLLM cannot serve
        these drafts against (dspark.models.vllm_targets: every dense family reads the same aux hidden states)."""
        refuse_unshareable_target(hf)
        refuse_unserved_target(hf)
        heads = int(hf.num_attention_heads)
        return dict(
            hidden_size=int(hf.hidden_size), vocab_size=int(hf.vocab_size), num_attention_heads=heads,
            num_key_value_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
            intermediate_size=int(hf.intermediate_size), rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
            rope_parameters=draft_rope_parameters(hf),
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", None) or 32768),
        )


@dataclass(kw_only=True)
class DSparkDenseConfig(DenseLayerSizes):
    # draft-group keys at the top level of configs/draft/*.yaml (the rest sits under `arch`)
    GROUP_KEYS: ClassVar[tuple[str, ...]] = ("num_layers", "block_size", "mask_token_id", "target_layer_ids",
                                             "markov_rank", "markov_head_type", "sliding_window", "layout",
                                             "draft_vocab_size", "final_norm_init")
    DRAFTS_KEY: ClassVar[str] = "block_size"  # the group key of the drafts per verify step
    DEFAULT_TARGET: ClassVar[str | None] = None  # target kind (configs/target) when a run records none
    FLOPS_COUNTED: ClassVar[bool] = True  # dspark.training.flops counts this class's step (not a subclass's)

    num_layers: int = 1
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)
    markov_rank: int = 0  # 0 = DFlash (no Markov head, no confidence head)
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    draft_vocab_size: int | None = None  # None / == vocab_size: full vocabulary (no d2t)
    sliding_window: int | None = None  # DeepSpec dense drafts see the whole context
    # how the window bounds the block (dspark.ops.attention.WINDOW_RULES): "block" (every slot sees the
    # sliding_window context keys before the anchor) or "query" (vLLM's non-causal window |q - k| < W, which
    # from_target_config sets with the window of a target whose layers all slide: vLLM gives it to the draft too)
    window_rule: str = "block"
    initializer_range: float = 0.02
    # the final norm's starting weight: the draft's logits are lm_head(w * h / rms(h)), so w sets their spread at step
    # 0 (1.0: logit std 7.7 on SmolLM2, twice the target's 3.6, held-out CE 56; benchmarks/README.md "Step-0 CE")
    final_norm_init: float = 1.0
    # block layout: anchor (DSpark) | mask (DFlash 1+N); unset: anchor with a Markov head, else mask (the only
    # layout vLLM serves DFlash drafts with)
    layout: str | None = None

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = "anchor" if self.markov_rank > 0 else "mask"

    @property
    def vllm_method(self) -> str:
        """vLLM's speculative_config method for this draft."""
        return "dspark" if self.markov_rank > 0 else "dflash"

    def validate(self) -> "DSparkDenseConfig":
        """Raise FieldError naming the offending key; returns self."""
        bad = lambda key, why: field_error(self, key, why)  # noqa: E731
        for key in ("hidden_size", "vocab_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "intermediate_size", "block_size"):
            if int(getattr(self, key)) < 1:
                raise bad(key, f"must be >= 1, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_attention_heads", f"({self.num_attention_heads}) must be a multiple of "
                                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise bad("head_dim", f"must be even for RoPE, got {self.head_dim}")
        if self.markov_rank < 0:
            raise bad("markov_rank", f"must be >= 0, got {self.markov_rank}")
        check_block_fields(self)
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise bad("draft_vocab_size", f"must be in [1, vocab_size={self.vocab_size}] or null, "
                                          f"got {self.draft_vocab_size}")
        if not self.final_norm_init > 0:
            raise bad("final_norm_init", f"must be > 0, got {self.final_norm_init}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise bad("sliding_window", f"must be >= 1 or null, got {self.sliding_window}")
        if self.window_rule not in WINDOW_RULES:
            raise bad("window_rule", f"must be one of {WINDOW_RULES}, got {self.window_rule!r}")
        rp = self.rope_parameters
        if not isinstance(rp, dict) or "rope_theta" not in rp or any(isinstance(v, dict) for v in rp.values()):
            raise bad("rope_parameters", f"must be one flat transformers rope dict with rope_theta, got {rp!r}")
        if rp.get("rope_type", "default") not in ROPE_TYPES:
            raise bad("rope_parameters", f"rope_type {rp.get('rope_type')!r} is not one of {ROPE_TYPES}")
        if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
            raise bad("rope_parameters", "partial_rotary_factor != 1 (partial rotary) is not supported by the dense "
                                         "draft")
        return self

    @classmethod
    def from_target_config(cls, hf, **draft_keys) -> "DSparkDenseConfig":
        """Attention / MLP sizes and RoPE from a dense HF config (Llama, Qwen2/3, SmolLM2, ...), draft keys given;
        refuses a DeepSeek-V4 target. A target whose layers all slide hands the draft its window under vLLM's
        per-query rule (window_rule "query"; dspark.models.vllm_targets.served_window says so in one info line)."""
        if getattr(hf, "hc_mult", 0):
            raise FieldError("kind", "dspark_dense needs a dense target; use dspark_v4 for DeepSeek-V4")
        base = cls.sizes_of(hf)
        base.update(draft_keys)
        window = served_window(hf, draft_keys.get("sliding_window"), f"the {cls.__name__} block")
        if window is not None:
            base.update(sliding_window=window, window_rule="query")
        return config_from_dict(cls, base).validate()


def target_rope_parameters(hf) -> dict:
    """The target config's standardized `rope_parameters` (transformers 5 puts rope_theta, rope_type and the
    scaling keys there), as plain JSON values; an old-style config without it has rope_theta only."""
    rp = getattr(hf, "rope_parameters", None)
    if not rp:
        return {"rope_type": "default", "rope_theta": float(getattr(hf, "rope_theta", None) or 10000.0)}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(rp).items()}


def draft_rope_parameters(hf) -> dict:
    """The draft's own RoPE: the target's frequencies over the whole head. A partial-rotary target (StableLM, GPT-NeoX,
    Phi-2: partial_rotary_factor < 1) rotates part of its heads; the draft's layers are its own and what vLLM serves
    is the export's config, so the draft rotates its whole head (said once per config build)."""
    rp = target_rope_parameters(hf)
    factor = float(rp.pop("partial_rotary_factor", None) or getattr(hf, "partial_rotary_factor", None) or 1.0)
    if factor != 1.0:
        log.info("target partial_rotary_factor=%g (%s): the dense draft applies full rotary to its own heads "
                 "(its RoPE is its own; the export's config says so to vLLM)", factor, getattr(hf, "model_type", "?"))
    return rp


# Targets whose forward does more around the embedding / LM head than the weights the draft shares: the draft embeds
# with the raw embedding matrix and the teacher's logits are lm_head(final), so these would be misread in silence.
EMBED_SCALED_MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text", "recurrent_gemma")


def refuse_unshareable_target(hf) -> None:
    """FieldError (one line, naming the architecture and why) for a target whose embedding scale or final logit
    soft-capping the shared embedding / LM head would drop; called from the target's config.json, before any model
    loads."""
    kind = str(getattr(hf, "model_type", "") or "")
    why = []
    if kind in EMBED_SCALED_MODEL_TYPES:
        why.append(f"scales its input embeddings by sqrt(hidden_size) = {math.sqrt(int(hf.hidden_size)):.4g}")
    cap = getattr(hf, "final_logit_softcapping", None) or getattr(getattr(hf, "text_config", None),
                                                                  "final_logit_softcapping", None)
    if cap:
        why.append(f"soft-caps its final logits (final_logit_softcapping={cap})")
    if why:
        raise FieldError("kind", f"the dense drafts do not support a {kind or type(hf).__name__} target: it "
                                 f"{' and '.join(why)}, which the draft's shared embedding / LM head and the teacher "
                                 "logits (lm_head(final)) do not apply; choose another target architecture")


def rope(x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
    """Half-split (Llama / Qwen) RoPE over the whole head. x [B, heads, T, D], positions [B, T]."""
    cos, sin = rotary(x, positions)  # [B, T, D/2] fp32, attention scaling included
    return apply_rope(x, cos[:, None], sin[:, None], interleaved=False)


class DenseAttention(nn.Module):
    def __init__(self, cfg: DSparkDenseConfig, rotary: nn.Module):
        super().__init__()
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        object.__setattr__(self, "rotary", rotary)  # the draft's one rotary module (not registered per layer)
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.hd).transpose(1, 2)  # [B, T, n*hd] -> [B, n, T, hd]

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, nkv, T, hd]; k gets k_norm and RoPE at its positions, v neither."""
        k = rope(self.k_norm(self._heads(self.k_proj(x), self.nkv)), positions, self.rotary)
        return k, self._heads(self.v_proj(x), self.nkv)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] (normed block hidden), ctx_kv (k, v) [B, nkv, S, hd], mask [B, T, S+T] -> [B, T, H]."""
        q = rope(self.q_norm(self._heads(self.q_proj(x), self.nh)), positions, self.rotary)
        k_blk, v_blk = self.kv(x, positions)
        k = torch.cat([ctx_kv[0], k_blk], dim=2)
        v = torch.cat([ctx_kv[1], v_blk], dim=2)
        o = masked_attention(q, k, v, mask, scale=self.hd ** -0.5)  # [B, nh, T, hd]
        return self.o_proj(o.transpose(1, 2).flatten(2))


class DenseMLP(nn.Module):
    def __init__(self, cfg: DSparkDenseConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DenseDraftLayer(nn.Module):
    def __init__(self, cfg: DSparkDenseConfig, rotary: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DenseAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DenseMLP(cfg)

    def forward(self, x, positions, ctx_kv, mask):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@register("dspark_dense", config=DSparkDenseConfig, objective="block", serving="dspark.export.dense")
class DSparkDenseDraft(BlockDraft, DraftVocab, SharedTargetWeights, nn.Module):
    context_seq_dim = 2  # context_kv rows (eval's draft-side cache, block_draft.BlockContextCache): k, v [B, nkv, S, hd]

    def __init__(self, cfg: DSparkDenseConfig):
        super().__init__()
        cfg.validate()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        # the target's positions (llama3 / yarn / ... scaling); non-persistent buffers: no checkpoint names
        self.rotary_emb = RotaryEmbedding(cfg.rope_parameters, cfg.head_dim, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(DenseDraftLayer(cfg, self.rotary_emb) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.markov_head = None
        self.confidence_head = None
        vd = cfg.draft_vocab_size or cfg.vocab_size
        self.init_draft_vocab(cfg.vocab_size, vd)  # d2t / t2d (dspark.models.draft_vocab)
        if cfg.markov_rank > 0:
            self.markov_head = build_markov_head(  # a reduced draft's bias lands at its target ids
                cfg.vocab_size, vd, cfg.markov_rank, H, cfg.markov_head_type,
                draft_to_target=self.draft_to_target if self.reduced_vocab else None)
            if cfg.confidence_head:
                self.confidence_head = ConfidenceHead(H + cfg.markov_rank, bias=True)
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if name.startswith(("markov_head.", "confidence_head.")):
                continue  # the heads initialise themselves
            if p.dim() == 2:
                nn.init.normal_(p, std=self.config.initializer_range)
        nn.init.constant_(self.norm.weight, self.config.final_norm_init)

    # ---- interface (docs/CONTRACTS.md) ----------------------------------------------------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, S, n*H] -> main_x [B, S, H]."""
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [B, nkv, S, hd] from main_x (no input_layernorm on the context)."""
        return [layer.self_attn.kv(main_x, positions) for layer in self.layers]

    def backbone(self, block_ids, block_positions, ctx, attn_mask) -> torch.Tensor:
        """block_ids/positions [B, T], attn_mask [B, T, S+T] -> pre-norm hidden [B, T, H]."""
        embed = self._shared("embed_weight")
        x = F.embedding(block_ids, embed).to(self.fc.weight.dtype)  # [B, T, H]
        for layer, kv in zip(self.layers, ctx):
            x = layer(x, block_positions, kv, attn_mask)
        return x

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] (pre-norm) -> norm(h) [..., H], the rows the shared LM head scores (the fused loss takes them)."""
        return self.norm(h)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] (pre-norm) -> lm_head(norm(h)) [..., V] (a reduced draft: -inf outside its ids)."""
        lm_head = self._shared("lm_head_weight")
        if not self.reduced_vocab:
            return F.linear(self.head_input(h).to(lm_head.dtype), lm_head)  # [..., V]
        small = F.linear(self.head_input(h).to(lm_head.dtype), lm_head[self.draft_to_target()])  # [..., Vd]
        return self.scatter_to_target(small)  # [..., V]

    def confidence_logit(self, h: torch.Tensor, feat: torch.Tensor | None) -> torch.Tensor:
        return self.confidence_head(self.norm(h), feat)

"""EAGLE-3 draft (vLLM 0.33.0 `Eagle3LlamaForCausalLM`, vllm/model_executor/models/llama_eagle3.py), trained with
training-time test: the MTP chain objective (dspark.models.mtp_common.teacher_forced_chain) IS EAGLE-3's unrolled
test-time recursion, because vLLM's EAGLE proposer drafts exactly the chain that module describes.

    g   = fc(concat of the target's aux hidden states)               [B, S, H]   once, target rows only
                                                                                  (combine_hidden_states :397-418)
    one draft row (token x, hidden h, position p):
      e    = input_layernorm(embed(x))                                [.., H]   (the target's embedding, shared)
      hn   = hidden_norm(h);  res = hn if norm_before_residual else h             (:110-122)
      a    = self_attn(cat([e, hn]), RoPE at p)                       q/k/v take 2H (:82-96, :135-144)
      r1   = a + res;  r2 = mlp(post_attention_layernorm(r1)) + r1    (:146-149)
      out  = r2 (pre-norm; fed to the next chain step, :283-288); logits = lm_head(norm(r2)) over the draft vocabulary,
             scattered to target ids (-inf elsewhere) by d2t (:373-395)
    step 0 row p: (x_{p+1}, g_p, p); step k >= 1: (y_{k-1}, out_{k-1}, p + k) (v1/spec_decode/llm_base_proposer.py
    :816-853, :665-773).

lm_head is the target's LM head at the draft vocabulary's rows, frozen (speculators 0.9.0 eagle3: model.py:66-71,
:172-185), so it is no parameter here: the export writes those rows as `lm_head.weight`. The embedding is the
target's (vLLM shares it when the export has no `embed_tokens`, spec_decode/llm_base_proposer.py:1418-1503).
`target_layer_ids` are 0-based ids of the target layers whose OUTPUT is tapped, as for every family here; vLLM's
`eagle_aux_hidden_state_layer_ids` name the stream ENTERING a layer (models/interfaces.py:1640-1650), one more: the
export adds 1. Parameter names are the checkpoint's (fc, layers.0.*, norm).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.common import FieldError, SharedTargetWeights, config_from_dict, field_error
from dspark.models.dspark_dense import DenseLayerSizes, DenseMLP, rope
from dspark.models.draft_vocab import DraftVocab
from dspark.models.mtp_common import ChainDraft
from dspark.models.registry import register
from dspark.models.vllm_targets import served_window
from dspark.ops.attention import masked_attention
from dspark.ops.norms import RMSNorm
from dspark.ops.rope import ROPE_TYPES, RotaryEmbedding


@dataclass(kw_only=True)
class Eagle3Config(DenseLayerSizes):
    GROUP_KEYS: ClassVar[tuple[str, ...]] = ("num_steps", "target_layer_ids", "draft_vocab_size",
                                             "norm_before_residual")
    DRAFTS_KEY: ClassVar[str] = "num_steps"
    DEFAULT_TARGET: ClassVar[str | None] = "tiny_llama"
    vllm_method: ClassVar[str] = "eagle3"
    # taps end below the last layer (from_target_config says why); registry.build_config's range check reads it
    TAPS_BELOW_LAST: ClassVar[str] = "EAGLE-3 cannot tap the last layer: vLLM's stream there is before the final norm"

    num_layers: int = 1  # EAGLE-3 drafts with one decoder layer (the layer whose q/k/v take 2H)
    num_steps: int = 3  # training-time-test depth and the default drafts per verify step
    target_layer_ids: list[int] = field(default_factory=list)  # low / middle / high target layers (outputs)
    draft_vocab_size: int | None = None  # None / == vocab_size: the target's whole vocabulary (no d2t)
    norm_before_residual: bool = False  # vLLM's default for a non-speculators config (llama_eagle3.py:101)
    initializer_range: float = 0.02
    # the window of a target whose layers all slide (from_target_config): vLLM gives it to the draft's causal layer
    # too (engine/arg_utils.py:2288-2294, layers/attention/attention.py:265-271), a query at q seeing the keys at
    # q - W < k <= q (v1/attention/backends/flash_attn.py:1086-1087: window (W - 1, 0)); None: the whole context
    sliding_window: int | None = None

    @property
    def block_size(self) -> int:
        """Drafts per verify step (eval's default gamma), = num_steps."""
        return self.num_steps

    def validate(self) -> "Eagle3Config":
        bad = lambda key, why: field_error(self, key, why)  # noqa: E731
        for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "num_steps"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(key, f"must be a positive int, got {value!r}")
        if self.num_layers != 1:
            raise bad("num_layers", f"must be 1 (vLLM's EAGLE-3 chain drafts through one layer), got {self.num_layers}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_attention_heads", f"({self.num_attention_heads}) must be a multiple of "
                                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise bad("head_dim", f"must be even for RoPE, got {self.head_dim}")
        if not self.target_layer_ids:
            raise bad("target_layer_ids", "must name the target layers whose outputs fc fuses (EAGLE-3: low, middle, "
                                          "high)")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise bad("draft_vocab_size", f"must be in [1, vocab_size={self.vocab_size}] (the target's) or null, got "
                                          f"{self.draft_vocab_size}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise bad("sliding_window", f"must be a positive int or null, got {self.sliding_window!r}")
        if self.rope_parameters.get("rope_type", "default") not in ROPE_TYPES:
            raise bad("rope_parameters", f"rope_type {self.rope_parameters.get('rope_type')!r} is not one of "
                                         f"{ROPE_TYPES}")
        return self


    @classmethod
    def from_target_config(cls, hf, **draft_keys) -> "Eagle3Config":
        """The draft layer's sizes and RoPE are the target's (vLLM builds the draft from its config.json, which the
        export writes from these); refuses a DeepSeek-V4 target (its layers' hc copies are no single stream) and,
        through sizes_of, a target vLLM 0.33.0 cannot serve an EAGLE-3 draft against (dspark.models.vllm_targets:
        the same SupportsEagle3 / shared-embedding rules as DFlash's). A target whose layers all slide hands the
        draft its window (served_window: one info line)."""
        if getattr(hf, "hc_mult", 0):
            raise FieldError("kind", f"eagle3 needs a dense target: {getattr(hf, 'model_type', None)!r} layers output "
                                     "hc_mult copies; use dspark_v4 or dsv4_mtp for DeepSeek-V4")
        n = int(hf.num_hidden_layers)
        # vLLM's default taps (2, N // 2, N - 3) (models/interfaces.py:1751-1772) as layer-output ids
        base = dict(cls.sizes_of(hf), target_layer_ids=sorted({max(i - 1, 0) for i in (2, n // 2, n - 3)}))
        base.update({k: v for k, v in draft_keys.items() if v is not None or k == "draft_vocab_size"})
        window = served_window(hf, draft_keys.get("sliding_window"), "the EAGLE-3 layer")
        if window is not None:
            base["sliding_window"] = window
        cfg = config_from_dict(cls, base).validate()
        if sorted(set(cfg.target_layer_ids)) != list(cfg.target_layer_ids):
            raise FieldError("target_layer_ids", f"{cfg.target_layer_ids}: vLLM concatenates the taps in ascending "
                                                 "layer order (models/interfaces.py:1616-1617): list them sorted, "
                                                 "without repeats")
        if max(cfg.target_layer_ids) >= n - 1:
            raise FieldError("target_layer_ids", f"{cfg.target_layer_ids}: the last layer's output ({n - 1}) is the "
                                                 "stream before the final norm in vLLM but after it in transformers' "
                                                 f"hidden states; tap layers below {n - 1}")
        return cfg


class Eagle3Attention(nn.Module):
    """Llama attention whose q / k / v read 2H (cat of the normed embedding and the normed hidden), no q/k norm."""

    def __init__(self, cfg: Eagle3Config, rotary: nn.Module):
        super().__init__()
        h2, nh, nkv, hd = 2 * cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        object.__setattr__(self, "rotary", rotary)  # the draft's one rotary module (not registered per layer)
        self.q_proj = nn.Linear(h2, nh * hd, bias=False)
        self.k_proj = nn.Linear(h2, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h2, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, past, mask: torch.Tensor):
        """x [B, T, 2H], positions [B, T], past (k, v) [B, P, nkv, hd] or None, mask [B, T, P+T]
        -> (out [B, T, H], this call's (k, v) [B, T, nkv, hd], rows-first as the chain's cache keeps them)."""
        b, t = x.shape[:2]
        q = rope(self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2), positions, self.rotary)
        k = rope(self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2), positions, self.rotary)
        k_rows, v_rows = k.transpose(1, 2), self.v_proj(x).view(b, t, self.nkv, self.hd)  # [B, T, nkv, hd]
        if past is not None:
            k_all, v_all = torch.cat([past[0], k_rows], dim=1), torch.cat([past[1], v_rows], dim=1)
        else:
            k_all, v_all = k_rows, v_rows
        o = masked_attention(q, k_all.transpose(1, 2), v_all.transpose(1, 2), mask, scale=self.hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).flatten(2)), (k_rows, v_rows)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, rotary: nn.Module):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DenseMLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, past, mask: torch.Tensor):
        """embeds, hidden [B, T, H] -> (pre-norm out r2 [B, T, H], (k, v) of the new rows)."""
        hn = self.hidden_norm(hidden)
        residual = hn if self.norm_before_residual else hidden
        a, kv = self.self_attn(torch.cat([self.input_layernorm(embeds), hn], dim=-1), positions, past, mask)
        r1 = a + residual
        return r1 + self.mlp(self.post_attention_layernorm(r1)), kv


@register("eagle3", config=Eagle3Config, objective="mtp", serving="dspark.export.eagle3")
class Eagle3Draft(ChainDraft, DraftVocab, SharedTargetWeights, nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        cfg.validate()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.rotary_emb = RotaryEmbedding(cfg.rope_parameters, cfg.head_dim, cfg.max_position_embeddings)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, self.rotary_emb)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.init_draft_vocab(cfg.vocab_size, cfg.draft_vocab_size)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=cfg.initializer_range)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def attention_window(self) -> int | None:
        """The chain's causal window (dspark.models.mtp_common.visible: q - W < k <= q, vLLM's (W - 1, 0)): the
        config's sliding_window, the target's when all its layers slide; None: full attention over the draft cache."""
        return self.config.sliding_window

    # ---- the chain interface (dspark.models.mtp_common) -----------------------------------------------------
    def context_hidden(self, feats) -> torch.Tensor:
        """TargetFeatures -> g = fc(aux) [B, S, H]: step 0's hidden (the target's taps fused once)."""
        n = len(self.config.target_layer_ids) * self.config.hidden_size
        if feats.aux is None or feats.aux.shape[-1] != n:
            got = None if feats.aux is None else tuple(feats.aux.shape)
            raise ValueError(f"Eagle3Draft needs the target's aux hidden states [B, S, {n}] (draft.target_layer_ids "
                             f"{self.config.target_layer_ids}), got {got}")
        return self.fc(feats.aux.to(self.dtype))

    def step_rows(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, layer_idx: int,
                  past, mask: torch.Tensor):
        """New rows (input_ids [B, T], hidden [B, T, H], position_ids [B, T]) attending to `past` rows ((k, v)
        [B, P, nkv, hd] as earlier calls returned them) and to themselves per `mask` [B, T, P+T]
        -> (pre-norm out [B, T, H], the new rows' (k, v))."""
        embeds = F.embedding(input_ids, self._shared("embed_weight")).to(self.dtype)  # [B, T, H]
        return self.layers[0](embeds, hidden.to(self.dtype), position_ids, past, mask)

    def head_weight(self) -> torch.Tensor:
        """[Vd, H]: the target's LM head at the draft vocabulary's rows (what the export writes as lm_head.weight)."""
        w = self._shared("lm_head_weight")
        if not self.reduced_vocab:
            return w
        # gathered once per head and mapping, not per draft step (the head is frozen; d2t changes only by copy_)
        key = (w.data_ptr(), w.device, w.dtype, self.d2t.data_ptr(), self.d2t._version)
        cached = self.__dict__.get("_head_rows")
        if cached is None or cached[0] != key:
            cached = (key, w.index_select(0, self.draft_to_target()))
            self.__dict__["_head_rows"] = cached
        return cached[1]

    def draft_logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """hidden_out [..., H] (pre-norm) -> lm_head(norm(.)) [..., Vd] over the draft vocabulary."""
        w = self.head_weight()
        return F.linear(self.norm(hidden_out).to(w.dtype), w)

    def logits(self, hidden_out: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        """hidden_out [..., H] -> [..., V] target-vocabulary logits (-inf outside a reduced draft vocabulary)."""
        return self.scatter_to_target(self.draft_logits(hidden_out))


__all__ = ["Eagle3Config", "Eagle3Draft", "Eagle3Layer"]

"""DeepSeek-V4.1 DSpark draft (vLLM 0.33.0 `DSparkV41DraftModel`, vllm/models/deepseek_v41/nvidia/dspark.py).

Only what differs from the V4 DSpark draft (dspark.models.dspark_v4, whose attention, MoE, norms, combiner,
context KV and heads are reused as they are) lives here; docs/v41.md has the table with vLLM file:line:

  * "delayed" mHC pre-mix (vllm/models/deepseek_v41/nvidia/model.py:522-524, 486-662; the reference
    vllm/model_executor/kernels/mhc/torch.py:6-45): every sublayer computes (pre, post, comb) from its input
    stream as V4 does, but collapses that stream with the PREVIOUS sublayer's pre-mix (the very first sublayer
    takes stream 0); its own pre-mix is carried on;
  * no hc_head: the last stream is collapsed with the pre-mix of the last layer's FFN (dspark.py:238-244);
  * the draft MoE has its own width: `dspark_n_routed_experts` / `dspark_num_experts_per_tok` of the target config
    (model.py:129-160), here the draft config's n_routed_experts / num_experts_per_tok;
  * the checkpoint's `dspark_target_layer_ids` name the stream ENTERING layer L (eagle3_utils.py:126-135), one more
    than the project's target_layer_ids (0-based id of the layer whose output is tapped, as for V4):
    from_target_config subtracts 1, the export adds it back.

Parameter names are the V4 draft's (serving names below the stage prefix, without hc_head_*); the export maps
markov_head.markov_w{1,2} to the checkpoint's markov_head.{embed,head} (dspark.py:502-511).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from dspark.models.common import FieldError
from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft, DSparkV4Layer
from dspark.models.registry import register
from dspark.models.v4_names import init_draft_layers_from_target, last_layer_ids, target_layer_names
from dspark.ops.mhc import HcSettings, hc_collapse, hc_post, hc_pre_delayed


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class DSparkV41Config(DSparkV4Config):
    """Sizes of a DeepSeek-V4.1 DSpark draft: V4's fields; n_routed_experts / num_experts_per_tok are the DRAFT's
    (the target config's dspark_n_routed_experts / dspark_num_experts_per_tok when it has them); target_layer_ids
    are 0-based ids of tapped layer OUTPUTS (checkpoint dspark_target_layer_ids - 1)."""

    DEFAULT_TARGET: ClassVar[str | None] = "tiny_v41"

    @classmethod
    def from_target_config(cls, hf_cfg: Any, **draft_keys: Any) -> "DSparkV41Config":
        """V4's constructor, plus V4.1's target keys: the draft MoE width (dspark_n_routed_experts,
        dspark_num_experts_per_tok; 0 or absent = the target's, model.py:129-160), the stage count (n_mtp_layers,
        else num_nextn_predict_layers, dspark.py:85-89) and the taps (dspark_target_layer_ids in entry-stream
        semantics, eagle3_utils.py:126-135: id L -> target_layer_ids L - 1; L = 0, the embedding, is refused)."""
        for key in ("n_routed_experts", "num_experts_per_tok"):
            own = getattr(hf_cfg, f"dspark_{key}", None)
            if own:
                draft_keys.setdefault(key, int(own))
        if getattr(hf_cfg, "n_mtp_layers", None) is None and getattr(hf_cfg, "num_nextn_predict_layers", None):
            draft_keys.setdefault("num_layers", int(hf_cfg.num_nextn_predict_layers))
        served = getattr(hf_cfg, "dspark_target_layer_ids", None)
        if served is not None and "target_layer_ids" not in draft_keys:
            served = [int(i) for i in served]
            if any(i < 1 for i in served):
                raise FieldError("target_layer_ids", f"dspark_target_layer_ids {served}: id 0 is the embedding stream "
                                 "(vLLM V4.1 taps the stream entering layer L); the draft reads layer outputs")
            draft_keys["target_layer_ids"] = [i - 1 for i in served]
        return super().from_target_config(hf_cfg, **draft_keys)


def served_layer_ids(cfg: DSparkV41Config) -> list[int]:
    """The checkpoint's dspark_target_layer_ids of a config (entry-stream ids: target_layer_ids + 1)."""
    return [int(i) + 1 for i in cfg.target_layer_ids]


# ------------------------------------------------------------------------------------------------
# Layer and draft
# ------------------------------------------------------------------------------------------------
class DSparkV41Layer(DSparkV4Layer):
    """V4's layer (same parameters) with the delayed pre-mix: forward takes and returns the carried pre-mix."""

    def _delayed(self, x: torch.Tensor, carried: torch.Tensor | None, which: str):
        fn, base, scale = (getattr(self, f"hc_{which}_{p}") for p in ("fn", "base", "scale"))
        return hc_pre_delayed(x, carried, fn, base, scale, HcSettings.of(self.cfg))

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, carried: torch.Tensor | None, positions: torch.Tensor, ctx_kv: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hc, H]; carried [B, T, hc] (None for the first layer); positions [B, T]; ctx_kv [B, S, D];
        mask [B, T, S+T] -> (x [B, T, hc, H], this layer's FFN pre-mix [B, T, hc])."""
        y, post, comb, attn_pre = self._delayed(x, carried, "attn")
        x = hc_post(self.attn(self.attn_norm(y), positions, ctx_kv, mask), x, post, comb)
        y, post, comb, ffn_pre = self._delayed(x, attn_pre, "ffn")
        return hc_post(self.ffn(self.ffn_norm(y)), x, post, comb), ffn_pre


@register("dspark_v41", config=DSparkV41Config, objective="block", serving="dspark.export.dspark_v41")
class DSparkV41Draft(DSparkV4Draft):
    """DeepSeek-V4.1 DSpark draft; interface in docs/CONTRACTS.md (the V4 draft's, without hc_head)."""

    layer_class = DSparkV41Layer
    has_hc_head = False  # the last stream is collapsed with the last FFN pre-mix (dspark.py:238-244)

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: Sequence[torch.Tensor], attn_mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, hc, H] -> h [B, T, H]: the layers carrying their pre-mixes, the last stream collapsed with the
        last FFN pre-mix (dspark.py:224-244)."""
        carried = None
        for layer, kv in zip(self.layers, ctx):
            x, carried = layer(x, carried, positions, kv, attn_mask)
        return hc_collapse(x, carried)

    def init_from_target(self, hf_causal_lm: nn.Module) -> list[int]:
        """Copy the target's last num_layers decoder layers into the draft layers (V4's rule; the draft MoE width
        must then be the target's)."""
        return init_draft_layers_from_target(self, hf_causal_lm)

    @staticmethod
    def init_reads(cfg: DSparkV41Config, hf_causal_lm: nn.Module) -> list[str]:
        """The target modules init_from_target copies: its last cfg.num_layers decoder layers (whole: the layer's
        state_dict is read), e.g. ["model.layers.3"] for one draft layer (registry.init_reads)."""
        n_target = len(getattr(hf_causal_lm, "model", hf_causal_lm).layers)
        return target_layer_names(hf_causal_lm, last_layer_ids(n_target, cfg.num_layers))


__all__ = ["DSparkV41Config", "DSparkV41Draft", "DSparkV41Layer", "served_layer_ids"]

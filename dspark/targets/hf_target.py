"""Frozen target: an HF causal LM whose layer outputs feed the draft and whose LM head is the teacher.

Layer outputs are captured with forward hooks on the decoder layers (output_hidden_states would hand
back post-norm or pre-layer states depending on the model). DeepSeek-V4 layers output hc_mult copies
[B, S, hc, H]; they are averaged over hc (SPEC.md 2.1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class TargetFeatures:
    aux: torch.Tensor  # [B, S, n*H] concatenated outputs of target_layer_ids
    final: torch.Tensor  # [B, S, H] final hidden after the model's final norm

    def prefix(self, length: int) -> "TargetFeatures":
        """The features of positions 0..length-1 (every field is sliced on dim 1)."""
        return type(self)(**{k: v[:, :length] for k, v in vars(self).items()})


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: cannot find decoder layers at .model.layers")
    return layers


class FrozenTarget:
    """Wraps an HF causal LM: no grads, eval mode, never part of an optimizer or checkpoint.

    Deliberately not an nn.Module, so assigning it to a LightningModule attribute does not register
    its weights as trainable or saved state.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], tokenizer=None):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.layers = _decoder_layers(model)
        n = len(self.layers)
        bad = [i for i in layer_ids if not 0 <= int(i) < n]
        if not layer_ids or bad:
            raise ValueError(
                f"draft.target_layer_ids={list(layer_ids)}: ids must be 0-based layer indices in [0, {n - 1}] "
                f"of the target ({type(model).__name__} has {n} layers); bad: {bad or 'empty list'}"
            )
        self.layer_ids = [int(i) for i in layer_ids]
        cfg = model.config
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.hc_mult = int(getattr(cfg, "hc_mult", 0) or 0)

    # ---- shared weights ---------------------------------------------------------------------------
    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # [V, H]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [V, H]

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def to(self, device) -> "FrozenTarget":
        self.model.to(device)
        return self

    # ---- forward ------------------------------------------------------------------------------------
    def _layer_output(self, out) -> torch.Tensor:
        h = out[0] if isinstance(out, tuple) else out
        if h.dim() == 4:  # DeepSeek-V4 hyper-connection copies [B, S, hc, H]
            h = h.mean(dim=-2)
        return h  # [B, S, H]

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 position_ids: torch.Tensor | None = None, cache=None) -> TargetFeatures:
        """input_ids [B, S] -> TargetFeatures (aux [B,S,n*H], final [B,S,H]) of those S tokens.

        attention_mask [B, S_cache + S] (1 = real token), position_ids [B, S] and an HF `cache` (updated in
        place) are passed through to the model for KV-cached decoding (dspark.evaluation.target_session)."""
        captured: dict[int, torch.Tensor] = {}
        handles = [
            self.layers[i].register_forward_hook(
                lambda _m, _inp, out, i=i: captured.__setitem__(i, self._layer_output(out))
            )
            for i in self.layer_ids
        ]
        try:
            base = getattr(self.model, "model", self.model)
            out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       cache=cache, use_cache=cache is not None)
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([captured[i] for i in self.layer_ids], dim=-1)
        return TargetFeatures(aux=aux, final=out.last_hidden_state)

    @torch.no_grad()
    def logits_from_final(self, final: torch.Tensor) -> torch.Tensor:
        """Teacher rows: [..., H] -> [..., V] via the target's LM head."""
        return nn.functional.linear(final.to(self.lm_head_weight.dtype), self.lm_head_weight)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def load_hf_target(path: str, layer_ids: list[int], dtype: str = "float32") -> FrozenTarget:
    """Any local HF causal-LM folder (offline)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"target.path={path!r} is not a local folder (nothing is downloaded at run time)")
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return FrozenTarget(model, layer_ids, tok)

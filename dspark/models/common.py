"""Pieces every draft model shares: dataclass configs built from plain mappings, and the target's
embedding / LM head held outside the module tree."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

C = TypeVar("C")


class FieldError(ValueError):
    """A draft config field holds a bad value. `field` names it: building a draft from a run config reports it as
    `draft.<field>` (a group key) or `draft.arch.<field>` (dspark.models.registry)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def field_error(config: Any, field: str, why: str) -> FieldError:
    """FieldError "<ConfigClass>.<field> <why>"."""
    name = config.__name__ if isinstance(config, type) else type(config).__name__
    return FieldError(field, f"{name}.{field} {why}")


def config_from_dict(cls: type[C], values: Mapping[str, Any]) -> C:
    """``cls(**values)`` for a dataclass config; unknown keys and missing required keys raise ValueError
    naming the class and the keys (no validation beyond that: callers validate)."""
    fields = dataclasses.fields(cls)
    unknown = sorted(set(values) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}")
    missing = sorted(
        f.name for f in fields
        if f.name not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise ValueError(f"{cls.__name__}: missing keys {missing}")
    return cls(**dict(values))


class DraftConfig:
    """Base of every family's config dataclass: the one validating constructor from plain values."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        """``cls(**values).validate()``: unknown / missing keys raise ValueError naming them (config_from_dict), bad
        values FieldError naming the field (the family's validate)."""
        return config_from_dict(cls, values).validate()


def raw_config_json(hf_config: Any) -> dict | None:
    """The config.json of the folder `hf_config` was loaded from, as written (before transformers fills in its
    defaults), or None (a config built in memory, or a Hub id)."""
    path = Path(str(getattr(hf_config, "_name_or_path", "") or "")) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


class SharedTargetWeights:
    """Mixin for an nn.Module draft that reads the target's embedding [V, H] and LM head [V, H] (none until
    share_target_weights); ``self.config`` has ``vocab_size`` and ``hidden_size``."""

    _embed_weight: torch.Tensor | None = None
    _lm_head_weight: torch.Tensor | None = None

    def share_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Use the target's embedding [V, H] and lm_head [V, H]; stored detached, outside the module tree.

        They are neither parameters nor buffers, so they never reach the optimizer, state_dict, or
        `.to()`; move the target weights yourself if the draft changes device.
        (object.__setattr__: nn.Module would register an nn.Parameter as the draft's own.)
        """
        v, h = self.config.vocab_size, self.config.hidden_size
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != (v, h):
                raise ValueError(f"share_target_weights: {name} must be [{v}, {h}], got {tuple(w.shape)}")
        object.__setattr__(self, "_embed_weight", embed_weight.detach())
        object.__setattr__(self, "_lm_head_weight", lm_head_weight.detach())

    def _shared(self, name: str) -> torch.Tensor:
        """The shared 'embed_weight' or 'lm_head_weight'; RuntimeError before share_target_weights()."""
        w = getattr(self, f"_{name}")
        if w is None:
            raise RuntimeError(f"{type(self).__name__}: call share_target_weights() before using {name}")
        return w

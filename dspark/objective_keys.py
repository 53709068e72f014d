"""Each training objective's train.* keys (the config layer: dspark.schema reads them without importing training/).

An objective (dspark.models.registry `Family.objective`) owns the train.* keys only it reads; its LightningModule
(dspark.training.modules.MODULES) is built from them. Here: the keys' types and docs, and `check`, the values their
types do not say. Defaults live in configs/config.yaml.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dspark.errors import ConfigError


def _check_weights(train, key: str, allowed: tuple[str, ...], none_zero: str) -> None:
    weights = dict(train[key])
    unknown = sorted(set(weights) - set(allowed))
    if unknown:
        raise ConfigError(f"train.{key}: unknown keys {unknown} ({', '.join(allowed)})")
    if not (all(v >= 0 for v in weights.values()) and sum(weights.values()) > 0):
        raise ConfigError(f"train.{key}: weights must be >= 0 and not {none_zero} 0, got {weights}")


@dataclass
class BlockKeys:
    """The block objective's train.* keys (DSpark / DFlash / DFlash2 / XPress)."""

    decay_gamma: float = field(metadata={"doc": "position weight w_k = exp(-k / decay_gamma)",
                                         "check": lambda v: None if v > 0 else "must be > 0"})
    loss_weights: dict[str, float] = field(metadata={"doc": "{ce, l1, conf} loss weights"})
    fused_loss: bool = field(metadata={"doc": "losses from hidden rows, no [N, V] logits (false: the materialised "
                                              "reference)"})

    @staticmethod
    def check(train) -> None:
        """Loss weights {ce, l1, conf}, >= 0, not all 0."""
        _check_weights(train, "loss_weights", ("ce", "l1", "conf"), "all")


@dataclass
class MTPKeys:
    """The MTP objective's train.* keys (the MTP chains)."""

    mtp_beta: float = field(metadata={"doc": "step k weight beta^k / sum_j beta^j",
                                      "check": lambda v: None if v > 0 else "must be > 0"})
    mtp_loss_weights: dict[str, float] = field(metadata={"doc": "{ce, kl}: CE vs the true token, KL to the target"})

    @staticmethod
    def check(train) -> None:
        """Loss weights {ce, kl}, >= 0, not both 0."""
        _check_weights(train, "mtp_loss_weights", ("ce", "kl"), "both")


OBJECTIVE_KEYS: dict[str, type] = {"block": BlockKeys, "mtp": MTPKeys}

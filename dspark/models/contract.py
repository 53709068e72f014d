"""The family contract: what a draft family's record (dspark.models.registry.register) must hold, as Protocols, and the
check that refuses a family breaking it when it registers (at import time, one line naming the family and the
members it lacks: FamilyContractError).

  * FamilyConfig: the family's config dataclass. Every reader of a family (the registry, the schema, train.py,
    eval.py, export, serve_check) reads these members directly: none asks whether they exist.
  * FamilyDraft: the family's draft class, an nn.Module built as `Draft(config)` that keeps the config as
    `self.config` (an instance attribute, not checked on the class). The objective's own interface (block / MTP
    draft, docs/CONTRACTS.md) is the objective's to read, not checked here.
  * OPTIONAL: the members a family may leave out, each with the default its readers take; read them with
    `optional(obj, name)`, the one place that knows the defaults.

The serving module a record names (`serving="dspark.export.<file>"`) is checked where the serving adapters are
collected (dspark.export.adapter.adapters): models/ does not import export/, and even finding the module's spec
(importlib.util.find_spec) imports its parent package, dspark.export. A record naming no serving module gives its
reason as the config's NOT_SERVED, checked here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import FunctionType
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

import torch


class FamilyContractError(ValueError):
    """A draft family's record breaks the family contract; the one-line message names the family and the members."""


@runtime_checkable
class FamilyConfig(Protocol):
    """A family's config dataclass (dspark.models.common.DraftConfig gives from_dict)."""

    GROUP_KEYS: ClassVar[tuple[str, ...]]  # draft-group keys at the top level of configs/draft/*.yaml (rest: arch)
    DRAFTS_KEY: ClassVar[str]  # the group key of the drafts per verify step (block_size, num_steps, ...)
    DEFAULT_TARGET: ClassVar[str | None]  # the target kind (configs/target) of runs that record none, or None
    vllm_method: str  # vLLM's speculative_config method (a class attribute or a property)
    block_size: int  # drafts per verify step, the value of DRAFTS_KEY (a field or a property)

    def validate(self) -> Self:
        """The config, its values checked (FieldError naming the field)."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        """The validated config of plain values (ValueError naming unknown / missing keys)."""

    @classmethod
    def from_target_config(cls, hf_config: Any, **keys: Any) -> Self:
        """The one constructor from the target's HF config and the draft group's keys; refuses another target."""


@runtime_checkable
class FamilyDraft(Protocol):
    """A family's draft class: `Draft(config)`, an nn.Module that scores with the target's embedding and LM head and
    drafts in eval (dspark.models.block_draft.BlockDraft, dspark.models.mtp_common.ChainDraft)."""

    def share_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Use the target's embedding [V, H] and LM head [V, H] (dspark.models.common.SharedTargetWeights)."""

    def propose_batch(self, feats: list, tokens: list[torch.Tensor], *, num_drafts: int, temperature: float,
                      **kwargs: Any) -> Any:
        """eval.py's drafting: the proposals of every request of a batch."""

    def new_cache(self) -> Any:
        """A request's draft-side cache, kept across its rounds."""


# the members a family may leave out -> the default its readers take (optional(obj, name))
OPTIONAL: dict[str, Any] = {
    # config
    "TAPS_BELOW_LAST": None,  # why the family cannot tap the target's last layer (ids then stop one below)
    "NOT_SERVED": None,  # why a record naming no serving module has no export (required then)
    "vllm_options": lambda: {},  # () -> the family's own speculative_config options (XPress's xpress_topc)
    # what eval says about vLLM's default num_speculative_tokens for the family's vllm_method
    "VLLM_TOKENS_NOTE": "vLLM's default num_speculative_tokens for DSpark is dspark_block_size / block_size",
    # dspark.training.flops counts the training step from the config's sizes (else replayed); read from the config
    # class itself, not inherited (a family on another's config with layers of its own is replayed)
    "FLOPS_COUNTED": False,
    # draft
    "init_from_target": None,  # (hf_model): start from the target's layers (draft.init_from_target)
    "init_reads": None,  # (config, hf_model) -> the target modules init_from_target reads (head-only targets)
    "needs_pre_head": False,  # the draft reads the last layer's raw output (TargetFeatures.pre_head)
    "reduced_vocab": False,  # the draft drafts over a reduced vocabulary (dspark.models.draft_vocab.DraftVocab)
    "confidence_head": None,  # a block draft's confidence head (its module, when it has one)
}


def optional(obj: Any, name: str) -> Any:
    """An optional family member (OPTIONAL) of a config / draft or their class: its own, else the default."""
    return getattr(obj, name, OPTIONAL[name])


def protocol_members(proto: type) -> tuple[str, ...]:
    """The members a Protocol declares: its annotated attributes, then its methods."""
    methods = [name for name, value in vars(proto).items() if not name.startswith("_")
               and isinstance(value, (FunctionType, classmethod, staticmethod, property))]
    return (*proto.__annotations__, *methods)


CONFIG_MEMBERS = protocol_members(FamilyConfig)
DRAFT_MEMBERS = protocol_members(FamilyDraft)


def contract_problems(config: type, draft: type, serving: str | None) -> list[str]:
    """What a family record (config class, draft class, serving module) lacks of the contract, in words; [] if none."""
    problems = []
    if not dataclasses.is_dataclass(config):
        problems.append(f"config {config.__name__} is not a dataclass")
        fields = set()
    else:
        fields = {f.name for f in dataclasses.fields(config)}
    missing = [name for name in CONFIG_MEMBERS if name not in fields and not hasattr(config, name)]
    if missing:
        problems.append(f"config {config.__name__} lacks {', '.join(missing)}")
    if not (isinstance(draft, type) and issubclass(draft, torch.nn.Module)):
        problems.append(f"draft {getattr(draft, '__name__', draft)!r} is not a torch.nn.Module class")
    missing = [name for name in DRAFT_MEMBERS if not hasattr(draft, name)]
    if missing:
        problems.append(f"draft {getattr(draft, '__name__', draft)} lacks {', '.join(missing)}")
    if serving is None:
        if not optional(config, "NOT_SERVED"):
            problems.append(f"serving is None and config {config.__name__} gives no NOT_SERVED reason")
    elif not (isinstance(serving, str) and all(part.isidentifier() for part in serving.split("."))):
        problems.append(f"serving {serving!r} is not a module name")
    return problems


def check_family(kind: str, config: type, draft: type, serving: str | None) -> None:
    """FamilyContractError (one line naming the family and what it lacks) unless the record meets the contract."""
    problems = contract_problems(config, draft, serving)
    if problems:
        raise FamilyContractError(f"draft family {kind!r} breaks the family contract (dspark.models.contract): "
                                  + "; ".join(problems))


__all__ = ["CONFIG_MEMBERS", "DRAFT_MEMBERS", "FamilyConfig", "FamilyContractError", "FamilyDraft", "OPTIONAL",
           "check_family", "contract_problems", "optional", "protocol_members"]

"""One registry of draft families. Each family's module in dspark/models/ registers its draft class:

    @register("dsv4_mtp", config=DSV4MTPConfig, objective="mtp", serving="dspark.export.dsv4_mtp")
    class DSV4MTPDraft(ChainDraft, SharedTargetWeights, nn.Module): ...

That call is the family's one record (Family): the kind, the draft, its config, its objective and the module of its
serving adapters. The family owns, in that one file,
  * its Config: `Config.from_target_config(hf_config, **keys)`, the one constructor from the target's config,
    holding the family's checks against the target (FieldError names the key); `GROUP_KEYS` (the draft-group keys
    at the top level of configs/draft/*.yaml, the rest under `arch`), `DRAFTS_KEY` (drafts per verify step), `DEFAULT_TARGET`,
    `block_size` (that number), `vllm_method` (vLLM's speculative_config method);
  * its draft: the interface its objective trains (docs/CONTRACTS.md), `init_from_target(hf_model)` when it can
    start from the target's layers (plus `init_reads(config, hf_model)`, the target modules that copy reads, when a
    target loaded head-only with those modules may start it), and the eval interface
    `propose_batch(feats, tokens, ...)` / `new_cache()` reading its settings from `self.config`
    (dspark.models.block_draft.BlockDraft, dspark.models.mtp_common.ChainDraft);
  * `objective`: the training step it trains with, a subclass of the shared LightningModule
    (dspark.training.modules.MODULES: "block" = DSpark / DFlash blocks, "mtp" = the MTP chain).
Its serving adapters (checkpoint names, config.json, vLLM rules: dspark.export.adapter.ServingAdapter) are in the
module its record names (`serving`, a dspark/export/ file), imported when an adapter is first asked for.
What the config and the draft class must hold is the family contract (dspark.models.contract: Protocols, the optional
members' defaults), checked when the family registers: a family lacking a member is refused at import time, in one
line naming it. A test registers a family of its own for a while with `temporary_family(Family(...))`.

The family modules are found by importing every module of this package once (no list to edit): adding a family
is one new file here plus its configs (docs/design.md, "How to add a family").
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import dspark.models as models_package  # the package whose modules _discover imports (each registers its family)
from dspark.errors import ConfigError
from dspark.models.common import FieldError, config_from_dict
from dspark.models.contract import FamilyContractError, check_family, optional

NOT_CONFIG_KEYS = ("kind", "init_from_target", "init_from", "init_from_any_target", "arch")  # draft-group keys that are not config fields


@dataclass(frozen=True)
class Family:
    kind: str  # draft.kind
    draft: type  # the nn.Module
    config: type  # its config dataclass
    objective: str  # the training step (dspark.training.modules.MODULES)
    serving: str | None = None  # the module of its serving adapters (dspark.export.<file>); None: no export

    @property
    def group_keys(self) -> tuple[str, ...]:
        return tuple(self.config.GROUP_KEYS)

    @property
    def drafts_key(self) -> str:
        """The group key of the drafts per verify step (block_size, num_steps, ...)."""
        return self.config.DRAFTS_KEY

    @property
    def default_target(self) -> str | None:
        """The target kind (configs/target) of the family's tiny default, for runs that record none."""
        return self.config.DEFAULT_TARGET


_FAMILIES: dict[str, Family] = {}
_discovered = False


def register(kind: str, *, config: type, objective: str, serving: str | None = None):
    """Class decorator of a family's draft class: the family's record (Family), checked against the family contract
    (dspark.models.contract: FamilyContractError at import time, naming the family and what it lacks)."""

    def add(draft: type) -> type:
        register_family(Family(kind=kind, draft=draft, config=config, objective=objective, serving=serving))
        return draft

    return add


def register_family(record: Family) -> Family:
    """Add a family's record (what `register` does; a family declared outside dspark/models/, e.g. in a test, is
    added for a while by temporary_family). FamilyContractError when the record breaks the family contract,
    ValueError when its kind is another draft's."""
    check_family(record.kind, record.config, record.draft, record.serving)
    known = _FAMILIES.get(record.kind)
    if known is not None and known.draft is not record.draft:
        raise ValueError(f"draft kind {record.kind!r} is registered twice ({known.draft.__name__}, "
                         f"{record.draft.__name__})")
    _FAMILIES[record.kind] = record
    record.draft.family_kind = record.kind
    return record


@contextmanager
def temporary_family(record: Family) -> Iterator[Family]:
    """A family registered for the `with` block (a test's family): the shipped families found first, the record added
    (register_family, contract checked), then removed on exit and its draft class's `family_kind` as it was. Its
    serving adapters, if any, register for the same block with dspark.export.adapter.temporary_adapter (first)."""
    _discover()
    if record.kind in _FAMILIES:
        raise ValueError(f"draft kind {record.kind!r} is registered already (by {_FAMILIES[record.kind].draft.__name__})")
    own = vars(record.draft)
    had_kind, kind_before = "family_kind" in own, own.get("family_kind")
    register_family(record)
    try:
        yield record
    finally:
        _FAMILIES.pop(record.kind, None)
        if had_kind:
            record.draft.family_kind = kind_before
        else:
            del record.draft.family_kind


def _discover() -> None:
    """Import every module of dspark.models once, so every family has registered itself."""
    global _discovered
    if _discovered:
        return
    for info in pkgutil.iter_modules(models_package.__path__):
        importlib.import_module(f"{models_package.__name__}.{info.name}")
    _discovered = True


def families() -> dict[str, Family]:
    _discover()
    return dict(_FAMILIES)


def kinds() -> tuple[str, ...]:
    return tuple(families())


def family(kind: str) -> Family:
    """The family of a draft kind; ConfigError naming draft.kind when there is none."""
    fams = families()
    if kind not in fams:
        raise ConfigError(f"draft.kind: {kind!r} is not one of {tuple(fams)}")
    return fams[kind]


def family_of(draft: torch.nn.Module) -> Family:
    """The family a built draft belongs to."""
    kind = getattr(type(draft), "family_kind", None)
    if kind is None:
        raise ValueError(f"{type(draft).__name__} is not a registered draft family")
    return family(kind)


def family_of_config(config: Any) -> Family:
    """The family whose Config `config` is (a resolved draft config: a run's `run.draft`)."""
    found = [f for f in families().values() if type(config) is f.config]
    if len(found) != 1:
        raise ValueError(f"{type(config).__name__} is the config of {len(found)} registered draft families "
                         f"({', '.join(f.kind for f in found) or 'none'}), not one")
    return found[0]


# ---- draft group <-> config ----------------------------------------------------------------------------
def _plain(group: Any) -> dict:
    """A draft group as given: a plain dict (a Hydra DictConfig is made plain above this package: dspark.schema.plain,
    dspark.factory); a copy, so nothing here changes the caller's."""
    if not isinstance(group, dict):
        raise TypeError(f"a draft group here is a plain dict (dspark.schema.plain converts Hydra's DictConfig), got "
                        f"{type(group).__name__}")
    return dict(group)


def config_values(group: Mapping[str, Any]) -> dict[str, Any]:
    """A draft group (configs/draft/*.yaml, draft_config.json) -> keyword arguments of its family's config: the
    top-level group keys of the family merged with `arch`."""
    group = _plain(group)
    fam = family(str(group.get("kind")))
    values = {k: group[k] for k in fam.group_keys if k in group}
    if values.get("target_layer_ids") is not None:
        values["target_layer_ids"] = [int(i) for i in values["target_layer_ids"]]
    arch = dict(group.get("arch") or {})
    # a group key repeated under arch with the same value is what draft_config.json files of earlier runs hold, and so
    # is a key under arch alone that was an arch field then (draft_vocab_size)
    clash = sorted(k for k in set(arch) & set(fam.group_keys) if k in values and arch[k] != values[k])
    if clash:
        raise ConfigError(f"draft.arch: {clash} belong at the draft level, not under arch")
    values.update(arch)
    return values


def resolved_group(config: Any, kind: str, group: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The draft group of a built config: `group`'s own keys (kind, init_from_target, ...) with the family's group
    keys resolved (mask_token_id from the tokenizer) and every other config field (the target's sizes, RoPE,
    vocabulary) under `arch`. draft/draft_config.json and a checkpoint's hyper_parameters hold it: the draft rebuilds
    from it without the target (load_draft), and rebuilding it against the target gives the same draft."""
    fam = family(kind)
    full = dataclasses.asdict(config)
    out = {k: v for k, v in _plain(group or {"kind": kind, "init_from_target": False}).items()}
    out.update({k: full[k] for k in fam.group_keys if k in full})
    out["arch"] = {k: v for k, v in full.items() if k not in fam.group_keys and k != "kind"}
    return out


def field_key(fam: Family, field: str) -> str:
    """Where a config field sits in the draft group: draft.<key> (group key or kind) or draft.arch.<key>."""
    return f"draft.{field}" if field in fam.group_keys or field == "kind" else f"draft.arch.{field}"


def tokenizer_mask_id(tokenizer) -> int:
    """A null mask_token_id: the target tokenizer's <|mask|> token."""
    mid = tokenizer.convert_tokens_to_ids("<|mask|>") if tokenizer is not None else None
    if mid is None or mid == getattr(tokenizer, "unk_token_id", None):
        raise ConfigError("draft.mask_token_id: null, and the target tokenizer has no <|mask|> token: set an "
                          "explicit id")
    return int(mid)


def build_config(group: Mapping[str, Any], hf_config, tokenizer=None):
    """The validated draft config of a draft group against the target's HF config (no weights needed): the checks
    every family shares (the draft reads the target's layers and shares its embedding / LM head), then the family's
    own (Config.from_target_config). Errors are ConfigError naming the draft-group key."""
    group = _plain(group)
    fam = family(str(group.get("kind")))
    values = config_values(group)
    target_hidden = int(hf_config.hidden_size)
    if values.get("hidden_size", target_hidden) != target_hidden:
        raise ConfigError(f"draft.arch.hidden_size: {values['hidden_size']} does not match the target hidden size "
                          f"{target_hidden} (the draft shares the target's embedding and LM head)")
    ids = values.get("target_layer_ids")
    if ids is not None:
        n = int(hf_config.num_hidden_layers)
        below_last = optional(fam.config, "TAPS_BELOW_LAST")  # a family that cannot tap the last layer says why
        top = n - 2 if below_last else n - 1
        bad = [i for i in ids if not 0 <= i <= top]
        if not ids or bad:
            raise ConfigError(f"draft.target_layer_ids: {ids}: ids must be 0-based layer indices in [0, {top}] of "
                              f"the target ({n} layers{'; ' + below_last if below_last else ''}); bad: "
                              f"{bad or 'empty list'}")
    if "mask_token_id" in values and values["mask_token_id"] is None:
        values["mask_token_id"] = tokenizer_mask_id(tokenizer)
    vocab = int(hf_config.vocab_size)
    if values.get("mask_token_id") is not None and not 0 <= int(values["mask_token_id"]) < vocab:
        raise ConfigError(f"draft.mask_token_id: {values['mask_token_id']} outside the target vocabulary [0, {vocab})")
    try:
        return fam.config.from_target_config(hf_config, **values)
    except ConfigError:
        raise
    except FieldError as e:
        raise ConfigError(f"{field_key(fam, e.field)}: {e}") from e
    except (AttributeError, KeyError, TypeError) as e:  # the target's config lacks what this family reads
        model_type = getattr(hf_config, "model_type", None)
        raise ConfigError(f"draft.kind: {fam.kind} drafts cannot be built against this target (model_type "
                          f"{model_type!r}, {type(hf_config).__name__}: {e}); choose the draft group of the target's "
                          "architecture or another target") from e
    except (TypeError, ValueError) as e:
        raise ConfigError(f"draft: {e}") from e


def build_draft(config: Any, target, *, init_from_target: bool = False) -> torch.nn.Module:
    """The draft of a resolved config (build_config), built against a loaded FrozenTarget: the draft, its start from
    the target's layers (`init_from_target`, the draft group's key), the target's embedding / LM head attached."""
    fam = family_of_config(config)
    draft = fam.draft(config)
    if init_from_target:
        _check_starts_from_target(fam)
        try:
            draft.init_from_target(target.model)
        except ValueError as e:
            raise ConfigError(f"draft.init_from_target: {e}") from e
    if optional(draft, "needs_pre_head"):
        target.capture_pre_head = True  # the draft reads the last layer's raw output (TargetFeatures.pre_head)
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return draft


def check_init_from_target(group: Mapping[str, Any]) -> None:
    """ConfigError now (before any model loads) when draft.init_from_target is set for a family whose draft cannot
    start from the target's layers."""
    group = _plain(group)
    if group.get("init_from_target", False):
        _check_starts_from_target(family(str(group.get("kind"))))


def _check_starts_from_target(fam: Family) -> None:
    if optional(fam.draft, "init_from_target") is None:
        starts = sorted(k for k in kinds() if optional(family(k).draft, "init_from_target") is not None)
        raise ConfigError(f"draft.init_from_target: not implemented for {fam.kind} (families that have it: "
                          f"{', '.join(starts)})")


def init_reads_named(kind: str) -> bool:
    """Whether the family names the target modules its init_from_target reads (its draft's `init_reads`), so a target
    holding only those (and its head) can start the draft: dspark.data.feature_cache_build.target_loading."""
    return callable(optional(family(kind).draft, "init_reads"))


def init_reads(config: Any, target_model: torch.nn.Module) -> list[str]:
    """The names of `target_model`'s modules that init_from_target of the draft of the resolved `config` reads (the
    model may be on the meta device: only its structure is read). ConfigError when the family does not name them
    (init_reads_named)."""
    fam = family_of_config(config)
    if not init_reads_named(fam.kind):
        raise ConfigError(f"draft.init_from_target: {fam.kind} does not name the target modules it copies")
    return list(fam.draft.init_reads(config, target_model))


def vllm_options(config) -> dict:
    """A family's own speculative_config options (its config's `vllm_options()`, e.g. XPress's xpress_topc; none
    when it has no such method)."""
    return dict(optional(config, "vllm_options")())


def config_from_group(group: Mapping[str, Any]):
    """A resolved draft group (draft_config.json) -> its family's config object, from the group alone (no target)."""
    group = _plain(group)
    kind = str(group.get("kind"))
    fam = family(kind)
    values = config_values(group)
    if "kind" in {f.name for f in dataclasses.fields(fam.config)}:
        values["kind"] = kind
    if "mask_token_id" in values and values["mask_token_id"] is None:
        raise ValueError("draft_config.json: mask_token_id is null (a run from before the config was recorded "
                         "resolved): rebuild it against its target with dspark.factory.build_draft")
    try:
        return config_from_dict(fam.config, values).validate()
    except (TypeError, ValueError) as e:
        raise ValueError(f"draft_config.json ({kind}): {e}; a draft folder written before the sizes were recorded "
                         "needs its target (dspark.factory.build_draft)") from e


__all__ = ["Family", "FamilyContractError", "register", "register_family", "temporary_family", "families", "kinds", "family", "family_of", "family_of_config", "config_values", "resolved_group",
           "build_config", "build_draft", "config_from_group", "tokenizer_mask_id"]

"""A run's draft section, resolved once against the target before anything heavy loads.

`resolve_draft(target, group)`: the checked draft group (configs/draft/*.yaml plus overrides, or a resolved one a
checkpoint or a feature stream's producer holds) built into its family's Config against the target's config.json
(dspark.models.registry.build_config: taps inside the target, hidden size, the vocabulary, the family's own rules)
and, where draft.mask_token_id is null, the target tokenizer's <|mask|> token. No weights load. A local target folder
is read as it is; a Hub id (org/name) through the Hugging Face cache (HF_HUB_OFFLINE honoured: an id the cache lacks
is refused now, naming target.path; without it only config.json and, for a null mask id, the tokenizer files are
fetched, which the target's loading fetches anyway). So every run's config is final when dspark.schema.run_config
returns it: training never rebuilds or replaces it once the target has loaded.

Hydra's DictConfig stops here: what reaches dspark.models.registry is a plain dict (dspark.schema.plain).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from dspark.errors import ConfigError, require
from dspark.models import registry
from dspark.targets import register_v41
from dspark.targets.hf_target import resolve_target_source
from dspark.targets.source import target_folder


def target_source(target) -> tuple[str, bool]:
    """(what from_pretrained reads for the target section, whether it is a local folder). ConfigError naming
    target.path for a local-looking path that is no folder, or a Hub id HF_HUB_OFFLINE cannot find in the cache."""
    folder = target_folder(target)
    if Path(folder).is_dir():
        return folder, True
    local = folder.startswith(("/", ".", "~")) or Path(folder).exists()
    require(not local, "target.path", f"{folder!r} is not a folder")
    try:
        return resolve_target_source(folder), False
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from e


def target_hf_config(target):
    """The target's HF config (config.json only, no weights)."""
    from transformers import AutoConfig

    register_v41()
    source, local = target_source(target)
    try:
        return AutoConfig.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError) as e:
        raise ConfigError(f"target.path: {source!r} holds no readable config.json ({e})") from e


def target_tokenizer(target):
    """The target's tokenizer (no weights): a null draft.mask_token_id is its <|mask|> token; None when it has none
    (registry.tokenizer_mask_id then says so)."""
    from transformers import AutoTokenizer

    register_v41()
    source, local = target_source(target)
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError):
        return None


def resolve_draft(target, group: Mapping[str, Any]):
    """The family's Config of the checked draft group `group` (plain values) against the target section `target`:
    what run.draft is. ConfigError naming the draft key (or target.path) when they do not fit."""
    group = dict(group)
    registry.check_init_from_target(group)
    hf_config = target_hf_config(target)
    tokenizer = target_tokenizer(target) if group.get("mask_token_id", 0) is None else None
    return registry.build_config(group, hf_config, tokenizer)

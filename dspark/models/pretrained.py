"""A trained draft as a self-contained folder, the way Hugging Face models are: `save_draft` / `load_draft`
(save_pretrained / from_pretrained) over the files a run writes to RUN/draft/:

    draft_config.json   the draft group with every size resolved (dspark.factory.record_resolved): kind, the
                        group keys (block_size, mask_token_id, target_layer_ids, ...) and `arch` (the target's
                        sizes, RoPE, vocabulary), enough to build the draft without the target or Hydra
    model.safetensors   the draft's own weights (never the target's embedding / LM head)
    target.json         the target it was trained against: kind, path (folder or Hub id), weight fingerprint
    dspark_manifest.json the checksums of the three (dspark.training.draft_dir), written last

A loaded draft still scores with its target's embedding and LM head: share_target_weights(embed, lm_head)
before running it (the target named in target.json; eval.py and the exporters do this).
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Mapping

import torch

from dspark.training import draft_dir
from dspark.training.draft_dir import CONFIG_FILE, TARGET_FILE, WEIGHTS_FILE
# draft kind -> (module, config class, draft class)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "dspark_v4": ("dspark.models.dspark_v4", "DSparkV4Config", "DSparkV4Draft"),
    "dspark_dense": ("dspark.models.dspark_dense", "DSparkDenseConfig", "DSparkDenseDraft"),
    "dsv4_mtp": ("dspark.models.dsv4_mtp", "DSV4MTPConfig", "DSV4MTPDraft"),
    "hyv4_mtp": ("dspark.models.hy_v4_mtp", "HYV4MTPConfig", "HYV4MTPDraft"),
}
_NOT_CONFIG = ("kind", "layout", "init_from_target", "arch")  # group keys that are not config fields


def _family(kind: str):
    if kind not in FAMILIES:
        raise ValueError(f"draft kind {kind!r} is not one of {tuple(FAMILIES)}")
    module, config_name, draft_name = FAMILIES[kind]
    mod = importlib.import_module(module)
    return getattr(mod, config_name), getattr(mod, draft_name)


def draft_group(draft: torch.nn.Module, kind: str, layout: str | None = None) -> dict[str, Any]:
    """The complete draft group of a built draft, in the layout dspark.factory reads (what draft_config.json
    holds): block drafts (dspark_v4, dspark_dense) need their `layout` (anchor / mask)."""
    from omegaconf import OmegaConf

    from dspark.factory import DRAFT_FIELD_KEYS, MTP_DRAFT_KINDS, MTP_FIELD_KEYS, record_resolved

    _family(kind)
    mtp = kind in MTP_DRAFT_KINDS
    if not mtp and layout not in ("anchor", "mask"):
        raise ValueError(f"save_draft: a {kind} draft needs layout 'anchor' or 'mask', got {layout!r}")
    node = OmegaConf.create({"kind": kind, **({} if mtp else {"layout": layout}), "init_from_target": False})
    record_resolved(node, draft.config, MTP_FIELD_KEYS if mtp else DRAFT_FIELD_KEYS)
    return OmegaConf.to_container(node)


def config_from_group(group: Mapping[str, Any]):
    """draft_config.json -> the family's config object, from the file alone. A group without the resolved sizes
    (written before they were recorded) is refused, naming what is missing."""
    kind = str(group.get("kind"))
    Config, _ = _family(kind)
    values = {k: v for k, v in group.items() if k not in _NOT_CONFIG}
    values.update(group.get("arch") or {})
    if kind in ("dsv4_mtp", "hyv4_mtp"):
        values["kind"] = kind
    if values.get("mask_token_id", 0) is None:
        raise ValueError("draft_config.json: mask_token_id is null (a run from before the config was recorded "
                         "resolved): rebuild it against its target with dspark.factory.build_draft")
    try:
        from dspark.models.common import config_from_dict

        return config_from_dict(Config, values).validate()
    except (TypeError, ValueError) as e:
        raise ValueError(f"draft_config.json ({kind}): {e}; a draft folder written before the sizes were recorded "
                         "needs its target (dspark.factory.build_draft)") from e


def save_draft(draft: torch.nn.Module, folder: str | Path, *, kind: str, layout: str | None,
               target: Mapping[str, Any]) -> Path:
    """save_pretrained: weights + complete config + the target's identity (kind, path, fingerprint) + the checksum
    manifest, as training writes RUN/draft/ (dspark.training.draft_dir)."""
    folder = Path(folder)
    draft_dir.write_weights_and_config(draft, draft_group(draft, kind, layout), folder)
    draft_dir.seal(folder, dict(target))
    return folder


def load_draft(folder: str | Path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict]:
    """from_pretrained: (draft with its trained weights, target.json) from a sealed draft folder, without the
    target and without Hydra. Weights are loaded strictly (names and shapes)."""
    from safetensors.torch import load_file

    from dspark.export._io import load_into

    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}: no {name} (a draft folder holds {CONFIG_FILE} + {WEIGHTS_FILE})")
    draft_dir.check(folder)  # complete and unaltered (its checksum manifest), before anything is built
    group = json.loads((folder / CONFIG_FILE).read_text())
    _, Draft = _family(str(group.get("kind")))
    draft = Draft(config_from_group(group))
    load_into(draft, load_file(str(folder / WEIGHTS_FILE)), f"load_draft({folder})", buffers=True)
    return draft.to(device), json.loads((folder / TARGET_FILE).read_text())

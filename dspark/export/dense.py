"""Dense DSpark / DFlash draft <-> a vLLM draft-model folder (config.json + model.safetensors).

Assumptions about vLLM 0.33 (state them when reporting):
- DSpark (markov_rank > 0): architectures ["Qwen3DSparkModel"] (SPEC.md 5).
- DFlash (markov_rank 0): architectures ["DFlashDraftModel"], the registry name vLLM maps to
  qwen3_dflash.DFlashQwen3ForCausalLM (the z-lab DFlash checkpoints use it).
- Tensor names are the module names WITHOUT a "model." prefix (fc.weight, hidden_norm.weight,
  layers.{i}.self_attn.*, layers.{i}.mlp.*, norm.weight, markov_head.*, confidence_head.proj.*): the
  DFlash loader prepends "model." itself, as the released z-lab checkpoints expect. No embed_tokens /
  lm_head (shared with the target); full vocabulary (draft_vocab_size == vocab_size, no d2t/t2d).
"""
from __future__ import annotations

from pathlib import Path

import torch

from dspark.export._io import DEFAULT_MAX_SHARD_BYTES, iter_tensors, load_into, write_tensors
from dspark.io import atomic_write_json
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft

DSPARK_ARCH = "Qwen3DSparkModel"
DFLASH_ARCH = "DFlashDraftModel"


def dense_config_json(cfg: DSparkDenseConfig, dtype: torch.dtype = torch.bfloat16,
                      num_target_layers: int | None = None) -> dict:
    is_dspark = cfg.markov_rank > 0
    out = {
        "architectures": [DSPARK_ARCH if is_dspark else DFLASH_ARCH],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "block_size": cfg.block_size,
        "dflash_config": {
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
        },
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type if is_dspark else None,
        "enable_confidence_head": bool(is_dspark and cfg.confidence_head),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if num_target_layers is not None:
        out["num_target_layers"] = int(num_target_layers)
    return out


def dense_export_plan(draft: DSparkDenseDraft, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{checkpoint name: (shape, dtype)}; names are the module's own."""
    return {k: (tuple(p.shape), dtype) for k, p in draft.named_parameters()}


def export_dense(draft: DSparkDenseDraft, out_dir, dtype: torch.dtype = torch.bfloat16,
                 num_target_layers: int | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    out_dir = Path(out_dir)
    tensors = {k: p.detach().to("cpu", dtype).contiguous() for k, p in draft.named_parameters()}
    write_tensors(tensors, out_dir, max_shard_bytes)
    atomic_write_json(out_dir / "config.json", dense_config_json(draft.config, dtype, num_target_layers))
    return out_dir


def import_dense(folder, draft: DSparkDenseDraft) -> DSparkDenseDraft:
    """Load an exported dense folder into `draft` (strict). A "model." prefix, if present, is dropped."""
    tensors = {k.removeprefix("model."): t for k, t in iter_tensors(Path(folder))}
    load_into(draft, tensors, f"import_dense({folder})")
    return draft

"""DeepSeek-V4 DSpark draft <-> serving `mtp.{i}.*` tensors (SPEC.md 4, vLLM `_remap_dspark_name`).

The draft's parameter names already are the serving names below the stage prefix:
    layers.{i}.<rest>                                   -> mtp.{i}.<rest>      (decoder layer i)
    main_proj.*, main_norm.*                            -> mtp.0.*              (context combiner)
    norm.*, hc_head_*, markov_head.*, confidence_head.* -> mtp.{N-1}.*          (head stack, last stage)
Compute weights are written in `dtype` (bf16 by default); hc_*, norms, attn_sink, gate bias and the
confidence head stay float32, as in the released checkpoints. No embed / lm_head (shared with the target).
A sidecar folder holds model.safetensors (or shards + index) and dspark_config.json.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from dspark.export._io import DEFAULT_MAX_SHARD_BYTES, iter_tensors, load_into, write_tensors
from dspark.io import atomic_write_json
from dspark.models.dspark_v4 import FP32_PARAM_RE, DSparkV4Config, DSparkV4Draft

CONFIG_NAME = "dspark_config.json"
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_STAGE0 = ("main_proj.", "main_norm.")


def serving_name(name: str, num_layers: int) -> str:
    """Draft parameter name -> checkpoint name `mtp.{stage}.<rest>`."""
    m = _LAYER_RE.match(name)
    if m:
        return f"mtp.{int(m.group(1))}.{m.group(2)}"
    if name.startswith(_STAGE0):
        return f"mtp.0.{name}"
    return f"mtp.{num_layers - 1}.{name}"


def export_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a draft parameter is written in: float32 for the fp32 set, `dtype` otherwise."""
    return torch.float32 if FP32_PARAM_RE.search(name) else dtype


def v4_export_plan(draft: DSparkV4Draft, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{checkpoint name: (shape, dtype)} without touching tensor data (works for a draft on the meta device)."""
    n = draft.config.num_layers
    return {serving_name(k, n): (tuple(p.shape), export_dtype(k, dtype)) for k, p in draft.named_parameters()}


def v4_config_json(cfg: DSparkV4Config, dtype: torch.dtype = torch.bfloat16) -> dict:
    """dspark_config.json: the target-config keys the serving loader reads + the draft sizes (HF key names)."""
    return {
        "dspark_block_size": cfg.block_size,
        "dspark_noise_token_id": cfg.mask_token_id,
        "dspark_target_layer_ids": list(cfg.target_layer_ids),
        "dspark_markov_rank": cfg.markov_rank,
        "dspark_markov_head_type": cfg.markov_head_type,
        "dspark_confidence_bias": cfg.confidence_bias,
        "n_mtp_layers": cfg.num_layers,
        "num_nextn_predict_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
        "scoring_func": cfg.scoring_func,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps,
        "dspark_rope_theta": cfg.rope_theta,
        "sliding_window": cfg.sliding_window,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dspark_torch_dtype": str(dtype).removeprefix("torch."),
        "dspark_format": "deepseek_v4_mtp",
    }


def export_v4_sidecar(draft: DSparkV4Draft, out_dir, dtype: torch.dtype = torch.bfloat16,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write the draft as a sidecar folder of `mtp.{i}.*` tensors + dspark_config.json; returns the folder."""
    out_dir = Path(out_dir)
    n = draft.config.num_layers
    tensors = {}
    for name, p in draft.named_parameters():
        if p.device.type == "meta":
            raise ValueError("export_v4_sidecar: the draft is on the meta device; use v4_export_plan for names/shapes")
        tensors[serving_name(name, n)] = p.detach().to("cpu", export_dtype(name, dtype)).contiguous()
    write_tensors(tensors, out_dir, max_shard_bytes)
    atomic_write_json(out_dir / CONFIG_NAME, v4_config_json(draft.config, dtype))
    return out_dir


def import_v4_sidecar(folder, draft: DSparkV4Draft) -> DSparkV4Draft:
    """Load a sidecar (or any folder of `mtp.{i}.*` tensors) into `draft`; strict in both directions.

    Non-`mtp.` tensors (a merged target checkpoint's own weights) are ignored; tensors are cast to the
    draft's parameter dtypes.
    """
    n = draft.config.num_layers
    back = {serving_name(k, n): k for k, _ in draft.named_parameters()}
    tensors = {}
    for name, t in iter_tensors(Path(folder)):
        if not name.startswith("mtp."):
            continue
        if name in back:
            tensors[back[name]] = t
        else:
            tensors[name] = t  # reported as unexpected by load_into
    load_into(draft, tensors, f"import_v4_sidecar({folder})")
    return draft


MERGED_SHARD = "model-dspark-mtp.safetensors"


def merge_v4_into_target(draft: DSparkV4Draft, target_dir, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A copy of a target checkpoint folder with the draft's `mtp.{i}.*` tensors added (SPEC.md 4).

    Files are hard-linked when possible (copied otherwise); the draft goes into its own shard
    `model-dspark-mtp.safetensors`; the index gains its names (a single-file target gets an index);
    config.json gains dspark_block_size, dspark_noise_token_id, dspark_target_layer_ids,
    dspark_markov_rank, n_mtp_layers / num_nextn_predict_layers. `mtp.*` tensors the target already holds
    (e.g. DeepSeek-V4's own MTP layer) would be loaded as draft weights by the serving loader, so they are
    removed from the copy (their shards are rewritten without them, the originals stay untouched).
    """
    import json
    import os
    import shutil

    from safetensors.torch import load_file

    from dspark.export._io import INDEX_NAME, SINGLE_NAME
    from dspark.io import save_safetensors_atomic

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.resolve() == target_dir.resolve():
        raise ValueError("merge_v4_into_target: out_dir must differ from target_dir (the target stays untouched)")
    config = json.loads((target_dir / "config.json").read_text())
    if int(config.get("hidden_size", draft.config.hidden_size)) != draft.config.hidden_size:
        raise ValueError(f"merge_v4_into_target: target hidden_size {config['hidden_size']} != draft "
                         f"{draft.config.hidden_size}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in target_dir.iterdir():
        if src.is_file() and src.name not in ("config.json", INDEX_NAME, MERGED_SHARD):
            dst = out_dir / src.name
            if dst.exists():
                dst.unlink()
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
    if (target_dir / INDEX_NAME).is_file():
        index = json.loads((target_dir / INDEX_NAME).read_text())
    else:
        from safetensors import safe_open

        with safe_open(str(target_dir / SINGLE_NAME), framework="pt") as fh:
            index = {"metadata": {}, "weight_map": {k: SINGLE_NAME for k in fh.keys()}}
    weight_map = dict(index["weight_map"])
    old_mtp = {k: f for k, f in weight_map.items() if k.startswith("mtp.")}
    for fname in sorted(set(old_mtp.values())):
        kept = {k: t for k, t in load_file(str(target_dir / fname)).items() if not k.startswith("mtp.")}
        (out_dir / fname).unlink()
        save_safetensors_atomic(kept, out_dir / fname, {"format": "pt"})
    for k in old_mtp:
        del weight_map[k]
    n = draft.config.num_layers
    tensors = {serving_name(k, n): p.detach().to("cpu", export_dtype(k, dtype)).contiguous()
               for k, p in draft.named_parameters()}
    save_safetensors_atomic(tensors, out_dir / MERGED_SHARD, {"format": "pt"})
    weight_map.update({k: MERGED_SHARD for k in tensors})
    index["weight_map"] = dict(sorted(weight_map.items()))
    index.setdefault("metadata", {}).pop("total_size", None)  # no longer exact; optional in the format
    atomic_write_json(out_dir / INDEX_NAME, index)
    sidecar = v4_config_json(draft.config, dtype)
    keys = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
            "dspark_markov_head_type", "dspark_confidence_bias", "n_mtp_layers", "num_nextn_predict_layers",
            "dspark_torch_dtype")
    config.update({k: sidecar[k] for k in keys})
    atomic_write_json(out_dir / "config.json", config)
    return out_dir

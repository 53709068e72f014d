"""Dense DSpark / DFlash draft <-> a vLLM draft-model folder (config.json + safetensors), in vLLM's own
config format or the speculators format. Facts checked against the vLLM 0.33.0 wheel (docs/CONTRACTS.md):

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
  a gated / rnn Markov head or a sliding_window draft is refused for the vLLM format (for_vllm=False or the
  speculators format write it anyway, listing the reasons under `dspark_not_for_vllm`).
- speculators format (vllm/transformers_utils/configs/speculators/algos.py update_dspark/update_dflash,
  speculators' DSparkSpeculatorConfig): top-level speculators_model_type, transformer_layer_config (the
  Qwen3 layer sizes), speculators_config (proposal_methods[0].speculative_tokens, verifier), and
  aux_hidden_state_layer_ids = target_layer_ids + 1 (vLLM maps back with id - 1), mask_token_id,
  markov_rank, markov_head_type, block_size, enable_confidence_head, confidence_head_with_markov,
  sample_from_anchor (speculators default false), draft_vocab_size, target_hidden_size.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.export._io import DEFAULT_MAX_SHARD_BYTES, NOT_FOR_VLLM, iter_tensors, load_into, sealed, write_tensors
from dspark.io import atomic_write_json
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft

DSPARK_ARCH = "Qwen3DSparkModel"
DFLASH_ARCH = "DFlashDraftModel"
FORMATS = ("vllm", "speculators")
_MAPPING = ("d2t", "t2d")


def _layout(cfg: DSparkDenseConfig, layout: str | None) -> str:
    layout = layout or ("anchor" if cfg.markov_rank > 0 else "mask")
    if layout not in ("anchor", "mask"):
        raise ValueError(f"layout must be 'anchor' or 'mask', got {layout!r}")
    if cfg.markov_rank == 0 and layout != "mask":
        raise ValueError("a DFlash draft (markov_rank 0) exports as DFlashDraftModel, which vLLM only runs with the "
                         "1+N 'mask' layout (sample_from_anchor=false); this draft uses layout 'anchor'")
    return layout


def _layer_config(cfg: DSparkDenseConfig, dtype: torch.dtype) -> dict:
    return {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_parameters["rope_theta"],
        "rope_parameters": dict(cfg.rope_parameters),  # the target's (llama3 / yarn / ... scaling included)
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def dense_config_json(cfg: DSparkDenseConfig, dtype: torch.dtype = torch.bfloat16,
                      num_target_layers: int | None = None, layout: str | None = None) -> dict:
    """vLLM's own draft config (architectures Qwen3DSparkModel / DFlashDraftModel)."""
    is_dspark = cfg.markov_rank > 0
    layout = _layout(cfg, layout)
    out = {
        "architectures": [DSPARK_ARCH if is_dspark else DFLASH_ARCH],
        **_layer_config(cfg, dtype),
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "block_size": cfg.block_size,
        "dflash_config": {  # never sample_from_anchor here (module docstring)
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
        },
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type if is_dspark else None,
        "enable_confidence_head": bool(is_dspark and cfg.confidence_head),
        "confidence_head_with_markov": bool(is_dspark and cfg.confidence_head),
        "sample_from_anchor": layout == "anchor",
    }
    if num_target_layers is not None:
        out["num_target_layers"] = int(num_target_layers)
    return out


def speculators_config_json(cfg: DSparkDenseConfig, dtype: torch.dtype = torch.bfloat16, layout: str | None = None,
                            verifier: str | None = None, verifier_architectures: list[str] | None = None) -> dict:
    """speculators-format config ("dspark" for DSpark drafts, "dflash" for DFlash drafts)."""
    is_dspark = cfg.markov_rank > 0
    layout = _layout(cfg, layout)
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
        "sample_from_anchor": layout == "anchor",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if is_dspark:
        out.update({"markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
                    "enable_confidence_head": bool(cfg.confidence_head),
                    "confidence_head_with_markov": bool(cfg.confidence_head)})
    return out


def dense_export_plan(draft: DSparkDenseDraft, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{checkpoint name: (shape, dtype)}; names are the module's own (+ lm_head / d2t / t2d when reduced)."""
    plan = {k: (tuple(p.shape), dtype) for k, p in draft.named_parameters()}
    if getattr(draft, "reduced_vocab", False):
        vd = draft.d2t.numel()
        plan["lm_head.weight"] = ((vd, draft.config.hidden_size), dtype)
        plan["d2t"] = ((vd,), torch.int64)
        plan["t2d"] = ((draft.config.vocab_size,), torch.bool)
    return plan


def dense_serving_problems(cfg: DSparkDenseConfig) -> list[str]:
    """Why vLLM 0.33.0 would serve this dense draft differently from how it was trained (empty: as trained);
    each line names the draft config key."""
    out = []
    if cfg.markov_rank > 0 and cfg.markov_head_type != "vanilla":
        out.append(f"markov_head_type {cfg.markov_head_type!r}: vLLM's DSparkMarkovHead has only markov_w1 / "
                   "markov_w2 (vllm/model_executor/models/qwen3_dspark.py:48-93), no parameter for the "
                   f"{'gate_proj' if cfg.markov_head_type == 'gated' else 'joint_proj'} tensors")
    if cfg.sliding_window is not None:
        out.append(f"sliding_window {cfg.sliding_window}: vLLM's Qwen3 DFlash / DSpark draft layers attend to the "
                   "whole context (full attention unless layer_types says sliding_attention, which also makes the "
                   "block causal: qwen3_dflash.py:62-81, 96-158)")
    return out


@sealed
def export_dense(draft: DSparkDenseDraft, out_dir, dtype: torch.dtype = torch.bfloat16,
                 num_target_layers: int | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 layout: str | None = None, fmt: str = "vllm", verifier: str | None = None,
                 for_vllm: bool = True) -> Path:
    """Write config.json + safetensors. `layout` defaults to "anchor" (DSpark) / "mask" (DFlash);
    `fmt` "vllm" (vLLM's own config) or "speculators"; `verifier` names the target (speculators only).
    A draft vLLM 0.33.0 would serve differently (dense_serving_problems) is refused in the vLLM format unless
    `for_vllm` is False; written anyway (speculators format or for_vllm=False), its config lists the reasons
    under `dspark_not_for_vllm`."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    not_served = dense_serving_problems(draft.config)
    if not_served and fmt == "vllm" and for_vllm:
        raise ValueError("export_dense: vLLM 0.33.0 cannot serve this draft as trained:\n  " + "\n  ".join(not_served)
                         + "\n(fmt='speculators' or for_vllm=False / CLI --format speculators or --not-for-vllm "
                         "write it anyway)")
    out_dir = Path(out_dir)
    tensors = {k: p.detach().to("cpu", dtype).contiguous() for k, p in draft.named_parameters()}
    if getattr(draft, "reduced_vocab", False):
        _, lm_head = draft._shared()
        tensors["lm_head.weight"] = lm_head[draft.draft_to_target()].detach().to("cpu", dtype).contiguous()
        tensors["d2t"] = draft.d2t.detach().cpu().long().contiguous()
        tensors["t2d"] = draft.t2d.detach().cpu().bool().contiguous()
    write_tensors(tensors, out_dir, max_shard_bytes)
    if fmt == "vllm":
        config = dense_config_json(draft.config, dtype, num_target_layers, layout)
    else:
        config = speculators_config_json(draft.config, dtype, layout, verifier)
    if not_served:
        config[NOT_FOR_VLLM] = not_served
    atomic_write_json(out_dir / "config.json", config)
    return out_dir


def read_dense_config(folder) -> dict:
    """The folder's config.json in vLLM's own key names (a speculators config is translated the way
    vLLM's update_dspark / update_dflash do, incl. target_layer_ids = aux id - 1)."""
    c = json.loads((Path(folder) / "config.json").read_text())
    algo = c.get("speculators_model_type")
    if algo is None:
        return c
    if algo not in ("dspark", "dflash"):
        raise ValueError(f"{folder}/config.json: speculators_model_type {algo!r} is not 'dspark' or 'dflash'")
    out = dict(c.get("transformer_layer_config") or {})
    if "aux_hidden_state_layer_ids" not in c or "mask_token_id" not in c:
        raise ValueError(f"{folder}/config.json: a speculators {algo} config needs aux_hidden_state_layer_ids and "
                         "mask_token_id")
    target_ids = [int(i) - 1 for i in c["aux_hidden_state_layer_ids"]]
    sfa = bool(c.get("sample_from_anchor", False))
    # as vLLM translates: update_dflash puts sample_from_anchor into dflash_config, update_dspark at the top
    # level (vllm/transformers_utils/configs/speculators/algos.py:118-126, 187-189)
    dflash = {"target_layer_ids": target_ids, "mask_token_id": c["mask_token_id"]}
    if algo == "dflash":
        dflash["sample_from_anchor"] = sfa
    out.update({"architectures": [DSPARK_ARCH if algo == "dspark" else DFLASH_ARCH], "dflash_config": dflash,
                "sample_from_anchor": sfa})
    for key in ("draft_vocab_size", "target_hidden_size", "markov_rank", "markov_head_type", "block_size",
                "enable_confidence_head", "confidence_head_with_markov", "torch_dtype"):
        if c.get(key) is not None:
            out[key] = c[key]
    return out


def dense_config_from_folder(folder) -> tuple[DSparkDenseConfig, str]:
    """(draft config, layout) of an exported folder (either format), to build a draft to import into."""
    c = read_dense_config(folder)
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
        draft_vocab_size=vd if vd < vocab else None)
    if rank and cfg.confidence_head and not c.get("confidence_head_with_markov", False):
        raise ValueError(f"{folder}/config.json: a confidence head without the Markov feature "
                         "(confidence_head_with_markov false) has no counterpart in the dense draft")
    return cfg.validate(), ("anchor" if c.get("sample_from_anchor", rank > 0) else "mask")


def import_dense(folder, draft: DSparkDenseDraft) -> DSparkDenseDraft:
    """Load an exported dense folder (vLLM or speculators config) into `draft` (strict). A "model." prefix,
    if present, is dropped. A reduced-vocab folder installs d2t / t2d and checks that its lm_head rows are
    the shared target LM head at those ids (the draft scores with the target's head)."""
    tensors = {k.removeprefix("model."): t for k, t in iter_tensors(Path(folder))}
    reduced = getattr(draft, "reduced_vocab", False)
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

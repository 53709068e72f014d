"""Reduced draft vocabulary at export: a full-vocab dense draft pruned to the ids dspark.data.vocab chooses (its
docstring: the d2t / t2d convention and what is counted). A draft trained with draft.draft_vocab_size is already
reduced and exports as it is."""
from __future__ import annotations

import torch

from dspark.data.vocab import build_vocab_mapping, count_tokens, count_tokens_jsonl  # noqa: F401  (the export CLI's)
from dspark.models.contract import optional
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft


def reduce_dense_vocab(draft: DSparkDenseDraft, d2t: torch.Tensor, t2d: torch.Tensor) -> DSparkDenseDraft:
    """A reduced-vocab copy of a full-vocab dense draft: same weights, markov_w2 rows at the kept ids,
    the given mapping; shares the target embedding / LM head. Its logits at kept ids equal the full
    draft's, -inf elsewhere."""
    if optional(draft, "reduced_vocab"):
        raise ValueError("reduce_dense_vocab: the draft already has a reduced vocabulary")
    cfg = DSparkDenseConfig(**{**draft.config.__dict__, "draft_vocab_size": int(d2t.numel())})
    small = DSparkDenseDraft(cfg)
    small.set_vocab_mapping(d2t, t2d)
    ids = small.draft_to_target()
    state = {k: v for k, v in draft.state_dict().items()}
    if draft.markov_head is not None:
        state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][ids]
    state["d2t"], state["t2d"] = small.d2t, small.t2d
    small.load_state_dict(state, strict=True)
    for (_, p), (_, src) in zip(small.named_parameters(), draft.named_parameters()):
        p.data = p.data.to(src.dtype)
    small.share_target_weights(draft._shared("embed_weight"), draft._shared("lm_head_weight"))
    return small.eval()

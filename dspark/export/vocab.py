"""Reduced draft vocabulary at export: a full-vocab draft of the dense backbone pruned to the ids dspark.data.vocab
chooses (its docstring: the d2t / t2d convention and what is counted). A draft trained with draft.draft_vocab_size is
already reduced and exports as it is."""
from __future__ import annotations

import torch

from dspark.data.vocab import build_vocab_mapping, count_tokens, count_tokens_jsonl  # noqa: F401  (the export CLI's)
from dspark.models.contract import optional
from dspark.models.draft_vocab import DraftVocab


def reduce_dense_vocab(draft: DraftVocab, d2t: torch.Tensor, t2d: torch.Tensor) -> DraftVocab:
    """A reduced-vocab copy of a full-vocab draft (a DraftVocab nn.Module built as `type(draft)(config)` whose config
    has draft_vocab_size; its Markov head, if any, keeps markov_w2's rows at the kept ids): same weights, the given
    mapping; shares the target embedding / LM head. Its logits at kept ids equal the full draft's, -inf elsewhere.
    The copy is of the draft's own classes (the dense family's or one built on it)."""
    if optional(draft, "reduced_vocab"):
        raise ValueError("reduce_dense_vocab: the draft already has a reduced vocabulary")
    cfg = type(draft.config)(**{**draft.config.__dict__, "draft_vocab_size": int(d2t.numel())})
    small = type(draft)(cfg)
    small.set_vocab_mapping(d2t, t2d)
    ids = small.draft_to_target()
    state = {k: v for k, v in draft.state_dict().items()}
    if getattr(draft, "markov_head", None) is not None:
        state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][ids]
    state["d2t"], state["t2d"] = small.d2t, small.t2d
    small.load_state_dict(state, strict=True)
    for (_, p), (_, src) in zip(small.named_parameters(), draft.named_parameters()):
        p.data = p.data.to(src.dtype)
    small.share_target_weights(draft._shared("embed_weight"), draft._shared("lm_head_weight"))
    return small.eval()

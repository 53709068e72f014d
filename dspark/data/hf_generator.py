"""Regeneration with a local transformers model: :class:`HFGenerator`, plus the tokenizer-side steps
(chat rendering, end tokens, cutting and decoding an answer) that the vLLM generator shares, so both
engines see the same prompts and end answers at the same tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from dspark.data.generator import Completion, Message, SamplingParams, derived_seed

NON_THINKING = {"enable_thinking": False}


def render_chat(tokenizer, messages: Sequence[Message], chat_template_kwargs: dict) -> str:
    """The prompt text of one conversation, ending with the assistant header."""
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True,
                                         **chat_template_kwargs)


def stop_token_ids(generation_eos, tokenizer) -> list[int]:
    """End-of-answer ids: ``generation_config.eos_token_id`` (an int, a list or None) and the tokenizer's eos."""
    ids = set([generation_eos] if isinstance(generation_eos, int) else (generation_eos or []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("no end-of-turn token: set tokenizer.eos_token or generation_config.eos_token_id")
    return sorted(ids)


def decode_answer(tokenizer, token_ids: Sequence[int], stop_ids, unstopped_reason: str | None) -> Completion:
    """Cut ``token_ids`` at the first end token and decode without special tokens.

    The finish reason is "stop" when an end token was found, else ``unstopped_reason``.
    """
    end = next((i for i, tok in enumerate(token_ids) if tok in stop_ids), None)
    kept = token_ids if end is None else token_ids[:end]
    return Completion(tokenizer.decode(kept, skip_special_tokens=True), "stop" if end is not None else unstopped_reason,
                      len(kept))


class HFGenerator:
    """Batched generation with a local transformers causal LM (left padding, chat template).

    Prompts are rendered with ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    **chat_template_kwargs)``; ``chat_template_kwargs`` defaults to ``{"enable_thinking": False}``
    (non-thinking answers for templates that know the switch, ignored by the others). Rendered text
    is tokenized WITHOUT extra special tokens (the template already has them) and left-padded, so
    every row's last prompt token is at the same column and generation continues all rows at once.
    Each answer stops at the first end token (``generation_config.eos_token_id`` and the
    tokenizer's eos); special tokens are removed from the decoded text.
    """

    def __init__(self, model, tokenizer, device=None, sampling: SamplingParams | None = None, *,
                 chat_template_kwargs: dict | None = None, name: str | None = None):
        import torch  # noqa: PLC0415 (importing this module stays cheap)

        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("HFGenerator needs a tokenizer with a chat template (tokenizer.chat_template is empty)")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingParams()
        self.chat_template_kwargs = dict(NON_THINKING) if chat_template_kwargs is None else chat_template_kwargs
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.stop_ids = stop_token_ids(eos, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids)
        self.name = name or f"hf:{getattr(model.config, '_name_or_path', '') or type(model).__name__}"

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt text for one conversation (ending with the assistant header)."""
        return render_chat(self.tokenizer, messages, self.chat_template_kwargs)

    def _generation_config(self, sampling: SamplingParams):
        from transformers import GenerationConfig  # noqa: PLC0415

        base = getattr(self.model, "generation_config", None)
        config = copy.deepcopy(base) if base is not None else GenerationConfig()
        # Exactly the requested sampling: no top-k, no penalties inherited from the checkpoint.
        config.update(
            max_new_tokens=sampling.max_new_tokens, max_length=None, min_new_tokens=None, min_length=0,
            do_sample=not sampling.greedy, num_beams=1, top_k=None if sampling.greedy else 0, repetition_penalty=1.0,
            temperature=None if sampling.greedy else sampling.temperature,
            top_p=None if sampling.greedy else sampling.top_p,
            pad_token_id=self.pad_id, eos_token_id=list(self.stop_ids),
        )
        return config

    def generate(self, batch: Sequence[Sequence[Message]], sampling: SamplingParams | None = None) -> list[Completion]:
        import torch  # noqa: PLC0415

        sampling = sampling or self.sampling
        if not batch:
            return []
        texts = [self.render(messages) for messages in batch]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                             add_special_tokens=False)
        input_ids = enc["input_ids"].to(self.device)  # [B, S] left-padded
        attention_mask = enc["attention_mask"].to(self.device)  # [B, S] 0 on padding
        fork_devices = [self.device] if self.device.type == "cuda" else []
        with torch.inference_mode(), torch.random.fork_rng(devices=fork_devices):
            torch.manual_seed(derived_seed(sampling.seed, texts))
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask,
                generation_config=self._generation_config(sampling),
            )  # [B, S + n_new]
        new_tokens = out[:, input_ids.shape[1]:].tolist()  # B lists of n_new ids
        stop = set(self.stop_ids)
        return [decode_answer(self.tokenizer, row, stop, "length") for row in new_tokens]

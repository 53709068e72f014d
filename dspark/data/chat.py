"""Render a conversation with a tokenizer's chat template and mark the trained (assistant) tokens.

``render_with_loss_mask`` works for any Hugging Face chat template without knowing its syntax:

1. render the whole conversation to text with ``apply_chat_template(tokenize=False)``;
2. find each assistant content's character span in that text: render the conversation prefix
   before the message with the generation prompt, take the longest common prefix of that render
   and the full text (where the template starts the assistant turn; templates that render
   earlier turns differently, e.g. Qwen3 dropping ``<think>`` blocks, still share the text up to
   the assistant header), and search the content from there (then its stripped form, for
   templates that trim);
3. tokenize the text once with ``return_offsets_mapping`` and set loss_mask = 1 on the tokens that
   overlap an assistant span, plus the end-of-turn token: the first special token after the
   content (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, the eos...), looking past tokens that
   are only whitespace. Everything else (system/user turns, role headers, separators) is 0.

A token that straddles the edge of an assistant content (possible when byte-level BPE merges the
header's newline with leading newlines of the content) counts as assistant: it carries content.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

ROLES = ("system", "user", "assistant")


class ChatTemplateError(ValueError):
    """The chat template rendered a conversation in a way the loss mask cannot follow."""


def _validate(messages: Sequence[dict]) -> None:
    if not messages:
        raise ValueError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")


def _render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (named ones plus added tokens flagged special)."""
    ids = set(tokenizer.all_special_ids)
    for idx, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", False):
            ids.add(int(idx))
    return ids


def assistant_char_spans(
    messages: Sequence[dict],
    tokenizer,
    text: str,
    chat_template_kwargs: dict | None = None,
    stop_at_char: int | None = None,
) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant message's content inside ``text``.

    ``text`` must be the full render of ``messages``. Spans are found left to right and never
    overlap; with ``stop_at_char`` the search stops once a span would start past that character
    (used to skip turns beyond the truncation point). Raises :class:`ChatTemplateError` when a
    content cannot be found (a template that rewrites assistant contents).
    """
    kwargs = chat_template_kwargs or {}
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            prefix = _render(tokenizer, messages[:i], True, kwargs)
            anchor = _common_prefix_len(prefix, text)
        except Exception:  # some templates refuse an empty / assistant-first prefix
            anchor = cursor
        start_search = max(anchor, cursor)
        if stop_at_char is not None and start_search >= stop_at_char:
            break
        content = m["content"]
        if not content.strip():
            continue  # nothing to train on in a blank turn
        pos = text.find(content, start_search)
        length = len(content)
        if pos < 0:
            stripped = content.strip()
            pos = text.find(stripped, start_search)
            length = len(stripped)
        if pos < 0:
            raise ChatTemplateError(
                f"assistant message {i} not found verbatim in the rendered chat template text after "
                f"character {start_search}; the template rewrites assistant contents"
            )
        spans.append((pos, pos + length))
        cursor = pos + length
    return spans


def _encode(tokenizer, text: str, max_length: int | None) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of ``text`` (no extra special tokens: the template has them).

    For long texts only a generous character prefix is tokenized, and tokens near the cut are
    dropped, so the first ``max_length`` tokens are exactly those of the full text.
    """
    margin = 512
    if max_length is not None and len(text) > max_length * 12 + 2 * margin:
        cut = max_length * 12 + 2 * margin
        enc = tokenizer(text[:cut], add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
        keep = bisect.bisect_right([o[1] for o in offsets], cut - margin)
        if keep >= max_length:
            return ids[:keep], offsets[:keep]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def render_with_loss_mask(
    messages: Sequence[dict],
    tokenizer,
    max_length: int | None,
    *,
    chat_template_kwargs: dict | None = None,
) -> tuple[list[int], list[int]]:
    """Tokenize a conversation with ``tokenizer``'s chat template and build its assistant loss mask.

    Args:
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
        tokenizer: a fast Hugging Face tokenizer with a ``chat_template``.
        max_length: keep only the first ``max_length`` tokens (None: keep all).
        chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).

    Returns:
        ``(input_ids, loss_mask)``, same length; loss_mask is 1 exactly on the tokens of assistant
        contents and on the end-of-turn token that closes each of them (see the module docstring).
    """
    _validate(messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat_template")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("render_with_loss_mask needs a fast tokenizer (character offsets)")
    kwargs = chat_template_kwargs or {}
    text = _render(tokenizer, messages, False, kwargs)
    ids, offsets = _encode(tokenizer, text, max_length)
    if max_length is not None:
        ids, offsets = ids[:max_length], offsets[:max_length]
    if not ids:
        return [], []

    stop_at = offsets[-1][1]
    spans = assistant_char_spans(messages, tokenizer, text, kwargs, stop_at_char=stop_at)
    special = special_token_ids(tokenizer)
    starts = [o[0] for o in offsets]
    mask = [0] * len(ids)
    for span_start, span_end in spans:
        # Tokens overlapping [span_start, span_end); scan from the last token starting before it.
        t = max(bisect.bisect_right(starts, span_start) - 1, 0)
        last = None
        while t < len(ids) and offsets[t][0] < span_end:
            a, b = offsets[t]
            if b > span_start and a < span_end and b > a:
                mask[t] = 1
                last = t
            t += 1
        if last is None:
            continue
        # End-of-turn token: the first special token after the content, past whitespace-only tokens.
        j = last + 1
        while j < len(ids):
            if ids[j] in special:
                mask[j] = 1
                break
            a, b = offsets[j]
            if text[a:b].strip():
                break
            j += 1
    return ids, mask

"""Assistant loss masks from chat templates, with the tiny target's tokenizer (and other template styles)."""

import copy

import pytest
from transformers import AutoTokenizer

from dspark.data.chat import ChatTemplateError, render_with_loss_mask
from dspark.targets.tiny_v4 import TINY_V4_DIR


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_V4_DIR, local_files_only=True)


def _runs(mask):
    """[start, end) of each maximal run of ones."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _decoded_runs(tok, ids, mask):
    return [tok.decode(ids[a:b]) for a, b in _runs(mask)]


def test_single_turn(tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 equals 4."}]
    ids, mask = render_with_loss_mask(msgs, tok, 512)
    assert ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert _decoded_runs(tok, ids, mask) == ["2+2 equals 4.<|im_end|>"]
    # everything before the run is template/user text, the trailing "\n" is not trained
    prefix = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids[: mask.index(1)]) == prefix
    assert mask[-1] == 0 and tok.decode(ids[-1:]) == "\n"


def test_multi_turn_with_system(tok):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say yes."},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "yes"},  # same text as the assistant turns: must not be masked
        {"role": "assistant", "content": "  Indented\n\ncode:\n    x = 1\n"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "yes"},
    ]
    ids, mask = render_with_loss_mask(msgs, tok, 1024)
    runs = _decoded_runs(tok, ids, mask)
    assert runs[0] == runs[2] == "yes<|im_end|>"
    # Byte-level BPE merges the header's "\n" with the content's leading spaces into one token:
    # that straddling token carries content, so it is trained (documented in dspark.data.chat).
    assert runs[1] == "\n  Indented\n\ncode:\n    x = 1\n<|im_end|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # one trained end token per assistant turn; user/system end tokens are not trained
    assert sum(1 for i, m in zip(ids, mask) if i == im_end and m) == 3
    assert sum(1 for i in ids if i == im_end) == 7


def test_no_assistant_gives_zero_mask(tok):
    ids, mask = render_with_loss_mask([{"role": "user", "content": "hello"}], tok, 64)
    assert ids and not any(mask)


def test_truncation(tok):
    msgs = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a time " * 40},
        {"role": "user", "content": "More."},
        {"role": "assistant", "content": "The end."},
    ]
    full_ids, full_mask = render_with_loss_mask(msgs, tok, None)
    for n in (1, 5, 20, 60, len(full_ids) - 1):
        ids, mask = render_with_loss_mask(msgs, tok, n)
        assert len(ids) == len(mask) == n
        assert ids == full_ids[:n] and mask == full_mask[:n]
    assert render_with_loss_mask(msgs, tok, 10_000) == (full_ids, full_mask)


def test_long_conversation_prefix_tokenization_matches(tok):
    # long texts are tokenized on a character prefix: the kept tokens must equal the full encoding
    msgs = [{"role": "user", "content": "question " * 3000}, {"role": "assistant", "content": "answer " * 3000}]
    full_ids, full_mask = render_with_loss_mask(msgs, tok, None)
    ids, mask = render_with_loss_mask(msgs, tok, 40)
    assert ids == full_ids[:40] and mask == full_mask[:40] and not any(mask)
    ids, mask = render_with_loss_mask(msgs, tok, len(full_ids) - 3)
    assert ids == full_ids[:-3] and mask == full_mask[:-3]


def _with_template(tok, template):
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


def test_trimming_template_with_eos_end_token(tok):
    # Llama-3-like layout: header tokens, trimmed content, a different end-of-turn special token
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}<|pad|>\n\n{{ m['content'] | trim }}<|endoftext|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant<|pad|>\n\n{% endif %}"
    )
    t = _with_template(tok, template)
    msgs = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "\n hello there \n"}]
    ids, mask = render_with_loss_mask(msgs, t, 256)
    assert _decoded_runs(t, ids, mask) == ["hello there<|endoftext|>"]


def test_template_that_renders_history_differently(tok):
    # Qwen3-like: the generation prompt opens an empty think block that history turns do not carry
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
    )
    t = _with_template(tok, template)
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "second answer"},
    ]
    ids, mask = render_with_loss_mask(msgs, t, 256)
    assert _decoded_runs(t, ids, mask) == ["first answer<|im_end|>", "second answer<|im_end|>"]


def test_template_that_rewrites_content_is_refused(tok):
    t = _with_template(tok, "{% for m in messages %}<|im_start|>{{ m['content'] | upper }}<|im_end|>{% endfor %}")
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "lower case answer"}]
    with pytest.raises(ChatTemplateError, match="assistant message 1"):
        render_with_loss_mask(msgs, t, 64)


def test_bad_messages_are_refused(tok):
    with pytest.raises(ValueError, match="messages is empty"):
        render_with_loss_mask([], tok, 8)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        render_with_loss_mask([{"role": "human", "content": "x"}], tok, 8)

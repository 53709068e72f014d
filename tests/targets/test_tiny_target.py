"""The shipped tiny DeepSeek-V4 target: loads offline, is peaked on held-out text, exposes [B,S,hc,H] layers."""

import math

import pytest
import torch

from dspark.data.sharegpt import default_sharegpt_path, is_heldout, iter_sharegpt
from dspark.targets.tiny_v4 import TINY_V4_DIR, check_tiny_v4_assets, load_tiny_v4

# A hand-written chat (never part of ShareGPT), used when the ShareGPT package is not installed.
FALLBACK_CHAT = [
    {"role": "user", "content": "Can you explain what a hash table is and when I should use one?"},
    {"role": "assistant", "content": (
        "A hash table is a data structure that stores key-value pairs. It uses a hash function to "
        "compute an index into an array of buckets, from which the desired value can be found. "
        "You should use a hash table when you need fast lookups, insertions and deletions, for "
        "example to count how many times each word appears in a document, or to cache the results "
        "of expensive function calls. The main drawbacks are that the keys are not stored in order "
        "and that a poor hash function can lead to many collisions, which slows everything down.")},
]


@pytest.fixture(scope="module")
def target():
    # One intra-op thread: this model's ops are tiny, and with other processes on the same cores
    # a second OpenMP thread makes them tens of times slower instead of faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield load_tiny_v4()
    torch.set_num_threads(threads)


def _heldout_batch(tokenizer, n=4, seq_len=256):
    """[n, seq_len] token windows (conversation starts) from held-out ShareGPT records, else the fallback."""
    chats = []
    try:
        for r in iter_sharegpt(default_sharegpt_path(), english_only=True):
            if is_heldout(r["id"]):
                chats.append(r["messages"])
            if len(chats) == 20:
                break
    except FileNotFoundError:
        pass
    rows = []
    for msgs in chats or [FALLBACK_CHAT]:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
        if len(ids) >= seq_len:
            rows.append(ids[:seq_len])
        if len(rows) == n:
            break
    if not rows:
        ids = tokenizer.apply_chat_template(FALLBACK_CHAT, tokenize=True, return_dict=True)["input_ids"]
        rows = [ids]
    return torch.tensor(rows)


def test_loads_offline_in_eval_mode(target):
    model, tok = target
    assert type(model).__name__ == "DeepseekV4ForCausalLM" and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config.vocab_size == len(tok)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    assert tok.mask_token == "<|mask|>" and tok.mask_token_id == model.config.dspark_noise_token_id
    # ordinary text never produces a special token (the mask token in particular)
    text_ids = tok("Hello world! Mask <mask> [MASK] |mask| done.\n\tcode()", add_special_tokens=False)["input_ids"]
    assert not set(text_ids) & set(tok.all_special_ids)


def test_heldout_distribution_is_peaked(target):
    model, tok = target
    ids = _heldout_batch(tok, n=8)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1).mean().item()
    max_prob = logp.max(-1).values.exp().mean().item()
    nll = -logp.gather(-1, ids[:, 1:, None]).mean().item()
    ln_v = math.log(model.config.vocab_size)
    # Measured on the shipped model with these 8 held-out windows: entropy 4.32 nats (0.567 ln V),
    # max-prob 0.200, loss 4.15 (ln V = 7.62, 1/V = 0.0005; an untrained model gives entropy
    # ~7.6, max-prob ~0.001). Margins: ~0.4 nats and ~40% of the max-prob.
    assert entropy < 0.62 * ln_v, (entropy, ln_v)
    assert nll < 0.62 * ln_v, (nll, ln_v)
    assert max_prob > 250 / model.config.vocab_size, max_prob


def test_layer_outputs_are_hc_streams(target):
    model, tok = target
    cfg = model.config
    captured = {}
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]))
    finally:
        for h in hooks:
            h.remove()
    assert sorted(captured) == list(range(cfg.num_hidden_layers))
    for out in captured.values():
        out = out[0] if isinstance(out, tuple) else out
        assert out.shape == (2, 5, cfg.hc_mult, cfg.hidden_size)


def test_greedy_generation_is_text_like(target):
    model, tok = target
    msgs = [{"role": "user", "content": "How do I make a good cup of coffee?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    words = text.split()
    assert len(words) >= 5, text
    letters = sum(c.isascii() and c.isalpha() for c in text)
    assert letters / max(1, len(text.replace(" ", ""))) > 0.6, text
    assert len(set(words)) >= 4, text  # not one token repeated


def test_missing_assets_error_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="scripts/build_tiny_target.py"):
        load_tiny_v4(tmp_path)
    assert check_tiny_v4_assets(TINY_V4_DIR) == TINY_V4_DIR

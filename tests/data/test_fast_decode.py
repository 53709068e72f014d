"""dspark.data.fast_decode (regeneration's native engine) against transformers on tiny random models (float32):
teacher-forced logits = the model's own full forward for rows at different lengths side by side; greedy output =
`generate`'s with slots refilled mid-run; end tokens and length limits; a request's sampled answer does not depend
on its batch mates; the nucleus sampler's distribution = the naive top-p distribution; the decode attention kernel
= its torch reference."""
from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dspark.data import fast_decode
from dspark.data.fast_decode import ContinuousDecoder, DecodeRequest, UnsupportedModel, nucleus_sample
from dspark.ops.decode_attention import decode_attention, decode_attention_reference

SIZES = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def _model(kind: str):
    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2}[kind])
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SIZES, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                     "original_max_position_embeddings": 32}))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SIZES))
        for layer in model.model.layers:  # attention biases far from zero, so a dropped bias shows
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
            torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=0.5)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16))
        for layer in model.model.layers:  # q/k norm weights far from one
            torch.nn.init.uniform_(layer.self_attn.q_norm.weight, 0.2, 2.0)
            torch.nn.init.uniform_(layer.self_attn.k_norm.weight, 0.2, 2.0)
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request):
    return _model(request.param)


PROMPTS = [[5, 17, 33, 2, 9], [44, 3], [7, 8, 9, 10, 11, 12, 13], [101], [60, 61, 62]]


def test_logits_equal_the_models_full_forward_for_rows_at_different_lengths(model):
    seqs = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [27, 18, 28, 18, 28, 45, 90, 45]]
    prompt_len = [4, 2]
    dec = ContinuousDecoder(model, slots=3, max_len=32, stop_ids=[0])
    with torch.no_grad():
        full = [model(torch.tensor([s])).logits[0] for s in seqs]  # [len, V]
    got = {b: [dec.prefill(b, seqs[b][:prompt_len[b]])] for b in range(2)}
    pos = list(prompt_len)
    for _ in range(5):  # both rows advance together, each at its own position; slot 2 idle
        tokens = torch.tensor([seqs[0][pos[0]], seqs[1][pos[1]]])
        logits = dec.step(tokens[:2], torch.tensor([pos[0], pos[1]]), torch.tensor([0, 1]))
        for b in range(2):
            got[b].append(logits[b])
            pos[b] += 1
    for b in range(2):
        want = full[b][prompt_len[b] - 1: prompt_len[b] + 5]
        torch.testing.assert_close(torch.stack(got[b]), want, atol=1e-4, rtol=1e-4)


def test_greedy_output_equals_generate_with_slots_refilled(model):
    want = []
    for p in PROMPTS:
        out = model.generate(torch.tensor([p]), max_new_tokens=9, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist()
        want.append(out)
    stop = want[0][3]  # an end token request 0 meets at its 4th token
    dec = ContinuousDecoder(model, slots=2, max_len=40, stop_ids=[stop])  # 5 requests through 2 slots
    got = dec.run([DecodeRequest(p, 9) for p in PROMPTS])
    for w, g in zip(want, got):
        cut = w.index(stop) if stop in w else None
        if cut is None:
            assert (g.token_ids, g.finish_reason) == (w, "length")
        else:
            assert (g.token_ids, g.finish_reason) == (w[:cut], "stop")
    assert got[0].finish_reason == "stop" and len(got[0].token_ids) == 3


def test_a_conversations_next_turn_reuses_its_slots_prefix_with_the_logits_of_a_fresh_prefill(model):
    dec = ContinuousDecoder(model, slots=2, max_len=48, stop_ids=[0])
    first = [5, 17, 33, 2, 9]
    answer = dec.run([DecodeRequest(first, 6)])[0].token_ids
    turn2 = first + answer[:-1] + [44, 45, 46]  # the earlier turn's tokens, then new ones (the last answer token
    slot = max(range(2), key=lambda i: len(dec.cached[i]))  # was never fed: its K/V is not in the cache)
    assert dec.cached[slot] == first + answer[:-1]
    reuse = len(first) + len(answer) - 1
    got = dec.prefill(slot, turn2, start=reuse)
    fresh = ContinuousDecoder(model, slots=1, max_len=48, stop_ids=[0]).prefill(0, turn2)
    torch.testing.assert_close(got, fresh, atol=1e-4, rtol=1e-4)
    # through run(): the next turn's answer = the same request run on a fresh decoder
    again = dec.run([DecodeRequest(turn2, 6)])[0]
    alone = ContinuousDecoder(model, slots=1, max_len=48, stop_ids=[0]).run([DecodeRequest(turn2, 6)])[0]
    assert again == alone


def test_the_cache_end_stops_a_request_and_a_prompt_too_long_is_refused_alone():
    model = _model("llama")
    dec = ContinuousDecoder(model, slots=2, max_len=8, stop_ids=[0])
    out = dec.run([DecodeRequest([1, 2, 3, 4, 5], 50), DecodeRequest(list(range(1, 9)), 5), DecodeRequest([7], 2)])
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 3  # 5 prompt + 3 new = max_len
    assert isinstance(out[1], ValueError) and "does not fit max_len 8" in str(out[1])
    assert len(out[2].token_ids) == 2


def test_a_sampled_answer_does_not_depend_on_its_batch_mates():
    model = _model("qwen2")
    alone = ContinuousDecoder(model, slots=1, max_len=40, stop_ids=[0], temperature=0.9, top_p=0.9)
    crowd = ContinuousDecoder(model, slots=3, max_len=40, stop_ids=[0], temperature=0.9, top_p=0.9)
    requests = [DecodeRequest(p, 12, seed=100 + i) for i, p in enumerate(PROMPTS)]
    a = [alone.run([r])[0].token_ids for r in requests]
    b = [r.token_ids for r in crowd.run(requests)]
    assert a == b
    other_seed = crowd.run([DecodeRequest(PROMPTS[2], 12, seed=7)])[0].token_ids
    assert other_seed != b[2]  # the seed is what decides


def _naive_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper, written out: sort ascending, drop tokens whose cumulative mass <= 1 - p."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort()
    cum = probs[order].cumsum(0)
    drop = cum <= 1 - top_p
    drop[-1] = False
    kept = probs.clone()
    kept[order[drop]] = 0
    return kept / kept.sum()


@pytest.mark.parametrize("topk_fast", [256, 2])  # 2: the nucleus reaches past the top-k, the full sort runs
def test_nucleus_sampler_draws_the_top_p_distribution(monkeypatch, topk_fast):
    monkeypatch.setattr(fast_decode, "TOPK_FAST", topk_fast)
    torch.manual_seed(0)
    logits = torch.randn(3, 9) * 2
    n = 20000
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # a grid: inverse CDF gives exact frequencies
    for row, (t, p) in enumerate([(0.7, 0.8), (1.0, 0.95), (1.3, 0.5)]):
        draws = nucleus_sample(logits[row].expand(n, -1).clone(), t, p, uniforms)
        freq = torch.bincount(draws, minlength=9).double() / n
        torch.testing.assert_close(freq, _naive_top_p(logits[row], t, p), atol=2.0 / n + 1e-6, rtol=0)


def test_greedy_sampling_is_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.99]])
    assert nucleus_sample(logits, 0.0, 1.0, torch.zeros(2)).tolist() == [1, 0]


# head size 32: the generic loop; 64 and 128: the vector paths (AVX-512 float32 / AVX512-BF16 dot products where the
# CPU has them). bf16: inputs rounded to bf16 (and, on the dot-product path, probabilities too), float32 sums.
@pytest.mark.parametrize("hd", [32, 64, 128])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_kernel_equals_its_reference(dtype, atol, hd):
    torch.manual_seed(0)
    n, kvh, g, max_len = 7, 2, 3, 41
    q = torch.randn(n, kvh, g, hd).to(dtype)
    k = torch.randn(n, kvh, max_len, hd).to(dtype)
    v = torch.randn(n, kvh, max_len, hd).to(dtype)
    # lengths 1, 8, 40, 13, 4, 16, 41: one and several blocks of 16 positions, odd and even, a row's whole cache
    pos = torch.tensor([0, 7, 39, 12, 3, 15, 40])
    rows = torch.tensor([4, 0, 2, 1, 3, 5, 6])  # query row b reads cache row rows[b]; the last one ends the cache
    got = decode_attention(q, k, v, pos, rows, 0.3)
    want = decode_attention_reference(q.float(), k.float(), v.float(), pos, rows, 0.3)
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)
    naive = []  # one row at a time, written out
    for b in range(n):
        keys, values = k[rows[b], :, : pos[b] + 1].float(), v[rows[b], :, : pos[b] + 1].float()  # [kvh, len, hd]
        weights = torch.softmax(q[b].float() @ keys.transpose(-1, -2) * 0.3, dim=-1)  # [kvh, g, len]
        naive.append(weights @ values)
    torch.testing.assert_close(got.float(), torch.stack(naive), atol=atol, rtol=0)
    k2 = k.clone()
    k2[0, :, 8:] = 100  # past the length of query row 1 (cache row 0): must not matter
    torch.testing.assert_close(decode_attention(q, k2, v, pos, rows, 0.3), got, atol=0, rtol=0)


def test_models_the_engine_does_not_reproduce_are_refused():
    cfg = dict(SIZES, hidden_act="gelu")
    with pytest.raises(UnsupportedModel, match="hidden_act 'gelu'"):
        ContinuousDecoder(LlamaForCausalLM(LlamaConfig(**cfg)), slots=1, max_len=16, stop_ids=[0])
    windowed = MistralForCausalLM(MistralConfig(**SIZES, sliding_window=8))
    with pytest.raises(UnsupportedModel, match="sliding_window 8 < max_len 16"):
        ContinuousDecoder(windowed, slots=1, max_len=16, stop_ids=[0])
    ContinuousDecoder(windowed, slots=1, max_len=8, stop_ids=[0])  # a window the cache never passes is fine

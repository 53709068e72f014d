"""Batched decoding of a dense Llama-family causal LM at the CPU's GEMM limit (regeneration's default engine).

``transformers``' ``generate`` spends most of a small model's decode step outside its GEMMs (per-step Python over
cache objects, masks rebuilt, logits processors) and finishes a batch only when its longest row does. This engine
does the same math with nothing else around it:

* the weights of each layer fused into one QKV and one gate/up matrix ([out, in], the model's dtype);
* a static KV cache per layer, ``[slots, kv_heads, max_len, head_dim]``, allocated once; a request owns a slot
  from its prefill to its last token, and a finished request's slot is refilled by the next prompt at once
  (continuous batching), so every decode step runs ``slots`` rows;
* a decode step = one [slots, H] pass over the layers, attention over the slot's own cache prefix
  (positions ``<= pos``), RoPE from the model's own rotary module (every rope_type it knows);
* sampling: temperature, then nucleus (top-p) exactly as transformers' TopPLogitsWarper keeps tokens (a token
  stays when the mass ranked strictly above it is < top_p), drawn by inverse CDF with one uniform per token from
  the request's own ``random.Random(seed)``: a request's answer does not depend on its batch mates.

Supported: the ``model_type`` values in :data:`SUPPORTED` (Llama, Qwen2 with QKV bias, Qwen3 with q/k norm,
Mistral without a window shorter than the cache); :func:`check_supported` says why another model is not, and
the caller falls back to transformers.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dspark.ops.decode_attention import decode_attention

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
TOPK_FAST = 256  # nucleus searched among the top-256 first; rows whose top-256 mass is < top_p sort in full


class UnsupportedModel(ValueError):
    """The model is not one this engine computes exactly (the message says why)."""


def check_supported(model, max_len: int) -> None:
    """Raise UnsupportedModel unless ``model`` is a dense Llama-shaped HF causal LM this engine reproduces."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        raise UnsupportedModel(f"model_type {kind!r} is not one of {', '.join(SUPPORTED)}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act {act!r} (only silu)")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < max_len:
        raise UnsupportedModel(f"sliding_window {window} < max_len {max_len}")
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        raise UnsupportedModel("mixture-of-experts MLP")


@dataclass(frozen=True)
class DecodeRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int = 0


@dataclass(frozen=True)
class DecodeResult:
    token_ids: list[int]  # generated tokens, the end token excluded
    finish_reason: str  # "stop" (an end token) | "length" (max_new_tokens or the cache's end)


@dataclass
class _Layer:
    in_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(nh + 2 kvh) * hd, H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [hd] (Qwen3)
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [H, nh * hd]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


def _cat_bias(*linears) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
                      for b, lin in zip(biases, linears)]).detach()


def _layer_of(block) -> _Layer:
    att, mlp = block.self_attn, block.mlp
    return _Layer(
        in_norm=block.input_layernorm.weight.detach(),
        qkv=torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).detach().contiguous(),
        qkv_bias=_cat_bias(att.q_proj, att.k_proj, att.v_proj),
        q_norm=att.q_norm.weight.detach() if hasattr(att, "q_norm") else None,
        k_norm=att.k_norm.weight.detach() if hasattr(att, "k_norm") else None,
        o=att.o_proj.weight.detach(), o_bias=None if att.o_proj.bias is None else att.o_proj.bias.detach(),
        post_norm=block.post_attention_layernorm.weight.detach(),
        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().contiguous(),
        down=mlp.down_proj.weight.detach(),
    )


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: statistics in float32, scaled in the input dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., hd] rotated by cos/sin broadcast to it (rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def nucleus_sample(logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (float32): greedy when temperature == 0, else temperature then
    top-p (a token is kept when the mass ranked strictly above it is < top_p), drawn by inverse CDF with
    ``uniforms`` [B] in [0, 1). Returns [B] int64."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    k = min(TOPK_FAST, probs.shape[-1])
    top, idx = probs.topk(k, dim=-1)  # [B, k] descending
    short = top.sum(-1) < top_p  # nucleus may reach beyond the top-k
    if bool(short.any()):
        full, full_idx = probs[short].sort(dim=-1, descending=True)
        out = torch.empty(probs.shape[0], dtype=torch.long)
        out[~short] = _draw(top[~short], idx[~short], top_p, uniforms[~short])
        out[short] = _draw(full, full_idx, top_p, uniforms[short])
        return out
    return _draw(top, idx, top_p, uniforms)


def _draw(sorted_probs: torch.Tensor, ids: torch.Tensor, top_p: float, uniforms: torch.Tensor) -> torch.Tensor:
    inclusive = sorted_probs.cumsum(-1)
    kept = torch.where(inclusive - sorted_probs < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    kept_cum = kept.cumsum(-1)  # [B, k]
    target = uniforms.to(kept_cum.dtype).unsqueeze(-1) * kept_cum[:, -1:]
    pick = (kept_cum <= target).sum(-1).clamp(max=sorted_probs.shape[-1] - 1)
    pick = torch.minimum(pick, (kept > 0).sum(-1) - 1)  # never past the last kept token
    return ids.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


@dataclass
class _Slot:
    index: int  # request index in the call
    pos: int  # position of the token fed next
    new: list[int] = field(default_factory=list)
    max_new: int = 0
    rng: random.Random | None = None


class ContinuousDecoder:
    """Continuous-batching decoder over a static KV cache (see the module docstring).

    ``model``: a transformers causal LM of a SUPPORTED type, already in the dtype to run (bf16 on CPUs with
    AMX / AVX512-BF16); ``slots``: rows per decode step; ``max_len``: positions per slot (prompt + answer).
    """

    def __init__(self, model, *, slots: int, max_len: int, stop_ids, temperature: float = 0.0, top_p: float = 1.0):
        if slots < 1 or max_len < 2:
            raise ValueError(f"slots must be >= 1 and max_len >= 2, got {slots}, {max_len}")
        check_supported(model, max_len)
        cfg = model.config
        inner = model.model
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.eps = float(cfg.rms_norm_eps)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.inter = cfg.intermediate_size
        self.layers = [_layer_of(block) for block in inner.layers]
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        self.slots, self.max_len = slots, max_len
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.temperature, self.top_p = float(temperature), float(top_p)
        with torch.no_grad():
            probe = torch.zeros(1, 1, cfg.hidden_size, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, torch.arange(max_len, device=self.device)[None])
        self.cos, self.sin = cos[0], sin[0]  # [max_len, hd]
        shape = (slots, self.n_kv, max_len, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.cached: list[list[int]] = [[] for _ in range(slots)]  # the tokens whose K/V each slot holds, in order

    # ---- the forward passes -------------------------------------------------------------------------------

    def _split_qkv(self, layer: _Layer, h: torch.Tensor, cos, sin):
        """h [N, H] -> q [N, nh, hd], k / v [N, kvh, hd] with q/k norm and RoPE applied."""
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        q = qkv[:, :nq].view(-1, self.n_heads, self.head_dim)
        k = qkv[:, nq:nq + nk].view(-1, self.n_kv, self.head_dim)
        v = qkv[:, nq + nk:].view(-1, self.n_kv, self.head_dim)
        if layer.q_norm is not None:
            q, k = _rms(q, layer.q_norm, self.eps), _rms(k, layer.k_norm, self.eps)
        return _rope(q, cos[:, None], sin[:, None]), _rope(k, cos[:, None], sin[:, None]), v

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        gu = F.linear(_rms(x, layer.post_norm, self.eps), layer.gate_up)
        return x + F.linear(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], layer.down)

    @torch.inference_mode()
    def prefill(self, slot: int, prompt_ids: list[int], start: int = 0) -> torch.Tensor:
        """Run ``prompt_ids[start:]`` into ``slot``'s cache at positions start..S-1 (positions < start already
        hold this prompt's prefix); the last position's logits [V] (float32)."""
        s = len(prompt_ids)
        if not 0 <= start < s:
            raise ValueError(f"start {start} outside the prompt's {s} tokens")
        new = s - start
        self.cached[slot] = list(prompt_ids[:start])  # what stays valid should this pass stop half-way
        ids = torch.tensor(prompt_ids[start:], dtype=torch.long, device=self.device)
        x = self.embed[ids]  # [new, H]
        cos, sin = self.cos[start:s], self.sin[start:s]
        # query i (position start + i) sees keys 0..start + i
        mask = None if start == 0 else (torch.arange(s, device=self.device)[None, :]
                                        <= torch.arange(start, s, device=self.device)[:, None])
        for li, layer in enumerate(self.layers):
            q, k, v = self._split_qkv(layer, _rms(x, layer.in_norm, self.eps), cos, sin)
            self.k_cache[li][slot, :, start:s] = k.transpose(0, 1)  # [kvh, new, hd]
            self.v_cache[li][slot, :, start:s] = v.transpose(0, 1)
            keys, values = self.k_cache[li][slot, :, :s], self.v_cache[li][slot, :, :s]
            att = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                                 is_causal=mask is None, scale=self.scale,
                                                 enable_gqa=self.n_kv != self.n_heads)
            x = x + F.linear(att[0].transpose(0, 1).reshape(new, -1), layer.o, layer.o_bias)
            x = self._mlp(layer, x)
        self.cached[slot] = list(prompt_ids)
        return F.linear(_rms(x[-1:], self.final_norm, self.eps), self.lm_head)[0].float()

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` [n] at positions ``pos`` [n] into the slots ``rows`` [n] (slot rows[b] holds positions
        0..pos[b]-1 already); the logits [n, V] (float32)."""
        n = tokens.shape[0]
        where = (rows[:, None], torch.arange(self.n_kv, device=self.device)[None, :], pos[:, None])
        x = self.embed[tokens]  # [n, H]
        cos, sin = self.cos[pos], self.sin[pos]
        group = self.n_heads // self.n_kv
        for li, layer in enumerate(self.layers):
            q, k, v = self._split_qkv(layer, _rms(x, layer.in_norm, self.eps), cos, sin)
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc.index_put_(where, k)  # k / v [n, kvh, hd] at (slot, head, pos)
            vc.index_put_(where, v)
            att = decode_attention(q.view(n, self.n_kv, group, self.head_dim), kc, vc, pos, rows, self.scale)
            x = x + F.linear(att.reshape(n, -1), layer.o, layer.o_bias)
            x = self._mlp(layer, x)
        return F.linear(_rms(x, self.final_norm, self.eps), self.lm_head).float()

    # ---- continuous batching ------------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rngs: list[random.Random | None]) -> list[int]:
        uniforms = torch.tensor([r.random() if r is not None else 0.0 for r in rngs], dtype=torch.float64)
        return nucleus_sample(logits, self.temperature, self.top_p, uniforms).tolist()

    def _admit(self, slot: int, index: int, request: DecodeRequest, slots, results) -> int | None:
        """Prefill ``request`` into ``slot``; its first token, or None when it finished (or was refused)."""
        n = len(request.prompt_ids)
        if n == 0 or n >= self.max_len:
            results.append((index, ValueError(f"prompt of {n} tokens does not fit max_len {self.max_len} "
                                              "(prompt + at least one answer token)")))
            return None
        rng = random.Random(request.seed) if self.temperature > 0 else None
        state = _Slot(index, n, max_new=min(request.max_new_tokens, self.max_len - n), rng=rng)
        reuse = min(_common_prefix(self.cached[slot], request.prompt_ids), n - 1)  # a conversation's earlier turns
        token = self._sample(self.prefill(slot, request.prompt_ids, reuse)[None], [rng])[0]
        return self._accept(slot, state, token, slots, results)

    def _accept(self, slot: int, state: _Slot, token: int, slots, results) -> int | None:
        """Record ``token`` for the slot's request; the token to feed next, or None when the request ended."""
        if token in self.stop_ids:
            results.append((state.index, DecodeResult(state.new, "stop")))
        else:
            state.new.append(token)
            if len(state.new) < state.max_new:
                slots[slot] = state
                return token
            results.append((state.index, DecodeResult(state.new, "length")))
        slots[slot] = None
        return None

    def run(self, requests: list[DecodeRequest]) -> list[DecodeResult | Exception]:
        """Every request decoded; a request that cannot run (too long) gets its exception in its place."""
        queue = deque(enumerate(requests))
        results: list = [None] * len(requests)
        for key, result in self.serve(lambda: queue.popleft() if queue else None):
            results[key] = result
        return results

    def serve(self, next_request) -> Iterator[tuple[object, DecodeResult | Exception]]:
        """Decode requests as ``next_request()`` hands them out (``(key, DecodeRequest)``, or None when it has
        nothing now); yields ``(key, result)`` as each finishes. A free slot asks for the next request at once,
        so the caller may hand out new work (e.g. a conversation's next turn) between results. Ends when no
        request is in flight and ``next_request()`` returns None."""
        keys: dict[int, object] = {}
        done: list = []  # (index, result) finished since the last yield
        slots: list[_Slot | None] = [None] * self.slots
        feed: list[int] = [0] * self.slots  # the token each busy slot feeds next
        counter = 0
        carry = None  # an item taken while checking for idleness
        while True:
            free = [i for i, s in enumerate(slots) if s is None]
            while free:
                item, carry = (carry, None) if carry is not None else (next_request(), None)
                if item is None:
                    break
                slot = max(free, key=lambda i: _common_prefix(self.cached[i], item[1].prompt_ids))
                keys[counter] = item[0]
                token = self._admit(slot, counter, item[1], slots, done)
                counter += 1
                if token is not None:
                    feed[slot] = token
                    free.remove(slot)
            while done:
                index, result = done.pop(0)
                yield keys.pop(index), result
            live = [i for i, s in enumerate(slots) if s is not None]
            if not live:
                carry = next_request()  # results just yielded may have made new work
                if carry is None:
                    return
                continue
            fed = [feed[i] for i in live]
            logits = self.step(torch.tensor(fed), torch.tensor([slots[i].pos for i in live]), torch.tensor(live))
            tokens = self._sample(logits, [slots[i].rng for i in live])
            for i, token, t in zip(live, tokens, fed):
                self.cached[i].append(t)
                slots[i].pos += 1
                nxt = self._accept(i, slots[i], token, slots, done)
                if nxt is not None:
                    feed[i] = nxt
            while done:  # before refilling: a conversation's next turn can take its own slot (and prefix) back
                index, result = done.pop(0)
                yield keys.pop(index), result


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo

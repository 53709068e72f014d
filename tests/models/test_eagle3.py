"""The EAGLE-3 draft (dspark/models/eagle3.py): its layer against a transcription of vLLM 0.33.0's Eagle3 Llama forward
(llama_eagle3.py:110-151, :261-288, :373-395; /work/notes/eagle3_facts.md §1), the served chain (chain_propose, with
and without the draft-side cache) and the training-time-test chain (teacher_forced_chain) against explicit per-position
chains, the reduced vocabulary (d2t / t2d) and its loss, and the config refusals of registry.build_config."""
from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, MixtralConfig

from conftest import assert_same_argmax, tiny_v4_config
from dspark.errors import ConfigError
from dspark.models.eagle3 import Eagle3Config, Eagle3Draft
from dspark.models.mtp_common import ChainCache, chain_propose, teacher_forced_chain
from dspark.models.registry import build_config
from dspark.targets.hf_target import TargetFeatures
from dspark.training.mtp_module import MTPDraftModule
from dspark.training.mtp_objectives import MTPLossWeights, step_weights
from test_mtp_chain import _reference_chain

H, V, NH, NKV, HD, INTER = 32, 97, 2, 1, 16, 64
TAPS = [0, 1, 2]
THETA = 500.0  # not the default 10000: a reference that ignored rope_theta would differ


def assert_fp32_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """A float32 result against a reference (float64, or float32 computed through other shapes): max |error| <= 1e-5
    of the reference's scale (max |ref|, at least 1). float32 rounds each op to 2^-24 ~ 6e-8 relative; over the <= 64
    long dot products here that accumulates to ~1e-6 of the magnitudes involved (measured: <= 7e-7 of scale), so 1e-5
    leaves a 10x margin, while any real mistake (a wrong norm, residual, RoPE pairing, visible key, row) moves
    values by >= 1e-2 of scale."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    got, ref = got.double(), ref.double()
    finite = torch.isfinite(ref)  # a reduced vocabulary's -inf columns: the same, exactly
    assert torch.equal(got[~finite], ref[~finite])
    got, ref = got[finite], ref[finite]
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= 1e-5 * max(scale, 1.0), f"max error {err:.3g} at scale {scale:.3g}"


def make_cfg(**kw) -> Eagle3Config:
    keys = dict(hidden_size=H, vocab_size=V, num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD,
                intermediate_size=INTER, target_layer_ids=list(TAPS),
                rope_parameters={"rope_type": "default", "rope_theta": THETA})
    keys.update(kw)
    return Eagle3Config(**keys)


def make_draft(seed: int = 0, **kw) -> Eagle3Draft:
    """A tiny draft with O(1)-effect random weights (the init's std 0.02 would make attention and MLP negligible next
    to the residual) and random norm weights, sharing a random target embedding / LM head."""
    draft = Eagle3Draft(make_cfg(**kw)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 1:  # RMSNorm weights: around 1, not all 1 (a norm applied to the wrong tensor shows)
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    draft.share_target_weights(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g))
    return draft


def feats_of(length: int, seed: int, batch: int = 1) -> TargetFeatures:
    g = torch.Generator().manual_seed(seed)
    return TargetFeatures(aux=torch.randn(batch, length, len(TAPS) * H, generator=g),
                          final=torch.randn(batch, length, H, generator=g))


def kept_ids(vd: int, seed: int = 3) -> torch.Tensor:
    """[vd] sorted random target ids (not a prefix: d2t is non-trivial)."""
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:vd].sort().values


def mapping(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a kept id set, by their definitions: target = d + d2t[d]; t2d marks the kept target ids."""
    d2t = kept - torch.arange(kept.numel())
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def reduced_draft(vd: int = 40, seed: int = 0, **kw) -> tuple[Eagle3Draft, torch.Tensor]:
    draft = make_draft(seed, draft_vocab_size=vd, **kw)
    kept = kept_ids(vd, seed + 3)
    draft.set_vocab_mapping(*mapping(kept))
    return draft, kept


# ---- 1. the layer against vLLM's Eagle3 Llama forward, transcribed ----------------------------------------------
def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama "rotate half": channel i pairs with i + d/2, angle pos * theta^(-2i/d). x [T, heads, d], pos [T]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    ang = pos.double()[:, None, None] * inv  # [T, 1, d/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1)


def ref_eagle3_forward(w: dict, embed: torch.Tensor, lm_head: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
                       pos: torch.Tensor, norm_before_residual: bool, nh: int = NH, nkv: int = NKV, eps: float = 1e-6):
    """One sequence (causal), float64. ids [T], hidden [T, H] (g), pos [T] -> (pre-norm r2 [T, H], logits [T, V]).

    vLLM llama_eagle3.py: e = input_layernorm(embed(x)) (:133); hn = hidden_norm(g), residual = hn if
    norm_before_residual else g (:110-122); a = self_attn(cat[e, hn]) (:135-144); r1 = a + residual (:146);
    r2 = mlp(post_attention_layernorm(r1)) + r1 (:146-149); logits = lm_head(norm(r2)) (:283, :373)."""
    p = "layers.0."
    T = ids.numel()
    e = ref_rms(embed[ids], w[p + "input_layernorm.weight"], eps)
    hn = ref_rms(hidden, w[p + "hidden_norm.weight"], eps)
    residual = hn if norm_before_residual else hidden
    x = torch.cat([e, hn], dim=-1)  # [T, 2H]: embeds first (:135)
    q = ref_rope((x @ w[p + "self_attn.q_proj.weight"].T).view(T, nh, HD), pos, THETA)
    k = ref_rope((x @ w[p + "self_attn.k_proj.weight"].T).view(T, nkv, HD), pos, THETA)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, nkv, HD)
    heads = []
    for h in range(nh):
        kv = h // (nh // nkv)  # GQA: query head h reads kv head h // group (vLLM's / HF's repeat_kv order)
        rows = []
        for i in range(T):
            scores = torch.stack([q[i, h] @ k[j, kv] / math.sqrt(HD) for j in range(i + 1)])  # keys 0..i
            prob = torch.exp(scores - scores.max())
            prob = prob / prob.sum()
            rows.append((prob[:, None] * v[: i + 1, kv]).sum(0))
        heads.append(torch.stack(rows))  # [T, HD]
    a = torch.cat(heads, dim=-1) @ w[p + "self_attn.o_proj.weight"].T  # [T, H]
    r1 = a + residual
    m = ref_rms(r1, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    r2 = (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T + r1
    return r2, ref_rms(r2, w["norm.weight"], eps) @ lm_head.T


@pytest.mark.parametrize("nh, nkv", [(NH, NKV), (4, 2)], ids=["2q-1kv", "4q-2kv"])  # 4q-2kv: the head grouping shows
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_layer_is_vllms_eagle3_llama_forward(norm_before_residual, nh, nkv):
    draft = make_draft(1, norm_before_residual=norm_before_residual, num_attention_heads=nh, num_key_value_heads=nkv)
    B, T = 2, 6
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, V, (B, T), generator=g)
    hidden = torch.randn(B, T, H, generator=g)
    pos = torch.arange(T).expand(B, T) + 3  # positions need not start at 0
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    with torch.no_grad():
        out, (k_rows, v_rows) = draft.step_rows(ids, hidden, pos, 0, None, causal)
        logits = draft.logits(out)
    assert out.shape == (B, T, H) and logits.shape == (B, T, V)
    assert k_rows.shape == v_rows.shape == (B, T, nkv, HD)  # this call's rows, rows first (the chain's cache)
    w = {k: t.double() for k, t in draft.state_dict().items()}
    embed, head = draft._embed_weight.double(), draft._lm_head_weight.double()
    for b in range(B):
        r2, ref_logits = ref_eagle3_forward(w, embed, head, ids[b], hidden[b].double(), pos[b], norm_before_residual,
                                            nh, nkv)
        assert_fp32_close(out[b].double(), r2)
        assert_fp32_close(logits[b].double(), ref_logits)
        # the flag matters on these inputs: the other branch of :110-122 is far from the draft's output
        other, _ = ref_eagle3_forward(w, embed, head, ids[b], hidden[b].double(), pos[b], not norm_before_residual,
                                      nh, nkv)
        assert (other - out[b].double()).abs().max() > 1e-2


def test_context_hidden_is_fc_of_the_aux_taps():
    draft = make_draft(2)
    feats = feats_of(5, seed=4)
    with torch.no_grad():
        got = draft.context_hidden(feats)
    assert_fp32_close(got.double(), feats.aux.double() @ draft.fc.weight.double().T)
    with pytest.raises(ValueError, match=r"aux hidden states \[B, S, 96\]"):
        draft.context_hidden(TargetFeatures(aux=torch.zeros(1, 5, 2 * H), final=torch.zeros(1, 5, H)))


# ---- 2. the served chain and training-time test --------------------------------------------------------------
class _CausalSteps:
    """The draft as `_reference_chain` (tests/models/test_mtp_chain.py) drives it: step(ids, hidden, positions, k)
    = one plain causal step_rows call over the whole explicit row sequence (no cache, every row recomputed)."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft

    def step(self, ids, hidden, positions, k):
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril().expand(ids.shape[0], t, t)
        return self.draft.step_rows(ids, hidden, positions, k, None, causal)[0]


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_eval_chain_with_cache_is_the_uncached_and_the_served_recursion(reduced):
    """Two rounds of one request: the ChainCache call equals cache=None, computes only the new step-0 rows in round 2,
    and both equal the explicit chain: step-0 rows (t_{p+1}, g_p, p), then (y_{k-1}, out_{k-1}, a-1+k)."""
    draft = reduced_draft(seed=5)[0] if reduced else make_draft(5)
    g_drafts, total = 3, 12
    tokens = torch.randint(0, V, (total,), generator=torch.Generator().manual_seed(6))
    feats = feats_of(total, seed=7)
    cache, new_rows = ChainCache(), []
    real = draft.step_rows

    def counting(ids, *args):
        new_rows.append(ids.shape[1])
        return real(ids, *args)

    for round_, a in enumerate((4, 7)):  # round 2: x0 at 4 and two accepted drafts kept
        new_rows.clear()
        draft.step_rows = counting
        cached = chain_propose(draft, feats.prefix(a), tokens[: a + 1], num_drafts=g_drafts, cache=cache)
        draft.step_rows = real
        fresh = chain_propose(draft, feats.prefix(a), tokens[: a + 1], num_drafts=g_drafts, cache=None)
        assert torch.equal(cached.tokens, fresh.tokens)
        assert_fp32_close(cached.logits, fresh.logits)
        assert new_rows == [a if round_ == 0 else a - 4] + [1] * (g_drafts - 1) and cache.n == a
        with torch.no_grad():
            ref = _reference_chain(_CausalSteps(draft), draft.context_hidden(feats), tokens, a,
                                   fresh.tokens[:-1].tolist())
        for k in range(g_drafts):
            logits = draft.logits(ref[k].unsqueeze(1))[0, 0]
            assert_fp32_close(fresh.logits[k], logits)
            assert_same_argmax(fresh.tokens[k : k + 1], logits.argmax().view(1), logits[None])  # (ties: rounding)
            if reduced:  # the chain feeds target ids back: every draft is a kept id
                assert bool(draft.t2d[fresh.tokens[k]])


def test_teacher_forced_chain_rows_are_per_position_eval_chains():
    """Row t of step k = the depth-k row of the chain an eval request anchored at row t (a = t + 1) computes when its
    drafts are the true tokens ids[t+2..]: every row of every step, both batch rows."""
    draft = make_draft(8, norm_before_residual=True)
    B, S, K = 2, 7, 3
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        hidden = draft.context_hidden(feats_of(S, seed=10, batch=B))  # [B, S, H]
        outs = teacher_forced_chain(draft, hidden, ids, K)
    assert [o.shape[1] for o in outs] == [S - 1, S - 2, S - 3]
    for b in range(B):
        for t in range(S - 1):
            depth = min(K, S - 1 - t)  # the rows this anchor has (later steps end at L_k = S - k - 1)
            with torch.no_grad():
                ref = _reference_chain(_CausalSteps(draft), hidden[b : b + 1], ids[b], t + 1,
                                       [int(ids[b, t + m + 1]) for m in range(1, depth)])
            for k in range(depth):
                assert_fp32_close(outs[k][b, t], ref[k][0])


# ---- 3. the reduced vocabulary -----------------------------------------------------------------------------
def test_reduced_vocabulary_logits_scatter_to_kept_target_ids():
    draft, kept = reduced_draft(vd=40, seed=12)
    d2t = draft.d2t.clone()
    assert torch.equal(torch.arange(40) + d2t, kept) and not torch.equal(d2t, torch.zeros(40, dtype=torch.long))
    h = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        small, full = draft.draft_logits(h), draft.logits(h)
    assert small.shape == (3, 5, 40) and full.shape == (3, 5, V)
    # the draft head is the target head's rows at the kept ids (vLLM's lm_head [Vd, H]); the naive reference in fp64
    naive = ref_rms(h.double(), draft.norm.weight.double(), 1e-6) @ draft._lm_head_weight.double()[kept].T
    assert_fp32_close(small.double(), naive)
    outside = torch.ones(V, dtype=torch.bool)
    outside[kept] = False
    assert bool(torch.isneginf(full[..., outside]).all()) and bool(torch.isfinite(full[..., kept]).all())
    assert torch.equal(full[..., kept], small)  # a scatter: the same numbers
    d = small.argmax(-1)  # draft ids
    assert torch.equal(full.argmax(-1), d + d2t[d]) and bool(draft.t2d[full.argmax(-1)].all())
    # target_to_draft inverts it: -1 outside
    to_draft = draft.target_to_draft()
    assert torch.equal(to_draft[kept], torch.arange(40)) and bool((to_draft[outside] == -1).all())


def test_set_vocab_mapping_refuses_inconsistent_maps():
    draft = make_draft(0, draft_vocab_size=40)
    kept = kept_ids(40)
    d2t, t2d = mapping(kept)
    before = (draft.d2t.clone(), draft.t2d.clone())
    swapped = d2t.clone()
    swapped[[3, 4]] = torch.stack([d2t[4] + 1, d2t[3] - 1])  # ids 3 and 4 exchange targets: not increasing
    high = d2t.clone()
    high[-1] = V - 39  # last draft id -> target V: out of range
    other = t2d.clone()
    other[int(kept[0])] = False
    other[int((~t2d).nonzero()[0])] = True  # marks one id d2t does not map to, misses one it does
    cases = [((swapped, t2d), "strictly increasing"), ((high, t2d), "strictly increasing"),
             ((d2t, other), "t2d does not mark exactly"), ((d2t[:-1], t2d), r"expected d2t \[40\] and t2d \[97\]"),
             ((d2t, t2d[:-1]), r"expected d2t \[40\] and t2d \[97\]")]
    for (a, b), msg in cases:
        with pytest.raises(ValueError, match=msg):
            draft.set_vocab_mapping(a, b)
        assert torch.equal(draft.d2t, before[0]) and torch.equal(draft.t2d, before[1])  # nothing half-installed
    draft.set_vocab_mapping(d2t, t2d)  # the consistent pair goes in
    assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    with pytest.raises(ValueError, match="full vocabulary"):
        make_draft(0).set_vocab_mapping(d2t, t2d)


# ---- 4. the reduced-vocabulary loss --------------------------------------------------------------------------
def test_reduced_vocabulary_losses_are_kl_and_ce_over_the_kept_columns():
    """MTPDraftModule._reduced_vocab_losses (the training step of a reduced draft) against a naive float64
    computation: per step k and scored row t (label ids[t+k+2] with loss_mask set), draft q = softmax over the Vd
    kept columns of lm_head(norm(out_k[t])); teacher p = softmax of the target's logits of final[t+k+1] at the kept
    columns only (renormalised); KL(p || q); CE -log q[label] where the label is a kept id (0 otherwise), both
    averaged over the step's scored rows; loss = w_ce * sum_k beta_k CE_k + w_kl * sum_k beta_k KL_k."""
    K, beta, weights = 3, 0.6, MTPLossWeights(ce=0.3, kl=0.7)
    draft, kept = reduced_draft(vd=30, seed=14, num_steps=K)
    B, S = 2, 9
    g = torch.Generator().manual_seed(15)
    # half the labels drawn from the kept ids, half from anywhere (so some rows have no CE term)
    ids = torch.where(torch.rand(B, S, generator=g) < 0.5, kept[torch.randint(0, 30, (B, S), generator=g)],
                      torch.randint(0, V, (B, S), generator=g))
    loss_mask = (torch.rand(B, S, generator=g) < 0.8).long()
    feats = feats_of(S, seed=16, batch=B)
    target_head = torch.randn(V, H, generator=g)  # the target's LM head (the draft's shared one is its rows too)
    draft.share_target_weights(draft._embed_weight, target_head)
    stub = SimpleNamespace(draft=draft, target=SimpleNamespace(lm_head_weight=target_head, head_fp32=True),
                           num_steps=K, beta=beta, mtp_weights=weights, training=False, _global_rows=None)
    with torch.no_grad():
        got = MTPDraftModule._reduced_vocab_losses(stub, ids, loss_mask, feats, metrics=True)
        outs = teacher_forced_chain(draft, draft.context_hidden(feats), ids, K)  # checked against eval above

    head = target_head.double()[kept]  # [Vd, H]
    col = {int(t): d for d, t in enumerate(kept.tolist())}
    ce_k, kl_k, n_outside = [], [], 0
    for k in range(K):
        ce_sum = kl_sum = 0.0
        n = 0
        for b in range(B):
            for t in range(S - k - 2):  # rows with a label
                if not loss_mask[b, t + k + 2]:
                    continue
                n += 1
                normed = ref_rms(outs[k][b, t].double(), draft.norm.weight.detach().double(), 1e-6)
                logq = torch.log_softmax(normed @ head.T, -1)
                logp = torch.log_softmax(feats.final[b, t + k + 1].double() @ head.T, -1)
                kl_sum += float((logp.exp() * (logp - logq)).sum().detach())
                label = int(ids[b, t + k + 2])
                if label in col:
                    ce_sum -= float(logq[col[label]])
                else:
                    n_outside += 1
        ce_k.append(ce_sum / n)
        kl_k.append(kl_sum / n)
    assert n_outside > 0  # the case the -1 labels exist for is exercised
    w = step_weights(K, beta).double()
    # the module works in fp32 (log-softmax over 30 columns, means over <= 16 rows of O(1-10) values): ~1e-7 relative
    # rounding; 1e-5 bounds it, a wrong column set, teacher normalisation or CE row set moves these by >= 1e-2
    for k in range(K):
        assert float(got[f"ce_{k}"]) == pytest.approx(ce_k[k], rel=1e-5)
        assert float(got[f"kl_{k}"]) == pytest.approx(kl_k[k], rel=1e-5)
    want = weights.ce * float((w * torch.tensor(ce_k)).sum()) + weights.kl * float((w * torch.tensor(kl_k)).sum())
    assert float(got["loss"]) == pytest.approx(want, rel=1e-5)


# ---- 5. config refusals (registry.build_config) --------------------------------------------------------------
def llama(num_hidden_layers: int = 6) -> LlamaConfig:
    return LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=num_hidden_layers,
                       num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD, rope_theta=THETA)


def group(**kw) -> dict:
    return {"kind": "eagle3", "num_steps": 3, "target_layer_ids": [0, 2, 3], "draft_vocab_size": None,
            "norm_before_residual": False, "init_from_target": False, "arch": {}, **kw}


def test_build_config_takes_the_targets_sizes_and_vllms_default_taps():
    cfg = build_config(group(draft_vocab_size=40), llama())
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size) == (H, V, NH, NKV, HD, INTER)
    assert cfg.rope_parameters["rope_theta"] == THETA and cfg.target_layer_ids == [0, 2, 3]
    assert cfg.draft_vocab_size == 40
    # no taps given: vLLM's defaults (2, N // 2, N - 3) (interfaces.py:1751-1772) are ids of the stream ENTERING a
    # layer; as layer-output ids they are one less
    cfg = build_config(group(target_layer_ids=None), llama(32))
    assert cfg.target_layer_ids == [i - 1 for i in (2, 32 // 2, 32 - 3)]


def _refusal(grp, hf) -> str:
    with pytest.raises(ConfigError) as info:
        build_config(grp, hf)
    msg = str(info.value)
    assert "\n" not in msg  # one line
    return msg


@pytest.mark.parametrize("hf, why", [(tiny_v4_config(), "hc_mult copies"),
                                     (MixtralConfig(vocab_size=V, hidden_size=H, num_hidden_layers=6), "SupportsEagle3")],
                         ids=["deepseek_v4", "mixtral"])
def test_a_target_vllm_does_not_tap_is_refused(hf, why):
    msg = _refusal(group(target_layer_ids=[0]), hf)
    assert msg.startswith("draft.kind:") and hf.model_type in msg and why in msg


def test_a_target_whose_vllm_class_inherits_the_taps_is_accepted():
    """vLLM's MistralForCausalLM is a LlamaForCausalLM (model_executor/models/mistral.py:236): SupportsEagle3. Without
    a sliding window (7B v0.2 and later) the draft attends to its whole cache; with one (transformers' default, v0.1:
    every layer slides, 4096) vLLM gives the draft's layer that window too, so the draft takes it (one info line)."""
    keys = dict(vocab_size=V, hidden_size=H, num_hidden_layers=6, num_attention_heads=NH, num_key_value_heads=NKV,
                head_dim=HD, intermediate_size=INTER)
    cfg = build_config(group(target_layer_ids=[0, 2]), MistralConfig(**keys, sliding_window=None))
    assert cfg.target_layer_ids == [0, 2] and cfg.sliding_window is None
    draft = Eagle3Draft(build_config(group(target_layer_ids=[0, 2]), MistralConfig(**keys)))
    assert draft.config.sliding_window == 4096 and draft.attention_window == 4096


@pytest.mark.parametrize("grp, key, why", [
    (group(target_layer_ids=[0, 2, 6]), "draft.target_layer_ids", r"bad: \[6\]"),  # a 6-layer target: 0..5
    (group(target_layer_ids=[-1, 2]), "draft.target_layer_ids", r"bad: \[-1\]"),
    (group(target_layer_ids=[0, 2, 5]), "draft.target_layer_ids", r"in \[0, 4\] .*cannot tap the last layer.*bad: \[5\]"),
    (group(target_layer_ids=[2, 0, 3]), "draft.target_layer_ids", "list them sorted"),
    (group(target_layer_ids=[0, 2, 2]), "draft.target_layer_ids", "without repeats"),
    (group(draft_vocab_size=V + 1), "draft.draft_vocab_size", r"must be in \[1, vocab_size=97\]"),
    (group(draft_vocab_size=0), "draft.draft_vocab_size", r"must be in \[1, vocab_size=97\]"),
], ids=["beyond-target", "negative", "last-layer", "unsorted", "repeated", "vocab-too-large", "vocab-zero"])
def test_bad_draft_keys_are_one_config_error_naming_the_key(grp, key, why):
    msg = _refusal(grp, llama(6))
    assert msg.startswith(key + ":") and re.search(why, msg), msg

"""XPress (dspark/models/xpress.py, dspark/export/xpress.py): the refiner against a direct transcription of vLLM
0.34's formula, K = N Jacobi passes == sequential greedy decoding of the refined logits, top-C = V == the whole
vocabulary, the training rows (block objective, teacher forcing) == the drafting math fed the true tokens, export ->
verify -> import, broken folders and bad configs refused, a warm start from DFlash."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from dspark.errors import ConfigError
from dspark.export.verify import verify_folder
from dspark.export.xpress import export_xpress, import_xpress, xpress_config_from_config
from dspark.models import registry
from dspark.models.xpress import XPressConfig, XPressDraft

H, V, N = 32, 61, 4
HF = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
KEYS = dict(num_layers=1, block_size=N, mask_token_id=V - 1, target_layer_ids=[0, 1], xpress_rank=6,
            xpress_mlp_hidden=10, xpress_num_passes=N, xpress_topc=0)


def make(seed: int = 0, **kw) -> XPressDraft:
    draft = XPressDraft(XPressConfig.from_target_config(HF, **{**KEYS, **kw}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)  # mix_l nonzero: the causal mix matters
    draft.share_target_weights(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g))
    return draft


def transcribed_refined(draft: XPressDraft, hs: torch.Tensor, blk: torch.Tensor, prev0: torch.Tensor) -> torch.Tensor:
    """vLLM 0.34's refiner written out slot by slot and channel by channel (float64): hs [L, H], blk [L] -> [L-1, V]."""
    hd = draft.xpress_head
    w = {k: v.double() for k, v in hd.state_dict().items()}
    r = w["down_h.weight"].shape[0]
    L = hs.shape[0]
    hs = hs.double()
    gmean = hs.mean(0)
    prev = [int(prev0)] + [int(t) for t in blk[:-1]]
    x = torch.stack([w["in_proj.weight"] @ torch.cat([w["down_h.weight"] @ hs[b], w["down_g.weight"] @ gmean,
                                                       w["w1.weight"][prev[b]]]) for b in range(L)])  # [L, r]
    u = torch.zeros(L, r, dtype=torch.float64)
    for c in range(r):
        for b in range(L):
            for j in range(b + 1):
                m = w["mix_l"][c, b, j] + (1.0 if j == b else 0.0)  # M = raw * tril + I
                u[b, c] += m * x[j, c]
    z = u + (F.silu(u @ w["mlp_gate.weight"].T) * (u @ w["mlp_up.weight"].T)) @ w["mlp_down.weight"].T
    base = hs @ draft._lm_head_weight.double().T
    return (base + z @ w["w2.weight"].T)[1:]


def test_the_refiner_is_vllms_formula():
    draft = make()
    g = torch.Generator().manual_seed(3)
    hs = torch.randn(2, N + 1, H, generator=g)
    blk = torch.randint(0, V, (2, N + 1), generator=g)
    prev0 = torch.randint(0, V, (2,), generator=g)
    got = draft.refined_logits(hs, blk, prev0)
    for i in range(2):  # float32 vs float64 on O(10) logits: 1e-4 absolute
        torch.testing.assert_close(got[i].double(), transcribed_refined(draft, hs[i], blk[i], prev0[i]),
                                   atol=1e-4, rtol=1e-5)


def _block(draft: XPressDraft, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    h_all = torch.randn(2, N + 1, H, generator=g)
    x0 = torch.randint(0, V, (2,), generator=g)
    return h_all, x0


def test_n_jacobi_passes_are_sequential_greedy_decoding():
    draft = make()
    h_all, x0 = _block(draft)
    props = draft._draft_block(h_all, 1, x0, 0.0, [None, None], None)
    hs = draft.head_input(h_all)
    for i, p in enumerate(props):
        blk = [int(x0[i])]
        for k in range(N):  # slot k+1 from the slots before it (the anchor stands in for the token before it)
            cur = torch.tensor(blk + [0] * (N + 1 - len(blk)))
            logits = draft.refined_logits(hs[i : i + 1], cur.unsqueeze(0), x0[i : i + 1])[0, k]
            blk.append(int(logits.argmax()))
        assert p.tokens.tolist() == blk[1:]
        assert torch.equal(p.q_probs.argmax(-1), p.tokens) and torch.all(p.q_probs.sum(-1) == 1)  # one-hot


def test_fewer_passes_can_differ_and_topc_v_is_the_whole_vocabulary():
    full = make()
    h_all, x0 = _block(full)
    whole = [p.tokens for p in full._draft_block(h_all, 1, x0, 0.0, [None, None], None)]
    topv = make(xpress_topc=V)
    top_v = [p.tokens for p in topv._draft_block(h_all, 1, x0, 0.0, [None, None], None)]
    assert all(torch.equal(a, b) for a, b in zip(top_v, whole))
    one = make(xpress_num_passes=1)  # one pass: slot 1 exact, later slots from the base argmax's prefix
    first = [p.tokens for p in one._draft_block(h_all, 1, x0, 0.0, [None, None], None)]
    assert all(int(a[0]) == int(b[0]) for a, b in zip(first, whole))


def test_training_rows_are_the_drafting_math_on_the_true_tokens():
    """What the block objective scores (latent from block_latent with the true previous tokens, read out by w2 as the
    fused loss does) equals refined_logits fed the true block: train and eval compute the same function."""
    draft = make()
    h_all, x0 = _block(draft)
    g = torch.Generator().manual_seed(9)
    true = torch.randint(0, V, (2, N), generator=g)
    before = torch.randint(0, V, (2,), generator=g)
    hs = draft.head_input(h_all)
    prev = torch.cat([before.unsqueeze(1), x0.unsqueeze(1), true[:, :-1]], 1)  # [B, N+1]: as block_module builds it
    z = draft.markov_head.block_latent(prev, hs)[:, 1:]
    fused = F.linear(hs[:, 1:], draft._lm_head_weight) + z @ draft.markov_head.markov_w2.weight.T
    blk = torch.cat([x0.unsqueeze(1), true], 1)
    torch.testing.assert_close(fused, draft.refined_logits(hs, blk, before), atol=1e-5, rtol=1e-5)


def test_export_verify_import(tmp_path):
    draft = make(xpress_topc=7)
    out = export_xpress(draft, tmp_path / "x", dtype=torch.float32, num_target_layers=3)
    rep = verify_folder(out)
    assert rep.ok, rep.problems
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["Qwen3XPressModel"] and c["xpress_block_size"] == N + 1
    assert (c["xpress_rank"], c["xpress_mlp_hidden"], c["xpress_num_passes"], c["xpress_topc"]) == (6, 10, N, 7)
    from safetensors.torch import load_file
    names = set(load_file(str(out / "model.safetensors")))
    assert "xpress_head.mix.L" in names and "xpress_head.mix_l" not in names
    back = import_xpress(out, XPressDraft(xpress_config_from_config(c)))
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("key, value, problem", [
    ("xpress_block_size", N + 3, r"xpress_block_size=7 != block_size \+ 1"),
    ("xpress_rank", None, r"lacks \['xpress_rank'\]"),
    ("sample_from_anchor", True, r"sample_from_anchor true"),
])
def test_a_broken_config_fails_verify(tmp_path, key, value, problem):
    import re

    from conftest import reseal

    out = export_xpress(make(), tmp_path / "x", dtype=torch.float32)
    c = json.loads((out / "config.json").read_text())
    if value is None:
        c.pop(key)
    else:
        c[key] = value
    (out / "config.json").write_text(json.dumps(c))
    reseal(out)
    rep = verify_folder(out)
    assert not rep.ok and any(re.search(problem, p) for p in rep.problems), rep.problems


@pytest.mark.parametrize("override, key", [("markov_rank=4", "draft.markov_rank"),
                                           ("layout=anchor", "draft.layout"),
                                           ("draft_vocab_size=20", "draft.draft_vocab_size"),
                                           (f"xpress_topc={V + 1}", "draft.xpress_topc")])
def test_bad_config_names_the_key(override, key):
    k, v = override.split("=")
    group = {"kind": "xpress", **KEYS, k: int(v) if v.isdigit() else v}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        registry.build_config(group, HF)


def test_warm_start_from_a_dflash_draft(tmp_path):
    from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
    from dspark.pretrained import save_draft
    from dspark.warm_start import init_from

    dense_keys = {k: v for k, v in KEYS.items() if not k.startswith("xpress_")}
    src = DSparkDenseDraft(DSparkDenseConfig.from_target_config(HF, **dense_keys, markov_rank=0))
    folder = save_draft(src, tmp_path / "draft", target={"kind": "hf", "path": None, "fingerprint": None})
    xp = make()
    head_before = {k: v.clone() for k, v in xp.xpress_head.state_dict().items()}
    report = init_from(xp, str(folder))
    assert all(torch.equal(xp.state_dict()[k], v) for k, v in src.state_dict().items())
    assert all(torch.equal(xp.xpress_head.state_dict()[k], v) for k, v in head_before.items())
    assert sorted(n for n in report.fresh if n.startswith("xpress_head.")) == sorted(
        f"xpress_head.{k}" for k in head_before)

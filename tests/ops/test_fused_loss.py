"""The chunked fused DSpark loss against the materialised computation (values and gradients), its
autograd wrapper (gradcheck), draft_losses fused against draft_losses materialised, and dispatch errors."""
import pytest
import torch
from conftest import assert_same_argmax

from dspark.ops.fused_loss import lm_loss, lm_loss_naive, lm_loss_reference
from dspark.training.objectives import LossWeights, draft_losses


def _case(seed=0, n=11, h=6, v=13, r=3, dtype=torch.float32, markov=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=dtype)
    y = torch.randn(n, h, generator=g, dtype=dtype)
    w = torch.randn(v, h, generator=g, dtype=dtype)
    e = torch.randn(n, r, generator=g, dtype=dtype) if markov else None
    w2 = torch.randn(v, r, generator=g, dtype=dtype) if markov else None
    labels = torch.randint(0, v, (n,), generator=g)
    a = torch.rand(n, generator=g, dtype=dtype)
    b = torch.rand(n, generator=g, dtype=dtype)
    a[3] = b[3] = 0.0  # a masked row
    return x, y, w, e, w2, labels, a, b


def _leaves(case):
    x, y, w, e, w2, labels, a, b = case
    lf = lambda t: None if t is None else t.clone().requires_grad_(True)  # noqa: E731
    return lf(x), y, w, lf(e), lf(w2), labels, a, b


@pytest.mark.parametrize("markov", [True, False])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunked_matches_naive_values_and_gradients(markov, chunk):
    case = _case(markov=markov)
    xn, _, _, en, w2n, *_ = args_n = _leaves(case)
    ln, ce_n, l1_n, da_n, ta_n = lm_loss_naive(*args_n)
    ln.backward()
    xf, _, _, ef, w2f, *_ = args_f = _leaves(case)
    lf, ce_f, l1_f, da_f, ta_f = lm_loss(*args_f, chunk_rows=chunk, backend="torch")
    (2.5 * lf).backward()  # the upstream gradient must scale the stored one
    torch.testing.assert_close(lf, ln, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ce_f, ce_n, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l1_f, l1_n, atol=1e-5, rtol=1e-5)
    x, y, w, e, w2 = case[:5]  # chunked rows vs one [N, V] product: argmaxes agree up to near-ties
    d_logits = x @ w.T + (e @ w2.T if markov else 0)
    assert_same_argmax(da_f, da_n, d_logits) and assert_same_argmax(ta_f, ta_n, y @ w.T)
    torch.testing.assert_close(xf.grad, 2.5 * xn.grad, atol=1e-5, rtol=1e-5)
    if markov:
        torch.testing.assert_close(ef.grad, 2.5 * en.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w2f.grad, 2.5 * w2n.grad, atol=1e-5, rtol=1e-5)
    assert xn.grad[3].abs().sum() == 0 and xf.grad.abs().sum() > 0


def test_gradcheck_float64():
    x, y, w, e, w2, labels, a, b = _case(1, n=5, h=4, v=7, r=2, dtype=torch.float64)
    # keep |q - p| away from 0 so sign() is locally constant (L1 is not differentiable there)
    f = lambda x_, e_, w2_: lm_loss(x_, y, w, e_, w2_, labels, a, b, chunk_rows=2, backend="torch")[0]  # noqa: E731
    inputs = tuple(t.clone().requires_grad_(True) for t in (x, e, w2))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5)


def test_l1_gradient_formula_by_hand():
    """2 rows, V=3, W = I: the logits are x itself; compare with q (s - sum q s) written out."""
    x = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]], requires_grad=True)
    y = torch.tensor([[0.0, 1.0, 0.0], [0.5, 2.0, 1.0]])
    w = torch.eye(3)
    labels = torch.tensor([0, 2])
    loss, *_ = lm_loss(x, y, w, None, None, labels, torch.zeros(2), torch.ones(2), backend="torch")
    loss.backward()
    q, p = x.detach().softmax(-1), y.softmax(-1)
    s = torch.sign(q - p)
    expect = q * (s - (q * s).sum(-1, keepdim=True))
    torch.testing.assert_close(x.grad, expect)
    torch.testing.assert_close(loss, (q - p).abs().sum())


def test_no_grad_path_and_bad_inputs():
    x, y, w, e, w2, labels, a, b = _case(2)
    with torch.no_grad():
        l0, *_ = lm_loss(x, y, w, e, w2, labels, a, b, backend="torch")
    torch.testing.assert_close(l0, lm_loss_naive(x, y, w, e, w2, labels, a, b)[0], atol=1e-5, rtol=1e-5)
    assert lm_loss_reference(x, y, w, e, w2, labels, a, b, need_grads=False).grad_x is None
    with pytest.raises(ValueError, match="labels must lie in"):
        lm_loss(x, y, w, e, w2, labels + 100, a, b, backend="torch")
    with pytest.raises(ValueError, match="markov_w2 must be"):
        lm_loss(x, y, w, e, w2[:, :2], labels, a, b, backend="torch")
    with pytest.raises(ValueError, match="both the Markov latent"):
        lm_loss(x, y, w, e, None, labels, a, b, backend="torch")
    with pytest.raises(ValueError, match="ops_backend must be one of"):
        lm_loss(x, y, w, e, w2, labels, a, b, backend="cuda")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        lm_loss(x, y, w, e, w2, labels, a, b, backend="tilelang")


def test_draft_losses_fused_matches_materialised():
    g = torch.Generator().manual_seed(3)
    N, G, H, V, R = 5, 4, 6, 9, 3
    rows = torch.randn(N, G, H, generator=g)
    teach = torch.randn(N, G, H, generator=g)
    w = torch.randn(V, H, generator=g)
    lat = torch.randn(N, G, R, generator=g)
    w2 = torch.randn(V, R, generator=g)
    labels = torch.randint(0, V, (N, G), generator=g)
    labels[2] = 0
    conf = torch.randn(N, G, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]).bool()
    for weights in (LossWeights(), LossWeights(ce=1.0, l1=0.0, conf=0.0)):
        leaves_a = [t.clone().requires_grad_(True) for t in (rows, lat, w2, conf)]
        leaves_b = [t.clone().requires_grad_(True) for t in (rows, lat, w2, conf)]
        ra, la, wa, ca = leaves_a
        ref = draft_losses(ra, teach, w, la, wa, labels, mask, ca, decay_gamma=4.0, weights=weights,
                           normalizer=torch.tensor(3.0), materialise=True)
        rb, lb, wb, cb = leaves_b
        got = draft_losses(rb, teach, w, lb, wb, labels, mask, cb, decay_gamma=4.0, weights=weights,
                           normalizer=torch.tensor(3.0), backend="torch", chunk_rows=3)
        assert set(got) == set(ref)
        for k in ref:
            torch.testing.assert_close(got[k].detach(), ref[k].detach(), atol=1e-5, rtol=1e-5, msg=k)
        ref["loss"].backward()
        got["loss"].backward()
        for a, b in zip(leaves_b, leaves_a):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


# ---- the training module: fused path == unfused path --------------------------------------------------
V, S, G, MASK = 40, 24, 3, 39


def _module(kind: str, markov: str, fused: bool):
    from conftest import tiny_v4_config
    from transformers import DeepseekV4ForCausalLM, LlamaConfig, LlamaForCausalLM

    from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
    from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft
    from dspark.targets.hf_target import FrozenTarget
    from dspark.training.block_module import BlockDraftModule

    torch.manual_seed(0)
    if kind == "v4":
        cfg = tiny_v4_config(vocab_size=V, sliding_window=6)
        target = FrozenTarget(DeepseekV4ForCausalLM(cfg), [1, 2])
        draft = DSparkV4Draft(DSparkV4Config.from_target_config(
            cfg, num_layers=1, block_size=G, mask_token_id=MASK, target_layer_ids=[1, 2], markov_rank=4,
            sliding_window=5, markov_head_type=markov))
    else:
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2)
        target = FrozenTarget(LlamaForCausalLM(cfg), [0, 2])
        draft = DSparkDenseDraft(DSparkDenseConfig.from_target_config(
            cfg, num_layers=1, block_size=G, mask_token_id=MASK, target_layer_ids=[0, 2], markov_rank=4,
            markov_head_type=markov))
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return BlockDraftModule(draft, target, fused_loss=fused)


def _batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, MASK, (2, S), generator=g)
    loss_mask = torch.ones(2, S, dtype=torch.long)
    loss_mask[1, 18:] = 0  # some blocks end early: eval_mask prefixes of different lengths
    return {"input_ids": ids, "attention_mask": torch.ones(2, S, dtype=torch.long), "loss_mask": loss_mask,
            "anchors": torch.tensor([[3, 9, 15, 20], [2, 8, 14, 16]]),
            "keep": torch.tensor([[True] * 4, [True, True, True, False]])}


@pytest.mark.parametrize("kind,markov", [("v4", "vanilla"), ("v4", "gated"), ("v4", "rnn"), ("dense", "vanilla")])
def test_module_fused_losses_equal_unfused(kind, markov):
    ref_m, fused_m = _module(kind, markov, False), _module(kind, markov, True)
    fused_m.draft.load_state_dict(ref_m.draft.state_dict())
    ref, _ = ref_m._losses(_batch())
    got, _ = fused_m._losses(_batch())
    assert set(got) == set(ref)
    for k in ref:
        torch.testing.assert_close(got[k].detach(), ref[k].detach(), atol=2e-5, rtol=2e-5, msg=k)
    ref["loss"].backward()
    got["loss"].backward()
    grads = dict(ref_m.draft.named_parameters())
    n_checked = 0
    for name, p in fused_m.draft.named_parameters():
        r = grads[name].grad
        if r is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        torch.testing.assert_close(p.grad, r, atol=2e-5, rtol=1e-3, msg=name)
        n_checked += 1
    assert fused_m.draft.markov_head.markov_w2.weight.grad.abs().sum() > 0 and n_checked > 5


@pytest.mark.parametrize("kind,markov", [("v4", "vanilla"), ("v4", "gated"), ("v4", "rnn"), ("dense", "vanilla")])
def test_the_loss_rows_are_the_drafts_logits(kind, markov):
    """What the loss scores (head input x the scored LM-head rows + latent x markov_w2) is the logits the draft
    drafts with (base_logits + the Markov head's bias), for every prediction row."""
    module = _module(kind, markov, True)
    with torch.no_grad():
        module.draft.markov_head.markov_w2.weight.mul_(100)  # the trained size of the bias, not the init's ~1e-4
        r = module.draft_rows(_batch())
        draft, head = module.draft, module.draft.markov_head
        lm_head = module._scored_head()[0]
        scored = draft.head_input(r.hidden) @ lm_head.T + r.latent @ head.markov_w2.weight.T  # [B, A, g, V]
        drafted = draft.base_logits(r.hidden) + head.project(r.latent)
    torch.testing.assert_close(scored.float(), drafted.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("markov", ["vanilla", "gated", "rnn"])
def test_markov_latent_reproduces_the_head(markov):
    from dspark.models.heads import build_markov_head

    torch.manual_seed(0)
    head = build_markov_head(20, 20, 3, 5, markov)
    prev = torch.randint(0, 20, (2, 3, 4))
    h = torch.randn(2, 3, 4, 5)
    bias, feat = head(prev, h)
    latent, feat2 = head.latent(prev, h)
    torch.testing.assert_close(head.project(latent), bias)
    torch.testing.assert_close(feat2, feat)


def test_ops_backend_config_key_is_validated():
    from conftest import compose

    from dspark.errors import ConfigError
    from dspark.ops import backend
    from dspark.schema import check_run_keys

    with pytest.raises(ConfigError, match="ops_backend: must be one of auto, torch, tilelang"):
        check_run_keys(compose(["ops_backend=cuda"]))
    with pytest.raises(ValueError, match="ops_backend must be one of"):
        backend.set_ops_backend("triton")
    assert compose([]).ops_backend == "auto" and compose([]).train.fused_loss is True
    assert backend.resolve(torch.zeros(1), "auto") == "torch"  # CPU tensors never go to the kernels


def _torch_loop(monkeypatch):
    """Make the chunk loop run its torch ops (the path of a machine without a C++ compiler)."""
    from dspark.ops import loss_rows_cpu

    monkeypatch.setattr(loss_rows_cpu, "kernel", lambda: None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("markov,teacher", [(True, True), (False, True), (True, False)])
def test_cpu_row_kernel_equals_the_torch_chunk_loop(monkeypatch, dtype, markov, teacher):
    """The C++ row pass (dspark.ops.loss_rows_cpu) against the torch loop it replaces, on a vocabulary of a few
    thousand ids, three chunks with a short last one, a bf16 or float32 head. Both round the GEMM outputs and the
    logit gradient to the head's dtype at the same points; what differs is the order of float32 sums, so the
    values agree to float32 precision and the gradients to the head dtype's rounding of a few elements."""
    from dspark.ops import loss_rows_cpu

    if loss_rows_cpu.kernel() is None:
        pytest.skip("no C++ compiler here: only the torch loop runs")
    g = torch.Generator().manual_seed(3)
    n, h, v, r = 37, 24, 3001, 8
    x, y = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    w = (torch.randn(v, h, generator=g) * 0.3).to(dtype)
    e = torch.randn(n, r, generator=g) if markov else None
    w2 = torch.randn(v, r, generator=g) * 0.1 if markov else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[0] = v - 1  # the last id
    a, b = torch.rand(n, generator=g), torch.rand(n, generator=g)
    a[5] = b[5] = 0.0
    yy = y if teacher else None
    got = lm_loss_reference(x, yy, w, e, w2, labels, a, b, chunk_rows=16)
    _torch_loop(monkeypatch)
    want = lm_loss_reference(x, yy, w, e, w2, labels, a, b, chunk_rows=16)
    torch.testing.assert_close(got.ce, want.ce, atol=1e-5, rtol=1e-5)
    if teacher:
        torch.testing.assert_close(got.l1, want.l1, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.teacher_argmax, want.teacher_argmax)
    else:
        assert got.l1.isnan().all() and (got.teacher_argmax == -1).all()
    assert torch.equal(got.draft_argmax, want.draft_argmax)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(got.grad_x, want.grad_x, **tol)
    assert got.grad_x[5].abs().sum() == 0 and got.grad_x.abs().sum() > 0
    if markov:
        torch.testing.assert_close(got.grad_latent, want.grad_latent, **tol)
        torch.testing.assert_close(got.grad_w2, want.grad_w2, **tol)


def test_the_torch_chunk_loop_still_matches_naive(monkeypatch):
    """Where the C++ kernel cannot be built the torch loop runs: it stays checked against the materialised loss."""
    _torch_loop(monkeypatch)
    test_chunked_matches_naive_values_and_gradients(True, 4)
    test_no_grad_path_and_bad_inputs()

"""Training with a reduced draft vocabulary (draft.draft_vocab_size) and without a teacher GEMM (CE-only objectives).

The one LM loss, fused and materialised, is checked against naive computations written here from the definitions
(dspark.ops.fused_loss docstring): values and autograd gradients, on small float64 tensors.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark.ops.fused_loss import lm_loss, lm_loss_reference

N, H, V, R = 7, 5, 13, 3
PATHS = pytest.mark.parametrize("materialise", [False, True], ids=["fused", "materialised"])


def _inputs(seed=0, markov=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    kept = torch.tensor([0, 2, 3, 7, 8, 11])  # the draft's target ids, ascending
    lat = torch.randn(N, R, generator=g, dtype=torch.float64, requires_grad=True) if markov else None
    w2 = torch.randn(len(kept), R, generator=g, dtype=torch.float64, requires_grad=True) if markov else None
    a = torch.rand(N, generator=g, dtype=torch.float64)
    b = torch.rand(N, generator=g, dtype=torch.float64)
    labels = torch.randint(0, len(kept), (N,), generator=g)
    return x, y, w, kept, lat, w2, a, b, labels


def _draft_logits(x, w, kept, lat, w2):
    d = x @ w[kept].T  # [N, Vd]
    return d if lat is None else d + lat @ w2.T


def _grads(loss, *ts):
    return torch.autograd.grad(loss, [t for t in ts if t is not None])


@pytest.mark.parametrize("markov", [True, False])
@PATHS
def test_restricted_teacher_equals_naive(markov, materialise):
    """Training form: head rows at the kept ids, teacher softmax over the same ids (renormalised)."""
    x, y, w, kept, lat, w2, a, b, labels = _inputs(markov=markov)
    d = _draft_logits(x, w, kept, lat, w2)
    p = (y @ w[kept].T).softmax(-1)
    ce = F.cross_entropy(d, labels, reduction="none")
    l1 = (d.softmax(-1) - p).abs().sum(-1)
    naive = (a * ce + b * l1).sum()
    loss, ce_f, l1_f, d_arg, t_arg = lm_loss(x, y, w[kept], lat, w2, labels, a, b, chunk_rows=3,
                                              materialise=materialise)
    torch.testing.assert_close(loss, naive)
    torch.testing.assert_close(ce_f, ce.detach())
    torch.testing.assert_close(l1_f, l1.detach())
    assert torch.equal(d_arg, d.argmax(-1)) and torch.equal(t_arg, p.argmax(-1))
    for got, want in zip(_grads(loss, x, lat, w2), _grads(naive, x, lat, w2)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("markov", [True, False])
@PATHS
def test_full_teacher_is_the_true_total_variation(markov, materialise):
    """Held-out form: the draft's q is zero outside its ids; p is the target's whole distribution, so
    l1 = ||q_V - p||_1 over the full vocabulary, and the ids compared for agreement are target ids."""
    x, y, w, kept, lat, w2, a, b, labels = _inputs(seed=1, markov=markov)
    d = _draft_logits(x, w, kept, lat, w2)
    q_full = torch.zeros(N, V, dtype=d.dtype).index_copy(1, kept, d.softmax(-1))
    p = (y @ w.T).softmax(-1)
    l1 = (q_full - p).abs().sum(-1)
    ce = F.cross_entropy(d, labels, reduction="none")
    naive = (a * ce + b * l1).sum()
    loss, ce_f, l1_f, d_arg, t_arg = lm_loss(x, y, w[kept], lat, w2, labels, a, b, chunk_rows=4,
                                              teacher_w=w, teacher_cols=kept, materialise=materialise)
    torch.testing.assert_close(loss, naive)
    torch.testing.assert_close(l1_f, l1.detach())
    assert torch.equal(d_arg, kept[d.argmax(-1)]) and torch.equal(t_arg, p.argmax(-1))
    for got, want in zip(_grads(loss, x, lat, w2), _grads(naive, x, lat, w2)):
        torch.testing.assert_close(got, want)


@PATHS
def test_no_teacher_is_ce_only(materialise):
    """y = None: no teacher GEMM; the loss and gradients are the CE part alone, l1 NaN, teacher argmax -1."""
    x, y, w, kept, lat, w2, a, b, labels = _inputs(seed=2)
    d = _draft_logits(x, w, kept, lat, w2)
    naive = (a * F.cross_entropy(d, labels, reduction="none")).sum()
    loss, ce_f, l1_f, d_arg, t_arg = lm_loss(x, None, w[kept], lat, w2, labels, a, b, chunk_rows=2,
                                              materialise=materialise)
    torch.testing.assert_close(loss, naive)
    assert torch.isnan(l1_f).all() and (t_arg == -1).all()
    for got, want in zip(_grads(loss, x, lat, w2), _grads(naive, x, lat, w2)):
        torch.testing.assert_close(got, want)


def test_bad_teacher_arguments_are_refused():
    x, y, w, kept, lat, w2, a, b, labels = _inputs()
    with pytest.raises(ValueError, match="teacher_w and teacher_cols"):
        lm_loss_reference(x.detach(), y, w[kept], None, None, labels, a, b, teacher_w=w)
    with pytest.raises(ValueError, match="teacher_cols must be"):
        lm_loss_reference(x.detach(), y, w[kept], None, None, labels, a, b, teacher_w=w,
                          teacher_cols=torch.tensor([0, 1, 2, 3, 4, V]))


@PATHS
def test_out_of_vocabulary_labels_get_no_ce(materialise):
    """draft_losses: a label outside a reduced draft's vocabulary (-1) adds no CE; the other rows' CE is the
    naive one, normalised over the rows that have one."""
    from dspark.training.objectives import LossWeights, draft_losses, position_weights

    x, y, w, kept, lat, w2, a, b, labels = _inputs(seed=3)
    rows = lambda t: t.detach().view(1, N, *t.shape[1:])  # noqa: E731  [N, ...] -> [1, N, ...]
    lab = labels.clone()
    lab[2] = -1
    mask = torch.ones(1, N, dtype=torch.bool)
    out = draft_losses(rows(x), None, w[kept], rows(lat), w2.detach(), lab.view(1, N), mask, None,
                       decay_gamma=4.0, weights=LossWeights(ce=1.0, l1=0.0, conf=0.0), materialise=materialise)
    wk = position_weights(mask, 4.0).view(N).double()
    ce = F.cross_entropy(_draft_logits(x, w, kept, lat, w2).detach(), labels, reduction="none")
    ok = lab >= 0
    torch.testing.assert_close(out["loss"], (wk * ce * ok).sum() / wk.sum())
    torch.testing.assert_close(out["ce"], (wk * ce * ok).sum() / (wk * ok).sum())
    assert "tau_prob" not in out and "l1" not in out  # no teacher: no metric that needs one


def test_mapping_from_training_rows_keeps_eos_and_counts_loss_tokens_only():
    from dspark.data.vocab import build_vocab_mapping, count_tokens

    rows = [{"input_ids": [5, 5, 6, 9, 1], "loss_mask": [0, 1, 1, 1, 0]},
            {"input_ids": [6, 6, 3], "loss_mask": [1, 1, 0]}]
    counts = count_tokens(rows, 10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 1, 3, 0, 0, 1]
    d2t, t2d = build_vocab_mapping(counts, 3, always=[2])  # 2 never occurs but is forced
    kept = torch.arange(3) + d2t
    assert kept.tolist() == [2, 5, 6] and t2d.nonzero().flatten().tolist() == [2, 5, 6]


def test_a_reduced_dense_draft_trains_exports_and_imports_back(tmp_path):
    """experiment with draft.draft_vocab_size: the mapping is the training rows' most frequent loss tokens (+ EOS),
    the draft trains, draft/ carries d2t / t2d, the dense export has lm_head [Vd, H] + d2t, and the imported folder
    scores exactly like the trained draft."""
    import json

    from conftest import compose
    from safetensors.torch import load_file

    from dspark.data.vocab import build_vocab_mapping, count_tokens
    from dspark.export.__main__ import main as export_main
    from dspark.export.dense import dense_config_from_folder, import_dense
    from dspark.export.verify import verify_folder
    from dspark.models.dspark_dense import DSparkDenseDraft
    from dspark.pretrained import load_draft
    from dspark.targets.tiny_llama import build_tiny_llama
    from dspark.training.run import run_training

    target = build_tiny_llama(tmp_path / "target")
    run = tmp_path / "run"
    vd = 300
    cfg = compose(["experiment=dflash2_tiny", f"target.path={target}", "draft=dspark_smollm2",
                   "draft.target_layer_ids=[0,2]", "draft.mask_token_id=4", "draft.num_layers=1", "draft.block_size=3",
                   "draft.markov_rank=8", f"draft.draft_vocab_size={vd}", "train.loss_weights={ce: 0.1, l1: 0.9, conf: 1.0}",
                   "trainer.max_steps=3", "trainer.val_check_interval=3", f"run_dir={run}",
                   "trainer.enable_progress_bar=false"])
    summary = run_training(cfg)
    assert summary["global_step"] == 3 and 1.0 <= summary["final"]["val/tau_prob"] <= 4.0
    weights = load_file(run / "draft" / "model.safetensors")
    assert tuple(weights["markov_head.markov_w2.weight"].shape) == (vd, 8)
    # the mapping is the training rows' choice (recomputed here from the same rows)
    from dspark import factory

    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(target))
    rows = factory.build_dataset(cfg.data, tok)
    train_rows = rows.select(range(len(rows) - int(cfg.data.val_examples)))
    d2t, t2d = build_vocab_mapping(count_tokens(train_rows, 2048), vd, [tok.eos_token_id])
    assert torch.equal(weights["d2t"], d2t) and torch.equal(weights["t2d"], t2d)
    assert json.loads((run / "draft" / "draft_config.json").read_text())["draft_vocab_size"] == vd
    # export -> verify -> import: the same logits as the trained draft
    out = tmp_path / "export"
    assert export_main(["dense", "--run-dir", str(run), "--out", str(out), "--dtype", "float32"]) == 0
    assert verify_folder(out).ok
    with pytest.raises(SystemExit, match="trained with draft_vocab_size=300"):  # pruning it again is refused
        export_main(["dense", "--run-dir", str(run), "--out", str(tmp_path / "again"), "--draft-vocab-size", "100",
                     "--vocab-counts", str(tmp_path / "none.jsonl")])
    trained, _ = load_draft(run / "draft")
    back = import_dense(out, DSparkDenseDraft(dense_config_from_folder(out)))
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(target))
    for d in (trained, back):
        d.share_target_weights(model.get_input_embeddings().weight.detach(), model.lm_head.weight.detach())
        d.eval()
    h = torch.randn(2, 3, 64)
    torch.testing.assert_close(back.base_logits(h), trained.base_logits(h))
    assert torch.isinf(trained.base_logits(h)).sum() == 2 * 3 * (2048 - vd)  # -inf outside the draft's ids


def test_the_verifier_refuses_a_vocabulary_map_that_does_not_match(tmp_path):
    """A reduced export whose d2t maps outside the vocabulary, is not increasing, or disagrees with its t2d is refused
    by `python -m dspark.export verify`, naming the map."""
    from safetensors.torch import load_file, save_file

    from dspark.export.dense import export_dense
    from dspark.export.verify import verify_folder
    from dspark.integrity import write_manifest
    from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft

    cfg = DSparkDenseConfig(hidden_size=16, vocab_size=40, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, intermediate_size=32, block_size=3, mask_token_id=1, target_layer_ids=[0],
                            markov_rank=4, draft_vocab_size=10)
    draft = DSparkDenseDraft(cfg)
    kept = torch.tensor([0, 2, 3, 5, 8, 13, 21, 30, 34, 39])
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[kept] = True
    draft.set_vocab_mapping(kept - torch.arange(10), t2d)
    draft.share_target_weights(torch.randn(40, 16), torch.randn(40, 16))
    good = tmp_path / "good"
    export_dense(draft, good, dtype=torch.float32, num_target_layers=2)
    assert verify_folder(good).ok

    def broken(name, edit):
        folder = tmp_path / name
        __import__("shutil").copytree(good, folder)
        t = load_file(folder / "model.safetensors")
        edit(t)
        save_file(t, folder / "model.safetensors", metadata={"format": "pt"})
        write_manifest(folder)  # the checksums are right: only the map is wrong
        return verify_folder(folder)

    def outside(t):
        t["d2t"][-1] += 5  # last id 44 >= 40

    def unordered(t):
        t["d2t"][1] -= 2  # ids 0, 0, ...

    def disagree(t):
        t["t2d"][1] = True

    for name, edit, why in (("outside", outside, "d2t: draft id"), ("unordered", unordered, "not increasing"),
                            ("disagree", disagree, "t2d: does not mark")):
        report = broken(name, edit)
        assert not report.ok and any(why in p for p in report.problems), (name, report.problems)


@pytest.mark.parametrize("change, key", [(["draft.draft_vocab_size=4096"], "draft.draft_vocab_size"),
                                         (["draft.draft_vocab_size=0"], "draft.draft_vocab_size")])
def test_an_unservable_vocabulary_setting_is_one_line_before_any_model_loads(tmp_path, change, key):
    """Larger than the target's vocabulary (2048) or not positive: one ConfigError
    line naming the key, from the checks that run before any model loads."""
    from conftest import compose

    from dspark.errors import ConfigError
    from dspark.preflight import check_training_config
    from dspark.targets.tiny_llama import build_tiny_llama

    target = build_tiny_llama(tmp_path / "target")
    cfg = compose(["experiment=dflash2_tiny", f"target.path={target}", "draft=dspark_smollm2",
                   "draft.target_layer_ids=[0,2]", "draft.mask_token_id=4", *change])
    with pytest.raises(ConfigError) as err:
        check_training_config(cfg, [])
    assert str(err.value).startswith(key + ":") and "\n" not in str(err.value), str(err.value)

"""DFlash2 (dspark.models.dflash2, docs/dflash2.md): the grouped convolution and the candidate walk against direct
transcriptions of vLLM 0.33.0's formulas, the training score = the walk's score, greedy speculative decoding ==
plain greedy decoding, config errors naming the key, and the tiny experiment training end to end."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import FP32_CROSS_SHAPE_ATOL, tiny_llama_target
from dspark.errors import ConfigError
from dspark.evaluation.speculative import speculative_generate, target_generate
from dspark.models import registry
from dspark.models.block_draft import block_attention_mask
from dspark.models.dflash2 import DFlash2Config, DFlash2Draft, grouped_conv
from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
from dspark.targets.hf_target import FrozenTarget

V, MASK = 64, 63
KEYS = dict(num_layers=1, block_size=3, mask_token_id=MASK, target_layer_ids=[0, 1], conv_kernel_size=3,
            conv_group_size=8, selector_rank=4, selector_top_k=5)


@pytest.fixture(scope="module")
def llama_target() -> FrozenTarget:
    return tiny_llama_target(V)


def make_draft(target: FrozenTarget, seed: int = 1, scramble: bool = True, **kw) -> DFlash2Draft:
    """A DFlash2 draft; `scramble`: every convolution / selector weight random (not the identity start)."""
    torch.manual_seed(seed)
    draft = DFlash2Draft(DFlash2Config.from_target_config(target.model.config, **{**KEYS, **kw})).eval()
    if scramble:
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if "_conv." in name or name.startswith("candidate_selector."):
                    p.normal_(0.0, 0.5)
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return draft


# ---- the convolution: vLLM's formula over flattened rows, element by element ----------------------------
def vllm_conv_loops(x, delta, base, block_size, group_size):
    """qwen3_dflash2.py:144-167 / the Triton kernel :25-78 written as loops: x [N, H] rows of consecutive blocks,
    delta [N, taps, G], base [taps, H]."""
    N, H = x.shape
    out = torch.zeros_like(x)
    for row in range(N):
        pos = row % block_size
        for c in range(H):
            acc = 0.0
            for tap in range(base.shape[0]):
                if pos >= tap:
                    acc += float(base[tap, c] + delta[row, tap, c // group_size]) * float(x[row - tap, c])
            out[row, c] = acc
    return out


def test_grouped_conv_equals_vllms_formula():
    g = torch.Generator().manual_seed(0)
    B, blocks, Lb, H, gs, taps = 2, 3, 4, 8, 4, 3
    x = torch.randn(B, blocks * Lb, H, generator=g)
    delta = torch.randn(B, blocks * Lb, taps, H // gs, generator=g)
    base = torch.randn(taps, H, generator=g)
    offset = torch.arange(blocks * Lb) % Lb
    got = grouped_conv(x, delta, base, offset, gs)
    for b in range(B):
        want = vllm_conv_loops(x[b], delta[b], base, Lb, gs)
        torch.testing.assert_close(got[b], want, atol=1e-5, rtol=1e-5)
    # a shifted block boundary is a different convolution (the test can fail)
    assert not torch.allclose(grouped_conv(x, delta, base, torch.arange(blocks * Lb) % (Lb + 1), gs), got)


def test_identity_convolutions_make_the_dflash_backbone(llama_target):
    """At its start (base tap 0 = 1, no dynamic part) a DFlash2 layer is the DFlash layer with the same weights."""
    d2 = make_draft(llama_target, scramble=False)
    dense = DSparkDenseDraft(DSparkDenseConfig.from_target_config(
        llama_target.model.config, num_layers=1, block_size=3, mask_token_id=MASK, target_layer_ids=[0, 1],
        markov_rank=0, layout="mask")).eval()
    dense.load_state_dict({k: v for k, v in d2.state_dict().items() if "_conv." not in k
                           and not k.startswith("candidate_selector.")})
    dense.share_target_weights(llama_target.embed_weight, llama_target.lm_head_weight)
    aux = torch.randn(1, 5, 64)
    ids, pos, Lb, _ = d2._block_inputs(torch.tensor([[5]]), [7], 3)
    mask = block_attention_mask(torch.tensor([[5]]), Lb, 5, None)
    ctx = d2.context_kv(d2.combine(aux), torch.arange(5).view(1, 5))
    torch.testing.assert_close(d2.backbone(ids, pos, ctx, mask), dense.backbone(ids, pos, ctx, mask))
    scrambled = make_draft(llama_target, scramble=True)
    scrambled.load_state_dict({**scrambled.state_dict(), **{k: v for k, v in d2.state_dict().items()
                                                            if not k.startswith("candidate_selector.")
                                                            and "_conv." not in k}})
    assert not torch.allclose(scrambled.backbone(ids, pos, ctx, mask), dense.backbone(ids, pos, ctx, mask))


# ---- the walk: vLLM's K x K lattice (qwen3_dflash2.py:290-310) and _selector_walk_kernel ---------------
def vllm_walk(draft: DFlash2Draft, h: torch.Tensor, anchor: int):
    """h [g, H] pre-norm mask rows -> (tokens [g], realized scores [g, K], candidate ids [g, K])."""
    sel = draft.candidate_selector
    n = draft.norm(h)  # last_hidden_states: the model's output is after its final norm
    logits = n @ llama_lm_head(draft).t()
    values, ids = torch.topk(logits, sel.top_k, dim=-1)  # compute_candidates
    hidden = n @ sel.hidden_projection.weight.t()  # [g, r]
    K = sel.top_k
    pred_ids = torch.cat([torch.full((1, K), anchor), ids[:-1]], dim=0)  # [g, K]
    predecessors = sel.predecessor_codebook[pred_ids]  # [g, K, r]
    successors = sel.successor_codebook[ids]  # [g, K, r]
    # vLLM's unary_logits[:, :, None] on [B, L, K] is [B, L, 1, K]: the candidate's own unary (batch dim dropped here)
    scores = values[:, None, :] + torch.einsum("lpr,lcr->lpc", predecessors * hidden[:, None], successors)
    previous, tokens, realized = 0, [], []
    for step in range(h.shape[0]):
        row = scores[step, previous]
        index = int(row.argmax())
        tokens.append(int(ids[step, index]))
        realized.append(row)
        previous = index
    return tokens, torch.stack(realized), ids


def llama_lm_head(draft):
    return draft._shared("lm_head_weight")


def _rows(draft, aux, anchor, g):
    a = aux.shape[1]
    ids, pos, Lb, off = draft._block_inputs(torch.tensor([[a]]), [anchor], g)
    ctx = draft.context_kv(draft.combine(aux), torch.arange(a).view(1, a))
    return draft.backbone(ids, pos, ctx, block_attention_mask(torch.tensor([[a]]), Lb, a, None))[0, off:off + g]


@pytest.mark.parametrize("g", [1, 4])
def test_proposals_are_vllms_candidate_walk(llama_target, g):
    draft = make_draft(llama_target)
    torch.manual_seed(3)
    for trial in range(4):
        aux = torch.randn(1, 6, 64)
        anchor = int(torch.randint(0, V - 1, ()))
        with torch.no_grad():
            prop = draft.propose_blocks([aux], [anchor], num_drafts=g, temperature=0.0)[0]
            tokens, realized, ids = vllm_walk(draft, _rows(draft, aux, anchor, g), anchor)
        assert prop.tokens.tolist() == tokens
        for k in range(g):  # draft logits: the realized scores at the K candidates, -inf elsewhere (speculator.py:99-107)
            torch.testing.assert_close(prop.logits[k, ids[k]], realized[k], atol=FP32_CROSS_SHAPE_ATOL, rtol=0)
            assert torch.isinf(prop.logits[k]).sum() == V - draft.config.selector_top_k
            assert prop.q_probs[k, tokens[k]] == 1.0


def test_sampled_q_lives_on_the_candidates(llama_target):
    draft = make_draft(llama_target)
    aux = torch.randn(1, 6, 64)
    with torch.no_grad():
        prop = draft.propose_blocks([aux], [3], num_drafts=3, temperature=0.7,
                                    generators=[torch.Generator().manual_seed(0)])[0]
    for k in range(3):
        support = torch.isfinite(prop.logits[k])
        torch.testing.assert_close(prop.q_probs[k].sum(), torch.tensor(1.0))
        assert bool((prop.q_probs[k][~support] == 0).all()) and bool(support[prop.tokens[k]])
        want = torch.softmax(prop.logits[k][support] / 0.7, dim=-1)
        torch.testing.assert_close(prop.q_probs[k][support], want)


def test_training_scores_are_the_walks_scores(llama_target):
    """What the block objective trains (base_logits + markov_head.project(latent), teacher-forced predecessor)
    equals the walk's score at every candidate when the walk's predecessors are those tokens."""
    draft = make_draft(llama_target)
    aux = torch.randn(1, 6, 64)
    forced = torch.tensor([[9, 17, 2, 40]])
    with torch.no_grad():
        prop = draft.propose_blocks([aux], [5], num_drafts=4, temperature=0.0, forced_tokens=forced)[0]
        h = _rows(draft, aux, 5, 4)  # [4, H]
        prev = torch.tensor([5, 9, 17, 2])
        latent, _ = draft.markov_head.latent(prev, h)
        full = draft.base_logits(h) + draft.markov_head.project(latent)  # [4, V]
    ok = torch.isfinite(prop.logits)
    torch.testing.assert_close(prop.logits[ok], full[ok], atol=FP32_CROSS_SHAPE_ATOL, rtol=0)
    wrong = draft.base_logits(h) + draft.markov_head.project(draft.markov_head.latent(prev.roll(1), h)[0])
    assert not torch.allclose(prop.logits[ok], wrong[ok], atol=1e-3)


# ---- greedy speculative decoding == plain greedy decoding ------------------------------------------------
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("cache", [True, False])
def test_greedy_speculative_decoding_equals_the_target(llama_target, g, cache):
    draft = make_draft(llama_target, seed=g)
    gen = torch.Generator().manual_seed(g)
    accepted = 0
    for _ in range(3):
        prompt = torch.randint(0, V - 1, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
        ref = target_generate(llama_target, prompt, 12)
        out, stats = speculative_generate(llama_target, draft, prompt, max_new_tokens=12, num_drafts=g,
                                          draft_cache=cache)
        assert out.tolist() == ref.tolist()
        assert stats and all(s.num_drafts == g and 0 <= s.num_accepted <= g for s in stats)
        accepted += sum(s.num_accepted for s in stats)
    assert accepted > 0 or g == 1  # these seeds accept some drafts at g = 3: the accept path ran too


# ---- config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, key", [
    ({"conv_group_size": 5}, r"draft\.conv_group_size: .*must divide hidden_size"),
    ({"selector_top_k": 0}, r"draft\.selector_top_k: .*must be >= 1"),
    ({"arch": {"markov_rank": 8}}, r"draft\.arch\.markov_rank: .*must be 0"),
    ({"arch": {"layout": "anchor"}}, r"draft\.arch\.layout: .*must be 'mask'"),
    ({"arch": {"draft_vocab_size": 32}}, r"draft\.arch\.draft_vocab_size: .*must be null"),
])
def test_bad_config_names_the_key(llama_target, change, key):
    group = {"kind": "dflash2", **KEYS, "init_from_target": False, "arch": {}}
    assert isinstance(registry.build_config(group, llama_target.model.config), DFlash2Config)
    with pytest.raises(ConfigError, match=key):
        registry.build_config({**group, **change}, llama_target.model.config)


# ---- the tiny experiment (experiment=dflash2_tiny): trains on CPU, exports, verifies -------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from conftest import compose
    from dspark.targets.tiny_llama import build_tiny_llama
    from dspark.training.run import run_training

    root = tmp_path_factory.mktemp("dflash2_tiny")
    target = build_tiny_llama(root / "target")
    cfg = compose(["experiment=dflash2_tiny", f"target.path={target}", f"run_dir={root / 'run'}",
                   "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.log_every_n_steps=1",
                   "callbacks.last_checkpoint.every_n_train_steps=4", "trainer.enable_progress_bar=false",
                   "validate_at_start=true"])
    summary = run_training(cfg)
    return root, target, root / "run", cfg, summary


@pytest.mark.slow  # ~40 s with the tiny run (CI runs slow tests too, .ci/run)
def test_the_tiny_experiment_trains_the_selector_and_the_convolutions(tiny_run):
    import json

    from safetensors.torch import load_file

    root, target, run, cfg, summary = tiny_run
    assert summary["global_step"] == 4
    saved = json.loads((run / "metrics.json").read_text())
    for part in ("step0", "final"):
        assert 1.0 <= saved[part]["val/tau_prob"] <= 1.0 + cfg.draft.block_size
    # the tiny Llama is trained on text: its distribution is peaked, and the run prints no degenerate-target warning
    health = saved["target_health"]
    assert health["positions"] > 0 and health["entropy"] < 0.9 * health["ln_vocab"], health
    from dspark.targets.health import degenerate_warning

    assert degenerate_warning(health) is None
    weights = load_file(run / "draft" / "model.safetensors")
    group = json.loads((run / "draft" / "draft_config.json").read_text())
    assert group["kind"] == "dflash2" and group["selector_top_k"] == 8
    fresh = DFlash2Draft(registry.config_from_group(group))
    assert set(weights) == set(fresh.state_dict())
    # four optimizer steps moved the DFlash2 parts away from their start (they get gradient)
    for name in ("layers.0.attention_conv.kernel_projection.weight", "layers.0.mlp_conv.base_kernel",
                 "candidate_selector.predecessor_codebook"):  # deterministic starts: zeros, identity, ones
        assert not torch.equal(weights[name], fresh.state_dict()[name]), name


@pytest.mark.slow  # ~40 s with the tiny run (CI runs slow tests too, .ci/run)
def test_the_tiny_run_exports_verifies_and_reimports(tiny_run, capsys):
    from dspark.export.__main__ import main as export_main
    from dspark.export.dflash2 import import_dflash2
    from dspark.export.verify import verify_folder
    from safetensors.torch import load_file

    root, target, run, cfg, summary = tiny_run
    out = root / "export"
    assert export_main(["dflash2", "--run-dir", str(run), "--out", str(out), "--dtype", "float32"]) == 0
    assert verify_folder(out).ok
    hint = capsys.readouterr().out.strip().splitlines()[-1]  # the next step: a draft model of its own for vLLM
    assert hint.startswith("next: vllm serve <target> --speculative-config '{\"method\": \"dflash\", "
                           f"\"num_speculative_tokens\": {cfg.draft.block_size}, \"model\": \"{out}\"}}'"), hint
    weights = load_file(run / "draft" / "model.safetensors")
    group = __import__("json").loads((run / "draft" / "draft_config.json").read_text())
    fresh = import_dflash2(out, DFlash2Draft(registry.config_from_group(group)))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, weights[k]), k
    with pytest.raises(SystemExit, match="not a dense DSpark/DFlash draft"):  # DFlash's command refuses it
        export_main(["dense", "--run-dir", str(run), "--out", str(root / "dense"), "--dtype", "float32"])


def test_the_tiny_experiment_needs_no_target_path_and_no_build(tmp_path, monkeypatch):
    """experiment=dflash2_tiny needs no target.path (it used to stop at `target.path: set it`): target=tiny_llama is the
    shipped tiny Llama (trained on text), nothing is built into the dspark cache, and build_tiny_llama copies the same
    bytes (the same weight fingerprint on every machine)."""
    from conftest import compose
    from dspark.targets.source import target_folder
    from dspark.targets.tiny_llama import TINY_LLAMA_DIR, build_tiny_llama

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    folder = Path(target_folder(compose(["experiment=dflash2_tiny"]).target))
    assert folder == TINY_LLAMA_DIR and (folder / "config.json").is_file() and not (tmp_path / "cache").exists()
    other = build_tiny_llama(tmp_path / "again")
    assert (folder / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes()

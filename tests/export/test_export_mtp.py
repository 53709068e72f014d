"""MTP sidecar export (issue 5 item 3-5): HY V4 `model.mtp_layers.{i}.*` / DeepSeek-V4 `mtp.{i}.*` round trips
with identical logits, strict import, the independent verifier's MTP rules, and the CLI on a run folder."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import REPO, reseal, tiny_v4_config
from dspark.export.mtp import CONFIG_NAME, export_mtp, import_mtp, mtp_config_from_folder
from dspark.export.verify import main_verify, verify_folder
from dspark.models.dsv4_mtp import DSV4MTPConfig, DSV4MTPDraft
from dspark.models.hy_v4_mtp import HYV4MTPConfig, HYV4MTPDraft

V = 40


# ---- helpers ----------------------------------------------------------------------------------------
def _hy_cfg(**overrides) -> HYV4MTPConfig:
    keys = dict(num_layers=2, mtp_start_layer=3, hidden_size=16, vocab_size=V, num_attention_heads=2, q_lora_rank=8,
                kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=3,
                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=5, intermediate_size=12,
                index_topk=2, index_head_dim=6, index_n_heads=2, routed_scaling_factor=1.5)
    keys.update(overrides)
    return HYV4MTPConfig.from_dict(keys)


def _randomise(draft: torch.nn.Module, seed: int) -> None:
    """Every parameter AND buffer random (norms, sinks, router bias included) so a dropped tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in draft.state_dict().values():
            t.copy_((torch.randn(t.shape, generator=g) * 0.3 + (1.0 if t.dim() == 1 else 0.0)).to(t.dtype))


def _share(draft, vocab: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(100)
    draft.share_target_weights(torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g))


def _hy_draft(seed: int = 0, **overrides) -> HYV4MTPDraft:
    draft = HYV4MTPDraft(_hy_cfg(**overrides))
    _randomise(draft, seed)
    _share(draft, V, 16)
    return draft


def _dsv4_draft(seed: int = 0, num_layers: int = 2) -> DSV4MTPDraft:
    draft = DSV4MTPDraft(DSV4MTPConfig.from_target_config(tiny_v4_config(), num_layers=num_layers))
    _randomise(draft, seed)
    _share(draft, 50, 16)
    return draft


def _hidden(draft, b: int, s: int, g: torch.Generator) -> torch.Tensor:
    c = draft.config
    shape = (b, s, c.hidden_size) if isinstance(draft, HYV4MTPDraft) else (b, s, c.hc_mult, c.hidden_size)
    return torch.randn(shape, generator=g)


def _chain_logits(draft, seed: int = 7) -> torch.Tensor:
    """Two chained step()s (layers 0 then 1) on random ids / hidden -> stacked logits [2, B, S, V]."""
    g = torch.Generator().manual_seed(seed)
    b, s = 2, 5
    ids = torch.randint(0, draft.config.vocab_size, (b, s), generator=g)
    pos = torch.arange(s).expand(b, s)
    h = _hidden(draft, b, s, g)
    out = []
    with torch.no_grad():
        for k in range(2):
            h = draft.step(ids, h, pos + k, k)
            out.append(draft.logits(h, k).float())
    return torch.stack(out)


def _import(folder, like):
    back = import_mtp(folder)
    _share(back, like.config.vocab_size, like.config.hidden_size)
    return back


# ---- round trips ------------------------------------------------------------------------------------
CASES = {
    "hy_fused": lambda: _hy_draft(1),
    "hy_dense_indexer_headwise": lambda: _hy_draft(2, mlp_type="dense", use_indexer=True, gating_type="headwise"),
    "hy_no_sink_no_shared": lambda: _hy_draft(3, learnable_sink=False, n_shared_experts=0),
    "hy_one_layer": lambda: _hy_draft(3, num_layers=1),
    "dsv4": lambda: _dsv4_draft(4),
}
LAYOUTS = {"hy_fused": [{}, {"split_experts": True}], "hy_one_layer": [{"layer_names": "layers"}]}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_float32_identical_logits(tmp_path, case):
    src = CASES[case]()
    for i, kw in enumerate(LAYOUTS.get(case, [{}])):
        out = export_mtp(src, tmp_path / f"{case}{i}", dtype=torch.float32, **kw)
        assert main_verify(out) == 0
        back = _import(out, src)
        assert type(back) is type(src) and back.config == src.config
        assert torch.equal(_chain_logits(src), _chain_logits(back)), kw
        for (n, a), (m, b) in zip(src.state_dict().items(), back.state_dict().items()):
            assert n == m and torch.equal(a, b), n


def test_round_trip_bfloat16_keeps_the_fp32_set_and_re_exports_bit_identically(tmp_path):
    hy_f32 = r"\.(mlp\.gate\.weight|mlp\.gate\.e_score_correction_bias|self_attn\.learnable_sink_param)$"
    v4_f32 = r"(norm\.weight|\.hc_(head|attn|ffn)_(fn|base|scale)|\.attn\.attn_sink|\.ffn\.gate\.bias)$"
    for src, rule, n_f32 in ((_hy_draft(5), hy_f32, 2 * 3), (_dsv4_draft(6), v4_f32, 2 * (3 + 9 + 4 + 2))):
        out = export_mtp(src, tmp_path / type(src).__name__, dtype=torch.bfloat16)
        assert main_verify(out) == 0
        stored = load_file(str(out / "model.safetensors"))
        f32 = sorted(n for n, t in stored.items() if t.dtype == torch.float32)
        assert f32 == sorted(n for n in stored if re.search(rule, n)) and len(f32) == n_f32, f32
        assert {t.dtype for n, t in stored.items() if n not in f32} == {torch.bfloat16}
        back = _import(out, src)
        # the imported fp32 draft holds exactly the stored values
        serving = dict(stored)
        again = export_mtp(back, tmp_path / f"again-{type(src).__name__}", dtype=torch.bfloat16)  # a new folder
        for n, t in load_file(str(again / "model.safetensors")).items():
            assert t.dtype == serving[n].dtype and torch.equal(t, serving[n]), n
        a, b = _chain_logits(src), _chain_logits(back)
        assert not torch.equal(a, b)  # bf16 rounding is real ...
        assert (a - b).abs().max() < 0.05 * a.abs().max()  # ... and small


def test_hy_serving_names_and_config(tmp_path):
    src = _hy_draft(8, use_indexer=True)
    one = export_mtp(_hy_draft(8, use_indexer=True, num_layers=1), tmp_path / "hy1", dtype=torch.float32,
                     layer_names="layers")
    assert "model.layers.3.eh_proj.weight" in set(load_file(str(one / "model.safetensors")))
    out = export_mtp(src, tmp_path / "hy", dtype=torch.float32, split_experts=True)
    names = set(load_file(str(out / "model.safetensors")))
    assert "model.mtp_layers.0.eh_proj.weight" in names and "model.mtp_layers.1.final_layernorm.weight" in names
    assert "model.mtp_layers.1.mlp.experts.2.down_proj.weight" in names
    assert "model.mtp_layers.0.self_attn.indexer.k_norm.bias" in names
    assert not any(n.startswith("model.layers.") or "embed_tokens" in n or "shared_head" in n for n in names)
    c = json.loads((out / CONFIG_NAME).read_text())
    assert (c["num_nextn_predict_layers"], c["num_hidden_layers"], c["mtp_layer_type"]) == (2, 3, "sparse_attention")
    assert mtp_config_from_folder(out) == src.config
    # naive count: per layer 4 layer-level + 2 block norms + 8 attention + sink + 5 indexer + 2 router
    # + 3 * E split experts + 3 shared
    assert len(names) == 2 * (4 + 2 + 8 + 1 + 5 + 2 + 3 * 3 + 3)


def test_dsv4_serving_names(tmp_path):
    src = _dsv4_draft(9)
    out = export_mtp(src, tmp_path / "v4", dtype=torch.float32)
    names = set(load_file(str(out / "model.safetensors")))
    assert names == {f"mtp.{n.split('.', 2)[1]}.{n.split('.', 2)[2].removeprefix('block.')}"
                     for n in src.state_dict()}
    assert "mtp.1.e_proj.weight" in names and "mtp.0.attn.wkv.weight" in names and "mtp.1.hc_head_scale" in names
    c = json.loads((out / CONFIG_NAME).read_text())
    assert c["n_mtp_layers"] == c["num_nextn_predict_layers"] == 2


def test_sharded_export_round_trips(tmp_path):
    src = _hy_draft(10)
    out = export_mtp(src, tmp_path / "sh", dtype=torch.float32, max_shard_bytes=4096)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    assert main_verify(out) == 0
    assert torch.equal(_chain_logits(src), _chain_logits(_import(out, src)))


def test_import_is_strict_and_names_the_tensor(tmp_path):
    src = _hy_draft(11)
    out = export_mtp(src, tmp_path / "hy", dtype=torch.float32)
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.mtp_layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, str(path))
    reseal(path.parent)  # hand-edited: only the layout checks should object
    with pytest.raises(ValueError, match=r"missing: mtp_layers\.1\.self_attn\.kv_b_proj\.weight"):
        import_mtp(out)
    with pytest.raises(ValueError, match="cannot load into DSV4MTPDraft"):
        import_mtp(out, _dsv4_draft())


# ---- the independent verifier -----------------------------------------------------------------------
def _mutate(folder, how: str, name: str) -> str:
    path = folder / "model.safetensors"
    t = load_file(str(path))
    if how == "missing":
        del t[name]
    elif how == "extra":
        name = name.rsplit(".", 1)[0] + ".bogus"
        t[name] = torch.zeros(3)
    elif how == "shape":
        t[name] = t[name][:-1].contiguous()
    elif how == "dtype":
        t[name] = t[name].to(torch.float16)
    save_file(t, str(path))
    reseal(path.parent)  # hand-edited: only the layout checks should object
    return name


@pytest.mark.parametrize("how", ["missing", "extra", "shape", "dtype"])
@pytest.mark.parametrize("fmt", ["hy", "dsv4"])
def test_verifier_catches(tmp_path, fmt, how, capsys):
    src = _hy_draft(12) if fmt == "hy" else _dsv4_draft(12)
    name = "model.mtp_layers.1.self_attn.q_b_proj.weight" if fmt == "hy" else "mtp.1.h_proj.weight"
    out = export_mtp(src, tmp_path / fmt, dtype=torch.bfloat16)
    assert verify_folder(out).ok
    changed = _mutate(out, how, name)
    report = verify_folder(out)
    assert len(report.problems) == 1, report.problems
    line = report.problems[0]
    assert line.startswith({"missing": "missing:", "extra": "unexpected:", "shape": "shape:",
                            "dtype": "dtype:"}[how]) and changed in line, line
    if how == "dtype":
        assert line.endswith("is F16, expected BF16")
    assert main_verify(out) == 1
    assert "FAILED" in capsys.readouterr().out


def test_verifier_reads_the_layout_from_the_config(tmp_path):
    """Split experts written but the config saying fused: every expert tensor is reported, nothing passes."""
    src = _hy_draft(13, num_layers=1)
    out = export_mtp(src, tmp_path / "hy", dtype=torch.float32, split_experts=True)
    assert verify_folder(out).ok
    c = json.loads((out / CONFIG_NAME).read_text())
    c["mtp_split_experts"] = False
    (out / CONFIG_NAME).write_text(json.dumps(c))
    reseal(out)  # hand-edited: only the layout checks should object
    problems = verify_folder(out).problems
    assert sorted(p.split()[0] for p in problems) == ["missing:"] * 2 + ["unexpected:"] * 9
    del c["hidden_size"]
    (out / CONFIG_NAME).write_text(json.dumps(c))
    reseal(out)  # hand-edited: only the layout checks should object
    assert verify_folder(out).problems == [f"{CONFIG_NAME}: missing keys ['hidden_size']"]


# ---- CLI on a run folder (draft/model.safetensors + draft_config.json, as training writes it) ------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark.export", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("experiment,fmt", [("hyv4_mtp", "hy_v4_mtp"), ("dsv4_mtp", "deepseek_v4_mtp_native")])
def test_cli_exports_verifies_and_reimports_a_tiny_mtp_run(tmp_path, experiment, fmt):
    from conftest import compose
    from dspark import factory
    from dspark.training.run import export_draft

    cfg = compose([f"experiment={experiment}", "draft.num_layers=2"])
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    _randomise(draft, seed=14)
    run = tmp_path / "run"
    export_draft(draft, cfg.draft, cfg.target, run / "draft")
    out = tmp_path / "out"
    extra = ["--split-experts"] if experiment == "hyv4_mtp" else []
    res = _cli("mtp", "--run-dir", str(run), "--out", str(out), "--dtype", "float32", *extra)  # target by kind
    assert res.returncode == 0, res.stdout + res.stderr
    *lines, hint = res.stdout.strip().splitlines()  # the last line: the next step, the merge into the target
    assert hint.startswith("next: vLLM reads this draft from inside the target's checkpoint: merge it"), hint
    notes = 2 if experiment == "hyv4_mtp" else 1  # HY: the indexed MTP layer's index_share_for_mtp_iteration note
    assert lines[-1 - notes].startswith(f"OK {out}: {fmt}")
    # 2 MTP layers: vLLM runs its multi-module speculator for >= 2 speculative tokens (config/speculative.py:2188)
    assert lines[-notes].startswith("  note: num_nextn_predict_layers=2")
    if experiment == "hyv4_mtp":
        assert lines[-1].startswith("  note: indexed MTP layer: serve with speculative_config.index_share_for")
    back = import_mtp(out)
    back.share_target_weights(target.embed_weight, target.lm_head_weight)
    assert torch.equal(_chain_logits(draft), _chain_logits(back))
    if experiment == "hyv4_mtp":  # --merge-into: a copy of the target checkpoint with the draft added
        from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR

        merged = tmp_path / "merged"
        res = _cli("mtp", "--run-dir", str(run), "--out", str(merged), "--merge-into", str(TINY_HY_V4_DIR))
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.strip().splitlines()[-4].startswith(f"OK {merged}: {fmt}")
        hint = res.stdout.strip().splitlines()[-1]
        assert hint.startswith(  # the chain depth eval measured (draft.num_steps)
            f"next: vllm serve {merged} --speculative-config '{{\"method\": \"mtp\", \"num_speculative_tokens\": "
            f"{draft.config.num_steps}}}'"), hint
        assert torch.cuda.is_available() or "on a GPU with vLLM >= 0.33 (not on this machine" in hint, hint
        assert (merged / "model-mtp-draft.safetensors").is_file()
    if experiment == "dsv4_mtp":  # HY-only options are refused for a DeepSeek-V4 draft
        res = _cli("mtp", "--run-dir", str(run), "--out", str(tmp_path / "x"), "--layer-names", "layers")
        assert res.returncode != 0 and "HY V4 MTP drafts only" in res.stderr


@pytest.mark.parametrize("experiment", ["hyv4_mtp", "dsv4_mtp"])
def test_merge_into_a_target_checkpoint(tmp_path, experiment):
    from conftest import compose
    from dspark import factory
    from dspark.export.mtp import MERGED_SHARD, merge_mtp_into_target
    from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    target_dir = TINY_HY_V4_DIR if experiment == "hyv4_mtp" else TINY_V4_DIR
    cfg = compose([f"experiment={experiment}", "draft.num_layers=2"])
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    _randomise(draft, seed=15)
    kw = {}
    if experiment == "hyv4_mtp":  # 2 layers named model.layers.{N+i}: vLLM would load only the first (mtp.py:57-72)
        with pytest.raises(ValueError, match="layer_names='layers' with num_layers=2"):
            merge_mtp_into_target(draft, target_dir, tmp_path / "layers", layer_names="layers")
    out = merge_mtp_into_target(draft, target_dir, tmp_path / "merged", dtype=torch.float32, **kw)
    assert main_verify(out) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as fh:
        own = set(fh.keys())
    drafted = {n for n, f in index.items() if f == MERGED_SHARD}
    assert set(index) == own | drafted and not own & drafted
    n_layers = json.loads((target_dir / "config.json").read_text())["num_hidden_layers"]
    assert n_layers > 0
    probe = "model.mtp_layers.1.eh_proj.weight" if experiment == "hyv4_mtp" else "mtp.1.e_proj.weight"
    assert probe in drafted
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    back = import_mtp(out)
    back.share_target_weights(target.embed_weight, target.lm_head_weight)
    assert torch.equal(_chain_logits(draft), _chain_logits(back))
    # merging again into the merged folder replaces its MTP tensors (nothing of the first draft survives)
    _randomise(draft, seed=17)
    again = merge_mtp_into_target(draft, out, tmp_path / "again", dtype=torch.float32, **kw)
    index2 = json.loads((again / "model.safetensors.index.json").read_text())["weight_map"]
    assert index2 == index and main_verify(again) == 0
    back2 = import_mtp(again)
    back2.share_target_weights(target.embed_weight, target.lm_head_weight)
    assert torch.equal(_chain_logits(draft), _chain_logits(back2))
    assert not torch.equal(_chain_logits(back), _chain_logits(back2))
    # the verifier still judges the MTP tensors of a merged folder
    t = load_file(str(out / MERGED_SHARD))
    t[probe] = t[probe].to(torch.float16)
    save_file(t, str(out / MERGED_SHARD))
    reseal(out)  # hand-edited: only the layout checks should object
    assert [p.split()[0] for p in verify_folder(out).problems] == ["dtype:"]
    # a draft whose sizes are not the target's is refused (vLLM builds the MTP layers from the target config)
    wrong = _hy_draft(16) if experiment == "hyv4_mtp" else _dsv4_draft(16)
    with pytest.raises(ValueError, match="hidden_size: draft 16 vs target"):
        merge_mtp_into_target(wrong, target_dir, tmp_path / "wrong")

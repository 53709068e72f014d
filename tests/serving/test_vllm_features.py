"""Target features from vLLM (data.feature_producer=vllm, dspark/serving/vllm_features.py) equal FrozenTarget's.

Without vLLM: the identity computed from the checkpoint equals the loaded target's, the id mapping / final norm
reproduce FrozenTarget from transformers' own hidden states, DeepSeek-V4 is refused naming why, a missing vLLM is one
clear error. With vLLM (its own venv; CI installs it, DSPARK_REQUIRE_VLLM=1 makes a missing one fail): vLLM's
extracted states of every layer vs FrozenTarget's taps in float32 (the mapping passes, a layer off by one fails),
20 training steps of the tiny dense DFlash config on a vLLM-built cache follow the HF-built cache's loss curve, and a
streamed run (data.feature_stream) whose child producer runs the real engine trains on the head-only target and
leaves the offline cache of its rows.

Tolerance of the float32 comparison: TOL_ULPS ulps of float32 at the tensor's own scale (max |ref|). The two
sides run the same math through different kernels (oneDNN GEMMs and vLLM's CPU attention vs torch's matmul and SDPA),
so only the summation order differs: a dot product of K terms differs by ~sqrt(K) ulps typically, K*eps at worst
(K <= 128 here), and 4 layers compound it; the final norm divides by the RMS (scale ~1/rms). Measured: ~2 ulps on the
taps, ~8 on the normed final. A tap from the neighbouring layer differs by O(max|ref|), ~10^6 ulps.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch

from conftest import REPO, vllm_or_skip
from dspark.schema import run_config

EPS32 = torch.finfo(torch.float32).eps
TOL_ULPS = 128
LAYERS = [2, 0]  # of the tiny target's 4: unsorted on purpose (the taps keep this order)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, the tolerance at b's scale)."""
    return (a - b).abs().max().item(), TOL_ULPS * EPS32 * max(1.0, b.abs().max().item())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from dspark.targets.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("vllm_features") / "target")


def _rows(lengths=(5, 30, 17, 64, 9), seed=0) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_dict({"input_ids": [torch.randint(5, 2048, (n,), generator=g).tolist()
                                                     for n in lengths]})


# ---- without vLLM ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_identity_is_the_loaded_targets(tiny, tmp_path, dtype):
    from safetensors.torch import load_file, save_file

    from dspark.data.feature_cache import target_identity
    from dspark.targets.checkpoint import checkpoint_identity
    from dspark.targets.hf_target import load_hf_target

    assert checkpoint_identity(tiny, LAYERS, dtype) == target_identity(load_hf_target(str(tiny), LAYERS, dtype))
    # another weight (first element of one tensor, which the strided sample reads): another identity
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    sd = load_file(other / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"][0, 0] += 0.5
    save_file(sd, other / "model.safetensors", metadata={"format": "pt"})
    a, b = checkpoint_identity(tiny, LAYERS, dtype), checkpoint_identity(other, LAYERS, dtype)
    assert a["weights_hash"] != b["weights_hash"] and a["config_hash"] == b["config_hash"]
    assert b == target_identity(load_hf_target(str(other), LAYERS, dtype))


def test_checkpoint_identity_reads_sharded_and_bf16_checkpoints(tiny, tmp_path):
    """An index with several shards, and a bfloat16 checkpoint loaded as float32 (the loader upcasts exactly)."""
    from transformers import AutoModelForCausalLM

    from dspark.data.feature_cache import target_identity
    from dspark.targets.checkpoint import checkpoint_identity
    from dspark.targets.hf_target import load_hf_target

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / f, tmp_path / f)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    for dtype in ("float32", "bfloat16"):
        assert checkpoint_identity(tmp_path, LAYERS, dtype) == target_identity(load_hf_target(str(tmp_path), LAYERS,
                                                                                              dtype)), dtype


def test_id_mapping_and_final_norm_rebuild_frozen_target_from_vllm_layout(tiny):
    """vLLM's aux id i = the stream entering layer i = transformers' hidden_states[i] (before the final norm for
    i = num_layers); mapping the taps through vllm_aux_ids and applying FinalNorm gives FrozenTarget's features."""
    from transformers import AutoModelForCausalLM

    from dspark.serving.vllm_features import FinalNorm, vllm_aux_ids
    from dspark.targets.hf_target import FrozenTarget

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    target = FrozenTarget(model, LAYERS)
    ids = torch.tensor([_rows()[3]["input_ids"]])
    ref = target.features(ids)
    with torch.no_grad():
        out = model.model(input_ids=ids, output_hidden_states=True)
    n = model.config.num_hidden_layers
    # transformers' hidden_states[n] is post-norm; the residual stream leaving the last layer is hooked instead
    streams = list(out.hidden_states[:n])
    last = {}
    h = model.model.layers[-1].register_forward_hook(lambda _m, _i, o: last.setdefault("x", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        model.model(input_ids=ids)
    h.remove()
    streams.append(last["x"])  # vLLM's layout: [vllm id] -> [1, T, H]
    vids, tap_rows, final_row = vllm_aux_ids(LAYERS, n)
    stacked = torch.stack([streams[i][0] for i in vids], dim=1)  # [T, n_ids, H] as the connector writes it
    aux = torch.cat([stacked[:, r] for r in tap_rows], dim=-1)
    final = FinalNorm(tiny, torch.float32)(stacked[:, final_row])
    assert torch.equal(aux, ref.aux[0]) and torch.equal(final, ref.final[0])
    # the same layout read with the project's ids (no +1) is another layer's output
    wrong = torch.cat([streams[l][0] for l in LAYERS], dim=-1)
    assert (wrong - ref.aux[0]).abs().max() > 1e-2


def test_deepseek_v4_is_refused_naming_why(tmp_path, monkeypatch):
    """The tiny target's sizes / dtype are not what vLLM's V4 kernels take (tests/serving/test_vllm_v4_features.py)."""
    from dspark.serving.vllm_features import ALLOW_UNVERIFIED_ENV, build_feature_cache_vllm
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    with pytest.raises(ValueError, match=r"'deepseek_v4' \(hc_mult=\d+, the normed final captured.*head_dim 32"):
        build_feature_cache_vllm(TINY_V4_DIR, [0, 1], _rows(), tmp_path / "c", python="/nonexistent/python")
    assert not (tmp_path / "c").exists()


def test_unverified_architecture_is_refused(tiny, tmp_path):
    from dspark.serving.vllm_features import build_feature_cache_vllm

    other = tmp_path / "gemma_like"
    shutil.copytree(tiny, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"model_type 'gemma' is not one .*verified: llama"):
        build_feature_cache_vllm(other, LAYERS, _rows(), tmp_path / "c", python="/nonexistent/python")


def test_missing_vllm_is_one_clear_error(tiny, tmp_path):
    from dspark.serving.vllm_features import build_feature_cache_vllm
    from dspark.serving.engine import VLLMUnavailable

    with pytest.raises(VLLMUnavailable, match=r"does not exist: install it with `bash scripts/setup_vllm.sh`"):
        build_feature_cache_vllm(tiny, LAYERS, _rows(), tmp_path / "c", python=str(tmp_path / "no" / "python"))
    assert not (tmp_path / "c" / "meta.json").exists()


# ---- with vLLM --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_vllm_states_equal_frozen_target_taps_and_off_by_one_fails(tiny, tmp_path):
    """One vLLM engine extracting EVERY aux id 0..num_layers: the producer's mapping (tap L = id L + 1, final =
    norm(id num_layers)) is within float32 kernel noise of FrozenTarget; the tap read at id L is not."""
    from safetensors.torch import load_file

    from dspark.serving.vllm_features import FinalNorm, vllm_aux_ids
    from dspark.serving.engine import VLLMWorker
    from dspark.targets.hf_target import load_hf_target

    python = vllm_or_skip()
    target = load_hf_target(str(tiny), LAYERS, "float32")
    n = len(target.layers)
    rows = _rows()
    seqs = [r["input_ids"] for r in rows]
    with VLLMWorker(python, log_path=tmp_path / "vllm.log") as w:
        w.init(target=str(tiny), dtype="float32", max_model_len=128, kv_cache_gib=1, per_request_metrics="none",
               extract_layer_ids=list(range(n + 1)), extract_dir=str(tmp_path / "hs"))
        paths = w.extract(seqs)["paths"]
    norm = FinalNorm(tiny, torch.float32)
    vids, tap_rows, final_row = vllm_aux_ids(LAYERS, n)  # every id was extracted: the row of id i is i
    worst = {"aux": (0.0, 1.0), "final": (0.0, 1.0), "off_by_one": (float("inf"), 1.0)}
    for s, path in zip(seqs, paths):
        data = load_file(path)
        hs = data["hidden_states"]
        assert data["token_ids"].tolist() == s and hs.shape == (len(s), n + 1, target.hidden_size)
        ref = target.features(torch.tensor([s]))
        got = {"aux": torch.cat([hs[:, vids[r]] for r in tap_rows], dim=-1), "final": norm(hs[:, vids[final_row]])}
        for k in ("aux", "final"):
            d, tol = _max_diff(got[k], ref.aux[0] if k == "aux" else ref.final[0])
            worst[k] = max(worst[k], (d, tol), key=lambda x: x[0] / x[1])
        off = torch.cat([hs[:, l] for l in LAYERS], dim=-1)  # id L = the input of layer L: one layer early
        d, tol = _max_diff(off, ref.aux[0])
        worst["off_by_one"] = min(worst["off_by_one"], (d, tol), key=lambda x: x[0] / x[1])
    print("max |vLLM - FrozenTarget| (tolerance):", {k: f"{d:.3g} ({t:.3g})" for k, (d, t) in worst.items()})
    assert worst["aux"][0] <= worst["aux"][1], worst
    assert worst["final"][0] <= worst["final"][1], worst
    assert worst["off_by_one"][0] > 100 * worst["off_by_one"][1], worst


def _train_cfg(tiny, run_dir, cache_dir, producer, python):
    from hydra import compose, initialize_config_dir

    from dspark.serving.tiny_dense import MASK_ID

    overrides = [
        "experiment=dflash_smollm2", "target=hf", f"target.path={tiny}", "target.dtype=float32",
        "data=sharegpt_tiny", "data.limit=48", "data.max_length=96", "data.val_examples=4", "data.min_loss_tokens=4",
        f"data.feature_cache={cache_dir}", "data.feature_cache_dtype=float32", f"data.feature_producer={producer}",
        f"data.vllm_producer.python={python}", "data.vllm_producer.kv_cache_gib=1",
        "draft.num_layers=1", "draft.block_size=4", f"draft.mask_token_id={MASK_ID}",
        f"draft.target_layer_ids=[{min(LAYERS)},{max(LAYERS)}]", "train.batch_size=4", "train.val_batch_size=8",
        "train.num_anchors=4", "trainer.max_steps=20", "trainer.val_check_interval=20", "trainer.log_every_n_steps=1",
        "callbacks.last_checkpoint.every_n_train_steps=20", "trainer.enable_progress_bar=false",
        "validate_at_start=false", "draft.draft_vocab_size=null", "trainer.precision=32-true", f"run_dir={run_dir}"]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.slow
def test_training_on_a_vllm_cache_follows_the_hf_cache(tiny, tmp_path):
    from test_feature_cache import NoTargetForward
    from test_train_e2e import train_losses

    from dspark.data.feature_cache import FeatureCache
    from dspark.training.run import run_training

    python = vllm_or_skip()
    runs = {}
    for producer in ("hf", "vllm"):
        run_training(_train_cfg(tiny, tmp_path / f"run_{producer}", tmp_path / f"fc_{producer}", producer, python),
                     callbacks=(NoTargetForward(),))
        runs[producer] = train_losses(tmp_path / f"run_{producer}")
    hf, vl = FeatureCache(tmp_path / "fc_hf"), FeatureCache(tmp_path / "fc_vllm")
    assert (hf.meta["producer"], vl.meta["producer"]) == ("hf", "vllm")
    assert vl.meta["key"] == hf.meta["key"] and vl.meta["target"] == hf.meta["target"]  # the same identity
    worst = 0.0
    for i in range(len(hf)):
        (a1, f1), (a2, f2) = hf.get(i), vl.get(i)
        for x, y in ((a2, a1), (f2, f1)):
            d, tol = _max_diff(x, y)
            assert d <= tol, (i, d, tol)
            worst = max(worst, d)
    a, b = runs["hf"], runs["vllm"]
    print(f"max feature diff {worst:.3g}; losses hf {[round(a[s], 4) for s in sorted(a)]}")
    assert sorted(a) == sorted(b) == list(range(20))
    rel = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    print(f"max relative loss difference over 20 steps: {rel:.3g}")
    assert rel <= 1e-3, (a, b)
    assert a[19] < a[0]  # the curve is a curve: training moved


@pytest.mark.slow
def test_streamed_training_with_the_real_vllm_producer(tiny, tmp_path, monkeypatch):
    """data.feature_stream with data.feature_producer=vllm: the trainer (head-only target) reads the shards a real
    vLLM engine writes in its child process (one engine start, shards of 16); the run ends, and the finished cache is
    the offline cache of the same rows: producer vllm, the key of an offline build (hf here: an offline vllm build
    gets the same key, test_training_on_a_vllm_cache_follows_the_hf_cache), features within TOL_ULPS."""
    from test_head_only_target import TargetKind
    from test_train_e2e import train_losses

    from dspark.data import feature_stream
    from dspark.data.feature_cache import FeatureCache, build_feature_cache
    from dspark.data.feature_cache_build import rows_before_target
    from dspark.factory import build_dataset
    from dspark.targets.head_only import HeadOnlyTarget
    from dspark.targets.hf_target import load_hf_target
    from dspark.training.run import run_training

    python = vllm_or_skip()
    monkeypatch.setattr(feature_stream, "SHARD_SIZE", 16)
    cfg = _train_cfg(tiny, tmp_path / "run", tmp_path / "fc", "vllm", python)
    cfg.data.feature_stream, cfg.trainer.max_steps, cfg.trainer.val_check_interval = True, 3, 3
    kind = TargetKind()
    run_training(cfg, callbacks=(kind,))
    assert kind.kinds == [HeadOnlyTarget] and sorted(train_losses(tmp_path / "run")) == [0, 1, 2]
    streamed = FeatureCache(tmp_path / "fc")
    rows = rows_before_target(run_config(cfg).data, str(tiny), build_dataset)
    taps = [int(i) for i in cfg.draft.target_layer_ids]
    offline = FeatureCache(build_feature_cache(load_hf_target(str(tiny), taps, "float32"), rows, tmp_path / "hf",
                                               dtype=torch.float32))
    assert streamed.meta["producer"] == "vllm" and streamed.meta["key"] == offline.meta["key"]
    assert len(streamed) == len(offline) == len(rows) > 2 * 16  # 3 shards at least
    worst = 0.0
    for i in range(len(rows)):
        for x, y in zip(streamed.get(i), offline.get(i)):
            d, tol = _max_diff(x, y)
            assert d <= tol, (i, d, tol)
            worst = max(worst, d)
    print(f"streamed vLLM cache vs offline HF build: {len(rows)} rows, max feature diff {worst:.3g}")


class FakeExtractWorker:
    """Stands in for dspark.serving.engine.VLLMWorker: writes what vLLM's hidden-states connector writes (the
    stream entering each requested layer, [T, n_ids, H]) from transformers' forward, so the producer's plumbing
    (shards, resume, reuse, identity) runs without vLLM."""

    started = 0
    extracted = 0

    def __init__(self, python=None, **_kw):
        type(self).started += 1

    def init(self, *, target, extract_layer_ids, extract_dir, **_kw):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.ids, self.dir = list(extract_layer_ids), Path(extract_dir)
        return {}

    def extract(self, prompts):
        from safetensors.torch import save_file

        paths = []
        for k, p in enumerate(prompts):
            streams = {}
            hooks = [layer.register_forward_hook(lambda _m, _i, o, i=i: streams.__setitem__(i + 1, o[0] if isinstance(o, tuple) else o))
                     for i, layer in enumerate(self.model.model.layers)]
            hooks.append(self.model.model.embed_tokens.register_forward_hook(lambda _m, _i, o: streams.__setitem__(0, o)))
            with torch.no_grad():
                self.model.model(input_ids=torch.tensor([p]))
            for h in hooks:
                h.remove()
            path = self.dir / f"{type(self).extracted}-{k}.safetensors"
            save_file({"hidden_states": torch.stack([streams[i][0] for i in self.ids], dim=1).contiguous(),
                       "token_ids": torch.tensor(p)}, str(path))
            paths.append(str(path))
        type(self).extracted += 1
        return {"paths": paths, "extract_s": 0.0}

    def close(self):
        pass


def test_vllm_producer_shards_resume_and_reuse(tiny, tmp_path, monkeypatch):
    import dspark.serving.vllm_features as vllm_features
    from dspark.data.feature_cache import FeatureCache, build_feature_cache, shard_name
    from dspark.serving.vllm_features import build_feature_cache_vllm
    from dspark.targets.hf_target import load_hf_target

    monkeypatch.setattr(vllm_features, "VLLMWorker", FakeExtractWorker)
    rows = _rows(lengths=(5, 30, 17, 64, 9, 12, 3))
    kw = dict(dtype=torch.float32, shard_size=3, batch_size=2)
    ref = FeatureCache(build_feature_cache(load_hf_target(str(tiny), LAYERS, "float32"), rows, tmp_path / "hf", **kw))
    out = tmp_path / "vl"
    build_feature_cache_vllm(tiny, LAYERS, rows, out, **kw)
    assert FakeExtractWorker.started == 1 and FakeExtractWorker.extracted == 5  # batches of <= 2 in shards of 3: 2+2+1
    first = FeatureCache(out)
    assert first.meta["key"] == ref.meta["key"] and first.meta["producer"] == "vllm"
    for i in range(len(rows)):
        for x, y in zip(first.get(i), ref.get(i)):
            d, tol = _max_diff(x, y)
            assert d <= tol, (i, d, tol)
    # interrupted after shard 0: meta.json and shard 2 gone -> only shard 2 is computed again, same bytes
    from safetensors.torch import load_file

    def contents():
        return {k: load_file(out / shard_name(k)) for k in range(3)}

    shards = contents()
    (out / "meta.json").unlink()
    (out / shard_name(2)).unlink()
    FakeExtractWorker.extracted = 0
    build_feature_cache_vllm(tiny, LAYERS, rows, out, **kw)
    assert FakeExtractWorker.started == 2 and FakeExtractWorker.extracted == 1
    again = contents()
    assert all(again[k].keys() == shards[k].keys() and all(torch.equal(again[k][n], shards[k][n]) for n in shards[k])
               for k in range(3))
    # complete: reused without starting an engine; another layer set is refused naming it
    build_feature_cache_vllm(tiny, LAYERS, rows, out, **kw)
    assert FakeExtractWorker.started == 2
    with pytest.raises(ValueError, match="other layer ids"):
        build_feature_cache_vllm(tiny, [1, 3], rows, out, **kw)
    assert FakeExtractWorker.started == 2


def test_cache_built_as_its_own_job_is_the_one_training_reuses(tiny, tmp_path, monkeypatch):
    """scripts/build_feature_cache.py's function (no target loaded) writes the cache under the key train.py computes
    for data.feature_cache=auto, so the training run reuses it without starting vLLM again."""
    import dspark.serving.vllm_features as vllm_features
    from test_feature_cache import NoTargetForward

    from dspark.data.feature_cache import FeatureCache
    from dspark.data.feature_cache_build import build_feature_cache_offline
    from dspark.factory import build_dataset
    from dspark.training.cache_plan import feature_cache_plan
    from dspark.training.run import run_training

    monkeypatch.setattr(vllm_features, "VLLMWorker", FakeExtractWorker)
    FakeExtractWorker.started = 0
    cfg = _train_cfg(tiny, tmp_path / "run", "auto", "vllm", "/nonexistent/python")
    run = run_config(cfg)
    path = build_feature_cache_offline(feature_cache_plan(run), run.data, build_dataset)
    assert FakeExtractWorker.started == 1 and FeatureCache(path).meta["producer"] == "vllm"
    run_training(_train_cfg(tiny, tmp_path / "run", "auto", "vllm", "/nonexistent/python"),
                 callbacks=(NoTargetForward(),))
    assert FakeExtractWorker.started == 1  # reused: the same key, found where training looks
    with pytest.raises(ValueError, match="feature_producer"):
        hf = run_config(_train_cfg(tiny, tmp_path / "run2", "auto", "hf", "/nonexistent/python"))
        build_feature_cache_offline(feature_cache_plan(hf), hf.data, build_dataset)

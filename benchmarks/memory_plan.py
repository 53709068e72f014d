"""Per-GPU memory and a step-time model of DSpark draft training under DDP / FSDP2 / ZeRO-3 on 8 and 16 GPUs,
for DeepSeek-V4-Flash and a dense 8B target (Llama-3.1-8B sizes), plus feature-cache bytes per token per layout.
Every parameter count comes from the real modules built on the meta device (no memory, no weights): the target
from transformers' class, the draft from dspark's.

    python benchmarks/memory_plan.py [--json out.json] [--markdown]     (benchmarks/README.md "Memory plan")

Memory per GPU (bytes), P = draft parameters, N = GPUs; Lightning's bf16-mixed keeps fp32 weights and autocasts:
  draft state        fp32 weights 4P + fp32 grads 4P + AdamW moments 8P = 16P, plus per strategy:
    DDP              16P + 4P (gradient buckets: DDP copies the grads into them, gradient_as_bucket_view=False)
    FSDP2 (ours)     16P / N + 8P transient: the whole draft is one FSDP unit (dspark.training.sharding), so a step
                     holds the unsharded fp32 weights and, until the reduce-scatter, the unsharded grads
    ZeRO-3           16P / N + 2 x 4 x (largest draft layer) transient (per-module gather + one prefetched)
  target             never sharded nor in the optimizer: online (target forward every step) the whole target in
                     bf16 on every GPU; from a feature cache only the embedding, final norm and LM head
  activations        per draft layer and token 34 x H bytes (bf16; Korthikanti et al. 2022, eq. 2 without the
                     attention-score term, as flash/flex attention keeps none) over the block tokens
                     (num_anchors x block length per sequence) + the context K/V and combined context rows
                     (S x (2 x layers + 1) x H x 2), + the fused loss's chunk (rows x V x 4, 512 rows)
Step time per GPU = compute + exposed communication: 6 x active draft params x block tokens (+ 2 x active target
params x tokens online) / (peak x MFU); gradients over the interconnect: DDP ring all-reduce 2 (N-1)/N x 4P,
FSDP2 all-gather + reduce-scatter 2 (N-1)/N x 4P, ZeRO-3 + one more all-gather in backward 3 (N-1)/N x 4P; 16
GPUs = 2 nodes of 8, the inter-node links bound the ring. Assumptions are printed with the result.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

STRATEGIES = ("ddp", "fsdp2", "zero3")
ACT_BYTES_PER_H = 34  # bytes per token per layer per hidden unit, bf16 (Korthikanti et al. 2022, no s^2 term)
LOSS_CHUNK_ROWS = 512  # dspark.ops.fused_loss default chunk


@dataclass
class Workload:
    seq_len: int = 4096  # tokens per sequence
    seqs_per_gpu: int = 1
    num_anchors: int = 512  # blocks per sequence (train.num_anchors)
    peak_tflops: float = 989.0  # H100/H200 dense bf16
    mfu: float = 0.35
    intra_node_GBps: float = 350.0  # NVLink ring bandwidth (effective)
    inter_node_GBps: float = 45.0  # 400 Gb/s InfiniBand per GPU (effective)
    gpus_per_node: int = 8


def draft_state_bytes(p: int, n: int, strategy: str, largest_layer: int) -> dict[str, float]:
    """The draft's weights + grads + AdamW moments per GPU (persistent) and the step's transient copies."""
    persistent = {"ddp": 16 * p, "fsdp2": 16 * p / n, "zero3": 16 * p / n}[strategy]
    transient = {"ddp": 4 * p, "fsdp2": 8 * p, "zero3": 2 * 4 * largest_layer}[strategy]
    return {"draft_state": persistent, "draft_transient": transient}


def activation_bytes(w: Workload, hidden: int, layers: int, block_len: int, vocab: int) -> float:
    block_tokens = w.num_anchors * block_len
    per_seq = (ACT_BYTES_PER_H * hidden * layers * block_tokens + w.seq_len * (2 * layers + 1) * hidden * 2)
    return w.seqs_per_gpu * per_seq + LOSS_CHUNK_ROWS * vocab * 4


def comm_seconds(w: Workload, p: int, n: int, strategy: str) -> float:
    volume = {"ddp": 2, "fsdp2": 2, "zero3": 3}[strategy] * (n - 1) / n * 4 * p
    bw = w.intra_node_GBps if n <= w.gpus_per_node else w.inter_node_GBps
    return volume / (bw * 1e9)


def plan_rows(spec: dict, w: Workload) -> list[dict]:
    rows = []
    for online in (True, False):
        target_bytes = spec["target_params"] * 2 if online else spec["target_loss_params"] * 2
        for n in (8, 16):
            for s in STRATEGIES:
                mem = draft_state_bytes(spec["draft_params"], n, s, spec["draft_largest_layer"])
                act = activation_bytes(w, spec["hidden"], spec["draft_layers"], spec["block_len"], spec["vocab"])
                total = target_bytes + mem["draft_state"] + mem["draft_transient"] + act
                tokens = w.seqs_per_gpu * w.num_anchors * spec["block_len"]
                flops = 6 * spec["draft_active"] * tokens
                if online:
                    flops += 2 * spec["target_active"] * w.seqs_per_gpu * w.seq_len
                compute = flops / (w.peak_tflops * 1e12 * w.mfu)
                comm = comm_seconds(w, spec["draft_params"], n, s)
                rows.append({"target": spec["name"], "features": "online" if online else "cache", "gpus": n,
                             "strategy": s, "target_GB": target_bytes / 1e9,
                             "draft_state_GB": mem["draft_state"] / 1e9,
                             "draft_transient_GB": mem["draft_transient"] / 1e9, "activations_GB": act / 1e9,
                             "total_GB": total / 1e9, "compute_s": compute, "comm_s": comm,
                             "step_s": compute + comm})
    return rows


def _count(module: torch.nn.Module, pred=lambda name: True) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if pred(n))


def v4_flash_spec() -> dict:
    from omegaconf import OmegaConf
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft
    from dspark.models.registry import config_values

    dcfg = DSparkV4Config.from_dict(config_values(OmegaConf.load(ROOT / "configs/draft/dspark_v4_flash.yaml")))
    a = {k: getattr(dcfg, k) for k in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads",
                                       "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts",
                                       "num_experts_per_tok", "hc_mult", "topk_method")}
    tcfg = DeepseekV4Config(num_hidden_layers=max(dcfg.target_layer_ids) + 1, **a)  # 43 layers: ids 40-42
    with torch.device("meta"):
        target = DeepseekV4ForCausalLM(tcfg)
        draft = DSparkV4Draft(dcfg)
    routed = lambda n: ".experts." in n and "shared" not in n  # noqa: E731
    E, k = dcfg.n_routed_experts, dcfg.num_experts_per_tok
    return _spec("DeepSeek-V4-Flash", target, draft, dcfg, routed, k / E,
                 loss_params=2 * dcfg.vocab_size * dcfg.hidden_size + dcfg.hidden_size,
                 largest=max(_count(layer) for layer in draft.layers))


def dense_8b_spec() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft

    tcfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    dcfg = DSparkDenseConfig.from_target_config(tcfg, num_layers=2, block_size=6, mask_token_id=128002,
                                                target_layer_ids=[1, 9, 17, 25, 31], markov_rank=256)
    with torch.device("meta"):
        target = LlamaForCausalLM(tcfg)
        draft = DSparkDenseDraft(dcfg)
    return _spec("dense 8B (Llama-3.1-8B sizes)", target, draft, dcfg, lambda n: False, 0.0,
                 loss_params=2 * tcfg.vocab_size * tcfg.hidden_size + tcfg.hidden_size,
                 largest=max(_count(layer) for layer in draft.layers))


def _spec(name, target, draft, dcfg, routed, routed_share, loss_params, largest) -> dict:
    t_all, t_routed = _count(target), _count(target, routed)
    d_all, d_routed = _count(draft), _count(draft, routed)
    return {"name": name, "target_params": t_all, "target_active": int(t_all - t_routed + routed_share * t_routed),
            "target_loss_params": loss_params, "draft_params": d_all,
            "draft_active": int(d_all - d_routed + routed_share * d_routed), "draft_largest_layer": largest,
            "draft_layers": int(dcfg.num_layers), "hidden": int(dcfg.hidden_size), "vocab": int(dcfg.vocab_size),
            "block_len": int(dcfg.block_size) + (1 if getattr(dcfg, "layout", "anchor") == "anchor" else 0),
            "aux_layers": len(dcfg.target_layer_ids)}


def cache_bytes_per_token(spec: dict, assistant_fraction: float = 0.68) -> dict[str, float]:
    """Feature-cache bytes per token for each layout (dspark.data.feature_cache), as benchmarks/v4_flash_sizes.py."""
    H, n, f = spec["hidden"], spec["aux_layers"], assistant_fraction
    return {"plain bfloat16": (n * H + H) * 2, "plain float32": (n * H + H) * 4,
            "fp8_e4m3 (scale per row and layer)": (n * H + 4 * n) + (H + 4),
            "bf16, teacher_rows=assistant": n * H * 2 + f * (H * 2 + 4),
            "fp8_e4m3, teacher_rows=assistant": (n * H + 4 * n) + f * (H + 4 + 4)}


def markdown(specs: list[dict], rows: list[dict], w: Workload) -> str:
    out = [f"Workload per GPU: {w.seqs_per_gpu} x {w.seq_len} tokens, {w.num_anchors} anchors; {w.peak_tflops:.0f} "
           f"TFLOP/s x MFU {w.mfu}; rings {w.intra_node_GBps:.0f} GB/s in a node, {w.inter_node_GBps:.0f} GB/s "
           f"across ({w.gpus_per_node} GPUs a node).", ""]
    for s in specs:
        out.append(f"- {s['name']}: target {s['target_params'] / 1e9:.1f} B parameters ({s['target_active'] / 1e9:.1f}"
                   f" B active per token); draft {s['draft_params'] / 1e6:.0f} M ({s['draft_active'] / 1e6:.0f} M "
                   f"active), {s['draft_layers']} layers, largest layer {s['draft_largest_layer'] / 1e6:.0f} M")
    out += ["", "| target | features | GPUs | strategy | target GB | draft state GB | transient GB | activations GB "
            "| total GB / GPU | step s (compute + comm) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['target']} | {r['features']} | {r['gpus']} | {r['strategy']} | {r['target_GB']:.1f} | "
                   f"{r['draft_state_GB']:.2f} | {r['draft_transient_GB']:.2f} | {r['activations_GB']:.2f} | "
                   f"{r['total_GB']:.1f} | {r['step_s']:.3f} ({r['compute_s']:.3f} + {r['comm_s']:.3f}) |")
    out += ["", "| target | cache layout | bytes / token | GB / 1M tokens |", "|---|---|---|---|"]
    for s in specs:
        for k, v in cache_bytes_per_token(s).items():
            out.append(f"| {s['name']} | {k} | {v:.0f} | {v * 1e6 / 1e9:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    w = Workload()
    specs = [v4_flash_spec(), dense_8b_spec()]
    rows = [r for s in specs for r in plan_rows(s, w)]
    result = {"workload": asdict(w), "targets": specs, "rows": rows,
              "cache_bytes_per_token": {s["name"]: cache_bytes_per_token(s) for s in specs}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(markdown(specs, rows, w) if args.markdown else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

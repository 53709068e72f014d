"""FLOPs of one training step of a dense block draft (DSpark / DFlash: a family whose config declares FLOPS_COUNTED,
trained by dspark.training.block_module.BlockDraftModule), counted from the draft's config and the batch's shapes;
and the GEMM peak a step's FLOP rate is compared with (MFU).

What is counted: every matrix product the step runs, forward and backward, as 2*m*n*k. Nothing else: norms, RoPE,
softmax, the loss's exp / sums / signs, gathers, the embedding lookups and their backward are elementwise or
memory work and count 0. The frozen target is not in the step (its features come from data.feature_cache; a run
without one also runs the target's forward, which is not counted). The optimizer is the one exception: AdamW plus
gradient clipping counted as OPTIMIZER_FLOPS_PER_PARAM elementwise FLOPs per trainable parameter.

A linear layer y = x W^T over `rows` rows runs 1 GEMM forward and, backward, one for dW and one for dx when its
input needs a gradient (3 passes); the combiner `fc` reads the target's features, which need none (2 passes).
Every other input in the step needs one (the first layer's input is the frozen embedding, but its input norm has a
trainable weight). Parts:

  context       fc (n*H -> H, 2 passes) and every layer's k_proj / v_proj over the context rows B x S: all padded
                positions, as the training forward runs them today
  draft_layers  q / k / v / o projections and the SwiGLU MLP of every layer over the block rows B x A x Lb
  attention     q.k scores and p.v over the (query, key) pairs masked_attention really scores (attention_work):
                3 passes; when its backward recomputes them (torch.utils.checkpoint above RECOMPUTE_BYTES) the
                forward once more, less its last GEMM (p.v over each block's own keys): checkpoint's early stop
                ends the recomputation once the backward has what it needs, and no backward needs that output
  lm_head_loss  per scored row (valid eval rows only, fused or materialised): draft GEMM x W[Vd, H]^T, Markov GEMM
                latent x W2[Vd, r]^T, teacher GEMM y W[Vt, H]^T (when the step runs one), and the gradients the fused
                loss forms in its forward: dD W, dD W2, dD^T E. Plus the draft's heads over every prediction row:
                the gated / RNN Markov projection (3 passes) and the confidence head (3 passes when the confidence
                loss trains it, else forward only)
  optimizer     OPTIMIZER_FLOPS_PER_PARAM x trainable parameters

The attention count follows the torch reference masked_attention runs on CPU; on CUDA flex_attention scores
128 x 128 tiles of the same rule, which this count does not model.
"""
from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass

import torch

from dspark.models.contract import optional
from dspark.ops import attention
from dspark.ops.attention import masked_attention
from dspark.training.block_module import BlockDraftModule
from dspark.training.blocks import build_blocks

PARTS = ("lm_head_loss", "draft_layers", "context", "attention", "optimizer")

# AdamW per parameter: weight decay (1), m = b1 m + (1 - b1) g (3), v = b2 v + (1 - b2) g^2 (4), bias corrections,
# sqrt, + eps, divide, scale by lr, subtract (~6); gradient clipping: its norm (2) and the rescale (1). ~16.
OPTIMIZER_FLOPS_PER_PARAM = 16


@dataclass(frozen=True)
class DraftDims:
    """The sizes of a dense draft the step's FLOPs depend on (DSparkDenseConfig)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    taps: int  # len(target_layer_ids): fc reads taps x hidden features
    markov_rank: int  # 0: no Markov head (DFlash)
    markov_kind: str  # vanilla | gated | rnn
    confidence: bool  # a confidence head Linear(H + r -> 1)
    vocab: int  # the target's vocabulary (markov_w1 rows)
    draft_vocab: int  # the rows the draft scores (markov_w2 rows)

    @classmethod
    def from_config(cls, cfg) -> "DraftDims":
        r = int(cfg.markov_rank)
        return cls(hidden=int(cfg.hidden_size), layers=int(cfg.num_layers), heads=int(cfg.num_attention_heads),
                   kv_heads=int(cfg.num_key_value_heads), head_dim=int(cfg.head_dim),
                   intermediate=int(cfg.intermediate_size), taps=len(cfg.target_layer_ids), markov_rank=r,
                   markov_kind=str(cfg.markov_head_type), confidence=bool(r > 0 and cfg.confidence_head),
                   vocab=int(cfg.vocab_size), draft_vocab=int(cfg.draft_vocab_size or cfg.vocab_size))


@dataclass(frozen=True)
class StepShapes:
    """What one batch makes the step compute (step_shapes reads it from a batch)."""

    context_rows: int  # B x S (S = padded length)
    block_rows: int  # B x A x Lb
    pred_rows: int  # B x A x g: the rows the draft's heads run over
    loss_rows: int  # valid eval_mask rows (the loss tokens)
    attention_pairs: int  # (query, key) pairs scored per query head per layer, summed over the batch
    attention_own_pairs: int  # of those, the pairs of a block's queries with its own keys: B x A x Lb x Lb
    attention_recompute: bool  # the attention's backward recomputes its forward (checkpointed block groups)
    draft_vocab: int  # Vd, the LM-head rows the draft scores
    teacher_vocab: int  # Vt, the rows the teacher GEMM scores; 0 = no teacher GEMM in the step
    conf_loss: bool  # the confidence head is in the backward


def _linear(rows: int, n_in: int, n_out: int, passes: int) -> int:
    """GEMM FLOPs of a linear layer [rows, n_in] -> [rows, n_out]: 1 pass = forward, 2 = + dW, 3 = + dx."""
    return passes * 2 * rows * n_in * n_out


def trainable_params(d: DraftDims) -> int:
    """The draft's trainable parameters (its embedding and LM head are the target's, frozen, not counted)."""
    h, r = d.hidden, d.markov_rank
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * d.intermediate + 2 * d.head_dim + 2 * h  # + q/k norms, 2 norms
    n = d.taps * h * h + 2 * h + d.layers * layer  # fc, hidden_norm, norm, layers
    if r:
        n += d.vocab * r + d.draft_vocab * r  # markov_w1 [V, r], markov_w2 [Vd, r]
        n += {"gated": (h + r) * r + r, "rnn": (2 * r + h) * 3 * r + 3 * r}.get(d.markov_kind, 0)
    if d.confidence:
        n += h + r + 1
    return n


def _heads_flops(d: DraftDims, s: StepShapes) -> int:
    """The Markov projection (gated / RNN) and the confidence head over every prediction row."""
    h, r, p = d.hidden, d.markov_rank, s.pred_rows
    n = 0
    if r and d.markov_kind == "gated":
        n += _linear(p, h + r, r, 3)  # gate_proj [P, H + r] -> [P, r]
    elif r and d.markov_kind == "rnn":
        n += _linear(p, 2 * r + h, 3 * r, 3)  # joint_proj [P, 2r + H] -> [P, 3r], one position at a time
    if d.confidence:
        n += _linear(p, h + r, 1, 3 if s.conf_loss else 1)  # proj [P, H + r] -> [P, 1]
    return n


def _lm_head_flops(d: DraftDims, s: StepShapes) -> int:
    """The LM-head loss's GEMMs over the loss rows M (the fused loss forms the gradients in its forward)."""
    h, r, m, vd, vt = d.hidden, d.markov_rank, s.loss_rows, s.draft_vocab, s.teacher_vocab
    n = 2 * m * vd * h * 2  # D = X W^T [M, H] x [H, Vd]; dX = dD W [M, Vd] x [Vd, H]
    n += 2 * m * vt * h  # teacher Y W^T [M, H] x [H, Vt] (Vt = 0: none)
    if r:
        n += 2 * m * vd * r * 3  # D += E W2^T [M, r] x [r, Vd]; dE = dD W2; dW2 = dD^T E [Vd, M] x [M, r]
    return n + _heads_flops(d, s)


def _layer_flops(d: DraftDims, rows: int) -> int:
    """One layer's projections and SwiGLU MLP over the block rows T."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    attn = _linear(rows, h, q, 3) + 2 * _linear(rows, h, kv, 3) + _linear(rows, q, h, 3)  # q, k, v [T, H] -> ., o
    return attn + 3 * _linear(rows, h, d.intermediate, 3)  # gate, up [T, H] -> [T, I]; down [T, I] -> [T, H]


def _context_flops(d: DraftDims, rows: int) -> int:
    """fc [C, n*H] -> [C, H] (no gradient to its input: the target's features) and every layer's context k / v
    [C, H] -> [C, nkv*hd]."""
    kv = d.kv_heads * d.head_dim
    return _linear(rows, d.taps * d.hidden, d.hidden, 2) + d.layers * 2 * _linear(rows, d.hidden, kv, 3)


def _attention_flops(d: DraftDims, s: StepShapes) -> int:
    """Every layer's q.k and p.v over the scored pairs, forward + backward (+ the recomputed forward)."""
    per_pair = 2 * d.heads * d.head_dim  # one GEMM's FLOPs per (query, key) pair: all query heads
    fwd = 2 * s.attention_pairs * per_pair  # scores q.k, then p.v
    if s.attention_recompute:  # the forward again, less p.v over the blocks' own keys (module docstring)
        return d.layers * (4 * fwd - s.attention_own_pairs * per_pair)
    return d.layers * 3 * fwd


def step_flops(d: DraftDims, s: StepShapes, optimizer_steps: float = 1.0) -> dict[str, int]:
    """FLOPs of one step by part (module docstring) plus "total". optimizer_steps: optimizer steps per batch
    (1 / accumulate_grad_batches when gradients accumulate)."""
    parts = {
        "lm_head_loss": _lm_head_flops(d, s),
        "draft_layers": d.layers * _layer_flops(d, s.block_rows),
        "context": _context_flops(d, s.context_rows),
        "attention": _attention_flops(d, s),
        "optimizer": round(OPTIMIZER_FLOPS_PER_PARAM * trainable_params(d) * optimizer_steps),
    }
    parts["total"] = sum(parts.values())
    return parts


# ---- shapes of a batch --------------------------------------------------------------------------------------
def _query_chunk() -> int:
    """The query chunk masked_attention groups packed blocks by (its default: the dense drafts pass none)."""
    return int(inspect.signature(masked_attention).parameters["query_chunk"].default)


def attention_work(anchors: torch.Tensor, block_len: int, context_len: int, window: int | None, heads: int,
                   packed: bool = True, rule: str = "block") -> tuple[int, bool]:
    """(query, key) pairs masked_attention scores per query head for one layer, and whether its backward
    recomputes them. anchors [B, A]. Packed (PackedBlockMask, the torch reference): blocks in groups of
    query_chunk // block_len; a group scores its c*K queries against one context span (min lo .. max hi over the
    group and the batch), or each block's own window gathered when the window is shorter than that span, plus
    each block's own K keys; the context bounds are the mask's own (PackedBlockMask.context_bounds, `rule` its window
    rule: a rule "query" block reaches W - 1 keys back, not W). Dense mask: every query against all S + A*K keys."""
    b, a = anchors.shape
    k = int(block_len)
    if not packed:
        return b * a * k * (context_len + a * k), False
    lo, hi = attention.PackedBlockMask(anchors, k, context_len, window, rule).context_bounds()  # [B, A] each
    per = max(1, _query_chunk() // k)
    pairs = 0
    for i in range(0, a, per):
        c = min(per, a - i)
        span_lo, span_hi = int(lo[:, i:i + c].min()), int(hi[:, i:i + c].max())
        span = 0 if span_hi <= span_lo else (window if window is not None and window < span_hi - span_lo
                                             else span_hi - span_lo)
        pairs += b * c * k * (span + k)
    seen = (hi - lo).clamp(min=0).amax(dim=0)  # [A]
    saved = 3 * 4 * b * heads * k * int((seen + k).sum())  # the reference's own estimate
    return pairs, saved > attention.RECOMPUTE_BYTES


def is_dense_block_module(module) -> bool:
    """Whether step_shapes can count this LightningModule's step: a BlockDraftModule training a draft whose config
    class declares FLOPS_COUNTED itself (the dense block draft's layers). Not inherited: a family built on that config
    with layers of its own (DFlash2, XPress) is counted by replay until its own class says otherwise."""
    config = getattr(module.draft, "config", None)
    return isinstance(module, BlockDraftModule) and bool(vars(type(config)).get("FLOPS_COUNTED", False))


def step_shapes(module, batch: dict[str, torch.Tensor]) -> StepShapes:
    """The shapes one training step of a BlockDraftModule computes on `batch` (input_ids, loss_mask, anchors, keep),
    with the blocks built as the step builds them (dspark.training.blocks.build_blocks: cheap tensor code)."""
    cfg = module.draft.config
    b, s = batch["input_ids"].shape  # [B, S]
    g = int(cfg.block_size)
    blocks = _step_blocks(module, batch)
    a, lb = blocks.input_ids.shape[1:]
    loss_rows = int(blocks.eval_mask.sum())
    vd, vt = module.lm_head_vocab()
    pairs, recompute = attention_work(batch["anchors"], lb, s, cfg.sliding_window, int(cfg.num_attention_heads),
                                      packed=bool(getattr(module, "packed_attention_mask", True)),
                                      rule=cfg.window_rule)
    conf_head = optional(module.draft, "confidence_head") is not None
    return StepShapes(
        context_rows=b * s, block_rows=b * a * lb, pred_rows=b * a * g, loss_rows=loss_rows,
        attention_pairs=pairs, attention_own_pairs=b * a * lb * lb,
        attention_recompute=recompute,
        draft_vocab=int(vd), teacher_vocab=int(vt), conf_loss=bool(conf_head and vt and module.loss_weights.conf))


def module_step_flops(module, batch: dict[str, torch.Tensor], optimizer_steps: float = 1.0) -> tuple[dict, StepShapes]:
    """(step_flops by part, the shapes) of one training step of `module` (is_dense_block_module) on `batch`."""
    shapes = step_shapes(module, batch)
    return step_flops(DraftDims.from_config(module.draft.config), shapes, optimizer_steps), shapes


# ---- the GEMM peak ------------------------------------------------------------------------------------------
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}


def counted_step_flops(module, counted: int, optimizer_steps: float = 1.0) -> dict[str, int]:
    """A step of a draft this module does not model (EAGLE-3, an MTP head, V4 / DFlash2 block drafts), by part: what
    torch's FlopCounterMode counted while it ran (matrix products and attention, forward and backward) and the
    optimizer's OPTIMIZER_FLOPS_PER_PARAM per trainable parameter."""
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    optimizer = round(OPTIMIZER_FLOPS_PER_PARAM * params * optimizer_steps)
    return {"counted": int(counted), "optimizer": optimizer, "total": int(counted) + optimizer}


def step_loss_tokens(module, batch: dict[str, torch.Tensor]) -> int:
    """The rows one training step of `module` scores on `batch`: an MTP chain's step k scores the rows whose label
    t+k+2 counts (dspark.training.mtp_objectives.recursive_forward); a block objective the blocks' eval rows
    (dspark.training.blocks.build_blocks, as the step builds them)."""
    steps = getattr(module, "num_steps", None)
    if steps is not None:
        lm = batch["loss_mask"] * batch["attention_mask"]  # [B, S]
        return sum(int(lm[:, k + 2:].sum()) for k in range(int(steps)))
    return int(_step_blocks(module, batch).eval_mask.sum())


def _step_blocks(module, batch: dict[str, torch.Tensor]):
    """The blocks a block objective's training step builds from `batch` (dspark.training.blocks.build_blocks)."""
    cfg = module.draft.config
    return build_blocks(batch["input_ids"], batch["loss_mask"], batch["anchors"], batch["keep"], int(cfg.block_size),
                        cfg.mask_token_id, cfg.layout)


def precision_dtype(precision) -> torch.dtype:
    """The dtype a Lightning precision computes its GEMMs in: bf16-mixed / bf16-true -> bfloat16, 16-mixed ->
    float16, 32-true -> float32, 64-true -> float64."""
    key = str(precision).split("-")[0]
    if key not in AUTOCAST_DTYPES:
        raise ValueError(f"unknown trainer precision {precision!r}")
    return AUTOCAST_DTYPES[key]


def gemm_peak(hidden: int, vocab: int, dtype: torch.dtype = torch.float32, *, rows: int = 768,
              device: str | torch.device = "cpu", budget_s: float = 1.0, min_repeats: int = 3,
              max_repeats: int = 50) -> dict:
    """GFLOP/s of an LM-head-shaped GEMM [rows, H] @ [H, V] in `dtype` at the current torch thread count, measured
    here: one warm-up, then repeats until `budget_s` has passed (at least min_repeats, at most max_repeats); the
    BEST repeat is the peak (the machine's rate when nothing else slows it; the median is reported beside it).
    The right operand is a transposed [V, H] weight, as the fused loss multiplies by the LM head.
    -> {gflops, median_gflops, dtype, threads, shape, repeats}."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)  # [rows, H]
    w = torch.randn(vocab, hidden, generator=gen).to(device=device, dtype=dtype)  # [V, H]
    out = torch.empty(rows, vocab, device=device, dtype=dtype)  # [rows, V]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flop = 2 * rows * hidden * vocab
    with torch.autocast(device.type, enabled=False):
        torch.mm(x, w.t(), out=out)
        sync()
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() - start < budget_s):
            t = time.perf_counter()
            torch.mm(x, w.t(), out=out)
            sync()
            times.append(time.perf_counter() - t)
    rate = lambda t: round(flop / t / 1e9, 2)  # noqa: E731  s -> GFLOP/s
    return {"gflops": rate(min(times)), "median_gflops": rate(statistics.median(times)),
            "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "shape": [rows, hidden, vocab], "repeats": len(times)}


__all__ = ["OPTIMIZER_FLOPS_PER_PARAM", "PARTS", "DraftDims", "StepShapes", "attention_work", "counted_step_flops",
           "gemm_peak", "is_dense_block_module", "module_step_flops", "precision_dtype", "step_flops", "step_loss_tokens",
           "step_shapes", "trainable_params"]

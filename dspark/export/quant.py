"""FP8 block and FP4 (MXFP4-style) weight quantisation in the DeepSeek-V4 checkpoint layout.

FP8 linears (vLLM `Fp8LinearMethod`, block quantisation, `weight_block_size` [128, 128]):
    weight  float8_e4m3fn [N, K]
    scale   [ceil(N/128), ceil(K/128)]; float8_e8m0fnu when the checkpoint's expert_dtype is "fp4"
            (V4-Flash, `DeepseekV4FP8Config.is_scale_e8m0`), float32 when it is "fp8" (V4-Flash-Base)
    w ~= weight * scale per 128x128 block (DeepSeek's `weight_scale_inv` is the multiplier).
FP4 experts (vLLM `Mxfp4MoEMethod`, transformers `FineGrainedFP8` with expert_dtype "fp4"):
    weight  int8 [N, K/2]: two e2m1 codes per byte, element 2j in the LOW nibble, 2j+1 in the high one
            (code = sign bit 0x8 | index into E2M1_VALUES)
    scale   float8_e8m0fnu [N, K/32], one power of two per 32 consecutive input elements.

Every scale here is a power of two (e8m0 representable): the smallest 2^e with amax / 2^e <= qmax
(448 for e4m3, 6 for e2m1), so nothing saturates. Values are then rounded to nearest (ties to even):
e4m3 by torch's cast, e2m1 by `_e2m1_codes`.
"""
from __future__ import annotations

import torch

FP8_BLOCK = 128
FP4_GROUP = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = E2M1_VALUES[-1]
_E8M0_BIAS = 127


def pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest integer e with amax / 2^e <= qmax (int32, same shape); 0 where amax == 0. Clamped to e8m0."""
    amax = amax.float()
    ratio = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    _, e = torch.frexp(ratio)  # ratio = m * 2^e, m in [0.5, 1)
    e = e.to(torch.int32)
    # frexp gives 2^(e-1) <= ratio < 2^e; step down when ratio is an exact power of two, and correct the
    # rounding of the division by checking the exact (power-of-two) divisions on amax itself.
    e = torch.where(amax / torch.exp2((e - 1).float()) <= qmax, e - 1, e)
    e = torch.where(amax / torch.exp2(e.float()) > qmax, e + 1, e)
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    return e.clamp(-_E8M0_BIAS, _E8M0_BIAS)


def e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """Integer exponents -> float8_e8m0fnu holding exactly 2^e (built from the bytes, no rounding)."""
    return (e + _E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale (float8_e8m0fnu, raw e8m0 bytes as uint8, or float32/bf16) -> float32 multipliers."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - _E8M0_BIAS)
    return scale.float()


# ---- FP8 128x128 blocks -----------------------------------------------------------------------------
def _blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """w [N, K] -> zero-padded view [nb, block, kb, block] and (nb, kb)."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32)
    padded[:n, :k] = w.float()
    return padded.view(nb, block, kb, block), nb, kb


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK,
                       scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], scale [ceil(N/block), ceil(K/block)] in scale_dtype)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block: expected a 2-D weight, got shape {tuple(w.shape)}")
    if scale_dtype not in (torch.float8_e8m0fnu, torch.float32):
        raise ValueError(f"quantize_fp8_block: scale_dtype must be float8_e8m0fnu or float32, got {scale_dtype}")
    n, k = w.shape
    view, nb, kb = _blocks(w, block)
    e = pow2_exponent(view.abs().amax(dim=(1, 3)), FP8_MAX)  # [nb, kb]
    scale = torch.exp2(e.float())
    q = (view / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nb * block, kb * block)[:n, :k].contiguous()
    stored = e8m0_from_exponent(e) if scale_dtype == torch.float8_e8m0fnu else scale
    return q, stored


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """float8_e4m3fn [N, K] + block scale [ceil(N/block), ceil(K/block)] -> float32 [N, K]."""
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"dequantize_fp8_block: expected a 2-D float8_e4m3fn weight and a 2-D scale, got "
                         f"{q.dtype} {tuple(q.shape)} / {scale.dtype} {tuple(scale.shape)}")
    n, k = q.shape
    if tuple(scale.shape) != (-(-n // block), -(-k // block)):
        raise ValueError(f"dequantize_fp8_block: scale {tuple(scale.shape)} is not the {block}x{block} block grid "
                         f"of weight {tuple(q.shape)} (expected {(-(-n // block), -(-k // block))})")
    s = scale_to_float(scale).repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return q.float() * s


# ---- FP4 e2m1, one scale per 32 inputs --------------------------------------------------------------
def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """x (already scaled, |x| <= 6) -> 4-bit codes (uint8): nearest e2m1 value, ties to the even index."""
    mag = x.abs()
    vals = torch.tensor(E2M1_VALUES)
    mids = (vals[1:] + vals[:-1]) / 2  # 7 midpoints
    idx = torch.zeros(x.shape, dtype=torch.uint8)
    for i, m in enumerate(mids.tolist()):
        # between index i and i+1: a tie goes to whichever of the two is even
        up = mag > m if i % 2 == 0 else mag >= m
        idx += up.to(torch.uint8)
    sign = ((x < 0) & (idx > 0)).to(torch.uint8) << 3  # -0 is stored as +0
    return idx | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (any int dtype, values 0..15) -> float32 values."""
    c = codes.to(torch.int64)
    vals = torch.tensor(E2M1_VALUES)[c & 7]
    return torch.where((c & 8) != 0, -vals, vals)


def quantize_fp4(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of `group`) -> (packed int8 [N, K/2], float8_e8m0fnu scale [N, K/group])."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp4: expected a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % group:
        raise ValueError(f"quantize_fp4: the input dimension {k} of weight {tuple(w.shape)} is not a multiple of "
                         f"the FP4 group size {group} (FP4 experts need moe_intermediate_size and hidden_size "
                         f"divisible by {group})")
    g = w.float().view(n, k // group, group)
    e = pow2_exponent(g.abs().amax(dim=-1), FP4_MAX)  # [N, K/group]
    codes = _e2m1_codes(g / torch.exp2(e.float())[..., None]).view(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # element 2j low nibble, 2j+1 high nibble
    return packed.view(torch.int8), e8m0_from_exponent(e)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed int8/uint8 [N, K/2] + scale [N, K/group] -> float32 [N, K]."""
    if packed.dtype not in (torch.int8, torch.uint8) or packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"dequantize_fp4: expected 2-D int8/uint8 packed codes and a 2-D scale, got "
                         f"{packed.dtype} {tuple(packed.shape)} / {scale.dtype} {tuple(scale.shape)}")
    n, half = packed.shape
    k = 2 * half
    if scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1]:
        raise ValueError(f"dequantize_fp4: scale {tuple(scale.shape)} does not tile weight [{n}, {k}]")
    u = packed.view(torch.uint8)
    codes = torch.stack([u & 0xF, u >> 4], dim=-1).view(n, k)
    group = k // scale.shape[1]
    return e2m1_decode(codes) * scale_to_float(scale).repeat_interleave(group, 1)


# ---- tensor sets -------------------------------------------------------------------------------------
def dequantize_tensors(tensors: dict[str, torch.Tensor], block: int = FP8_BLOCK) -> dict[str, torch.Tensor]:
    """Replace every quantised pair (`X.weight`, `X.scale`) by a float32 `X.weight`; other tensors pass through.

    float8_e4m3fn weights are FP8 blocks, int8/uint8 weights packed FP4. A `.scale` without its weight, or a
    quantised weight without its `.scale`, raises ValueError naming the tensor.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".scale"):
            if name.removesuffix(".scale") + ".weight" not in tensors:
                raise ValueError(f"dequantize: {name} has no matching .weight")
            continue
        scale_name = name.removesuffix(".weight") + ".scale"
        quantised = t.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8)
        if name.endswith(".weight") and scale_name in tensors:
            if t.dtype == torch.float8_e4m3fn:
                out[name] = dequantize_fp8_block(t, tensors[scale_name], block)
            elif t.dtype in (torch.int8, torch.uint8):
                out[name] = dequantize_fp4(t, tensors[scale_name])
            else:
                raise ValueError(f"dequantize: {name} has a .scale but dtype {t.dtype} (expected float8_e4m3fn "
                                 "or packed int8 FP4)")
        elif quantised:
            raise ValueError(f"dequantize: {name} is {t.dtype} but {scale_name} is missing")
        else:
            out[name] = t
    return out


def error_stats(ref: torch.Tensor, approx: torch.Tensor) -> dict[str, float]:
    """max |ref - approx|, max |ref|, and the relative Frobenius error ||ref - approx|| / ||ref||."""
    ref, approx = ref.float(), approx.float()
    diff = (ref - approx).abs()
    norm = ref.norm().item()
    return {"max_abs_err": diff.max().item() if diff.numel() else 0.0,
            "max_abs": ref.abs().max().item() if ref.numel() else 0.0,
            "rel_err": (ref - approx).norm().item() / norm if norm > 0 else 0.0}

"""Index arithmetic at sizes only real models reach, tested just above each threshold (cheap tensors or the
meta device): the target fingerprint past 2^24 elements, the kernels' int32 offsets and float32 index lanes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dspark.ops.limits import FLOAT32_EXACT_INT, INT32_MAX
from dspark.targets.hf_target import FrozenTarget, strided_sample_index


SMOLLM2_EMBED = 49152 * 576  # SmolLM2-135M's embedding: the tensor that crashed the float32 linspace


def test_strided_sample_index_is_exact_past_2_pow_24():
    n = SMOLLM2_EMBED
    idx = strided_sample_index(n, 4096)
    assert idx[0] == 0 and idx[-1] == n - 1 and len(idx) == 4096
    assert bool((idx[1:] > idx[:-1]).all()) and int(idx.max()) < n
    # the float32 linspace it replaces rounds the last index one past the end at this size
    assert int(torch.linspace(0, n - 1, 4096).long()[-1]) == n
    assert strided_sample_index(5, 4096).tolist() == [0, 1, 2, 3, 4]
    assert strided_sample_index(1, 4096).tolist() == [0]
    big = 3 * 2**40  # int64 products, no overflow at any real size
    assert int(strided_sample_index(big, 4096)[-1]) == big - 1


class _BigModel(nn.Module):
    """A 'target' with a tensor of SmolLM2's embedding size (28M elements; uint8 to keep it at 28 MB)."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Linear(2, 2)])
        self.register_buffer("big", torch.zeros(SMOLLM2_EMBED, dtype=torch.uint8))
        self.config = SimpleNamespace(hidden_size=2, vocab_size=3)


def test_fingerprint_of_a_tensor_past_2_pow_24_elements_sees_its_last_element():
    target = FrozenTarget(_BigModel(), [0])
    before = target.fingerprint()
    with torch.no_grad():
        target.model.big[-1] = 1
    assert target.fingerprint() != before


def test_kernel_operands_past_int32_offsets_are_refused_before_launch():
    from dspark.ops.kernels.mhc_tl import _c

    _c(torch.empty(1024, 4, 2, device="meta"))  # small: passes through
    with pytest.raises(ValueError, match="int32 offsets"):
        _c(torch.empty(INT32_MAX // 4 + 1, 4, device="meta"))


def test_fused_loss_kernel_refuses_vocabularies_and_chunks_it_cannot_index():
    pytest.importorskip("tilelang")
    from dspark.ops.kernels.fused_loss_tl import lm_loss_with_kernel

    def call(n, v, chunk):
        x, y = torch.empty(n, 8, device="meta"), torch.empty(n, 8, device="meta")
        w = torch.empty(v, 8, device="meta")
        labels, a = torch.empty(n, dtype=torch.long, device="meta"), torch.empty(n, device="meta")
        lm_loss_with_kernel("cuda", x, y, w, None, None, labels, a, a, chunk_rows=chunk, need_grads=False)

    with pytest.raises(ValueError, match="float32"):
        call(4, FLOAT32_EXACT_INT + 1, 4)
    with pytest.raises(ValueError, match=r"\[16384, 151936\]: 2489319424 elements exceed the int32 offsets"):
        call(20000, 151936, 16384)  # 2.49e9 logits in one chunk

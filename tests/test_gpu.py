"""CUDA-only checks (skipped without a GPU; run them with scripts/gpu_check.sh on a GPU machine)."""
import pytest
import torch

from dspark.ops.attention import masked_attention
from dspark.training.blocks import block_attention_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("hq,hk,d", [(8, 1, 512), (8, 2, 64)])
def test_compiled_flex_equals_reference_on_cuda(hq, hk, d):
    """The CUDA backend (compiled flex_attention) against the torch reference, V4 head_dim 512 included."""
    torch.manual_seed(0)
    B, S, A, L = 2, 300, 16, 5
    anchors = torch.sort(torch.randint(1, S, (B, A)), dim=-1).values
    mask = block_attention_mask(anchors, L, S, window=128).cuda()
    T = A * L
    q = torch.randn(B, hq, T, d, device="cuda")
    k, v = torch.randn(B, hk, S + T, d, device="cuda"), torch.randn(B, hk, S + T, d, device="cuda")
    sink = torch.randn(hq, device="cuda")
    ref = masked_attention(q, k, v, mask, d ** -0.5, sink, backend="reference")
    got = masked_attention(q, k, v, mask, d ** -0.5, sink)  # auto -> flex on CUDA
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)


def test_tiny_training_step_on_cuda_bf16(tmp_path):
    from conftest import TINY_RUN, compose
    from dspark.training.run import run_training

    summary = run_training(compose(TINY_RUN + [f"run_dir={tmp_path}", "trainer=gpu", "train.max_steps=3",
                                               "train.val_every_steps=3", "trainer.enable_progress_bar=false"]))
    assert summary["global_step"] == 3 and summary["final"]["val/tau_prob"] >= 1.0

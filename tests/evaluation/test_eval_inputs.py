"""eval.py from a fresh clone: the default prompt sets ship inside the repository, and every input (prompt files,
run dir, draft files) is checked before any model loads."""
from __future__ import annotations

import json

import pytest

from conftest import REPO, compose_eval as _eval_cfg
from dspark import factory
from dspark.evaluation import run_eval as ev


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any target load fails the test: the input checks must come first."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(factory, "build_target", refuse)


def _fake_run(tmp_path):
    (tmp_path / "draft").mkdir(parents=True)
    (tmp_path / "draft" / "model.safetensors").write_bytes(b"")
    (tmp_path / "draft" / "draft_config.json").write_text(json.dumps({"kind": "dspark_v4", "block_size": 4}))
    return tmp_path


def test_default_benchmarks_are_the_shipped_sets():
    cfg = _eval_cfg("run_dir=x")
    assert ev.benchmark_dir(cfg) == REPO / "dspark" / "assets" / "eval"
    sets = ev.read_benchmarks(cfg)
    assert list(sets) == ["mt-bench", "gsm8k", "humaneval"]
    assert all(len(v) == cfg.num_prompts for v in sets.values())
    assert all(len(c) == 2 for c in sets["mt-bench"])  # both MT-Bench turns


def test_missing_benchmark_fails_before_any_model_loads(tmp_path, no_model_loads):
    cfg = _eval_cfg(f"run_dir={_fake_run(tmp_path)}", "benchmarks=[mt-bench,no-such-set]")
    with pytest.raises(factory.ConfigError, match=r"benchmarks: no-such-set: .*no-such-set\.jsonl"):
        ev.run_eval(cfg)


def test_malformed_benchmark_line_fails_before_any_model_loads(tmp_path, no_model_loads):
    (tmp_path / "bad.jsonl").write_text('{"turns": ["ok"]}\n{"prompt": "no turns"}\n')
    cfg = _eval_cfg(f"run_dir={_fake_run(tmp_path / 'run')}", f"data_dir={tmp_path}", "benchmarks=[bad]")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        ev.run_eval(cfg)


@pytest.mark.parametrize("missing", ["model.safetensors", "draft_config.json"])
def test_incomplete_run_dir_fails_before_any_model_loads(tmp_path, no_model_loads, missing):
    run = _fake_run(tmp_path)
    (run / "draft" / missing).unlink()
    with pytest.raises(factory.ConfigError, match=r"run_dir: .*draft/model\.safetensors"):
        ev.run_eval(_eval_cfg(f"run_dir={run}"))


def test_missing_sps_table_fails_before_any_model_loads(tmp_path, no_model_loads):
    cfg = _eval_cfg(f"run_dir={_fake_run(tmp_path)}", f"sps_table={tmp_path / 'nope.json'}")
    with pytest.raises(factory.ConfigError, match="sps_table"):
        ev.run_eval(cfg)


def test_notebook_paths_resolve_against_the_checkout(tmp_path, monkeypatch):
    import os
    import time

    from dspark.evaluation.compare import default_experiment, eval_runs, newest_run, repo_root, runs_root

    monkeypatch.chdir(REPO / "notebooks")  # where Jupyter starts the kernel
    monkeypatch.delenv("DSPARK_RUNS", raising=False)
    assert repo_root() == REPO and runs_root() == REPO / "runs"
    monkeypatch.setenv("DSPARK_RUNS", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"python train\.py experiment=dspark_v4"):
        newest_run("dspark_v4")
    with pytest.raises(FileNotFoundError, match=r"python eval\.py run_dir="):
        eval_runs()
    for i, stamp in enumerate(["20300101-000000", "20200101-000000"]):  # the newer finish wins, not the name
        (tmp_path / "dspark_v4" / stamp / "eval").mkdir(parents=True)
        (tmp_path / "dspark_v4" / stamp / "metrics.json").write_text("{}")
        (tmp_path / "dspark_v4" / stamp / "eval" / "summary.T0.g4.json").write_text("{}")
        t = time.time() - 100 + i
        os.utime(tmp_path / "dspark_v4" / stamp / "metrics.json", (t, t))
    (tmp_path / "dspark_v4" / "unfinished").mkdir()
    assert newest_run("dspark_v4") == tmp_path / "dspark_v4" / "20200101-000000"
    assert default_experiment() == "dspark_v4" and newest_run() == newest_run("dspark_v4")  # train.py's default
    assert set(eval_runs()) == {"dspark_v4/20300101-000000", "dspark_v4/20200101-000000"}

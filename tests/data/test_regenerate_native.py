"""Regeneration through the native engine (scripts/regenerate.py's CPU default) on the shipped tiny Llama target:
greedy multi-turn answers = transformers' (same rendering, end tokens, decoding); killed mid-run (kill -9) and
rerun = an uninterrupted run, record for record (per-request seeds); Ctrl-C ends in one line; a source that yields
nothing and a target without a chat template are refused in one line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark.data.generator import SamplingParams
from dspark.data.hf_generator import HFGenerator
from dspark.data.native_generator import NativeGenerator
from dspark.data.regenerate import regenerate

TINY = REPO / "dspark" / "assets" / "tiny_llama"
SCRIPT = REPO / "scripts" / "regenerate.py"


def _records(n: int, turns: int = 2) -> list[dict]:
    words = "the cat sat on a mat while rain fell over quiet hills and rivers".split()
    out = []
    for i in range(n):
        messages = []
        for t in range(turns if i % 3 else 1):
            text = " ".join(words[(i + t + j) % len(words)] for j in range(4 + i % 5))
            messages.append({"role": "user", "content": f"{i}. {text}"})
            messages.append({"role": "assistant", "content": "original answer, thrown away"})
        out.append({"id": f"r{i}", "messages": messages})
    return out


@pytest.fixture(scope="module")
def tiny():
    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32), AutoTokenizer.from_pretrained(TINY)


def test_greedy_multi_turn_answers_equal_transformers(tiny, tmp_path):
    model, tok = tiny
    sampling = SamplingParams(max_new_tokens=12)
    native = NativeGenerator(model, tok, sampling, slots=3, max_model_len=256)
    hf = HFGenerator(model, tok, device="cpu", sampling=sampling)
    recs = _records(7)
    regenerate(recs, native, tmp_path / "native.jsonl", max_new_tokens=12)  # streamed: rows refilled across turns
    regenerate(recs, hf, tmp_path / "hf.jsonl", batch_size=1, max_new_tokens=12)  # batch 1: no padding effects
    a = {r["id"]: r for r in map(json.loads, (tmp_path / "native.jsonl").read_text().splitlines())}
    b = {r["id"]: r for r in map(json.loads, (tmp_path / "hf.jsonl").read_text().splitlines())}
    assert a.keys() == b.keys() == {r["id"] for r in recs}
    for rid in a:
        assert a[rid]["messages"] == b[rid]["messages"]
        assert a[rid]["meta"]["finish_reasons"] == b[rid]["meta"]["finish_reasons"]
        assert a[rid]["meta"]["answer_tokens"] == b[rid]["meta"]["answer_tokens"]
    assert any(len(r["meta"]["finish_reasons"]) == 2 for r in a.values())  # the later turns were answered


def _cmd(src, out, n):
    return [sys.executable, str(SCRIPT), "--source", str(src), "--target", str(TINY), "--out", str(out),
            "--limit", str(n), "--engine", "native", "--dtype", "float32", "--batch-size", "4",
            "--max-new-tokens", "24", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _start_and_wait(cmd, out, n_lines, **popen):
    """Start the regeneration and return once its output holds n_lines records (or it ended)."""
    proc = subprocess.Popen(cmd, env=_env(), **popen)
    while proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= n_lines:
            break
        time.sleep(0.02)
    return proc


def _prompt_file(tmp_path, n):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _records(n)))
    return src


def _by_id(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_records_of_an_uninterrupted_run(tmp_path):
    n = 300
    src = _prompt_file(tmp_path, n)
    whole = tmp_path / "whole.jsonl"
    subprocess.run(_cmd(src, whole, n), env=_env(), check=True, capture_output=True)
    out = tmp_path / "killed.jsonl"
    proc = _start_and_wait(_cmd(src, out, n), out, 5, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = out.read_bytes().count(b"\n")
    assert 5 <= kept < n, f"the run was not killed mid-way ({kept} of {n} records)"
    subprocess.run(_cmd(src, out, n), env=_env(), check=True, capture_output=True)
    lines = out.read_text().splitlines()
    failed = _by_id(out.with_name(out.name + ".failed.jsonl"))  # e.g. an empty first answer
    assert len(lines) == len(_by_id(out))  # nothing duplicated
    assert set(_by_id(out)) | set(failed) == {f"r{i}" for i in range(n)}  # nothing lost
    assert _by_id(out) == _by_id(whole)
    assert failed.keys() == _by_id(whole.with_name(whole.name + ".failed.jsonl")).keys()


@pytest.mark.slow
def test_two_processes_on_two_ranges_merged_equal_one_run(tmp_path):
    """--skip: a second process regenerates records K..N-1 into its own output; merged into the first's (records
    0..K-1), the result is line for line what one process writes (per-record seeds), and merging again adds nothing."""
    n, k = 12, 5
    src = _prompt_file(tmp_path, n)
    whole, first, second = tmp_path / "whole.jsonl", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    for cmd in (_cmd(src, whole, n), _cmd(src, first, k), _cmd(src, second, n) + ["--skip", str(k)]):
        subprocess.run(cmd, env=_env(), check=True, capture_output=True)
    assert set(_by_id(second)) | set(_by_id(second.with_name(second.name + ".failed.jsonl"))) == \
        {f"r{i}" for i in range(k, n)}
    merge = [sys.executable, str(REPO / "scripts" / "pack_regenerated.py"), "merge", str(first), str(second)]
    subprocess.run(merge, env=_env(), check=True, capture_output=True)
    assert sorted(first.read_text().splitlines()) == sorted(whole.read_text().splitlines())
    side = lambda p: sorted(p.with_name(p.name + ".failed.jsonl").read_text().splitlines())  # noqa: E731
    assert side(first) == side(whole)
    again = subprocess.run(merge, env=_env(), check=True, capture_output=True, text=True)
    assert "0 records and 0 failures appended" in again.stdout
    bad = subprocess.run(_cmd(src, tmp_path / "x.jsonl", 3) + ["--skip", "3"], env=_env(), capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "--skip 3 needs a --limit above it" in bad.stderr


@pytest.mark.slow
def test_ctrl_c_ends_in_one_line_saying_what_was_kept(tmp_path):
    n = 300
    src = _prompt_file(tmp_path, n)
    out = tmp_path / "out.jsonl"
    proc = _start_and_wait(_cmd(src, out, n), out, 3, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if x.startswith("interrupted:")]
    kept = out.read_bytes().count(b"\n")
    assert f"{kept} records kept in {out}" in line and "rerun the same command" in line


def test_a_source_that_yields_nothing_is_an_error(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    res = subprocess.run(_cmd(src, tmp_path / "o.jsonl", 5), env=_env(), capture_output=True, text=True)
    assert res.returncode == 2
    assert "the prompt source yielded no records" in res.stderr


def test_a_target_without_a_chat_template_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "no_template"
    folder.mkdir()
    for f in TINY.iterdir():
        if f.name != "chat_template.jinja":
            (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps(_records(1)[0]) + "\n")
    cmd = _cmd(src, tmp_path / "o.jsonl", 1)
    cmd[cmd.index("--target") + 1] = str(folder)
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    assert res.returncode != 0
    assert "has no chat template" in res.stderr and "Traceback" not in res.stderr

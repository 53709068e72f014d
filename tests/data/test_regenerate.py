"""Resumable regeneration (dspark.data.regenerate) and its two generators.

Fake generators are deterministic functions of the prompt, so every output line can be predicted;
HFGenerator runs a tiny random Llama with a character tokenizer built here; OpenAIChatGenerator
talks to a scripted http.server on 127.0.0.1 in a thread.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from dspark.data.generator import (
    BatchPartialFailure,
    Completion,
    GenerationError,
    GeneratorUnavailable,
    SamplingParams,
)
from dspark.data.hf_generator import HFGenerator
from dspark.data.openai_generator import OpenAIChatGenerator
from dspark.data.regenerate import OutputBusy, failed_path_for, plan_record, read_jsonl_state, regenerate

# --------------------------------------------------------------------------------------------
# Fakes and helpers
# --------------------------------------------------------------------------------------------


class Crash(BaseException):
    """Stands for a kill/KeyboardInterrupt: not an Exception, so never recorded as a failure."""


class EchoGenerator:
    """Answer = 'ans(<last user text>)#<number of assistant turns already in the prompt>'.

    ``crash_after``: raise Crash on that call (1-based). ``fail_on``: last-user texts that make
    the whole generate() call raise; ``empty_on``: texts answered with ''.
    """

    name = "echo"

    def __init__(self, crash_after=None, fail_on=(), empty_on=()):
        self.calls = []
        self.crash_after = crash_after
        self.fail_on, self.empty_on = set(fail_on), set(empty_on)

    def generate(self, batch, sampling=None):
        self.calls.append([list(m) for m in batch])
        if self.crash_after is not None and len(self.calls) == self.crash_after:
            raise Crash(f"killed on call {len(self.calls)}")
        out = []
        for messages in batch:
            last = messages[-1]["content"]
            assert messages[-1]["role"] == "user"
            if last in self.fail_on:
                raise RuntimeError(f"boom on {last}")
            n_prev = sum(m["role"] == "assistant" for m in messages)
            out.append(Completion("" if last in self.empty_on else f"ans({last})#{n_prev}", "stop"))
        return out


def make_records(n, turns=1):
    records = []
    for i in range(n):
        messages = [{"role": "system", "content": "sys"}] if i % 2 else []
        for t in range(turns):
            messages += [{"role": "user", "content": f"q{i}.{t}"}, {"role": "assistant", "content": f"OLD{i}.{t}"}]
        records.append({"id": f"r{i}", "messages": messages})
    return records


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def expected_messages(record):
    """What EchoGenerator regeneration must produce for a record from make_records."""
    out, n = [], 0
    for m in record["messages"]:
        if m["role"] == "assistant":
            continue
        out.append(m)
        if m["role"] == "user":
            out.append({"role": "assistant", "content": f"ans({m['content']})#{n}"})
            n += 1
    return out


# --------------------------------------------------------------------------------------------
# The loop: output format, multi-turn, resumption, failures
# --------------------------------------------------------------------------------------------


def test_output_lines_meta_and_multi_turn_prompts(tmp_path):
    records = make_records(5, turns=3)
    gen = EchoGenerator()
    out = tmp_path / "regen.jsonl"
    stats = regenerate(records, gen, out, batch_size=2, max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3)
    assert (stats.done, stats.failed, stats.skipped, stats.total) == (5, 0, 0, 5)
    rows = read_lines(out)
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(5)]
    for row, record in zip(rows, records):
        assert row["messages"] == expected_messages(record)
        assert row["meta"]["generator"] == "echo"
        assert row["meta"]["sampling"] == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3}
        assert row["meta"]["finish_reasons"] == ["stop"] * 3
    all_prompts = [p for call in gen.calls for p in call]
    assert len(gen.calls) == 3 * 3  # 3 batches (2+2+1) x 3 turns, one call per turn per batch
    for prompt in all_prompts:  # original answers never reach the generator
        assert not any("OLD" in m["content"] for m in prompt)
    # Turn 2 of r0 sees the two answers regenerated before it, in order.
    third = next(p for p in all_prompts if p[-1]["content"] == "q0.2")
    assert [m["content"] for m in third] == ["q0.0", "ans(q0.0)#0", "q0.1", "ans(q0.1)#1", "q0.2"]
    assert not failed_path_for(out).read_text()


def test_crash_then_resume_gives_each_id_exactly_once(tmp_path):
    records = make_records(10, turns=2)
    out = tmp_path / "regen.jsonl"
    with pytest.raises(Crash):  # batches of 3, 2 turns: call 5 is the first turn of batch 3
        regenerate(records, EchoGenerator(crash_after=5), out, batch_size=3)
    assert [r["id"] for r in read_lines(out)] == ["r0", "r1", "r2", "r3", "r4", "r5"]
    with open(out, "a") as handle:  # and a crash in the middle of writing the next line
        handle.write('{"id": "r6", "messages": [{"role": "us')

    gen = EchoGenerator()
    stats = regenerate(records, gen, out, batch_size=3)
    assert (stats.done, stats.failed, stats.skipped, stats.total) == (4, 0, 6, 10)
    rows = read_lines(out)  # parses: the partial line is gone
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(10)]
    assert all(row["messages"] == expected_messages(rec) for row, rec in zip(rows, records))
    assert {p[-1]["content"] for call in gen.calls for p in call} == {f"q{i}.{t}" for i in range(6, 10) for t in (0, 1)}

    again = regenerate(records, EchoGenerator(), out, batch_size=3)
    assert (again.done, again.failed, again.skipped, again.total) == (0, 0, 10, 10)
    assert len(read_lines(out)) == 10


def test_a_second_regeneration_into_the_same_output_is_refused_while_the_first_writes(tmp_path):
    """Two writers of one output would both take the records not yet in it: the second is refused at once, naming the
    first's pid; once the first is done (or dead: the lock is the kernel's) the output is free again."""
    records = make_records(4, turns=1)
    out = tmp_path / "regen.jsonl"
    refusals = []

    class SecondWriter(EchoGenerator):
        def generate(self, batch, sampling=None):
            if not refusals:  # while the first regeneration holds the output
                with pytest.raises(OutputBusy, match=f"pid {os.getpid()} is regenerating into it") as refused:
                    regenerate(records, EchoGenerator(), out, batch_size=2)
                refusals.append(refused.value)
            return super().generate(batch, sampling)

    stats = regenerate(records, SecondWriter(), out, batch_size=2)
    assert len(refusals) == 1 and stats.done == 4
    assert [r["id"] for r in read_lines(out)] == [f"r{i}" for i in range(4)]  # each once
    again = regenerate(records, EchoGenerator(), out, batch_size=2)  # free again
    assert (again.done, again.skipped) == (0, 4)


def test_crash_mid_file_then_resume_equals_an_uninterrupted_run(tmp_path):
    """Output and sidecar after (crash, torn last line, resume) == those of one uninterrupted run."""
    records = make_records(11, turns=2)
    faults = dict(fail_on={"q4.1"}, empty_on={"q8.0"})
    whole = tmp_path / "whole.jsonl"
    regenerate(records, EchoGenerator(**faults), whole, batch_size=3, seed=5)

    out = tmp_path / "resumed.jsonl"
    with pytest.raises(Crash):  # call 5 = first turn of the third batch (r6..r8)
        regenerate(records, EchoGenerator(crash_after=5, **faults), out, batch_size=3, seed=5)
    with open(out, "a") as handle:  # the kill tore the next line
        handle.write(json.dumps(read_lines(whole)[5])[:40])
    regenerate(records, EchoGenerator(**faults), out, batch_size=3, seed=5)

    assert read_lines(out) == read_lines(whole)
    strip_time = [{k: v for k, v in row.items() if k != "time"} for row in read_lines(failed_path_for(whole))]
    assert [{k: v for k, v in row.items() if k != "time"} for row in read_lines(failed_path_for(out))] == strip_time
    assert [row["id"] for row in strip_time] == ["r4", "r8"]


def test_limit_and_duplicate_ids(tmp_path):
    records = make_records(6)
    out = tmp_path / "regen.jsonl"
    stats = regenerate(records + [records[1]], EchoGenerator(), out, batch_size=4, limit=4)
    assert (stats.done, stats.skipped, stats.total) == (4, 0, 4)
    stats = regenerate(records + [records[1], records[5]], EchoGenerator(), out, batch_size=4)
    assert (stats.done, stats.skipped, stats.total) == (2, 6, 8)  # 4 done before + 2 duplicates
    assert sorted(r["id"] for r in read_lines(out)) == [f"r{i}" for i in range(6)]


def test_failures_go_to_sidecar_and_are_retried_only_when_asked(tmp_path):
    records = make_records(6, turns=2)
    records.append({"id": "no_user", "messages": [{"role": "system", "content": "only a system prompt"}]})
    out = tmp_path / "regen.jsonl"
    # r1 raises on its second turn (the rest of its batch must survive), r4 answers '' on turn 1.
    gen = EchoGenerator(fail_on={"q1.1"}, empty_on={"q4.0"})
    stats = regenerate(records, gen, out, batch_size=3)
    assert (stats.done, stats.failed, stats.skipped, stats.total) == (4, 3, 0, 7)
    assert sorted(r["id"] for r in read_lines(out)) == ["r0", "r2", "r3", "r5"]
    failed = {row["id"]: row for row in read_lines(failed_path_for(out))}
    assert set(failed) == {"r1", "r4", "no_user"}
    assert "turn 1" in failed["r1"]["error"] and "boom on q1.1" in failed["r1"]["error"]
    assert "empty output" in failed["r4"]["error"]
    assert "no user turn" in failed["no_user"]["error"]

    stats = regenerate(records, EchoGenerator(fail_on={"q1.1"}), out, batch_size=3)
    assert (stats.done, stats.failed, stats.skipped) == (0, 0, 7), "failed ids are not retried by default"

    stats = regenerate(records, EchoGenerator(fail_on={"q1.1"}), out, batch_size=3, retry_failed=True)
    assert (stats.done, stats.failed, stats.skipped) == (1, 2, 4)  # r4 now works, r1 and no_user fail again
    failed = read_lines(failed_path_for(out))
    assert sorted(r["id"] for r in failed) == ["no_user", "r1"], "sidecar compacted: one entry per failed id"
    ids = sorted(r["id"] for r in read_lines(out))
    assert ids == ["r0", "r2", "r3", "r4", "r5"] and len(set(ids)) == len(ids)


def test_generator_unavailable_aborts_instead_of_failing_records(tmp_path):
    class Down:
        name = "down"

        def generate(self, batch, sampling=None):
            raise GeneratorUnavailable("server gone")

    out = tmp_path / "regen.jsonl"
    with pytest.raises(GeneratorUnavailable):
        regenerate(make_records(3), Down(), out, batch_size=2)
    assert out.read_text() == "" and failed_path_for(out).read_text() == ""


class TokenEcho(EchoGenerator):
    """EchoGenerator whose answers say how many tokens they are (len of the text) and tick a fake clock."""

    def __init__(self, clock, seconds_per_call=30.0, **kw):
        super().__init__(**kw)
        self.clock, self.seconds_per_call = clock, seconds_per_call

    def generate(self, batch, sampling=None):
        self.clock.now += self.seconds_per_call
        return [Completion(str(a), a.finish_reason, len(a)) for a in super().generate(batch, sampling)]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_progress_lines_give_rate_tokens_and_eta(tmp_path, caplog):
    """Every `progress_every` records: records in the output / limit, records/min, answer tokens/s over this
    run's generation time, ETA of the records not read yet; resumed runs count only their own work."""
    clock = FakeClock()
    out = tmp_path / "regen.jsonl"
    records = make_records(12)
    with caplog.at_level("INFO", logger="dspark.data.regenerate"):
        regenerate(records, TokenEcho(clock), out, batch_size=2, limit=10, progress_every=4, clock=clock)
    lines = [r.getMessage() for r in caplog.records if "records in the output" in r.getMessage()]
    # 2 records per 30 s call: 4.0 records/min; reports after 4 and 8 records, and the last at 10
    assert len(lines) == 3, lines
    assert lines[0].startswith("regenerate: 4/10 records in the output (this run: done=4 failed=0 skipped=0 total=4)")
    assert "4.0 records/min" in lines[0] and "ETA 1m30s (6 records not read yet)" in lines[0]
    tokens = sum(len(f"ans(q{i}.0)#0") for i in range(4))
    assert f"{tokens / 60:.1f} answer tokens/s" in lines[0]
    assert lines[-1].startswith("regenerate: 10/10 records in the output") and "ETA 0s" in lines[-1]
    rows = read_lines(out)
    assert [r["meta"]["answer_tokens"] for r in rows] == [[len(r["messages"][-1]["content"])] for r in rows]

    caplog.clear()  # resume with a larger limit: the skipped prefix is not generation time
    clock.now += 5000
    with caplog.at_level("INFO", logger="dspark.data.regenerate"):
        stats = regenerate(records, TokenEcho(clock), out, batch_size=2, limit=12, progress_every=100, clock=clock)
    assert (stats.done, stats.skipped) == (2, 10)
    lines = [r.getMessage() for r in caplog.records if "records in the output" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("regenerate: 12/12 records in the output")
    assert "4.0 records/min" in lines[0]


def test_progress_without_token_counts_or_limit(tmp_path, caplog):
    clock = FakeClock()

    class Ticking(EchoGenerator):
        def generate(self, batch, sampling=None):
            clock.now += 60.0
            return super().generate(batch, sampling)

    with caplog.at_level("INFO", logger="dspark.data.regenerate"):
        regenerate(make_records(3), Ticking(), tmp_path / "o.jsonl", batch_size=3, clock=clock)
    (line,) = [r.getMessage() for r in caplog.records if "records in the output" in r.getMessage()]
    assert line.startswith("regenerate: 3 records in the output") and line.endswith("3.0 records/min")
    assert read_lines(tmp_path / "o.jsonl")[0]["meta"]["answer_tokens"] == [None]


def test_source_and_license_of_a_record_reach_its_output_line(tmp_path):
    records = make_records(2)
    records[0] = {**records[0], "source": "reasoning-gym/leg_counting", "license": "Apache-2.0", "other": 1}
    regenerate(records, EchoGenerator(), tmp_path / "o.jsonl")
    rows = read_lines(tmp_path / "o.jsonl")
    assert rows[0]["meta"]["source"] == "reasoning-gym/leg_counting" and rows[0]["meta"]["license"] == "Apache-2.0"
    assert "other" not in rows[0]["meta"] and "source" not in rows[1]["meta"]
    assert set(rows[0]) == {"id", "messages", "meta"}


def test_state_reader_rejects_damage_in_the_middle(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2"):
        read_jsonl_state(path, repair=True)
    path.write_text('{"id": "a"}\n{"id": "b"}\n\x00\x00garbage\n')
    assert [r["id"] for r in read_jsonl_state(path, repair=True)] == ["a", "b"]
    assert path.read_text() == '{"id": "a"}\n{"id": "b"}\n'


def test_seeds_are_pinned():
    """Per-request seeds (OpenAI, vLLM) and HF batch seeds: fixed values, so reruns and resumed runs of older
    outputs draw the same samples."""
    from dspark.data.generator import derived_seed, prompt_seed

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert (prompt_seed(0, messages), prompt_seed(7, messages)) == (1250843517, 1649121984)
    assert derived_seed(3, ["<a>", "<b>"]) == 296335058


def test_plan_record_rules():
    plan = plan_record({"id": "x", "messages": [
        {"role": "assistant", "content": "greeting first"}, {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}]})
    assert plan == [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, None,
                    {"role": "user", "content": "u2"}, None]
    with pytest.raises(ValueError, match="unknown role"):
        plan_record({"id": "x", "messages": [{"role": "tool", "content": "t"}]})


# --------------------------------------------------------------------------------------------
# HFGenerator on a tiny random Llama: batched with left padding == each row alone
# --------------------------------------------------------------------------------------------

CHARS = list("abcdefghijklmnopqrstuvwxyz ?.!,0123456789\n")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tiny_lm():
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"] + CHARS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        bos_token="<|im_start|>", unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML
    torch.manual_seed(1)  # with this seed and init scale, rows give varied text and one stops early
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                         initializer_range=0.3)
    model = LlamaForCausalLM(config).eval()
    return model, tokenizer


def test_tiny_tokenizer_round_trip(tiny_lm):
    _, tok = tiny_lm
    text = "hello, world 42?"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text


def test_hf_generator_batched_equals_rows_alone(tiny_lm):
    model, tok = tiny_lm
    gen = HFGenerator(model, tok, device="cpu", sampling=SamplingParams(max_new_tokens=12, temperature=0.0))
    batch = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is the capital of france?"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c d"}],
    ]
    lengths = [len(tok(gen.render(m), add_special_tokens=False).input_ids) for m in batch]
    assert max(lengths) - min(lengths) > 20, "rows must need real left padding"
    together = gen.generate(batch)
    alone = [gen.generate([m])[0] for m in batch]
    assert together == alone
    assert all(isinstance(c, Completion) and c.finish_reason in ("stop", "length") for c in together)
    assert len(set(together)) == 3, "rows must differ, or the comparison proves little"
    assert {c.finish_reason for c in together} == {"stop", "length"}, "both end paths exercised"

    # Independent reference for one row: plain greedy decoding with full forward passes.
    ids = tok(gen.render(batch[1]), add_special_tokens=False, return_tensors="pt").input_ids  # [1, S]
    new = []
    with torch.no_grad():
        for _ in range(12):
            nxt = model(ids).logits[0, -1].argmax().item()
            if nxt == 2:
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert together[1] == tok.decode(new, skip_special_tokens=True)
    assert together[1].finish_reason == ("stop" if len(new) < 12 else "length")


def test_hf_generator_sampling_is_seeded(tiny_lm):
    model, tok = tiny_lm
    gen = HFGenerator(model, tok, sampling=SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95, seed=7))
    batch = [[{"role": "user", "content": "tell me something"}], [{"role": "user", "content": "x"}]]
    first = gen.generate(batch)
    state = torch.get_rng_state()
    assert gen.generate(batch) == first, "same seed and prompts -> same samples"
    assert torch.equal(torch.get_rng_state(), state), "the global RNG must be left alone"
    other = gen.generate(batch, SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95, seed=8))
    assert other != first


def test_regenerate_with_hf_generator_end_to_end(tiny_lm, tmp_path):
    model, tok = tiny_lm
    gen = HFGenerator(model, tok, sampling=SamplingParams(max_new_tokens=6))
    records = [{"id": "m", "messages": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]}]
    stats = regenerate(records, gen, tmp_path / "o.jsonl", batch_size=2, max_new_tokens=6)
    rows = read_lines(tmp_path / "o.jsonl") if stats.done else []
    failed = read_lines(failed_path_for(tmp_path / "o.jsonl"))
    assert stats.done + stats.failed == 1 and len(rows) + len(failed) == 1
    if rows:  # (a random model may emit only <|im_end|>, which is an empty answer -> failed)
        assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant", "user", "assistant"]
        assert rows[0]["meta"]["generator"].startswith("hf:")


# --------------------------------------------------------------------------------------------
# OpenAIChatGenerator against a scripted local server
# --------------------------------------------------------------------------------------------


class StubServer:
    """ThreadingHTTPServer on 127.0.0.1: records requests, answers by the user text's prefix.

    'fail500:'  -> 500 the first time for that text, then 200
    'flaky<N>:' -> 429 (Retry-After: 0), then 503, ... for the first N requests with that text, then 200
    'always500' -> 500 every time;  'bad400' -> 400 with an OpenAI-style error body
    anything else -> 200 echoing the text; a request for model 'missing' -> 404.
    """

    def __init__(self):
        self.requests, self.seen, self.count = [], set(), {}
        self.lock = threading.Lock()
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):  # noqa: N802 (http.server naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                    text = body["messages"][-1]["content"]
                    first_time = text not in stub.seen
                    stub.seen.add(text)
                    stub.count[text] = nth = stub.count.get(text, 0) + 1
                if body["model"] == "missing":
                    return self._send(404, {"error": {"message": "The model `missing` does not exist."}})
                if text == "always500" or (text.startswith("fail500:") and first_time):
                    return self._send(500, {"error": {"message": "internal hiccup"}})
                if text.startswith("flaky") and nth <= int(text[5:text.index(":")]):
                    if nth % 2:
                        return self._send(429, {"error": {"message": "slow down"}}, {"Retry-After": "0"})
                    return self._send(503, {"error": {"message": "warming up"}})
                if text == "bad400":
                    return self._send(400, {"error": {"message": "prompt is longer than the context"}})
                n = sum(m["role"] == "assistant" for m in body["messages"])
                return self._send(200, {"id": "x", "object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": f"echo {text}#{n}"},
                     "finish_reason": "length" if text.endswith("!") else "stop"}]})

            def _send(self, code, payload, headers=None):
                data = json.dumps(payload).encode()
                self.send_response(code)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _client(server, **kwargs):
    defaults = dict(api_key="sk-test", timeout=5, max_retries=2, backoff_s=0.0,
                    sampling=SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.8, seed=1))
    return OpenAIChatGenerator(server.base_url + "/", "tiny-model", **{**defaults, **kwargs})


def test_openai_request_shape_and_batch():
    with StubServer() as server:
        client = _client(server)
        out = client.generate([[{"role": "user", "content": "hello"}],
                               [{"role": "system", "content": "s"}, {"role": "user", "content": "long!"}]])
        assert out == ["echo hello#0", "echo long!#0"]
        assert [c.finish_reason for c in out] == ["stop", "length"]
        assert len(server.requests) == 2
        req = next(r for r in server.requests if r["body"]["messages"][-1]["content"] == "hello")
        assert req["path"] == "/v1/chat/completions"
        assert req["headers"]["Authorization"] == "Bearer sk-test"
        assert req["headers"]["Content-Type"] == "application/json"
        body = req["body"]
        assert body["model"] == "tiny-model" and body["messages"] == [{"role": "user", "content": "hello"}]
        assert (body["max_tokens"], body["temperature"], body["top_p"], body["stream"]) == (9, 0.7, 0.8, False)
        assert isinstance(body["seed"], int)
        assert body["chat_template_kwargs"] == {"enable_thinking": False}


def test_openai_retries_500_then_succeeds():
    with StubServer() as server:
        client = _client(server)
        assert client.generate([[{"role": "user", "content": "fail500:x"}]]) == ["echo fail500:x#0"]
        assert len(server.requests) == 2
        with pytest.raises(GeneratorUnavailable, match=r"3 attempts.*HTTP 500.*internal hiccup"):
            client.complete([{"role": "user", "content": "always500"}])
        assert len(server.requests) == 2 + 3


def test_openai_server_failing_n_times_then_answering():
    """N failures (429 with Retry-After, 503) then an answer: max_retries >= N gets it, fewer gives up."""
    with StubServer() as server:
        assert _client(server, max_retries=3).complete([{"role": "user", "content": "flaky3:a"}]) == "echo flaky3:a#0"
        assert server.count["flaky3:a"] == 4
        with pytest.raises(GeneratorUnavailable, match=r"giving up after 3 attempts: HTTP 429.*slow down"):
            _client(server, max_retries=2).complete([{"role": "user", "content": "flaky3:b"}])
        assert server.count["flaky3:b"] == 3
        with pytest.raises(GeneratorUnavailable, match=r"giving up after 2 attempts: HTTP 503.*warming up"):
            _client(server, max_retries=1).complete([{"role": "user", "content": "flaky2:c"}])
        with pytest.raises(GeneratorUnavailable, match=r"giving up after 1 attempts: HTTP 429.*slow down"):
            _client(server, max_retries=0).complete([{"role": "user", "content": "flaky1:d"}])
        assert (server.count["flaky2:c"], server.count["flaky1:d"]) == (2, 1)


def test_openai_retry_policy_unit():
    """Which answers are retried, for POST, and how long the client waits before each retry."""
    from urllib3 import HTTPResponse

    from dspark.data.openai_generator import MAX_BACKOFF_S, retry_policy

    policy = retry_policy(max_retries=4, backoff_s=1.5)
    for status in (408, 409, 425, 429, 500, 502, 503, 504, 599):
        assert policy.is_retry("POST", status), status
    for status in (200, 400, 401, 403, 404, 405, 413, 422):
        assert not policy.is_retry("POST", status), status
    waits, retry = [], policy
    for _ in range(4):
        retry = retry.increment("POST", "/v1/chat/completions", response=HTTPResponse(status=503))
        waits.append(retry.get_backoff_time())
    assert waits == [0, 3.0, 6.0, 12.0]
    with pytest.raises(Exception, match="Max retries exceeded"):
        retry.increment("POST", "/v1/chat/completions", response=HTTPResponse(status=503))
    slow = retry_policy(max_retries=9, backoff_s=10.0)
    for _ in range(5):
        slow = slow.increment("POST", "/v1/chat/completions", response=HTTPResponse(status=500))
    assert slow.get_backoff_time() == MAX_BACKOFF_S


def test_openai_client_without_urllib3_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "urllib3", None)  # import urllib3 -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'dspark\[http\]'"):
        OpenAIChatGenerator("http://127.0.0.1:1/v1", "m")


def test_openai_4xx_errors_are_clear():
    with StubServer() as server:
        client = _client(server)
        with pytest.raises(GenerationError, match=r"HTTP 400.*longer than the context"):
            client.complete([{"role": "user", "content": "bad400"}])
        with pytest.raises(BatchPartialFailure) as info:
            client.generate([[{"role": "user", "content": "ok"}], [{"role": "user", "content": "bad400"}]])
        assert info.value.results[0] == "echo ok#0" and isinstance(info.value.results[1], GenerationError)
        with pytest.raises(GeneratorUnavailable, match=r"HTTP 404.*does not exist"):
            OpenAIChatGenerator(server.base_url, "missing", max_retries=2, backoff_s=0).complete(
                [{"role": "user", "content": "hi"}])
        assert sum(r["body"]["messages"][-1]["content"] == "bad400" for r in server.requests) == 2, "4xx: no retry"


def test_openai_unreachable_server_raises_unavailable():
    with StubServer() as server:
        base = server.base_url
    client = OpenAIChatGenerator(base, "m", timeout=2, max_retries=1, backoff_s=0.0)
    with pytest.raises(GeneratorUnavailable, match="cannot reach"):
        client.complete([{"role": "user", "content": "hi"}])


def test_regenerate_through_openai_multi_turn_and_failures(tmp_path):
    records = [
        {"id": "a", "messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "OLD"},
                                 {"role": "user", "content": "u2"}]},
        {"id": "b", "messages": [{"role": "user", "content": "bad400"}]},
        {"id": "c", "messages": [{"role": "user", "content": "fail500:c"}]},
    ]
    out = tmp_path / "o.jsonl"
    with StubServer() as server:
        stats = regenerate(records, _client(server), out, batch_size=3, max_new_tokens=5)
        second_turn = [r["body"]["messages"] for r in server.requests if r["body"]["messages"][-1]["content"] == "u2"]
    assert (stats.done, stats.failed, stats.total) == (2, 1, 3)
    assert second_turn == [[{"role": "user", "content": "u1"}, {"role": "assistant", "content": "echo u1#0"},
                            {"role": "user", "content": "u2"}]]
    rows = {r["id"]: r for r in read_lines(out)}
    assert rows["a"]["messages"][-1] == {"role": "assistant", "content": "echo u2#1"}
    assert rows["a"]["meta"]["generator"].startswith("openai:tiny-model@http://127.0.0.1:")
    assert rows["a"]["meta"]["sampling"]["max_new_tokens"] == 5
    failed = read_lines(failed_path_for(out))
    assert [f["id"] for f in failed] == ["b"] and "HTTP 400" in failed[0]["error"]

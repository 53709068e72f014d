"""When a greedy speculative output differs from the plain target's (eval's `exact k/n` below n/n), eval says why: the
target's top-2 logit margin at the first differing token and the dtype, so a bf16 near-tie reads as rounding (rerun in
float32) and a clear margin as a fault of the speculative decoding, instead of leaving the user to suspect either."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama_target
from dspark.evaluation.exactness import difference_line, greedy_difference
from dspark.evaluation.run_eval import ConversationRuns
from dspark.evaluation.speculative import plain_generate
from dspark.ops.lm_head import lm_head_logits

PROMPT = torch.tensor([5, 9, 2, 7, 11, 3])


def _runs(prompts, outputs) -> ConversationRuns:
    """One single-turn conversation per request."""
    return ConversationRuns([[o] for o in outputs], [], [0] * len(outputs), prompts=[[p] for p in prompts])


def _margin(target, ids) -> float:
    final = target.features(ids[None]).final[0, -1]
    top = lm_head_logits(final, target.lm_head_weight, True).topk(2).values
    return float(top[0] - top[1])


def test_a_bf16_near_tie_is_named_with_its_margin_and_dtype():
    """A tie in the bf16 target's logits at token 3 (two LM-head rows made equal): the speculative output took the
    other token there. The report names request, token, the margin measured at that prefix, the dtype, and the fix."""
    target = tiny_llama_target(64)
    target.model.to(torch.bfloat16)
    plain_out = plain_generate(target, [PROMPT], 8).tokens[0]
    k = 3
    head = target.lm_head_weight
    final = target.features(torch.cat([PROMPT, plain_out[:k]])[None]).final[0, -1]
    first, second = lm_head_logits(final, head, True).topk(2).indices.tolist()
    with torch.no_grad():
        head[second] = head[first]  # an exact tie at token k (and wherever `first` leads)
    plain_out = plain_generate(target, [PROMPT], 8).tokens[0]
    spec_out = plain_out.clone()
    spec_out[k] = second if int(plain_out[k]) == first else first
    other = plain_generate(target, [PROMPT.flip(0)], 8).tokens[0]  # a request that agrees
    diff = greedy_difference(target, _runs([PROMPT.flip(0), PROMPT], [other, spec_out]),
                             _runs([PROMPT.flip(0), PROMPT], [other, plain_out]))
    assert diff["request"] == 2 and diff["token"] == k and diff["differing"] == 1 and diff["requests"] == 2
    assert diff["dtype"] == "bfloat16" and diff["near_tie"]
    assert diff["margin"] == pytest.approx(_margin(target, torch.cat([PROMPT, plain_out[:k]])), abs=1e-6)
    line = difference_line("mt-bench", diff)
    assert line.startswith(f"mt-bench: request 2 (conversation 2, turn 1) differs from the plain target's output at "
                           f"output token {k + 1} (")
    assert "; 1 of 2 requests differ): the target's top-2 logit margin there is " in line
    assert "in bfloat16, within bfloat16 rounding" in line and "rerun with target.dtype=float32" in line


def test_a_clear_margin_is_not_blamed_on_rounding():
    target = tiny_llama_target(64)
    plain_out = plain_generate(target, [PROMPT], 6).tokens[0]
    spec_out = plain_out.clone()
    spec_out[0] = (int(plain_out[0]) + 1) % 64
    diff = greedy_difference(target, _runs([PROMPT], [spec_out]), _runs([PROMPT], [plain_out]))
    assert diff["token"] == 0 and diff["dtype"] == "float32" and not diff["near_tie"]
    assert diff["margin"] == pytest.approx(_margin(target, PROMPT), abs=1e-6) and diff["margin"] > 1e-3
    assert "not a rounding near-tie" in difference_line("chat", diff)
    assert greedy_difference(target, _runs([PROMPT], [plain_out]), _runs([PROMPT], [plain_out])) is None


def test_eval_prints_why_an_output_differs(tmp_path, monkeypatch, capsys):
    """eval.py's console: `exact 2/3` comes with the line that explains the first differing request."""
    import dspark.evaluation.run_eval as run_eval_module
    from conftest import compose_eval, tiny_chat_bench, tiny_dense_dspark_run

    _, target, _, run = tiny_dense_dspark_run(tmp_path)
    target.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # eval renders chats
    target.tokenizer.save_pretrained(tmp_path / "target")
    real = run_eval_module.speculative_generate_batch

    def one_token_off(*args, **kwargs):  # the first request's third token replaced: the output is not the target's
        out = real(*args, **kwargs)
        if not getattr(one_token_off, "done", False) and len(out.tokens[0]) > 2:
            out.tokens[0][2] = (int(out.tokens[0][2]) + 1) % 50
            one_token_off.done = True
        return out

    monkeypatch.setattr(run_eval_module, "speculative_generate_batch", one_token_off)
    reports = run_eval_module.run_eval(compose_eval(
        f"run_dir={run}", "target=hf", f"target.path={tmp_path / 'target'}", "target.dtype=float32",
        f"data_dir={tiny_chat_bench(tmp_path)}", "benchmarks=[chat]", "max_new_tokens=8", "plots=false",
        f"out={tmp_path / 'eval'}"))
    assert reports["chat"]["greedy_outputs_equal_target"] == "2/3"
    assert reports["chat"]["greedy_difference"]["token"] == 2
    out = capsys.readouterr().out
    assert "chat: request 1 (conversation 1, turn 1) differs from the plain target's output at output token 3" in out
    assert "in float32, well above float32 rounding" in out

"""Serving parity: eval.py's speculative decoding and vLLM's, on the same prompt token ids, side by side.

1. The project decodes every benchmark exactly as eval.py does (dspark.evaluation.run_eval: same prompts rendered
   with the target's chat template, turn by turn, same T / gamma / max_new_tokens / eos ids), speculatively and
   plainly, and keeps per request: the prompt ids, both outputs, and the accepted count of every verify step.
2. vLLM (in its own venv, dspark.serving.engine) decodes the SAME prompt ids with the exported draft
   (speculative method from the export's config) and, unless disabled, without a draft.
3. compare(): outputs (vs plain greedy at T=0), vLLM's own counters (`vllm:spec_decode_*`), per-request
   per-step accepted counts, and for every request that differs the first differing step with the reason.

Reasons a request can differ (each is reported, none is hidden):
- "output": vLLM's tokens differ from eval.py's. If vLLM without a draft also differs from the plain HF decode,
  the targets disagree numerically (`target_numerics`); otherwise the verification differs.
- "proposals": same tokens, a different accepted count at some verify step: the draft vLLM runs proposes other
  tokens than ours (a wrong export, or a different implementation of the draft's forward). `at_last_step`
  says whether it is only the request's last step. Both engines draft a full block even when fewer tokens
  remain before max_tokens, and both count every accepted draft of that step (also past max_tokens or eos),
  so a request that ends there is no excuse: measured equal step by step (benchmarks/README.md).
At T=0 parity means: every output equal (and equal to plain greedy), every step equal, AL within tolerance.
At T>0 the engines draw different random numbers: parity means the two ALs are within `z_max` (3) standard errors
of the per-step accepted counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dspark.evaluation.metrics import AcceptanceCounter


@dataclass
class Request:
    """One decoded request (a turn of a conversation) of one benchmark."""

    conv: int
    turn: int
    prompt_ids: list[int]
    spec_tokens: list[int]  # eval.py speculative output
    plain_tokens: list[int] | None  # eval.py plain target output (None when not decoded)
    steps_accepted: list[int]  # accepted drafts per verify step
    steps_drafted: list[int]  # drafts per verify step


@dataclass
class VLLMRequest:
    token_ids: list[int]
    finish_reason: str | None
    steps_accepted: list[int] | None  # None: vLLM gave no per-request record
    steps_drafted: list[int] | None
    plain_token_ids: list[int] | None = None  # vLLM without a draft


def request_order(convs: list[list[str]], all_turns: bool) -> list[tuple[int, int]]:
    """(conversation, turn) of every request in the order decode_conversations runs them (turn-major)."""
    n_turns = max(len(c) for c in convs) if all_turns else 1
    return [(i, t) for t in range(n_turns) for i, c in enumerate(convs) if len(c) > t]


def counter_of(accepted: list[list[int]], drafted: list[list[int]]) -> AcceptanceCounter:
    c = AcceptanceCounter()
    for acc, dr in zip(accepted, drafted):
        for n, k in zip(acc, dr):
            c.update(k, n)
    return c


def _first_diff(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(req: Request, vl: VLLMRequest) -> dict:
    """Per-request comparison: which steps / tokens differ and why (module docstring)."""
    out = {"conv": req.conv, "turn": req.turn, "prompt_tokens": len(req.prompt_ids), "finish": vl.finish_reason,
           "eval_tokens": len(req.spec_tokens), "vllm_tokens": len(vl.token_ids),
           "eval_al": counter_of([req.steps_accepted], [req.steps_drafted]).report()["mean_acceptance_length"],
           "vllm_al": None if vl.steps_accepted is None else
           counter_of([vl.steps_accepted], [vl.steps_drafted]).report()["mean_acceptance_length"]}
    tok = _first_diff(req.spec_tokens, vl.token_ids)
    if tok is not None:
        numerics = (vl.plain_token_ids is not None and req.plain_tokens is not None
                    and vl.plain_token_ids != req.plain_tokens)
        return {**out, "status": "output", "first_token_diff": tok, "target_numerics": numerics}
    if vl.steps_accepted is None:
        return {**out, "status": "tokens_equal_no_steps"}
    steps_e = list(zip(req.steps_accepted, req.steps_drafted))
    steps_v = list(zip(vl.steps_accepted, vl.steps_drafted))
    step = _first_diff(steps_e, steps_v)
    if step is None:
        return {**out, "status": "identical"}
    return {**out, "status": "proposals", "first_step_diff": step, "num_steps": [len(steps_e), len(steps_v)],
            "at_last_step": step >= min(len(steps_e), len(steps_v)) - 1,
            "eval_step": list(steps_e[step]) if step < len(steps_e) else None,
            "vllm_step": list(steps_v[step]) if step < len(steps_v) else None}


def al_z_score(acc_a: list[int], acc_b: list[int]) -> float | None:
    """|mean_a - mean_b| / sqrt(SE_a^2 + SE_b^2) of the accepted drafts per verify step (AL = 1 + mean):
    how many standard errors apart two sampled runs' acceptance lengths are."""
    if len(acc_a) < 2 or len(acc_b) < 2:
        return None

    def mean_var(x):
        m = sum(x) / len(x)
        return m, sum((v - m) ** 2 for v in x) / (len(x) - 1)

    (ma, va), (mb, vb) = mean_var(acc_a), mean_var(acc_b)
    se = (va / len(acc_a) + vb / len(acc_b)) ** 0.5
    return 0.0 if se == 0 and ma == mb else (float("inf") if se == 0 else abs(ma - mb) / se)


def compare(requests: list[Request], vllm: list[VLLMRequest], engine_counters: dict | None, temperature: float,
            al_tolerance: float = 0.02, z_max: float = 3.0) -> dict:
    """Side-by-side report of one benchmark (see the module docstring). T=0: exact (outputs, every step, AL
    within `al_tolerance`); T>0: the two ALs within `z_max` standard errors (independent random streams)."""
    if len(requests) != len(vllm):
        raise ValueError(f"{len(requests)} eval.py requests but {len(vllm)} vLLM outputs")
    ev = counter_of([r.steps_accepted for r in requests], [r.steps_drafted for r in requests]).report()
    have_steps = all(v.steps_accepted is not None for v in vllm)
    vl_req = counter_of([v.steps_accepted for v in vllm], [v.steps_drafted for v in vllm]).report() if have_steps else None
    vl = _engine_report(engine_counters) if engine_counters else vl_req
    per_request = [classify(r, v) for r, v in zip(requests, vllm)]
    statuses: dict[str, int] = {}
    for p in per_request:
        statuses[p["status"]] = statuses.get(p["status"], 0) + 1
    al_e, al_v = ev["mean_acceptance_length"], (vl or {}).get("mean_acceptance_length")
    rel = None if al_e is None or al_v is None else abs(al_v - al_e) / al_e
    n = len(requests)
    out: dict = {"num_requests": n, "temperature": temperature, "eval": ev, "vllm": vl,
                 "vllm_per_request_sum": vl_req, "al_rel_diff": rel, "al_tolerance": al_tolerance,
                 "request_status": statuses, "per_request": per_request}
    if engine_counters and vl_req is not None:  # vLLM's two records of the same run must agree
        out["vllm_counters_consistent"] = all(vl[k] == vl_req[k] for k in
                                              ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    if temperature == 0:
        plain = [r.plain_tokens for r in requests]
        outputs = {"vllm_equals_eval": f"{sum(r.spec_tokens == v.token_ids for r, v in zip(requests, vllm))}/{n}"}
        if all(p is not None for p in plain):
            outputs["eval_equals_plain"] = f"{sum(r.spec_tokens == r.plain_tokens for r in requests)}/{n}"
            outputs["vllm_equals_plain"] = f"{sum(v.token_ids == r.plain_tokens for r, v in zip(requests, vllm))}/{n}"
            if all(v.plain_token_ids is not None for v in vllm):
                outputs["vllm_plain_equals_plain"] = \
                    f"{sum(v.plain_token_ids == r.plain_tokens for r, v in zip(requests, vllm))}/{n}"
        out["outputs"] = outputs
        out["steps_equal"] = f"{statuses.get('identical', 0)}/{n}"
        out["parity"] = bool(rel is not None and rel <= al_tolerance and statuses.get("identical", 0) == n
                             and all(f.split("/")[0] == f.split("/")[1] for f in outputs.values()))
    else:  # sampled: different random streams, so only the rates compare, statistically
        acc_e = [n for r in requests for n in r.steps_accepted]
        acc_v = [n for v in vllm for n in (v.steps_accepted or [])] if have_steps else []
        z = al_z_score(acc_e, acc_v)
        out.update(al_z=z, al_z_max=z_max)
        out["parity"] = bool(z is not None and z <= z_max)
    out["explanation"] = explain(out)
    return out


def _engine_report(c: dict) -> dict:
    counter = AcceptanceCounter(c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"],
                                list(c["accepted_per_pos"]))
    return counter.report()


def explain(rep: dict) -> list[str]:
    """Plain-language reasons for every difference in a benchmark report."""
    lines = []
    st = rep["request_status"]
    if rep["temperature"] > 0:
        z = rep.get("al_z")
        lines.append("T > 0: the engines draw different random numbers, so outputs differ and only the acceptance "
                     f"rates compare: the ALs are {'-' if z is None else f'{z:.2f}'} standard errors apart "
                     f"(parity: <= {rep.get('al_z_max')})")
        return lines
    if st.get("output"):
        numerics = sum(p.get("target_numerics", False) for p in rep["per_request"] if p["status"] == "output")
        lines.append(f"{st['output']} request(s): vLLM's output differs from eval.py's; in {numerics} of them vLLM "
                     "without a draft also differs from the HF target's plain decoding (target numerics), the steps "
                     "after the first differing token are not comparable")
    if st.get("proposals"):
        last = sum(p.get("at_last_step", False) for p in rep["per_request"] if p["status"] == "proposals")
        lines.append(f"{st['proposals']} request(s): same tokens but a different accepted count at some verify step "
                     f"({last} of them only at their last step): vLLM's draft proposes other tokens than the "
                     "project's (check the export: python -m dspark.export verify, and the load audit)")
    if st.get("tokens_equal_no_steps"):
        lines.append("vLLM gave no per-request step record (per_request_spec_decode_metrics off): only totals compare")
    if not lines:
        lines.append("none: every request has identical outputs and identical accepted counts at every step")
    return lines


def _steps_or_z(r: dict) -> str:
    if r.get("steps_equal"):
        return r["steps_equal"]
    return "-" if r.get("al_z") is None else f"z={r['al_z']:.2f}"


def format_table(reports: dict[str, dict]) -> str:
    """One line per benchmark: AL and cumulative per-position rates of both engines, outputs, steps."""
    head = (f"{'benchmark':<12} {'req':>4} {'AL eval':>8} {'AL vLLM':>8} {'diff':>7}  {'steps eq/z':>11}  "
            "outputs (vLLM=eval, eval=plain, vLLM=plain)  per-position rate eval | vLLM")
    lines = [head]
    for name, r in reports.items():
        ev, vl = r["eval"], r["vllm"] or {}
        fmt = (lambda x: "-" if x is None else f"{x:.3f}")
        o = r.get("outputs", {})
        pos_e = " ".join(fmt(x) for x in ev["per_position_rate"])
        pos_v = " ".join(fmt(x) for x in vl.get("per_position_rate", []))
        diff = "-" if r["al_rel_diff"] is None else f"{100 * r['al_rel_diff']:.2f}%"
        lines.append(f"{name:<12} {r['num_requests']:>4} {fmt(ev['mean_acceptance_length']):>8} "
                     f"{fmt(vl.get('mean_acceptance_length')):>8} {diff:>7}  {_steps_or_z(r):>11}  "
                     f"{o.get('vllm_equals_eval', '-')}, {o.get('eval_equals_plain', '-')}, "
                     f"{o.get('vllm_equals_plain', '-')}  {pos_e} | {pos_v}")
    return "\n".join(lines)


@dataclass
class VLLMRun:
    """What one engine configuration returned for a list of prompts."""

    outputs: list[dict]
    counters: dict | None
    seconds: float
    extra: dict = field(default_factory=dict)

    def requests(self, plain: "VLLMRun | None" = None) -> list[VLLMRequest]:
        out = []
        for i, o in enumerate(self.outputs):
            spec = o.get("spec")
            detailed = spec is not None and sum(spec["histogram"]) == len(spec["per_step_accepted"])
            out.append(VLLMRequest(o["token_ids"], o.get("finish_reason"),
                                   list(spec["per_step_accepted"]) if detailed else None,
                                   list(spec["per_step_drafted"]) if detailed else None,
                                   None if plain is None else plain.outputs[i]["token_ids"]))
        return out

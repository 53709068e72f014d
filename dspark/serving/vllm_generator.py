"""Regeneration through vLLM: a `dspark.data.generator.Generator` backed by the vLLM worker (offline
`LLM.generate` in vLLM's own venv; tensor parallel on GPUs), so `regenerate()` keeps its bookkeeping
(done / failed / skipped, resumable, no duplicates) whatever the engine.

Prompts are rendered exactly as the HF backend renders them (`dspark.data.hf_generator.render_chat`: the target's
chat template through transformers in this process, `enable_thinking: False`, no extra special tokens) and sent as
token ids; answers come back as token ids and are decoded here by the HF backend's `decode_answer`, cut at the
first end token (`stop_token_ids`: generation_config + tokenizer eos), special tokens removed. Per-request seeds
are derived from (seed, the conversation) like the OpenAI client's (`prompt_seed`), so a record's answer does not
depend on its batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dspark.data.generator import Completion, GenerationError, GeneratorUnavailable, SamplingParams, prompt_seed
from dspark.data.hf_generator import NON_THINKING, decode_answer, render_chat, stop_token_ids
from dspark.serving import engine  # VLLMWorker looked up per call: tests substitute it
from dspark.serving.engine import VLLMWorkerError
from dspark.targets import register_v41


class VLLMGenerator:
    """`generate(batch of message lists, sampling) -> [Completion]` with vLLM serving `target` (an HF folder)."""

    def __init__(self, target: str | Path, sampling: SamplingParams | None = None, *, python: str | None = None,
                 tensor_parallel_size: int = 1, max_model_len: int = 4096, dtype: str = "float32",
                 kv_cache_gib: int = 2, chat_template_kwargs: dict | None = None, log_path=None,
                 threads: int | None = None, engine_kwargs: dict | None = None):
        from transformers import AutoTokenizer, GenerationConfig

        register_v41()
        self.target = str(target)
        self.tokenizer = AutoTokenizer.from_pretrained(self.target)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.target}: the tokenizer has no chat template")
        self.sampling = sampling or SamplingParams()
        self.chat_template_kwargs = dict(NON_THINKING) if chat_template_kwargs is None else chat_template_kwargs
        try:
            eos = GenerationConfig.from_pretrained(self.target).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        self.stop_ids = stop_token_ids(eos, self.tokenizer)
        self.max_model_len = int(max_model_len)
        self.name = f"vllm:{Path(self.target).name}"
        self.worker = engine.VLLMWorker(python, log_path=log_path, threads=threads)
        info = self.worker.init(target=self.target, dtype=dtype, max_model_len=self.max_model_len,
                                kv_cache_gib=kv_cache_gib, tensor_parallel_size=tensor_parallel_size,
                                engine_kwargs=engine_kwargs)
        self.versions = info.get("versions")

    def render(self, messages) -> list[int]:
        text = render_chat(self.tokenizer, messages, self.chat_template_kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, batch: Sequence[Sequence[dict]], sampling: SamplingParams | None = None) -> list[Completion]:
        sampling = sampling or self.sampling
        if not batch:
            return []
        prompts = [self.render(m) for m in batch]
        too_long = [i for i, p in enumerate(prompts) if len(p) + sampling.max_new_tokens > self.max_model_len]
        if too_long:  # vLLM refuses the whole call: fail these rows only (regenerate retries row by row)
            raise GenerationError(f"prompt + max_new_tokens exceeds max_model_len {self.max_model_len} "
                                  f"for rows {too_long}")
        try:
            res = self.worker.generate(prompts, max_tokens=sampling.max_new_tokens,
                                       temperature=sampling.temperature,
                                       top_p=sampling.request_top_p,
                                       seeds=[prompt_seed(sampling.seed, m) for m in batch],
                                       stop_token_ids=self.stop_ids)
        except VLLMWorkerError as exc:
            raise GenerationError(str(exc)) from exc
        except (RuntimeError, TimeoutError) as exc:  # the worker died: nothing else will work either
            raise GeneratorUnavailable(str(exc)) from exc
        stop = set(self.stop_ids)
        return [decode_answer(self.tokenizer, o["token_ids"], stop, o.get("finish_reason")) for o in res["outputs"]]

    def close(self) -> None:
        self.worker.close()

    def __enter__(self) -> "VLLMGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

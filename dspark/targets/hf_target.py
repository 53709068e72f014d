"""Frozen target: an HF causal LM whose layer outputs feed the draft and whose LM head is the teacher.

Layer outputs are captured with forward hooks on the decoder layers (output_hidden_states would hand
back post-norm or pre-layer states depending on the model). DeepSeek-V4 layers output hc_mult copies
[B, S, hc, H]; they are averaged over hc (docs/CONTRACTS.md §2.1).

Optionally (`pre_head=True`, or `capture_pre_head` set on the target) the raw output of the LAST decoder
layer is kept as well: for DeepSeek-V4 the pre-hc_head stream [B, S, hc, H] (before hc_head and the final
norm) that the official V4 MTP consumes; it costs nothing when not asked for.
"""
from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dspark.ops.lm_head import lm_head_logits, vllm_head_fp32
from dspark.targets import register_v41


@dataclass
class TargetFeatures:
    aux: torch.Tensor  # [B, S, n*H] concatenated outputs of target_layer_ids
    final: torch.Tensor  # [B, S, H] final hidden after the model's final norm
    pre_head: torch.Tensor | None = None  # [B, S, hc, H] (V4) / [B, S, H]: raw last-layer output, when asked

    def prefix(self, length: int) -> "TargetFeatures":
        """The features of positions 0..length-1 (every present field is sliced on dim 1)."""
        return type(self)(**{k: None if v is None else v[:, :length] for k, v in vars(self).items()})


def strided_sample_index(n: int, k: int, device=None) -> torch.Tensor:
    """min(k, n) indices spread evenly over [0, n), first and last included, in exact int64 arithmetic
    (a float32 linspace rounds past n - 1 once n exceeds 2^24)."""
    k = min(k, n)
    if k == 1:
        return torch.zeros(1, dtype=torch.long, device=device)
    return torch.arange(k, dtype=torch.long, device=device) * (n - 1) // (k - 1)


def _cache_kwarg(base: nn.Module) -> str:
    """The name under which the decoder takes its KV cache: `cache` (transformers >= 5.24) or `past_key_values`
    (earlier). A name the forward does not declare would land in **kwargs and be ignored: every cached forward
    would then silently start from an empty cache."""
    params = inspect.signature(base.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{type(base).__name__}.forward takes neither `cache` nor `past_key_values`: this transformers "
                    "version is not supported for KV-cached decoding (tested: 5.24)")


def decoder_base(model: nn.Module) -> nn.Module:
    """The decoder stack under a causal LM, the module whose forward gives the final (normed) hidden as
    `last_hidden_state` and holds the decoder layers as `.layers`: transformers' `base_model` (the attribute its
    `base_model_prefix` names: `.model` for Llama-style models, `.gpt_neox` for GPT-NeoX), else `.model`, else the
    model itself (a bare decoder). TypeError when none of them holds a ModuleList `.layers`."""
    for base in (getattr(model, "base_model", None), getattr(model, "model", None), model):
        if isinstance(base, nn.Module) and isinstance(getattr(base, "layers", None), nn.ModuleList):
            return base
    raise TypeError(f"{type(model).__name__}: cannot find decoder layers at .{getattr(model, 'base_model_prefix', '')}"
                    ".layers, .model.layers or .layers")


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    return decoder_base(model).layers


FP16_SMALLEST_NORMAL = 2.0 ** -14  # FrozenTarget.fingerprint: below it a float16 load loses bf16 bits


class FrozenTarget:
    """Wraps an HF causal LM: no grads, eval mode, never part of an optimizer or checkpoint.

    Deliberately not an nn.Module, so assigning it to a LightningModule attribute does not register
    its weights as trainable or saved state.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], tokenizer=None, *, require_aux: bool = True):
        """`require_aux=False` allows an empty `layer_ids` (drafts that read no intermediate layers, e.g.
        MTP heads); `aux` is then [B, S, 0]."""
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.layers = _decoder_layers(model)
        n = len(self.layers)
        bad = [i for i in layer_ids if not 0 <= int(i) < n]
        if (not layer_ids and require_aux) or bad:
            raise ValueError(
                f"draft.target_layer_ids={list(layer_ids)}: ids must be 0-based layer indices in [0, {n - 1}] "
                f"of the target ({type(model).__name__} has {n} layers); bad: {bad or 'empty list'}"
            )
        self.layer_ids = [int(i) for i in layer_ids]
        cfg = model.config
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(cfg.vocab_size)
        self.hc_mult = int(getattr(cfg, "hc_mult", 0) or 0)
        # features() also returns the raw last-layer output (pre-hc_head stream) when this is set;
        # the DSV4 MTP draft sets it when it is built against this target.
        self.capture_pre_head = False
        # vLLM's head dtype for this config (dspark.ops.lm_head): HY V4 computes its logits in float32 by default
        self.head_fp32 = vllm_head_fp32(model.config)

    # ---- shared weights ---------------------------------------------------------------------------
    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # [V, H]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [V, H]

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def to(self, device) -> "FrozenTarget":
        self.model.to(device)
        return self

    @torch.no_grad()
    def fingerprint(self, samples: int = 4096) -> str:
        """sha256 over every parameter's name and shape and a fixed strided sample of `samples` values (first and last
        included), each rounded to bfloat16: cheap at any size; retraining changes it (an edit of single values between
        the samples would not). Stored with a trained draft (draft/target.json) so eval refuses a different target
        under the same name. It names the weights, not the dtype they are loaded in: a float32 and a bfloat16 load of
        one folder give the same string (float32 holds the stored values, a bfloat16 load rounds them as this does),
        and so does a float16 load of a bf16-stored checkpoint (float16 holds every bf16 value from its smallest
        normal, 2^-14, up: smaller ones count as zero). `legacy_fingerprint`: the older, dtype-dependent scheme, for
        records written before."""
        h = hashlib.sha256()
        for name, p in sorted(self.model.state_dict().items()):
            h.update(f"{name}|{tuple(p.shape)}|".encode())
            if p.numel():
                values = self._sampled(name, p, strided_sample_index(p.numel(), samples))
                if p.is_floating_point():
                    values = values.to(torch.bfloat16).float()
                    values[values.abs() < FP16_SMALLEST_NORMAL] = 0.0
                h.update(values.numpy().tobytes())
        return h.hexdigest()

    @torch.no_grad()
    def legacy_fingerprint(self, dtype: torch.dtype | None = None, samples: int = 4096) -> str:
        """The fingerprint as draft/target.json files were written before it ignored the load dtype: the dtype in
        every entry's header and the sampled values as loaded. `dtype`: as if the floating-point weights were loaded
        in that dtype (default: as they are); exact for a dtype no finer than the loaded one's values (a float32 load
        reproduces a bfloat16 or float16 load's record; a bfloat16 load a float32 one's only for bf16-stored
        weights)."""
        h = hashlib.sha256()
        for name, p in sorted(self.model.state_dict().items()):
            as_dtype = dtype if dtype is not None and p.is_floating_point() else p.dtype
            h.update(f"{name}|{tuple(p.shape)}|{as_dtype}|".encode())
            if p.numel():
                values = self._sampled(name, p, strided_sample_index(p.numel(), samples))
                h.update(values.to(as_dtype).float().numpy().tobytes())
        return h.hexdigest()

    def _sampled(self, name: str, p: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """State-dict entry `name` (tensor p) at flat positions `index` [k] (int64, CPU) -> float32 [k] on the CPU."""
        return p.detach().reshape(-1)[index.to(p.device)].float().cpu()

    # ---- forward ------------------------------------------------------------------------------------
    def _layer_output(self, out) -> torch.Tensor:
        h = out[0] if isinstance(out, tuple) else out
        if h.dim() == 4:  # DeepSeek-V4 hyper-connection copies [B, S, hc, H]
            h = h.mean(dim=-2)
        return h  # [B, S, H]

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 position_ids: torch.Tensor | None = None, cache=None, pre_head: bool | None = None) -> TargetFeatures:
        """input_ids [B, S] -> TargetFeatures (aux [B,S,n*H], final [B,S,H], and with `pre_head` (default:
        self.capture_pre_head) the raw last-layer output [B,S,hc,H] / [B,S,H]) of those S tokens.

        attention_mask [B, S_cache + S] (1 = real token), position_ids [B, S] and an HF `cache` (updated in
        place) are passed through to the model for KV-cached decoding (dspark.evaluation.target_session)."""
        pre_head = self.capture_pre_head if pre_head is None else pre_head
        captured: dict[int, torch.Tensor] = {}
        handles = [
            self.layers[i].register_forward_hook(
                lambda _m, _inp, out, i=i: captured.__setitem__(i, self._layer_output(out))
            )
            for i in self.layer_ids
        ]
        if pre_head:  # the last layer's output as is: no hc averaging
            handles.append(self.layers[-1].register_forward_hook(
                lambda _m, _inp, out: captured.__setitem__("pre_head", out[0] if isinstance(out, tuple) else out)
            ))
        try:
            base = decoder_base(self.model)
            kwargs = {} if cache is None else {_cache_kwarg(base): cache}
            out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=cache is not None, **kwargs)
        finally:
            for h in handles:
                h.remove()
        final = out.last_hidden_state
        if self.layer_ids:
            aux = torch.cat([captured[i] for i in self.layer_ids], dim=-1)
        else:
            aux = final.new_zeros(*final.shape[:2], 0)  # [B, S, 0]
        return TargetFeatures(aux=aux, final=final, pre_head=captured.get("pre_head"))

    @torch.no_grad()
    def logits_from_final(self, final: torch.Tensor) -> torch.Tensor:
        """Teacher rows: [..., H] -> [..., V] via the target's LM head."""
        return lm_head_logits(final, self.lm_head_weight, self.head_fp32)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def resolve_target_source(path: str) -> str:
    """target.path -> what from_pretrained loads: a local folder as is, else a Hub id (org/name) resolved through
    the Hugging Face cache (HF_HOME / HF_HUB_CACHE; with HF_HUB_OFFLINE=1 nothing is downloaded). Neither a folder
    nor a usable id: FileNotFoundError naming target.path, before anything loads."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(path).expanduser().is_dir():
        return str(Path(path).expanduser())
    try:
        validate_repo_id(path)
    except HFValidationError:
        raise FileNotFoundError(f"target.path={path!r} is not a folder (nor a Hub id such as Qwen/Qwen3-8B)") from None
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(path, "config.json"), str):
        raise FileNotFoundError(
            f"target.path={path!r} is neither a local folder nor a model in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); HF_HUB_OFFLINE is set, so nothing is downloaded: `hf download {path}` "
            "where there is a network, or set target.path to a folder")
    return path


def load_hf_target(path: str, layer_ids: list[int], dtype: str = "float32", *, require_aux: bool = True) -> FrozenTarget:
    """A local HF causal-LM folder or a Hub id through the Hugging Face cache (resolve_target_source). Training from
    a complete feature cache needs only the head: dspark.targets.head_only.load_head_only_target."""
    from transformers import AutoModelForCausalLM

    source = resolve_target_source(str(path))
    register_v41()
    torch_dtype = getattr(torch, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as e:  # an id that is neither cached nor downloadable, a folder without a model, ...
        raise FileNotFoundError(f"target.path={path!r}: {e}") from e
    return FrozenTarget(model, layer_ids, load_target_tokenizer(source), require_aux=require_aux)


def load_target_tokenizer(source: str):
    """The target's tokenizer from a resolved source (resolve_target_source): what every target loader hands out."""
    from transformers import AutoTokenizer

    register_v41()  # a tokenizer without its class reads config.json's model_type
    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as e:
        raise FileNotFoundError(f"target.path={source!r}: {e}") from e

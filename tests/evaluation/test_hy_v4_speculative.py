"""HY V4 MTP chain drafting on the tiny HY V4 target: propose() == teacher-forced steps over the full sequence, and
greedy speculative decoding == plain greedy decoding with random, target-initialised and perturbed drafts."""
from __future__ import annotations

import pytest
import torch

from dspark.evaluation.speculative import acceptance_counter, speculative_generate, target_generate
from dspark.models.hy_v4_mtp import HYV4MTPConfig, HYV4MTPDraft
from dspark.targets.tiny_hy_v4 import load_tiny_hy_v4_target


@pytest.fixture(scope="module")
def target():
    return load_tiny_hy_v4_target()


def make_draft(target, kind: str, num_layers: int = 1) -> HYV4MTPDraft:
    torch.manual_seed(0)
    draft = HYV4MTPDraft(HYV4MTPConfig.from_target_config(target.model.config, num_layers=num_layers)).eval()
    if kind != "random":
        draft.init_from_target(target.model)
    if kind == "perturbed":
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(0.02 * torch.randn_like(p))
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return draft


def prompts(target) -> list[torch.Tensor]:
    tok = target.tokenizer
    msgs = ["What are the benefits of regular exercise?", "Write a short poem about the sea.", "hi"]
    return [torch.tensor(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]) for m in msgs]


def test_propose_equals_the_training_chain_at_the_anchor_row(target):
    """Chain drafting == the teacher-forced training chain (mtp_objectives.recursive_forward) over the sequence
    [prompt, x0, y_0..y_{g-2}] with the target's features of that sequence, read at chain a-1: training and eval
    run the same served recursion. Two MTP layers are refused (vLLM's multi-module speculator is not modelled)."""
    from dspark.training.mtp_objectives import recursive_forward

    draft = make_draft(target, "perturbed")
    tokens = prompts(target)[0][:20]  # [a+1], x0 = last
    a, g = tokens.numel() - 1, 4
    prop = draft.propose(target.features(tokens[None, :a]), tokens, num_drafts=g, temperature=0.0, generator=None)
    full = torch.cat([tokens, prop.tokens[:-1]])[None]  # [1, a + g]
    feats = target.features(full)
    with torch.no_grad():
        steps = recursive_forward(draft, draft.context_hidden(feats), full, torch.ones_like(full), feats.final, g)
    for k in range(g - 1):  # the last step's row a-1 has no label inside `full`
        row = (steps[k].rows[:, 1] == a - 1).nonzero()[0, 0]
        torch.testing.assert_close(steps[k].logits[row].float(), prop.logits[k], atol=1e-4, rtol=1e-5)
        assert int(steps[k].logits[row].argmax()) == int(prop.tokens[k])
    assert prop.q_probs.shape == (g, target.vocab_size) and prop.conf is None
    assert torch.equal(prop.q_probs.argmax(-1), prop.tokens)  # one-hot at T=0
    with pytest.raises(ValueError, match="num_layers=2 with 4 chained steps"):
        make_draft(target, "perturbed", num_layers=2).propose(target.features(tokens[None, :a]), tokens, num_drafts=g)


@pytest.mark.parametrize("kind", ["random", "target_init", "perturbed"])
def test_greedy_speculative_equals_target(target, kind):
    draft = make_draft(target, kind)
    eos = [target.tokenizer.convert_tokens_to_ids("<|im_end|>"), target.tokenizer.eos_token_id]
    stats_all = []
    for prompt, g in zip(prompts(target), (1, 3, 3)):
        ref = target_generate(target, prompt, 12, eos_token_id=eos)
        out, stats = speculative_generate(target, draft, prompt, max_new_tokens=12, num_drafts=g,
                                          eos_token_id=eos)
        assert out.tolist() == ref.tolist()
        assert stats and all(s.num_drafts == g and 0 <= s.num_accepted <= g for s in stats)
        stats_all += stats
    counter = acceptance_counter(stats_all)
    assert counter.num_drafts == len(stats_all)

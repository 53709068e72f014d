"""No leakage through the packed training forward (docs/CONTRACTS.md §2-3), for the DeepSeek-V4 and dense drafts:
a block's draft logits depend on the context before its anchor and on x_a only, never on later tokens or
on other blocks packed into the same sequence."""
import pytest
import torch
from conftest import tiny_v4_config
from transformers import DeepseekV4ForCausalLM, LlamaConfig, LlamaForCausalLM

from dspark.models.dspark_dense import DSparkDenseConfig, DSparkDenseDraft
from dspark.models.dspark_v4 import DSparkV4Config, DSparkV4Draft
from dspark.targets.hf_target import FrozenTarget
from dspark.training.block_module import BlockDraftModule

V, S, G, MASK = 40, 24, 3, 39


def v4_setup():
    torch.manual_seed(0)
    cfg = tiny_v4_config(vocab_size=V, sliding_window=6)
    target = FrozenTarget(DeepseekV4ForCausalLM(cfg), [1, 2])
    draft = DSparkV4Draft(DSparkV4Config.from_target_config(
        cfg, num_layers=2, block_size=G, mask_token_id=MASK, target_layer_ids=[1, 2], markov_rank=4,
        sliding_window=5))
    return target, draft


def dense_setup():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    target = FrozenTarget(LlamaForCausalLM(cfg), [0, 2])
    draft = DSparkDenseDraft(DSparkDenseConfig.from_target_config(
        cfg, num_layers=2, block_size=G, mask_token_id=MASK, target_layer_ids=[0, 2], markov_rank=4))
    return target, draft


def same(x, y):
    """Equal up to float reassociation (MoE expert batches change with the other tokens); a leak moves
    logits by orders of magnitude more."""
    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def module_for(setup, layout):
    target, draft = setup()
    draft.config.layout = layout
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    return BlockDraftModule(draft.eval(), target)


def batch(ids, anchors):
    A = len(anchors)
    return {"input_ids": ids[None], "attention_mask": torch.ones(1, S, dtype=torch.long),
            "loss_mask": torch.ones(1, S, dtype=torch.long), "anchors": torch.tensor([anchors]),
            "keep": torch.ones(1, A, dtype=torch.bool)}


@pytest.mark.parametrize("setup", [v4_setup, dense_setup], ids=["v4", "dense"])
@pytest.mark.parametrize("layout", ["anchor", "mask"])
def test_tokens_after_the_anchor_change_no_draft_logit(setup, layout):
    """The backbone (hence the base logits) of block b sees only x_<a and x_a. The Markov head is
    teacher-forced with prev_k = x_{a+k} (what inference feeds once drafts 0..k-1 are accepted), so the
    final logits of row k may depend on x_{a+1..a+k} and on nothing later."""
    m = module_for(setup, layout)
    torch.manual_seed(1)
    ids = torch.randint(0, MASK, (S,))
    anchors = [4, 11, 17]
    rand = lambda n: torch.randint(0, MASK, (n,))  # noqa: E731
    with torch.no_grad():
        base = m.draft_outputs(batch(ids, anchors))
        for b, a in enumerate(anchors):
            after = ids.clone()
            after[a + 1:] = rand(S - a - 1)  # everything after the anchor
            out = m.draft_outputs(batch(after, anchors))
            same(out.hidden[0, b], base.hidden[0, b])
            for k in range(G):  # row k: tokens after a+k are invisible even through the Markov head
                later = ids.clone()
                later[a + k + 1:] = rand(S - a - k - 1)
                out = m.draft_outputs(batch(later, anchors))
                same(out.logits[0, b, : k + 1], base.logits[0, b, : k + 1])
                same(out.conf_logits[0, b, : k + 1], base.conf_logits[0, b, : k + 1])
            # the anchor token and the context before it DO matter (the check can fail)
            at = ids.clone()
            at[a] = (ids[a] + 1) % MASK
            assert not torch.allclose(m.draft_outputs(batch(at, anchors)).hidden[0, b], base.hidden[0, b])
            before = ids.clone()
            before[a - 1] = (ids[a - 1] + 1) % MASK
            assert not torch.allclose(m.draft_outputs(batch(before, anchors)).hidden[0, b], base.hidden[0, b])
            nxt = ids.clone()  # x_{a+1} is row 1's teacher-forced prev: it must change row 1
            nxt[a + 1] = (ids[a + 1] + 1) % MASK
            assert not torch.allclose(m.draft_outputs(batch(nxt, anchors)).logits[0, b, 1], base.logits[0, b, 1])


@pytest.mark.parametrize("setup", [v4_setup, dense_setup], ids=["v4", "dense"])
def test_packed_blocks_equal_blocks_run_alone(setup):
    m = module_for(setup, "anchor")
    torch.manual_seed(2)
    ids = torch.randint(0, MASK, (S,))
    anchors = [3, 9, 10, 20]
    with torch.no_grad():
        packed = m.draft_outputs(batch(ids, anchors)).logits[0]  # [A, g, V]
        for b, a in enumerate(anchors):
            alone = m.draft_outputs(batch(ids, [a])).logits[0, 0]
            torch.testing.assert_close(packed[b], alone, rtol=1e-5, atol=1e-5)

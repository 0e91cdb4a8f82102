"""`opd.train.sft`: the SFT loss is the global token mean over assistant tokens (across micro-batches too), the
bf16 autocast path, and packing isolation (packed examples never see each other; padding where the model mixes them)."""

from __future__ import annotations

import pytest
import torch

from helpers import SFT_QA, chat, make_tiny_model
from opd.data.sft import Conversation, collate, tokenize_conversations
from opd.train.sft import forward_backward, packing_is_exact, target_logprobs


def _batch(tokenizer, pairs, **options):
    conversations = [Conversation(chat(q, a) if isinstance(q, str) else q, str(i)) for i, (q, a) in enumerate(pairs)]
    examples = tokenize_conversations(tokenizer, conversations, max_length=512, **options).examples
    return examples, collate(examples, pad_id=tokenizer.pad_token_id)


def test_loss_is_the_token_mean_over_assistant_tokens(tiny_llama, tiny_tokenizer):
    multi = [*chat("a", "b"), *chat("c", "dd")]
    examples, batch = _batch(tiny_tokenizer, [*SFT_QA, (multi, None)])
    metrics = forward_backward(tiny_llama, batch, micro_batch_tokens=10_000, packed=False)
    # by hand: full logits of each example alone, the log-prob of every target token from the position before it
    nll, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            logp = torch.log_softmax(tiny_llama(torch.tensor([ex.input_ids])).logits[0].double(), -1)
            for pos, (token, is_target) in enumerate(zip(ex.input_ids, ex.target_mask)):
                if is_target:
                    nll, count = nll - float(logp[pos - 1, token]), count + 1
    assert metrics["tokens"] == count == sum(ex.num_targets for ex in examples)
    assert float(metrics["loss"]) == pytest.approx(nll / count, abs=1e-5)
    # targets at masked positions (the second user turn sits inside the response grid) do not matter
    scrambled = collate(examples, pad_id=tiny_tokenizer.pad_token_id)
    masked = ~scrambled.response_mask & (torch.arange(scrambled.response_ids.shape[1]) < 20)
    scrambled.response_ids[masked] = 65
    assert masked.any()
    again = forward_backward(tiny_llama, scrambled, micro_batch_tokens=10_000, packed=False)
    assert float(again["loss"]) == float(metrics["loss"])


def test_loss_and_gradient_are_global_across_micro_batches(tiny_llama, tiny_tokenizer):
    _, batch = _batch(tiny_tokenizer, SFT_QA)
    grads, losses = [], []
    for budget in (10_000, 30):  # one micro-batch, then one example per micro-batch
        tiny_llama.zero_grad()
        losses.append(float(forward_backward(tiny_llama, batch, micro_batch_tokens=budget, packed=True)["loss"]))
        grads.append(torch.cat([p.grad.flatten() for p in tiny_llama.parameters()]))
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_bf16_autocast_path_runs(tiny_llama, tiny_tokenizer):
    _, batch = _batch(tiny_tokenizer, SFT_QA)
    exact = forward_backward(tiny_llama, batch, micro_batch_tokens=10_000, packed=False)["loss"]
    tiny_llama.zero_grad()
    mixed = forward_backward(tiny_llama, batch, micro_batch_tokens=10_000, packed=False, autocast_dtype=torch.bfloat16)
    assert float(mixed["loss"]) == pytest.approx(float(exact), rel=0.05)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in tiny_llama.parameters())


@pytest.mark.parametrize(
    "kind, attention", [("llama", "eager"), ("llama", "sdpa"), ("qwen3", "sdpa"), ("qwen3", "opd_varlen")]
)
def test_packed_examples_do_not_see_each_other(kind, attention, tiny_tokenizer):
    from opd.kernels import varlen_attention

    varlen_attention.register()
    net = make_tiny_model(kind)
    net.set_attn_implementation(attention)
    examples, batch = _batch(tiny_tokenizer, SFT_QA)
    with torch.no_grad():
        packed_B = target_logprobs(net, batch, packed=True).sum(-1)
        alone_B = torch.stack([target_logprobs(net, collate([ex], pad_id=0), packed=False).sum() for ex in examples])
    torch.testing.assert_close(packed_B, alone_B, atol=1e-5, rtol=0)
    assert packing_is_exact(net)


def test_packing_falls_back_to_padding_when_the_model_mixes_examples(monkeypatch, tiny_llama):
    import opd.recipes.sft as sft_module

    assert sft_module._choose_packing(tiny_llama, "packed", None)
    assert not sft_module._choose_packing(tiny_llama, "auto", None)  # eager attention: padded
    monkeypatch.setattr(sft_module, "packing_is_exact", lambda net: False)
    assert not sft_module._choose_packing(tiny_llama, "packed", None)

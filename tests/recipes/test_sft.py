"""`opd sft`: data layouts, tokenisation with the assistant-only loss mask, the global token-mean loss, packing
isolation, and whole runs (run directory, exact resume, LoRA + merge, learning from scratch) on tiny models."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import EOS_ID, SFT_QA, chat, make_tiny_model, sft_config, write_jsonl
from opd.config import ConfigError, build_config
from opd.data.prompts import DataError
from opd.data.sft import (
    Conversation,
    collate,
    end_of_turn_id,
    read_conversations,
    tokenize_conversations,
)
from opd.data.templates import encode_prompts
from opd.recipes.sft import SFTConfig, check_config, sft
from opd.train.sft import forward_backward, packing_is_exact, target_logprobs
from opd.types import Prompt

# ------------------------------------------------------------------------------------------------ layouts


def test_every_layout_parses(tmp_path):
    rollout = write_jsonl(
        tmp_path / "rollout.jsonl",
        [{"id": "p0", "source": "dapo", "answer": "5", "attempts": 2, "messages": chat("what is 2+3?", "5")}],
    )
    sharegpt = write_jsonl(
        tmp_path / "sharegpt.jsonl",
        [
            {
                "conversations": [
                    {"from": "system", "value": "be brief"},
                    {"from": "human", "value": "name a colour"},
                    {"from": "gpt", "value": "red"},
                ]
            }
        ],
    )
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(
        json.dumps(
            [
                {"instruction": "reverse", "input": "abc", "output": "cba"},
                {"instruction": "say hi", "output": "hi there"},
            ]
        )
    )
    assert read_conversations(rollout)[0].messages == chat("what is 2+3?", "5")
    assert read_conversations(sharegpt)[0].messages == [
        {"role": "system", "content": "be brief"},
        *chat("name a colour", "red"),
    ]
    assert [c.messages for c in read_conversations(alpaca)] == [chat("reverse\nabc", "cba"), chat("say hi", "hi there")]


def test_layout_errors_name_file_record_and_field(tmp_path):
    unknown = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "reply": "r"}])
    with pytest.raises(DataError, match=r"odd\.jsonl.*unknown SFT layout.*question, reply"):
        read_conversations(unknown)
    bad_role = write_jsonl(
        tmp_path / "sg.jsonl", [{"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}]
    )
    with pytest.raises(DataError, match=r"sg\.jsonl: record 0: conversations\[1\]\.from is 'bot'"):
        read_conversations(bad_role)
    missing = write_jsonl(tmp_path / "al.jsonl", [{"instruction": "q", "output": "a"}, {"instruction": "q"}])
    with pytest.raises(DataError, match=r"al\.jsonl: record 1: no field 'output' \(alpaca layout\)"):
        read_conversations(missing)
    no_answer = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DataError, match="record 0: no assistant turn"):
        read_conversations(no_answer)
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        read_conversations(tmp_path / "nope.jsonl")


# ------------------------------------------------------------------------------------------- tokenisation


def _targets(tokenizer, example):
    return tokenizer.decode([i for i, m in zip(example.input_ids, example.target_mask) if m])


def test_targets_are_the_answer_and_end_of_turn(tiny_tokenizer):
    messages = chat("what is 2+3?", "5")
    example = tokenize_conversations(tiny_tokenizer, [Conversation(messages, "x")], max_length=512).examples[0]
    prompt_ids = encode_prompts(tiny_tokenizer, [Prompt("0", messages[:1])], max_prompt_length=512).input_ids[0]
    assert example.input_ids[: len(prompt_ids)] == prompt_ids  # the same prompt tokens as rollout and eval see
    assert not any(example.target_mask[: len(prompt_ids)])
    assert _targets(tiny_tokenizer, example) == "5<|im_end|>"
    assert example.input_ids[-1] == EOS_ID == end_of_turn_id(tiny_tokenizer)
    assert end_of_turn_id(tiny_tokenizer, "<|endoftext|>") == 256


def test_multi_turn_trains_every_assistant_turn(tiny_tokenizer):
    messages = [*chat("a", "b"), *chat("c", "d")]
    kept = tokenize_conversations(tiny_tokenizer, [Conversation(messages, "x")], max_length=512).examples
    assert len(kept) == 1 and _targets(tiny_tokenizer, kept[0]) == "b<|im_end|>d<|im_end|>"
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert tiny_tokenizer.decode(kept[0].input_ids) + "\n" == rendered  # as the template writes it
    # a template whose history differs from its generation prompt (thinking off) gets one sequence per turn
    split = tokenize_conversations(
        tiny_tokenizer, [Conversation(messages, "x")], max_length=512, enable_thinking=False
    ).examples
    assert [_targets(tiny_tokenizer, ex) for ex in split] == ["b<|im_end|>", "d<|im_end|>"]
    assert tiny_tokenizer.decode(split[1].input_ids).endswith("assistant\n<think>\n\n</think>\n\nd<|im_end|>")


def test_max_length_filter_truncate_error(tiny_tokenizer):
    conversations = [Conversation(chat("q", "short"), "a"), Conversation(chat("q", "x" * 200), "b")]
    filtered = tokenize_conversations(tiny_tokenizer, conversations, max_length=64)
    assert (len(filtered.examples), filtered.num_filtered, filtered.num_truncated) == (1, 1, 0)
    cut = tokenize_conversations(tiny_tokenizer, conversations, max_length=64, on_overflow="truncate")
    assert (len(cut.examples), cut.num_truncated, len(cut.examples[1].input_ids)) == (2, 1, 64)
    with pytest.raises(DataError, match="b: 2.. tokens, over data.max_length=64"):
        tokenize_conversations(tiny_tokenizer, conversations, max_length=64, on_overflow="error")


# --------------------------------------------------------------------------------------------------- loss


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


# --------------------------------------------------------------------------------------------------- runs


def test_sft_run_writes_the_run_directory(tmp_path, tiny_model_dir, sft_data):
    bench = write_jsonl(
        tmp_path / "bench.jsonl",
        [{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}],
    )
    config = sft_config(
        tmp_path,
        tiny_model_dir,
        sft_data,
        "run.steps=2",
        "run.name=e2e",
        "run.report=true",
        "data.packing=packed",
        f"eval.benchmarks=[{bench}]",
        "eval.n=2",
        "eval.max_new_tokens=4",
    )
    run_dir = sft(config)
    assert {"config.yaml", "metrics.jsonl", "report.html", "checkpoints", "eval"} <= {p.name for p in run_dir.iterdir()}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 2]  # evals before the first step and at the end
    assert {"loss", "lr", "grad_norm", "tokens_per_second", "epoch"} <= metrics[2].keys()
    assert metrics[2]["epoch"] == pytest.approx(8 / 12)
    assert "eval/bench/avg@2" in metrics[0] and (run_dir / "eval" / "step_0" / "results.json").is_file()
    assert "eval/bench/avg@2" in metrics[3] and (run_dir / "eval" / "step_2" / "results.json").is_file()
    checkpoint = run_dir / "checkpoints" / "step_2"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt", "COMPLETE"} <= files
    AutoModelForCausalLM.from_pretrained(checkpoint)


@pytest.mark.parametrize("lora", [False, True])
def test_resume_is_bit_identical(tmp_path, tiny_model_dir, sft_data, lora):
    extra = ["lora.enabled=true", "lora.r=4", "lora.dropout=0.3", "lora.merge=false"] if lora else []
    full = sft(
        sft_config(
            tmp_path,
            tiny_model_dir,
            sft_data,
            "run.steps=4",
            "run.save_every=2",
            "run.keep_last=null",
            "optim.lr=1e-2",
            "run.name=full",
            *extra,
        )
    )
    # an interrupted run: the same directory as it was right after the step-2 checkpoint, then resumed
    resumed = tmp_path / "runs" / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    sft(
        sft_config(
            tmp_path,
            tiny_model_dir,
            sft_data,
            "run.steps=4",
            "run.save_every=2",
            "run.keep_last=null",
            "optim.lr=1e-2",
            "run.name=resumed",
            "run.resume=true",
            *extra,
        )
    )
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    a = (full / "checkpoints" / "step_4" / weights).read_bytes()
    assert a == (resumed / "checkpoints" / "step_4" / weights).read_bytes()
    losses = [
        [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, resumed)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 4


def test_lora_trains_adapters_only_and_merges(tmp_path, tiny_model_dir, sft_data):
    from peft import PeftModel

    run_dir = sft(
        sft_config(
            tmp_path,
            tiny_model_dir,
            sft_data,
            "run.steps=2",
            "run.name=lora",
            "optim.lr=3e-2",
            "lora.enabled=true",
            "lora.r=4",
            "lora.target_modules=[q_proj, v_proj, down_proj]",
        )
    )
    checkpoint = run_dir / "checkpoints" / "step_2"
    names = {p.name for p in checkpoint.iterdir()}
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names and "tokenizer.json" in names
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "merged")  # no peft needed
    changed = {n for n, p in merged.state_dict().items() if not torch.equal(p, base.state_dict()[n])}
    assert changed and all(n.rsplit(".", 2)[-2] in ("q_proj", "v_proj", "down_proj") for n in changed)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), checkpoint).eval()
    ids = torch.tensor([list(range(40, 80))])
    with torch.no_grad():
        # Two code paths: merged weights W + s·BA against W·x + s·B(A·x). Both float32, summed in another order over
        # the hidden size and the layers: a few float32 ulps of |logit| (eps 1.2e-7 · √(d · layers) · |logit| is
        # ~1e-5 here; 1.4e-5 was seen on 2 cores), so 1e-4 absolute plus 1e-5 relative, far below a wrong merge.
        torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, atol=1e-4, rtol=1e-5)


def test_sft_learns_from_scratch(tmp_path, tiny_model_dir, sft_data):
    run_dir = sft(
        sft_config(
            tmp_path, tiny_model_dir, sft_data, "run.steps=30", "run.name=learn", "optim.lr=1e-2", "run.save_every=0"
        )
    )
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and sum(losses[-3:]) / 3 < 0.1 * losses[0], losses


def test_config_defaults_and_contradictions():
    base = ["model.path=m", "data.path=d.jsonl"]
    config = build_config(SFTConfig, overrides=base)
    assert config.data.path == ["d.jsonl"] and config.optim.lr == 1e-5 and config.optim.schedule == "cosine"
    with pytest.raises(ConfigError, match="lora.dropout"):
        build_config(SFTConfig, overrides=[*base, "lora.dropout=1.5"])
    with pytest.raises(ValueError, match=r"either epochs \(2.0\) or run.steps \(10\)"):
        check_config(build_config(SFTConfig, overrides=[*base, "epochs=2", "run.steps=10"]))
    with pytest.raises(ValueError, match="micro_batch_tokens=100 is smaller than data.max_length=4096"):
        check_config(build_config(SFTConfig, overrides=[*base, "micro_batch_tokens=100"]))

"""The engine registry: one place maps names to engines; "auto" picks per device and layout."""

import pytest

from helpers import make_tiny_model
from opd.rollout import SamplingParams, engine_names, make_generator
from opd.rollout.registry import resolve_engine
from opd.rollout.static_engine import StaticGenerator
from opd.rollout.torch_engine import TorchGenerator


def test_names_and_auto_on_cpu(tiny_tokenizer):
    model = make_tiny_model("qwen3")
    assert engine_names()[:3] == ["auto", "torch", "static"]
    assert resolve_engine("auto", model) == "torch"  # no CUDA graphs on CPU
    assert type(make_generator(model, tiny_tokenizer)) is TorchGenerator
    assert type(make_generator(model, tiny_tokenizer, engine="static")) is StaticGenerator


def test_engines_agree_greedily_and_take_the_tokenizer_ids(tiny_tokenizer):
    model = make_tiny_model("qwen3")
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6)
    outputs = [make_generator(model, tiny_tokenizer, engine=name).generate([[5, 6, 7], [9]], params)
               for name in ("torch", "static")]
    assert outputs[0].response_ids == outputs[1].response_ids
    engine = make_generator(model, tiny_tokenizer, engine="torch")
    assert engine.pad_token_id == tiny_tokenizer.pad_token_id and engine.vocab_size == len(tiny_tokenizer)


def test_unknown_engine_names_the_choices(tiny_tokenizer):
    with pytest.raises(ValueError, match="one of auto, torch, static"):
        make_generator(make_tiny_model("llama"), tiny_tokenizer, engine="fast")


def test_batch_limits_and_the_fit_check_reach_both_engines(tiny_tokenizer):
    """rollout.max_batch_tokens goes through make_generator; check_generation_fits asks the engine (a fake free-memory
    figure: one byte less than a row needs fails, naming the settings) and passes engines without a memory rule."""
    from opd.rollout import memory
    from opd.rollout.registry import check_generation_fits

    model = make_tiny_model("qwen3")
    total = 2**34
    for name in ("torch", "static"):
        engine = make_generator(model, tiny_tokenizer, engine=name, max_batch_tokens=500,
                                free_memory=lambda device: (memory.margin_bytes(total) + 50 * 2**20, total))
        assert engine.max_batch_tokens == 500
        check_generation_fits(engine, prompt_tokens=8, new_tokens=16)
        with pytest.raises(ValueError, match=r"at most rollout\.max_new_tokens=\d+ fits after a 8-token prompt"):
            check_generation_fits(engine, prompt_tokens=8, new_tokens=10**6,
                                  names=("data.max_prompt_length", "rollout.max_new_tokens"))
    check_generation_fits(object(), prompt_tokens=8, new_tokens=10**9)


def test_max_batch_tokens_is_a_checked_config_key():
    from opd.config import SamplingSpec

    assert SamplingSpec().max_batch_tokens is None and SamplingSpec(max_batch_tokens=4096).max_batch_tokens == 4096
    with pytest.raises(ValueError, match="max_batch_tokens"):
        SamplingSpec(max_batch_tokens=0)

"""The engine registry: one place maps names to engines; "auto" picks per device and layout."""

import pytest

from conftest import make_tiny_model
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

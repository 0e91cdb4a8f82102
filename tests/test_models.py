"""opd.models: dtype/device resolution, loading from a save_pretrained directory, one-line load errors, and the
student/teacher vocabulary check."""

from __future__ import annotations

import pytest
import torch

from helpers import EOS_ID, PAD_ID, TINY_VOCAB, make_tiny_model, make_tiny_tokenizer
from opd.models import (
    ModelLoadError,
    TokenizerMismatchError,
    VocabInfo,
    check_tokenizer_compatibility,
    check_top_k,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)


def test_resolve_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="'bogus'"):
        resolve_device("bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    for name, dtype in [
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("fp32", torch.float32),
        ("float32", torch.float32),
    ]:
        assert resolve_dtype(name) == dtype
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError) as err:
        resolve_dtype("fp8")
    message = str(err.value)
    assert "\n" not in message and "'fp8'" in message and "'bf16'" in message and "'fp32'" in message


def test_load_model_from_directory(tiny_model_dir):
    model, tokenizer = load_model(tiny_model_dir, device="cpu")
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.pad_token_id == PAD_ID and tokenizer.eos_token_id == EOS_ID and len(tokenizer) == TINY_VOCAB
    ids = torch.tensor([tokenizer.encode("round trip")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, make_tiny_model("llama")(ids).logits)
    model_bf16, _ = load_model(tiny_model_dir, dtype="bf16", device="cpu")
    assert next(model_bf16.parameters()).dtype == torch.bfloat16


def test_load_model_packs_rows_where_the_varlen_kernel_runs(tiny_model_dir, monkeypatch):
    """On CUDA (simulated: the kernel check says yes) an unspecified attention becomes opd_varlen, which the scorer
    packs for; an explicit choice is kept, and on CPU transformers' default stays."""
    from opd.forward import uses_packing
    from opd.kernels import varlen_attention

    assert load_model(tiny_model_dir, device="cpu")[0].config._attn_implementation == "sdpa"
    monkeypatch.setattr(varlen_attention, "kernel_available", lambda device: True)
    model, _ = load_model(tiny_model_dir, device="cpu")
    assert model.config._attn_implementation == varlen_attention.ATTENTION and uses_packing(model)
    assert (
        load_model(tiny_model_dir, device="cpu", attn_implementation="eager")[0].config._attn_implementation == "eager"
    )


@pytest.mark.parametrize("name", ["/no/such/dir/model", "./missing-model", "not a valid id"])
def test_load_model_bad_path_is_one_line(name):
    with pytest.raises(ModelLoadError) as err:
        load_model(name, device="cpu")
    assert "\n" not in str(err.value) and repr(name) in str(err.value)


def test_load_model_incomplete_directory_is_one_line(tmp_path):
    make_tiny_tokenizer().save_pretrained(tmp_path)  # a tokenizer but no weights or config
    with pytest.raises(ModelLoadError) as err:
        load_model(tmp_path, device="cpu")
    assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)


def test_load_tokenizer_pads_with_eos(tmp_path):
    tokenizer = make_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == EOS_ID and len(loaded) == TINY_VOCAB


def test_eos_token_ids(tiny_tokenizer):
    model = make_tiny_model("qwen3")
    assert eos_token_ids(model, tiny_tokenizer) == [EOS_ID, PAD_ID]  # tokenizer's first, then generation config
    assert eos_token_ids(tokenizer=tiny_tokenizer) == [EOS_ID]


def test_compatibility_identical_and_padded_sizes(tiny_tokenizer):
    other = make_tiny_tokenizer()
    assert check_tokenizer_compatibility(tiny_tokenizer, other) == VocabInfo(
        TINY_VOCAB, TINY_VOCAB, TINY_VOCAB, TINY_VOCAB
    )
    # Embedding rows padded past the tokenizer (like Qwen's 151936 vs 152064): compare on the smaller one.
    info = check_tokenizer_compatibility(tiny_tokenizer, other, student_vocab_size=288, teacher_vocab_size=320)
    assert info == VocabInfo(size=288, tokenizer_size=TINY_VOCAB, student_size=288, teacher_size=320)
    with pytest.raises(TokenizerMismatchError, match="teacher model has 200 vocabulary rows"):
        check_tokenizer_compatibility(tiny_tokenizer, other, student_vocab_size=288, teacher_vocab_size=200)


def test_top_k_may_rank_the_whole_vocabulary_and_no_more(tiny_tokenizer):
    check_top_k(0, tiny_tokenizer)
    check_top_k(TINY_VOCAB, tiny_tokenizer)
    with pytest.raises(ValueError, match=rf"^objective.top_k={TINY_VOCAB + 1} .* must be in \[0, {TINY_VOCAB}\]"):
        check_top_k(TINY_VOCAB + 1, tiny_tokenizer)


class _VocabOnly:
    """Stands in for a tokenizer whose token→id map was edited."""

    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_compatibility_swapped_token_is_named(tiny_tokenizer):
    vocab = tiny_tokenizer.get_vocab()
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # ids 97 and 98 swapped in the teacher
    with pytest.raises(TokenizerMismatchError) as err:
        check_tokenizer_compatibility(tiny_tokenizer, _VocabOnly(vocab))
    assert str(err.value) == "tokenizers differ: token 'a' has id 97 in the student and id 98 in the teacher"


def test_compatibility_missing_token_is_named(tiny_tokenizer):
    teacher = make_tiny_tokenizer()
    teacher.add_tokens(["<extra>"])
    with pytest.raises(
        TokenizerMismatchError, match=r"'<extra>' \(id 261 in the teacher\) is missing from the student"
    ):
        check_tokenizer_compatibility(tiny_tokenizer, teacher)
    with pytest.raises(
        TokenizerMismatchError, match=r"'<extra>' \(id 261 in the student\) is missing from the teacher"
    ):
        check_tokenizer_compatibility(teacher, tiny_tokenizer)


@pytest.mark.slow
def test_compile_layers_is_cuda_only_by_default_and_keeps_results():
    """`compile_layers` (what `opd distill` does on a GPU): off on CPU unless asked; when on, the forward, the gradients
    under gradient checkpointing, and generation through the HF model (run eagerly by design) are unchanged."""
    from opd.forward import forward_hidden
    from opd.models import compile_layers
    from opd.rollout import SamplingParams
    from opd.rollout.torch_engine import TorchGenerator
    from opd.types import Rollouts

    eager, compiled = make_tiny_model("qwen3", seed=4), make_tiny_model("qwen3", seed=4)
    assert compile_layers(compiled) is False and compile_layers(compiled, False) is False
    assert compile_layers(compiled, True, backend="aot_eager") is True
    compiled.gradient_checkpointing_enable()
    ids = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.bool)
    mask[1, 9:] = False  # a shorter row: a padded batch with an attention mask
    rollouts = Rollouts(
        input_ids=ids,
        attention_mask=mask,
        prompt_lengths=torch.tensor([4, 4, 4]),
        response_ids=ids[:, 4:],
        response_mask=mask[:, 4:],
        group_ids=torch.arange(3),
        truncated=torch.zeros(3, dtype=torch.bool),
    )
    grads = []
    for model in (eager, compiled):
        model.train()
        hidden = forward_hidden(model, rollouts)
        hidden.hidden_ND.square().mean().backward()
        grads.append((hidden.hidden_ND.detach(), model.model.layers[0].mlp.down_proj.weight.grad.clone()))
        model.eval()
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=1e-5)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, stop_at_eos=False)
    outputs = [
        TorchGenerator(m, pad_token_id=PAD_ID, eos_token_ids=[EOS_ID]).generate([[5, 6, 7]], params)
        for m in (eager, compiled)
    ]
    assert outputs[0].response_ids == outputs[1].response_ids


def test_the_compiled_layers_option_against_size_guards_is_one_inductor_knows():
    """`compile_layers` compiles with inductor's mix-order reductions in non-strict mode: in strict mode each size
    test of that fusion became a guard on the packed token count, and the real pair's update compiled its graph again
    for a smaller micro-batch (docs/performance.md; `benchmarks/recompiles.py` shows it on a GPU). The option must
    be one this torch's inductor knows (an unknown key fails the compile), and it must reach the config."""
    import torch._inductor.config as inductor_config

    from opd.models import no_size_guards

    options = no_size_guards()
    assert options == {"triton.mix_order_reduction_non_strict_mode": True}
    assert inductor_config.triton.mix_order_reduction_non_strict_mode is False  # inductor's default: strict
    with inductor_config.patch(options):
        assert inductor_config.triton.mix_order_reduction_non_strict_mode is True


def test_activation_budget_patches_the_partitioner_only_inside():
    """Selective checkpointing (`gradient_checkpointing: None` with compiled layers on a GPU) acts through torch's
    activation memory budget while a training forward compiles; outside the context the global setting is untouched."""
    import torch._functorch.config as functorch_config

    from opd.models import activation_budget

    before = functorch_config.activation_memory_budget
    with activation_budget(0.5):
        assert functorch_config.activation_memory_budget == 0.5
    assert functorch_config.activation_memory_budget == before
    with activation_budget(None), activation_budget(1.0):  # no limit: nothing patched
        assert functorch_config.activation_memory_budget == before
    with pytest.raises(ValueError, match="activation budget"):
        activation_budget(-0.1)

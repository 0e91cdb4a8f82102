"""Model families beyond Llama/Qwen (issue 23): tiny random configs with their real attention features switched on
(sliding windows short enough to bind, soft-capping, attention sinks), built here.

Packed attention (`opd_varlen` over `cu_seq_lens`, the CPU reference path of the GPU's varlen kernel) must equal a
padded plain HF forward; whatever it cannot compute (sinks, soft-capping) must be refused at load, never dropped."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from helpers import EOS_ID, PAD_ID, TINY_VOCAB, make_rollouts, make_tiny_model, make_tiny_tokenizer
from opd import models
from opd.forward import forward_hidden
from opd.kernels import varlen_attention
from opd.models import ModelLoadError, load_model
from opd.rollout import SamplingParams, registry
from opd.rollout.static_engine import StaticGenerator, unsupported_reason
from opd.rollout.torch_engine import TorchGenerator

# the family builders live with the benchmarks (also used by scripts/support_table.py and benchmarks/check_cuda.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import families  # noqa: E402
from families import TINY_CONFIG, WINDOW, family  # noqa: E402

LENGTHS = (13, 3, 9, 6)  # WINDOW is shorter than every row but one, so the window binds
# fp32: packed (one SDPA call per row, banded mask) and padded (eager attention, [B, S, S] mask) sum the same terms
# in a different order; measured differences are ~1e-6 nats at this size, 1e-4 leaves margin for other BLAS builds
# while a dropped window / cross-row leak / dropped sink moves log-probs by ~0.1 or more
ATOL = 1e-4


def test_family_token_ids_are_the_tiny_tokenizers():
    assert (families.PAD_ID, families.EOS_ID, families.TINY_VOCAB) == (PAD_ID, EOS_ID, TINY_VOCAB)


WINDOWED = ["gemma3", "mistral", "phi3", "qwen2_window"]


def _rows(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=generator) for n in LENGTHS]


def padded_logprobs(model, rows) -> list[torch.Tensor]:
    """Each row's [n, V] log-probs from one right-padded batch through the model's own (non-packed) attention."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), PAD_ID, device=rows[0].device)
    mask = torch.zeros(len(rows), longest, dtype=torch.long, device=rows[0].device)
    for b, r in enumerate(rows):
        ids[b, : len(r)], mask[b, : len(r)] = r, 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    return [logits[b, : len(r)].log_softmax(-1) for b, r in enumerate(rows)]


def packed_logprobs(model, rows) -> list[torch.Tensor]:
    """The same through one packed [1, Σ n] sequence (`varlen_attention.packed_kwargs`, as `opd.forward` packs)."""
    lengths = torch.tensor([len(r) for r in rows], device=rows[0].device)
    position_ids = torch.cat([torch.arange(len(r), device=rows[0].device) for r in rows])[None]
    with torch.no_grad():
        logits = (
            model(
                input_ids=torch.cat(rows)[None],
                position_ids=position_ids,
                use_cache=False,
                **varlen_attention.packed_kwargs(lengths),
            )
            .logits[0]
            .float()
        )
    return list(logits.log_softmax(-1).split(lengths.tolist()))


@pytest.mark.parametrize("name", WINDOWED)
def test_packed_rows_with_binding_sliding_windows_equal_the_padded_forward(name):
    varlen_attention.register()
    reference = family(name)
    reference.set_attn_implementation("eager")
    packed = copy.deepcopy(reference)
    packed.set_attn_implementation(varlen_attention.ATTENTION)
    rows = _rows()
    want, got = padded_logprobs(reference, rows), packed_logprobs(packed, rows)
    for w, g in zip(want, got):
        assert torch.allclose(w, g, atol=ATOL, rtol=0), (w - g).abs().max()
    # the window binds: without it the longest row's late positions differ by far more than ATOL
    unwindowed = copy.deepcopy(reference)
    unwindowed.config.sliding_window = 10**6
    for layer in unwindowed.model.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            layer.self_attn.sliding_window = 10**6
    assert (padded_logprobs(unwindowed, rows)[0] - want[0]).abs().max() > 100 * ATOL


def test_window_of_the_reference_path_is_transformers_sliding_window():
    """Query q sees keys q - window < k ≤ q (transformers' `sliding_window_overlay`), against an explicit mask."""
    torch.manual_seed(1)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 7, 10], dtype=torch.int32)
    got = varlen_attention.packed_causal_attention(q, k, v, cu, 7, window=3)
    k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for start, end in ((0, 7), (7, 10)):
        n = end - start
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k4[start:end]) / 8**0.5
        i = torch.arange(n)
        visible = (i[None] <= i[:, None]) & (i[None] > i[:, None] - 3)
        want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v4[start:end])
        assert torch.allclose(got[start:end], want, atol=1e-6)
    # a window as long as the longest row is no window
    assert torch.equal(
        varlen_attention.packed_causal_attention(q, k, v, cu, 7, window=7),
        varlen_attention.packed_causal_attention(q, k, v, cu, 7),
    )


@pytest.mark.parametrize(("name", "feature"), [("gemma2", "soft-capping"), ("gpt_oss", "sinks")])
def test_opd_varlen_raises_on_sinks_and_softcap_rather_than_dropping_them(name, feature):
    varlen_attention.register()
    model = family(name)
    assert feature in varlen_attention.refusal(model)
    model.set_attn_implementation(varlen_attention.ATTENTION)
    with pytest.raises(ValueError, match="does not compute"):  # unpacked forwards too: SDPA would drop them
        padded_logprobs(model, _rows()[:2])


def _saved(tmp_path, model):
    model.save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("name", "feature"), [("gemma2", "attention logit soft-capping"), ("gpt_oss", "attention sinks")]
)
def test_loader_refuses_an_explicit_opd_varlen_for_sinks_and_softcap(tmp_path, name, feature):
    path = _saved(tmp_path, family(name))
    with pytest.raises(ModelLoadError, match=f"cannot run .* exactly: its {feature}") as error:
        load_model(path, dtype="float32", device="cpu", attn_implementation=varlen_attention.ATTENTION)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("name", "chosen"),
    [
        ("llama", varlen_attention.ATTENTION),
        ("gemma3", varlen_attention.ATTENTION),
        ("mistral", varlen_attention.ATTENTION),
        ("phi3", varlen_attention.ATTENTION),
        ("qwen2_window", varlen_attention.ATTENTION),
        ("gemma2", "eager"),
        ("gpt_oss", "eager"),
    ],
)
def test_loader_choice_where_the_varlen_kernel_runs(tmp_path, monkeypatch, capsys, name, chosen):
    """Where the kernel runs (as on CUDA), sdpa becomes opd_varlen unless a feature is not computed: then
    transformers' own exact choice stays and one line names the feature."""
    monkeypatch.setattr(varlen_attention, "kernel_available", lambda device: True)
    model = make_tiny_model("llama") if name == "llama" else family(name)
    model, _ = load_model(_saved(tmp_path, model), dtype="float32", device="cpu")
    assert model.config._attn_implementation == chosen
    lines = capsys.readouterr().err.splitlines()
    notes = [line for line in lines if "no packed attention" in line]
    assert len(notes) == (chosen != varlen_attention.ATTENTION)


def test_loader_never_runs_a_soft_capped_model_on_sdpa(tmp_path, capsys):
    """SDPA has no attention soft-cap: transformers 5.17 picks it for Gemma 2 by default and drops the cap without a
    word (measured on the H200 image: 0.006 nats/token off eager at a cap of 1), 5.24 raises. An explicit 'sdpa' is
    refused in one line before transformers sees it; a choice that came out 'sdpa' becomes 'eager' with one note,
    and the scores are then eager's."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**TINY_CONFIG, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=1.0)
    path = _saved(tmp_path, transformers.Gemma2ForCausalLM(config).eval())
    with pytest.raises(ModelLoadError, match=r"'sdpa' cannot run .* exactly: SDPA has no attention logit soft-cap"):
        load_model(path, dtype="float32", device="cpu", attn_implementation="sdpa")
    model, _ = load_model(path, dtype="float32", device="cpu")
    eager_lp = padded_logprobs(model, _rows()[:2])
    model.config._attn_implementation = "sdpa"  # what transformers 5.17 chooses (5.24 refuses to set it)
    capsys.readouterr()
    models._choose_attention(model, "gemma2-tiny", None, torch.device("cpu"))
    assert model.config._attn_implementation == "eager"
    (note,) = capsys.readouterr().err.splitlines()
    assert note == "note: gemma2-tiny: attention 'sdpa' drops its attention logit soft-capping " + (
        "(attn_logit_softcapping=1.0); using 'eager'"
    )
    assert all(torch.equal(a, b) for a, b in zip(padded_logprobs(model, _rows()[:2]), eager_lp))


def test_loader_keeps_sdpa_for_binding_windows_when_the_kernel_has_none(tmp_path, monkeypatch, capsys):
    """torch 2.10's varlen kernel has no window_size: windowed models stay on sdpa, saying so; a window that never
    binds (≥ max_position_embeddings, Phi-3's 262,144) does not count."""
    monkeypatch.setattr(varlen_attention, "kernel_available", lambda device: True)
    monkeypatch.setattr(varlen_attention, "_VARLEN_PARAMETERS", frozenset({"scale", "is_causal"}))
    model, _ = load_model(_saved(tmp_path / "a", family("mistral")), dtype="float32", device="cpu")
    assert model.config._attn_implementation == "sdpa"
    (note,) = [line for line in capsys.readouterr().err.splitlines() if "no packed attention" in line]
    assert "sliding window (4 tokens)" in note
    wide = family("phi3")
    wide.config.sliding_window = wide.config.max_position_embeddings
    model, _ = load_model(_saved(tmp_path / "b", wide), dtype="float32", device="cpu")
    assert model.config._attn_implementation == varlen_attention.ATTENTION


def _notes(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: engine auto")]


def test_engine_auto_names_what_the_static_engine_cannot_run_and_static_refuses(monkeypatch, capsys):
    """Where auto would pick the static engine (CUDA), a model it cannot run gets the torch engine with one line
    naming the feature; engine 'static' refuses with that reason as a one-line ValueError."""
    monkeypatch.setattr(registry, "_static_pays", lambda model: True)
    tokenizer = make_tiny_tokenizer()
    model = family("gpt_oss")
    generator = registry.make_generator(model, tokenizer, engine="auto")
    assert isinstance(generator, TorchGenerator)
    (note,) = _notes(capsys)
    assert "the static engine cannot run GptOssForCausalLM: model_type 'gpt_oss' is not one of" in note
    assert note.endswith("using the torch engine (decoding will be slower)")
    with pytest.raises(ValueError, match=r"^engine 'static' cannot run GptOssForCausalLM: model_type 'gpt_oss' ") as e:
        registry.make_generator(model, tokenizer, engine="static")
    assert "\n" not in str(e.value)
    assert registry.resolve_engine("auto", make_tiny_model("llama")) == "static"
    assert _notes(capsys) == []


def _llama_with_rope(rope: dict) -> torch.nn.Module:
    half = TINY_CONFIG["hidden_size"] // TINY_CONFIG["num_attention_heads"] // 2
    extra = {"short_factor": [1.0] * half, "long_factor": [4.0] * half} if rope["rope_type"] == "longrope" else {}
    config = LlamaConfig(**TINY_CONFIG, rope_parameters={"rope_theta": 10000.0, **rope, **extra})
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("rope", "reason"),
    [
        ({"rope_type": "longrope", "original_max_position_embeddings": 64}, "rope_type 'longrope' changes cos/sin"),
        ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' changes cos/sin"),
        ({"rope_type": "default"}, None),
        ({"rope_type": "linear", "factor": 2.0}, None),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            None,
        ),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, None),
    ],
)
def test_static_engine_refuses_length_dependent_rope_by_name(rope, reason):
    found = unsupported_reason(_llama_with_rope(rope))
    assert found == reason if reason is None else reason in found


# the families the static engine runs (`unsupported_reason` None): Llama's layout plus the features its step computes
STATIC_FAMILIES = [
    "llama3_2",
    "qwen2_5",
    "qwen2_window",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "mistral_no_window",
    "phi3",
    "phi3_partial_rotary",
    "granite",
    "smollm3",
    "olmo2",
    "gemma2",
    "gemma2_binding_softcap",
    "gemma3",
]


def _static_family(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "phi3_partial_rotary":  # Phi-4-mini's feature (its longrope is refused by itself): RoPE on half a head
        config = transformers.Phi3Config(**TINY_CONFIG, sliding_window=WINDOW, partial_rotary_factor=0.5)
        return transformers.Phi3ForCausalLM(config).eval()
    if name == "gemma2_binding_softcap":  # Gemma 2's cap of 50 hardly binds on tiny random scores: one of 1 does
        config = transformers.Gemma2Config(**TINY_CONFIG, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=1.0)
        return transformers.Gemma2ForCausalLM(config).eval()
    return family(name)


def test_static_engine_accepts_exactly_these_families():
    accepted = sorted(key for key in families.BUILDERS if unsupported_reason(family(key)) is None)
    assert accepted == sorted(name for name in STATIC_FAMILIES if name in families.BUILDERS)


@pytest.mark.parametrize("name", STATIC_FAMILIES)
def test_static_engine_matches_the_torch_engine_on_each_family_it_runs(name):
    """Greedy tokens equal, log-probs within fp32 rounding (the same 1e-4 as rollout/test_static_engine.py), with each
    family's features on: sliding windows that bind (Mistral v0.1: every layer; Qwen2: below max_window_layers; with
    the windows ignored log-probs move by 0.7-0.9), Mistral v0.3 / Small / Nemo (no window), Granite 3's multipliers
    (dropping any one of the four moves log-probs by 0.17-3 nats), SmolLM3's NoPE layer (RoPE there: 0.27), OLMo 2's
    norms after the branches and q/k norms over the whole projection; fused weights + SDPA and the module's own
    weights + the matmul reference; Phi-3's fused qkv and gate/up, with a binding window, and its partial rotary;
    Qwen3-MoE's top-k routing over stacked experts; Gemma 2 and 3's norms on both sides of each branch over (1 + w),
    scaled embeddings (without: 2.2 nats and other tokens), GELU-tanh gates (SiLU instead: 0.13), Gemma 2's logit
    soft-cap (0.06 without) and attention soft-cap (a binding cap of 1: 0.06 without), Gemma 3's q/k norms and its
    two RoPE tables (the sliding layers' table everywhere: 0.011)."""
    model = _static_family(name)
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    params = SamplingParams(n=2, temperature=0, max_new_tokens=24, return_logprobs=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    want = TorchGenerator(model, **common).generate(prompts, params)
    for options in ({}, {"fuse_weights": False, "attention": "matmul"}):
        got = StaticGenerator(model, kv_bucket=16, **common, **options).generate(prompts, params)
        assert got.response_ids == want.response_ids, options
        assert got.finish_reasons == want.finish_reasons
        for lps_want, lps_got in zip(want.logprobs, got.logprobs):
            assert torch.allclose(torch.tensor(lps_got), torch.tensor(lps_want), atol=1e-4), options


def test_static_engine_moe_both_expert_paths_match_the_torch_engine():
    """`_mlp`'s two MoE paths: one row (2 (row, slot) pairs < 4 experts: per-row expert gathers) and six rows (12 ≥ 4:
    every expert over every row), each against the torch engine."""
    model = family("qwen3_moe")
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    for prompts, n in (([[1, 2, 3, 4, 5]], 1), ([[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]], 2)):
        params = SamplingParams(n=n, temperature=0, max_new_tokens=16, return_logprobs=True)
        want = TorchGenerator(model, **common).generate(prompts, params)
        got = StaticGenerator(model, kv_bucket=16, **common).generate(prompts, params)
        assert got.response_ids == want.response_ids
        for lps_want, lps_got in zip(want.logprobs, got.logprobs):
            assert torch.allclose(torch.tensor(lps_got), torch.tensor(lps_want), atol=1e-4)


@pytest.mark.slow  # the Triton kernel runs interpreted on CPU (~1 s a step)
@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_the_triton_decode_kernel_reads_only_a_sliding_window(name):
    """Mistral: a window on every layer; Gemma 2: alternating windows with a binding attention soft-cap of 1."""
    from opd.kernels import decode_attention as triton_attention

    if not triton_attention.available(torch.device("cpu")):
        pytest.skip("Triton is not installed")
    torch.manual_seed(0)  # the kernel's least head size is 16: 64 / 4 heads
    wide = {**TINY_CONFIG, "hidden_size": 64}
    if name == "mistral":
        model = MistralForCausalLM(MistralConfig(**wide, sliding_window=WINDOW)).eval()
    else:
        config = transformers.Gemma2Config(**wide, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=1.0)
        model = transformers.Gemma2ForCausalLM(config).eval()
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=12, return_logprobs=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [7, 8]]
    want = TorchGenerator(model, **common).generate(prompts, params)
    got = StaticGenerator(model, attention="triton", **common).generate(prompts, params)
    assert got.response_ids == want.response_ids
    for lps_want, lps_got in zip(want.logprobs, got.logprobs):
        assert torch.allclose(torch.tensor(lps_got), torch.tensor(lps_want), atol=1e-4)


@pytest.mark.parametrize("name", WINDOWED)
def test_scorer_forward_packs_windowed_rows_as_the_padded_forward(name):
    """`opd.forward.forward_hidden`, the scorer's and trainer's forward: its packed layout on opd_varlen equals the
    padded layout on eager attention, rows of different lengths (windows binding)."""
    varlen_attention.register()
    reference = family(name)
    reference.set_attn_implementation("eager")
    packed = copy.deepcopy(reference)
    packed.set_attn_implementation(varlen_attention.ATTENTION)
    rollouts = make_rollouts([5, 3, 8], [9, 2, 5], 9, 250, seed=3, pad=PAD_ID)
    want = forward_hidden(reference, rollouts, packing="padded").hidden_ND
    got = forward_hidden(packed, rollouts, packing="auto")  # auto: this much padding packs
    torch.testing.assert_close(got.hidden_ND, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("rope", "status"),
    [({"rope_type": "longrope", "original_max_position_embeddings": 16}, "fail"), ({"rope_type": "default"}, "pass")],
)
def test_startup_check_flags_a_student_whose_generation_and_scoring_disagree(rope, status):
    """distill's startup row `generation_scoring` (issue 23 item 3): longrope switches its table with the sequence
    length, so the torch engine's cached decode (short factors from the prefill) and the scorer's full forward (long
    factors) disagree by ~1.7 nats/token on a row longer than original_max_position_embeddings; default RoPE agrees
    to fp32 rounding."""
    from opd.check.scoring import check_generation_scoring, generation_check_tokens
    from opd.teacher.local import LocalScorer

    torch.manual_seed(0)
    model = _llama_with_rope(rope)
    assert generation_check_tokens(model, 40) == 40
    assert generation_check_tokens(model, 4000) == (4000 if status == "fail" else 64)
    row = check_generation_scoring(
        TorchGenerator(model, eos_token_ids=[EOS_ID], pad_token_id=PAD_ID),
        LocalScorer(model),
        [[1, 2, 3, 4, 5, 6]],
        temperature=1.0,
        max_new_tokens=40,
        seed=0,
        pad_id=PAD_ID,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    assert row.status == status and row.hard, row


@pytest.mark.parametrize("name", sorted(families.BUILDERS))
def test_scorer_equals_the_plain_forward_on_each_family(name):
    """`LocalScorer` (the teacher's and the student's scorer: chunked head, padded or packed rows) against each row's
    own unpadded Hugging Face forward, fp32, rows of different prompt and response lengths."""
    from opd.teacher.local import LocalScorer

    model = family(name)
    rollouts = make_rollouts([3, 7, 2, 5], [6, 2, 4, 0], 6, TINY_VOCAB, seed=3, pad=PAD_ID)
    scores = LocalScorer(model, vocab_size=TINY_VOCAB).score(rollouts, top_k=4)
    for b in range(rollouts.batch_size):
        p, r = int(rollouts.prompt_lengths[b]), int(rollouts.response_mask[b].sum())
        if r == 0:
            continue
        ids = rollouts.input_ids[b, : p + r][None]
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        want = logits[p - 1 : p + r - 1].log_softmax(-1).gather(-1, ids[0, p:, None]).squeeze(-1)
        torch.testing.assert_close(scores.sampled_logprobs[b, :r].float(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(families.BUILDERS))
def test_distill_and_check_run_on_each_family(name, tmp_path):
    """Every family through `opd distill` (2 steps, its defaults on CPU, rows of different lengths) and `opd check`:
    both exit 0, the steps are logged with a finite loss, check.json is written."""
    import json
    import math

    from helpers import write_jsonl
    from opd.cli import main as opd_main

    tokenizer = make_tiny_tokenizer()
    for role, seed in (("student", 0), ("teacher", 1)):
        torch.manual_seed(seed)
        families.BUILDERS[name]().save_pretrained(tmp_path / role)
        tokenizer.save_pretrained(tmp_path / role)
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"prompt": "x" * (2 + 5 * i) + f" {i}+{i}=", "answer": str(2 * i)} for i in range(4)],
    )
    common = [
        f"student.path={tmp_path / 'student'}",
        f"teacher.path={tmp_path / 'teacher'}",
        f"data.path={prompts}",
        "data.answer_key=answer",
        "prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=12",
        "data.max_prompt_length=64",
        "micro_batch_tokens=512",
    ]

    def run(*args: str) -> int:
        argv, sys.argv = sys.argv, ["opd", *args]
        try:
            opd_main()
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else 0
        finally:
            sys.argv = argv
        return 0

    assert run("distill", *common, f"run.out_dir={tmp_path}", "run.name=run", "run.steps=2", "run.report=false") == 0
    # 3: no hard failure, the forecast says OPD is unlikely to help (random tiny models)
    assert run("check", "--out", str(tmp_path / "check"), "--prompts-sample", "4", "--n", "2", *common) in (0, 3)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "pg_loss" in s]
    assert len(steps) == 2 and all(math.isfinite(s["pg_loss"]) for s in steps)
    assert (tmp_path / "check" / "check.json").is_file()

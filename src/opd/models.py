"""Load a causal LM and its tokenizer (Hub id or local path), resolve dtype/device, and check that a student and a
teacher share one vocabulary (SPEC §1: the teacher scores the student's token ids).

Omitted on purpose: sharding and meta-device loading (train/distributed.py owns FSDP2), LoRA (peft, in train/),
quantised loading, and resizing embeddings (a model is loaded exactly as saved).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import socket
import sys
import zipfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import urlparse

import torch
from huggingface_hub import constants, try_to_load_from_cache
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from opd.kernels import varlen_attention
from opd.scoring import recompile_limit_at_least

_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
# A Hub id is "name" or "owner/name" of letters, digits, "-", "_", "."; anything else can only be a local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message is one line naming what was asked for (a user error:
    the CLI prints it and exits 2)."""


# Files of which a tokenizer is built (any one suffices); a model directory with none of them gets no tokenizer
# rather than the 1-token stub transformers would make from the config alone.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
)


class TokenizerMismatchError(ValueError):
    """Student and teacher do not share a vocabulary; the message names the first offending token."""


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """ "auto" → cuda (current device) when available, else cpu. Otherwise any `torch.device` string ("cpu", "cuda",
    "cuda:1", "mps"); asking for an accelerator that is absent raises ValueError."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available (use 'auto' or 'cpu')")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} was asked for but only {torch.cuda.device_count()} CUDA devices exist")
    return resolved


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device | None = None) -> torch.dtype:
    """ "auto" → bfloat16 on CUDA (float16 where bf16 is unsupported), float32 elsewhere. Names accepted: bf16,
    bfloat16, fp16, float16, half, fp32, float32, float (case-insensitive), or a `torch.dtype`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower()
    if key == "auto":
        dev = resolve_device(device if device is not None else "auto")
        if dev.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if key not in _DTYPES:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(repr(k) for k in _DTYPES)}; got {dtype!r}")
    return _DTYPES[key]


def _load_error(what: str, name_or_path: str | os.PathLike, err: Exception) -> ModelLoadError:
    name = str(name_or_path)
    if os.path.exists(name):
        # A local directory that exists but is incomplete or corrupt: keep the library's first line, it says which.
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ModelLoadError(f"cannot load {what} from local path {name!r}: {first}")
    if not _HUB_ID.match(name):
        return ModelLoadError(f"cannot load {what}: {name!r} is not an existing path nor a Hugging Face Hub id")
    return ModelLoadError(
        f"cannot load {what} {name!r}: no such local path, "
        "and not found on (or not reachable from) the Hugging Face Hub"
    )


def check_model_path(what: str, name_or_path: str | os.PathLike) -> dict[str, Any]:
    """Fail fast (no Hub round-trips and retries) for a name that can only be a local path and does not exist, and
    for a Hub id while the Hub is unreachable and the id is not in the local cache (transformers would retry for
    about a minute, printing a line per retry). Returns extra `from_pretrained` keywords: `local_files_only` for a
    cached id while the Hub is unreachable."""
    name = str(name_or_path)
    if os.path.exists(name):
        if os.path.isfile(name):
            raise ModelLoadError(
                f"cannot load {what} from {name!r}: it is a file; expected a model directory "
                f"(save_pretrained layout) or a Hugging Face Hub id"
            )
        return {}
    if not _HUB_ID.match(name):
        raise ModelLoadError(f"cannot load {what}: {name!r} is not an existing path nor a Hugging Face Hub id")
    unreachable = _hub_unreachable()
    if unreachable is None:
        return {}
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return {"local_files_only": True}
    raise ModelLoadError(
        f"cannot load {what} {name!r}: no such local path, not in the Hugging Face cache, and the "
        f"Hub is not reachable ({unreachable}); pass a local directory, or connect and retry"
    )


def _hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached (offline mode, no DNS, no route), or None when it may be: a TCP
    connection attempt of at most 3 s. Behind a proxy (HTTPS_PROXY / ALL_PROXY set) we cannot tell: None."""
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(constants.ENDPOINT)
    return _connect_error(url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80))


@functools.lru_cache(maxsize=8)
def _connect_error(host: str, port: int) -> str | None:
    """Why a TCP connection to host:port fails (at most 3 s), or None; once per process (a model's tokenizer and
    weights are loaded one after the other)."""
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as error:
        return f"{host}: {error.strerror or error}"
    return None


def _check_tokenizer_files(path: str) -> None:
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer files in {path} (none of {', '.join(_TOKENIZER_FILES[:4])}, …); copy the "
            f"tokenizer of the model it was trained from into it (tokenizer.save_pretrained)"
        )


def _weights_error(name_or_path: str | os.PathLike, err: Exception) -> ModelLoadError:
    """A one-line error for weights that exist but cannot be read (truncated download, corrupt file), naming the
    file: each weights file of the directory is checked cheaply (safetensors header, zip directory)."""
    path = str(name_or_path)
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    bad = None
    for entry in sorted(os.listdir(path)) if os.path.isdir(path) else []:
        file = os.path.join(path, entry)
        try:
            if entry.endswith(".safetensors"):
                with safe_open(file, framework="pt"):
                    pass
            elif entry.endswith((".bin", ".pt", ".pth")) and not entry.startswith("training_args"):
                zipfile.ZipFile(file).close()
        except Exception:  # noqa: BLE001 - any failure to open it is what we report
            bad = file
            break
    where = f"weights file {bad}" if bad else f"the weights in {path}"
    return ModelLoadError(
        f"cannot load model from {path!r}: {where} is corrupt or truncated ({first}); re-download or re-save it"
    )


def _is_weights_error(err: Exception) -> bool:
    """Errors of reading a weights file that exists (safetensors header, torch's zip reader, short reads)."""
    if type(err).__name__ == "SafetensorError":
        return True
    text = str(err)
    return isinstance(err, (RuntimeError, EOFError, OSError)) and any(
        marker in text
        for marker in (
            "PytorchStreamReader",
            "zip archive",
            "central directory",
            "unexpected EOF",
            "Unable to load weights",
            "invalid load key",
            "not a zip file",
        )
    )


def load_tokenizer(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    """AutoTokenizer for a Hub id or local directory, with a pad token guaranteed.

    Pad token: kept when the tokenizer has one; else set to the EOS token (pad positions are always masked, so sharing
    the id is harmless); only when there is no EOS either is a new `<|pad|>` special token added (its id is then
    len(tokenizer) - 1, which the model's embedding must cover; we never resize embeddings).
    The tokenizer's padding side is left as saved: engines take token ids and pad themselves.
    """
    hub_kwargs = check_model_path("tokenizer", name_or_path)
    _check_tokenizer_files(str(name_or_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code, **hub_kwargs)
    except (OSError, ValueError) as err:
        raise _load_error("tokenizer", name_or_path, err) from None
    if len(tokenizer) <= 1:  # what transformers builds from a config alone: every text encodes to nothing
        raise ModelLoadError(
            f"the tokenizer of {str(name_or_path)!r} has {len(tokenizer)} token(s): its tokenizer "
            f"files are missing or empty"
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return tokenizer


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    device_map: str | dict | None = None,
) -> tuple[Any, Any]:
    """(model, tokenizer) for a Hub id or a local `save_pretrained` directory.

    The model is an `AutoModelForCausalLM` in eval mode, in `dtype` (see `resolve_dtype`) on `device` (see
    `resolve_device`). `attn_implementation` ("eager", "sdpa", "flash_attention_2", "opd_varlen", …) is passed
    through; None lets transformers choose, and on CUDA turns its "sdpa" into "opd_varlen"
    (`opd.kernels.varlen_attention`: SDPA, except that packed forwards run FlashAttention varlen without padding).
    `device_map` ("auto" or accelerate's module → device dict) spreads the layers over several devices instead of
    putting the model on `device` (`opd serve-teacher --device-map auto`).
    A missing path / unknown id raises a one-line `ModelLoadError` naming it.
    """
    varlen_attention.register()

    hub_kwargs = check_model_path("model", name_or_path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    tokenizer = load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code, **hub_kwargs}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if attn_implementation == "sdpa":  # before transformers, whose versions differ here (see `_choose_attention`)
        softcap = getattr(_load_config(name_or_path, trust_remote_code, hub_kwargs), "attn_logit_softcapping", None)
        if softcap:
            raise _sdpa_softcap_error(str(name_or_path), softcap)
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif torch_device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
        kwargs["device_map"] = {"": torch_device}  # load straight onto the accelerator, no full CPU copy first
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(str(name_or_path), **kwargs)  # returned as Any
    except Exception as err:  # noqa: BLE001 - classified below; anything else is re-raised as it is
        if _is_weights_error(err):
            raise _weights_error(name_or_path, err) from None
        if isinstance(err, (OSError, ValueError)):
            raise _load_error("model", name_or_path, err) from None
        raise
    if device_map is None:
        model.to(torch_device)
    model.eval()
    _choose_attention(model, str(name_or_path), attn_implementation, torch_device)
    rows = embedding_rows(model, output=False)
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id >= rows:
        raise ModelLoadError(
            f"pad token id {tokenizer.pad_token_id} of {str(name_or_path)!r} "
            f"is outside the model's {rows} embedding rows"
        )
    return model, tokenizer


def _load_config(name_or_path: str | os.PathLike, trust_remote_code: bool, hub_kwargs: dict) -> Any:
    """The model's config alone (one small file), with load_model's one-line errors."""
    try:
        return AutoConfig.from_pretrained(str(name_or_path), trust_remote_code=trust_remote_code, **hub_kwargs)
    except (OSError, ValueError) as err:
        raise _load_error("model", name_or_path, err) from None


def _sdpa_softcap_error(name: str, softcap: float) -> ModelLoadError:
    return ModelLoadError(
        f"attn_implementation 'sdpa' cannot run {name!r} exactly: SDPA has no attention logit soft-capping "
        f"(attn_logit_softcapping={softcap}); leave attn_implementation unset or use 'eager'"
    )


def embedding_rows(model: torch.nn.Module, *, output: bool = True) -> int:
    """Rows of an HF model's output (or input) embedding: the vocabulary as the model sees it, padding included."""
    hf: Any = model  # an HF model: get_*_embeddings are not on nn.Module's type
    embeddings = hf.get_output_embeddings() if output else hf.get_input_embeddings()
    return embeddings.weight.shape[0]


def _choose_attention(model: Any, name: str, attn_implementation: str | None, device: torch.device) -> None:
    """`load_model`'s attention choice: an explicit `opd_varlen` for a model it cannot compute exactly is refused
    (one line); None keeps transformers' choice, with its "sdpa" turned into `opd_varlen` on CUDA unless
    `varlen_attention.refusal` names a feature, in which case one line says so and transformers' choice stays.
    Attention logit soft-capping (Gemma 2) is computed by eager attention, not by SDPA, which transformers (5.17
    among others) picks for Gemma 2 by default and which then drops the cap without a word: an explicit "sdpa" is
    refused, an unset one becomes "eager", saying so."""
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    if softcap and attn_implementation == "sdpa":
        raise _sdpa_softcap_error(name, softcap)
    if softcap and attn_implementation is None and model.config._attn_implementation == "sdpa":
        print(
            f"note: {name}: attention 'sdpa' drops its attention logit soft-capping "
            f"(attn_logit_softcapping={softcap}); using 'eager'",
            file=sys.stderr,
        )
        model.set_attn_implementation("eager")
    reason = varlen_attention.refusal(model, device)
    if attn_implementation == varlen_attention.ATTENTION and reason is not None:
        raise ModelLoadError(
            f"attn_implementation {varlen_attention.ATTENTION!r} cannot run {name!r} exactly: {reason}; "
            "leave attn_implementation unset (transformers' choice) or use 'eager'"
        )
    if attn_implementation is not None or not varlen_attention.kernel_available(device):
        return
    if reason is not None:
        print(
            f"note: {name}: no packed attention ({varlen_attention.ATTENTION}): {reason}; "
            f"attention stays {model.config._attn_implementation!r} (padded rows)",
            file=sys.stderr,
        )
    elif model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(varlen_attention.ATTENTION)


def compile_layers(model: torch.nn.Module, enabled: bool | None = None, *, backend: str = "inductor") -> bool:
    """`torch.compile` every decoder layer of an HF causal LM in place; returns whether it did.

    enabled: True / False, or None = only when the model is on CUDA (CPU compilation is slow to build and gains
    little). All layers share one compiled graph (same code, parameters are inputs), compiled with dynamic sizes
    from the first call (`dynamic=True`) and without inductor's size tests that would guard on them
    (`no_size_guards`): a new batch or sequence size reuses it. What still makes a graph of its
    own is a layout, not a size: a batch of one row (dynamo specializes size 1), an attention mask present or
    absent (transformers passes none for rows of equal length), grad mode and train/eval; `opd.train.step.warm_up`
    compiles those before the first step, so that no step recompiles. Why compile: the
    elementwise work between the matmuls (RMSNorm, RoPE, SiLU·gate, residual adds, casts) runs as a handful of fused
    kernels instead of dozens, a clear speed-up of the model body (docs/performance.md).
    Generation through the HF model (`TorchGenerator`, the prefill of `StaticGenerator`) runs these layers eagerly
    (`torch.compiler.set_stance("force_eager")`): a KV cache changes shapes every step. `backend` is torch.compile's
    (tests use "aot_eager": the same graph capture without code generation).
    """
    device = next(model.parameters()).device
    if enabled is False or (enabled is None and device.type != "cuda"):
        return False
    hf: Any = model  # an HF model: get_decoder is not on nn.Module's type
    body = hf.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(body, "layers", None)
    if layers is None:
        if enabled:
            raise ValueError(
                f"compile: {type(model).__name__} has no decoder layers to compile (model.get_decoder().layers)"
            )
        return False
    # One layer's forward is compiled per layout variant (above) and checkpoint recompute; dynamo's default of 8
    # versions per function can be reached, after which the layers would silently run eagerly.
    for name, value in recompile_limit_at_least(64).items():
        setattr(torch._dynamo.config, name, value)
    options = no_size_guards() if backend == "inductor" else None
    for layer in layers:
        layer.compile(backend=backend, dynamic=True, options=options)
    return True


def no_size_guards() -> dict[str, Any] | None:
    """Inductor options for `compile_layers` that keep its fusion choices from guarding on a dynamic size: its
    mix-order reduction (the backward of a norm: one reduction along rows, one along columns, fused) is taken only
    above a size (rows × columns ≥ 5 Mi, rows ≥ 4,096, rows ≥ 2 × columns) and, the row count being symbolic, each
    test became a guard: the real pair's update compiled its packed micro-batches again when one fell below 5,852
    tokens (896 × 5,852 ≥ 5 Mi; docs/performance.md). Non-strict mode skips these tests: the fusion is taken at every
    size, a guard-free graph. None where this torch has no such option."""
    import torch._inductor.config as inductor_config

    if not hasattr(getattr(inductor_config, "triton", None), "mix_order_reduction_non_strict_mode"):
        return None
    return {"triton.mix_order_reduction_non_strict_mode": True}


def warm_up_layouts(max_response: int, packed_tokens: int | None = None) -> list[tuple[int, ...]]:
    """Response lengths, per row, of the batches that compile every graph of compiled layers (`compile_layers`)
    before work starts (`opd.train.step.warm_up` runs them through scoring and the update, `opd serve-teacher`
    through scoring). A layout, not a size, makes a graph: one row (dynamo specializes a size of 1; transformers
    passes no mask), rows of equal length (no mask either), ragged rows (a mask, or packed where the model packs),
    rows within 10% of each other (a mask even where the model packs) — and inductor's own guards split sizes into
    ranges (32-bit indexing, fusion choices), so the layouts repeat over a ladder of lengths 4× apart up to
    `max_response`. `packed_tokens` (a model that packs): one more batch of long ragged rows filling it, the
    longest sequence a packed forward meets."""
    small = [(8,), (8, 8), (3, 29)]
    layouts = [tuple(min(n, max_response) for n in lengths) for lengths in small]
    near = min(22, max_response)  # near-equal rows must differ in length also below 22, or they become equal rows
    layouts.append((max(1, near - 2), max(1, near - 1), near))
    ladder, length = [], 256
    while length < max_response:
        ladder.append(length)
        length *= 4
    for length in [*ladder, max_response] if max_response > 29 else []:
        layouts += [(length,), (length, length), (length, length - length // 20, length - length // 10)]
    if packed_tokens:
        rows: list[int] = []
        while sum(rows) < packed_tokens and len(rows) < 64:
            rows.append(max(1, max_response >> (len(rows) % 3)))
        layouts.append(tuple(rows))
    return layouts


def activation_budget(budget: float | None):
    """Context for a training forward through compiled layers (`compile_layers`): the compiled graphs built inside
    keep at most `budget` ∈ (0, 1) of the activations they would save for backward and recompute the rest in
    backward (torch.compile's selective activation checkpointing: its min-cut partitioner recomputes the cheap
    elementwise ops and keeps matmul outputs). None or 1: no limit. It acts when a graph is compiled, so wrap every
    training forward (a new input shape compiles again)."""
    if budget is None or budget >= 1:
        return nullcontext()
    if not 0 < budget < 1:
        raise ValueError(f"activation budget must be in (0, 1], got {budget}")
    return torch._functorch.config.patch(activation_memory_budget=float(budget))


def eos_token_ids(model: Any = None, tokenizer: Any = None) -> list[int]:
    """Every EOS id the tokenizer, the model config and its generation config name (in that order, no repeats).
    Qwen instruct models, for one, list both `<|im_end|>` and `<|endoftext|>`."""
    found: list[Any] = []
    if tokenizer is not None:
        found.append(getattr(tokenizer, "eos_token_id", None))
    if model is not None:
        found.append(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
        found.append(getattr(getattr(model, "config", None), "eos_token_id", None))
    ids: list[int] = []
    for item in found:
        for i in item if isinstance(item, (list, tuple)) else [item]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def rows_and_eos_from_files(
    path: str, tokenizer: Any, *, trust_remote_code: bool = False
) -> tuple[int | None, list[int]]:
    """(output rows, EOS ids) of the model at `path` from its config.json and generation_config.json, no weights
    loaded (`eos_token_ids` of what they hold); (None, the tokenizer's) where they cannot be read."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None, eos_token_ids(None, tokenizer)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):
        generation = None
    rows = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    return rows, eos_token_ids(SimpleNamespace(config=config, generation_config=generation), tokenizer)


@dataclass(frozen=True)
class VocabInfo:
    """The vocabulary a student/teacher pair shares.

    size:           number of logit columns both models have and scorers compare on (`logits[..., :size]`);
                    min of the two model vocab sizes, ≥ tokenizer_size
    tokenizer_size: 1 + the largest token id the (shared) tokenizer uses; ids in [tokenizer_size, size) are
                    embedding padding rows and must never be sampled or selected as top-k candidates
    student_size:   rows of the student's output embedding (or tokenizer_size when not given)
    teacher_size:   rows of the teacher's output embedding (or tokenizer_size when not given)
    """

    size: int
    tokenizer_size: int
    student_size: int
    teacher_size: int


def check_tokenizer_compatibility(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    *,
    student_vocab_size: int | None = None,
    teacher_vocab_size: int | None = None,
) -> VocabInfo:
    """Require identical token → id maps (added tokens included) and model vocab sizes that differ only by padding
    rows beyond the tokenizer (e.g. Qwen 151936 vs 152064). Returns the shared `VocabInfo`; anything else raises a
    one-line `TokenizerMismatchError` naming the first mismatching or missing token (in student id order)."""
    student_vocab: dict[str, int] = student_tokenizer.get_vocab()
    teacher_vocab: dict[str, int] = teacher_tokenizer.get_vocab()
    if student_vocab != teacher_vocab:
        for token, sid in sorted(student_vocab.items(), key=lambda kv: kv[1]):
            tid = teacher_vocab.get(token)
            if tid is None:
                raise TokenizerMismatchError(
                    f"tokenizers differ: token {token!r} (id {sid} in the student) is missing from the teacher"
                )
            if tid != sid:
                raise TokenizerMismatchError(
                    f"tokenizers differ: token {token!r} has id {sid} in the student and id {tid} in the teacher"
                )
        for token, tid in sorted(teacher_vocab.items(), key=lambda kv: kv[1]):
            if token not in student_vocab:
                raise TokenizerMismatchError(
                    f"tokenizers differ: token {token!r} (id {tid} in the teacher) is missing from the student"
                )
    tokenizer_size = max(student_vocab.values()) + 1 if student_vocab else 0
    sizes = {"student": student_vocab_size, "teacher": teacher_vocab_size}
    for who, size in sizes.items():
        if size is not None and size < tokenizer_size:
            raise TokenizerMismatchError(
                f"the {who} model has {size} vocabulary rows but the tokenizer uses ids up to {tokenizer_size - 1}"
            )
    student_size = student_vocab_size if student_vocab_size is not None else tokenizer_size
    teacher_size = teacher_vocab_size if teacher_vocab_size is not None else tokenizer_size
    return VocabInfo(
        size=min(student_size, teacher_size),
        tokenizer_size=tokenizer_size,
        student_size=student_size,
        teacher_size=teacher_size,
    )


# ------------------------------------------------------------------------- RoPE tables that depend on the length

LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")
"""transformers' RoPE types whose factors `dynamic_rope_update` picks from the length of the *current* forward:
longrope its short or long factors (long beyond `original_max_position_embeddings`), dynamic its NTK base (grown
with the length beyond `max_position_embeddings`). Every other type of `ROPE_INIT_FUNCTIONS` (linear, yarn, llama3,
proportional) and default are functions of the position only. A cached decode keeps the keys of the table its prefill
chose while a full forward over the same tokens rotates them all with the table of its own length: generation, scoring
and training then disagree (issue 56). `fix_rope` makes one choice per run."""


def _length_dependent(kind: Any) -> bool:
    """transformers' own test (`dynamic_rope_update`): "dynamic" anywhere in the name, or "longrope"."""
    return isinstance(kind, str) and (kind == "longrope" or "dynamic" in kind)


@dataclass(frozen=True)
class RopeChoice:
    """The one table of a length-dependent RoPE for a run, chosen from the run's longest sequence.

    rope_type: "longrope" or "dynamic" (the model config's, unchanged: checkpoints keep it)
    threshold: longrope: `original_max_position_embeddings` (long factors beyond it); dynamic:
               `max_position_embeddings` (the NTK base grows beyond it)
    length:    the run's longest sequence, prompt + response, that the table was computed for: the table a full
               forward over a sequence of exactly this length computes in transformers
    """

    rope_type: str
    threshold: int
    length: int

    @property
    def setting(self) -> str:
        """The table, independent of the length where the length does not change it: two choices with equal
        settings (and types) rotate every position alike."""
        if self.rope_type == "longrope":
            return "long factors" if self.length > self.threshold else "short factors"
        return f"NTK base at {self.length} positions" if self.length > self.threshold else "original base"

    def describe(self) -> str:
        """One line: the choice and why."""
        limit = "original_max_position_embeddings" if self.rope_type == "longrope" else "max_position_embeddings"
        return (
            f"rope_type {self.rope_type!r} fixed to its {self.setting} for every forward (sequences up to "
            f"{self.length} tokens, {limit} {self.threshold})"
        )

    def to_info(self) -> dict[str, Any]:
        """What a served teacher's /info reports (`RopeChoice.from_info` reads it back)."""
        return {
            "rope_type": self.rope_type,
            "threshold": self.threshold,
            "length": self.length,
            "setting": self.setting,
        }

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> RopeChoice:
        return cls(str(info["rope_type"]), int(info["threshold"]), int(info["length"]))

    def at(self, length: int) -> RopeChoice:
        """The choice this model would make for another run length."""
        return RopeChoice(self.rope_type, self.threshold, length)


def _rope_tables(config: Any) -> list[dict[str, Any]]:
    """The RoPE parameter dicts of a model config: one, or one per layer type (Gemma 3); [] without RoPE."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return []
    if rope and all(isinstance(r, dict) for r in rope.values()):
        return list(rope.values())
    return [rope] if rope else []


def rope_choice(config: Any, max_length: int) -> RopeChoice | None:
    """The table a model config's length-dependent RoPE gets for a run whose sequences (prompt + response) are at
    most `max_length` tokens: what transformers computes for one full forward of that length. None when its RoPE
    does not depend on the length."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for table in _rope_tables(config):
        kind = table.get("rope_type", table.get("type"))
        if not _length_dependent(kind):
            continue
        context = int(getattr(text, "max_position_embeddings", 0) or 0)
        threshold = int(table.get("original_max_position_embeddings") or context) if kind == "longrope" else context
        return RopeChoice("longrope" if kind == "longrope" else "dynamic", threshold, int(max_length))
    return None


def fix_rope(model: torch.nn.Module, max_length: int) -> RopeChoice | None:
    """Fix a length-dependent RoPE (`LENGTH_DEPENDENT_ROPE`) of a loaded HF model to the one table of a run whose
    sequences are at most `max_length` tokens (`rope_choice`), in place; returns the choice (None: nothing depends on
    the length, the model is untouched).

    Each rotary module's inverse frequencies (and attention scaling) become what transformers' own init function
    computes for a forward of `max_length` tokens (`ROPE_INIT_FUNCTIONS[type](config, seq_len=max_length)`), and its
    `rope_type` becomes "default", so that `dynamic_rope_update` no longer switches tables: the cached decode of the
    torch engine, the static engine's precomputed table, the scorers' and the trainer's full forwards then rotate
    every position alike. The config is left as it is, so a checkpoint saves the model as it was loaded. Raises a
    one-line ValueError when the config asks for a length-dependent RoPE and no rotary module carries it."""
    choice = rope_choice(cast(Any, model).config, max_length)
    if choice is None:
        return None
    fixed = 0
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if kinds is None or not hasattr(module, "config"):
            continue
        # the types as loaded: a model fixed before is fixed again from them (another length, or the same)
        loaded = getattr(module, "_opd_loaded_rope_types", None) or (
            dict(kinds) if isinstance(kinds, dict) else {None: kinds}
        )
        for layer_type, kind in loaded.items():
            if not _length_dependent(kind):
                continue
            prefix = "" if layer_type is None else f"{layer_type}_"
            inv_freq = getattr(module, f"{prefix}inv_freq")
            extra = {} if layer_type is None else {"layer_type": layer_type}
            chosen, scaling = ROPE_INIT_FUNCTIONS[kind](module.config, inv_freq.device, seq_len=max_length, **extra)
            with torch.no_grad():
                for name in (f"{prefix}inv_freq", f"{prefix}original_inv_freq"):
                    if getattr(module, name, None) is not None:
                        getattr(module, name).copy_(chosen)
            setattr(module, f"{prefix}attention_scaling", scaling)
            if layer_type is None:
                module.rope_type = "default"  # type: ignore[assignment]  # an HF rotary module's plain attribute
            else:
                kinds[layer_type] = "default"
            fixed += 1
            module._opd_rope_choice = choice  # type: ignore[assignment]  # what `fixed_rope` reads back
            module._opd_loaded_rope_types = loaded  # type: ignore[assignment]
    if not fixed:
        raise ValueError(
            f"{type(model).__name__}: rope_type {choice.rope_type!r} changes its table with the sequence length and "
            f"no rotary module of the model carries it, so opd cannot fix one table per run"
        )
    return choice


def fixed_rope(model: torch.nn.Module) -> RopeChoice | None:
    """The choice `fix_rope` made on this model, or None where it made none."""
    for module in model.modules():
        choice = getattr(module, "_opd_rope_choice", None)
        if choice is not None:
            return choice
    return None


def unfixed_rope(model: torch.nn.Module) -> str | None:
    """Why this model's rotary tables still depend on the sequence length (a length-dependent RoPE that `fix_rope`
    has not fixed), or None."""
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if kinds is None or not hasattr(module, "config"):
            continue
        for kind in kinds.values() if isinstance(kinds, dict) else [kinds]:
            if _length_dependent(kind):
                return f"rope_type {kind!r} changes cos/sin with the sequence length"
    return None


# ------------------------------------------------------------------------- placement of frozen modules


@contextmanager
def on_device(module: torch.nn.Module | None, device: torch.device | None):
    """Put an offloaded (frozen) module on `device` for the duration of the block (no-op when device is None).

    Its tensors live in pinned host memory (`host_copies`); entering copies them to the device without blocking the
    host, leaving just points them back at the host copies: a frozen teacher has nothing to copy back. `module.to()`
    both ways cost seconds a step for a 1.7B teacher (pageable copies, and a new host allocation on the way out;
    docs/performance.md)."""
    if module is None or device is None:
        yield
        return
    pairs = host_copies(module)
    for tensor, host in pairs:
        tensor.data = host.to(device, non_blocking=True)
    try:
        yield
    finally:
        for tensor, host in pairs:
            tensor.data = host


def host_copies(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, its host copy) for every parameter and buffer of a frozen module, made once and cached on it: the
    module's tensors then point at those copies (pinned when CUDA exists, so that copies to the GPU run at full
    bandwidth; pageable if pinning fails). Made again when something else moved the module (`module.to`)."""
    tensors = [*module.parameters(), *module.buffers()]
    cached = getattr(module, "_opd_host_copies", None)
    if (
        cached is not None
        and len(cached) == len(tensors)
        and all(t.data_ptr() == h.data_ptr() for t, h in zip(tensors, cached))
    ):
        return list(zip(tensors, cached))
    cached = []
    for tensor in tensors:
        host = tensor.data if tensor.device.type == "cpu" else tensor.data.to("cpu")
        if torch.cuda.is_available() and not host.is_pinned():
            try:
                host = host.pin_memory()
            except RuntimeError:  # pinned memory exhausted (a host smaller than the teacher): pageable copies
                pass
        tensor.data = host
        cached.append(host)
    module._opd_host_copies = cached  # type: ignore[assignment]  # nn.Module's setattr is typed for tensors only
    return list(zip(tensors, cached))

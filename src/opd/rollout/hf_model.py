"""The Hugging Face side of the in-process engines (`TorchGenerator`, `StaticGenerator`): one place for what both do
with the trainer's module, so that neither engine imports the other.

    HFModel             a causal LM called with a `transformers` cache: one forward, the left-padded prefill of
                        distinct prompts or their packed prefill (`opd_varlen` attention), the keys/values of a
                        layer of its cache
    special_ids         EOS ids and pad id from the arguments, else the model's config
    generation_mode     eval mode + no_grad + SDPA without cuDNN, the training flag restored afterwards
    seeded_generator    the call's own `torch.Generator` (`SamplingParams.seed`)
    check_request       the checks every `generate` call makes (empty prompts, EOS ids, per-sample lengths)

Omitted: anything about the decode loop itself (each engine has its own) and sampling (`opd.rollout.sampling`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from opd.kernels import varlen_attention
from opd.models import eos_token_ids as model_eos_ids
from opd.rollout.base import SamplingParams


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """SDPA without cuDNN attention on CUDA: cuDNN builds a new execution plan for every new key length, i.e. at
    every decode step, a CPU cost per layer and step that slowed decoding badly (docs/performance.md).
    Flash / memory-efficient / math kernels have no such cost. Elsewhere (and for non-SDPA attention) a no-op."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def forward_parameters(model: torch.nn.Module) -> set[str]:
    """Named arguments of the model's forward, looking through wrappers (peft, DDP) whose forward is mostly
    `**kwargs` passed on to the wrapped model."""
    inner: Any = model  # wrappers and HF models: get_base_model and module are not on nn.Module's type
    for _ in range(4):
        names = {n for n, p in inspect.signature(inner.forward).parameters.items() if p.kind is not p.VAR_KEYWORD}
        if {"cache", "past_key_values"} & names:
            return names
        if callable(getattr(inner, "get_base_model", None)):
            inner = inner.get_base_model()
        elif isinstance(getattr(inner, "module", None), torch.nn.Module):
            inner = inner.module
        else:
            break
    return names


def cache_kwarg(parameters: set[str]) -> str:
    """transformers ≥ 5 names the KV-cache argument `cache`; 4.x names it `past_key_values`."""
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    # no way to tell from the signature: go by the library version
    return "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


def special_ids(
    model: torch.nn.Module, eos_token_ids: Sequence[int] | None, pad_token_id: int | None
) -> tuple[list[int], int]:
    """(EOS ids, pad id): the given ones, else the model's (`opd.models.eos_token_ids`; config pad id, else the first
    EOS id, else 0)."""
    if eos_token_ids is None:
        eos_token_ids = model_eos_ids(model)
    eos = [int(i) for i in eos_token_ids]
    if pad_token_id is None:
        config_pad = getattr(getattr(model, "config", None), "pad_token_id", None)
        pad_token_id = config_pad if config_pad is not None else (eos or [0])[0]
    return eos, int(pad_token_id)


def check_arguments(engine: str, checks: Sequence[tuple[str, bool, str, Any]]) -> None:
    """Raise ValueError for the first failed (name, ok, legal values, value) check, naming the engine's argument."""
    for name, ok, legal, value in checks:
        if not ok:
            raise ValueError(f"{engine} {name} must be {legal}, got {value!r}")


def batch_checks(
    max_batch_size: int, max_batch_tokens: int | None, sync_interval: int, vocab_size: int | None
) -> list[tuple[str, bool, str, Any]]:
    """The `check_arguments` rows of the batch settings every in-process engine takes."""
    return [
        ("max_batch_size", max_batch_size >= 1, "an integer ≥ 1", max_batch_size),
        ("max_batch_tokens", max_batch_tokens is None or max_batch_tokens >= 1, "None or ≥ 1", max_batch_tokens),
        ("sync_interval", sync_interval >= 1, "an integer ≥ 1", sync_interval),
        ("vocab_size", vocab_size is None or vocab_size >= 1, "None or ≥ 1", vocab_size),
    ]


def check_request(
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    max_new_tokens_per_sample: Sequence[int] | None,
) -> list[int]:
    """Validate one `generate` call; returns every sample's longest response (prompt-major, prompts × n entries)."""
    for i, prompt in enumerate(prompt_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    if params.stop_at_eos and not eos_token_ids:
        raise ValueError("stop_at_eos=True but no EOS id is known; pass eos_token_ids to the engine")
    samples = len(prompt_ids) * params.n
    if max_new_tokens_per_sample is None:
        return [params.max_new_tokens] * samples
    caps = [int(c) for c in max_new_tokens_per_sample]
    if len(caps) != samples:
        raise ValueError(
            f"max_new_tokens_per_sample has {len(caps)} entries; it needs one per sample "
            f"({len(prompt_ids)} prompts × n={params.n} = {samples}, prompt-major)"
        )
    bad = next((c for c in caps if not 1 <= c <= params.max_new_tokens), None)
    if bad is not None:
        raise ValueError(
            f"max_new_tokens_per_sample entries must be in [1, max_new_tokens={params.max_new_tokens}], got {bad}"
        )
    return caps


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A fresh `torch.Generator` on device, seeded with `seed` (None: a random seed)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@contextlib.contextmanager
def generation_mode(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Eval mode, no_grad (not inference_mode: the module is the trainer's, and tensors made here must stay usable in
    autograd) and `attention_backends`; the training flag is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), attention_backends(device):
            yield
    finally:
        model.train(was_training)


class HFModel:
    """A Hugging Face causal LM as the engines call it: forwards with a `transformers` cache, logits of the last
    position only, ids ≥ vocab_size masked to -inf."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, vocab_size: int | None) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size
        parameters = forward_parameters(model)
        self.cache_kwarg = cache_kwarg(parameters)
        # Prefill computes logits for the last position only when the model supports it (saves [R, L, V]).
        self.has_logits_to_keep = "logits_to_keep" in parameters

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        keep_1R: torch.Tensor | None = None,
        eager: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """One model call extending `cache` in place. [R, S] ids → [R, V] logits of the last position; with `keep_1R`
        (positions of a [1, S] packed input) → [R, V] logits of those positions. kwargs go to the model. eager: run
        layers compiled for scoring (`compile_layers`) eagerly, as a cache that grows call after call needs."""
        kwargs.update({self.cache_kwarg: cache, "use_cache": True})
        if self.has_logits_to_keep:
            kwargs["logits_to_keep"] = 1 if keep_1R is None else keep_1R
        with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        if keep_1R is None:
            logits_RV = out.logits[:, -1, :]
        else:
            logits_RV = out.logits[0] if self.has_logits_to_keep else out.logits[0, keep_1R]
        if self.vocab_size is not None and self.vocab_size < logits_RV.shape[-1]:
            logits_RV = logits_RV.clone()
            logits_RV[:, self.vocab_size :] = float("-inf")
        return logits_RV

    def packs_prompts(self) -> bool:
        """Whether `prefill_packed` can run this model: its attention is `opd_varlen` (rows attend in themselves)."""
        return getattr(self.model.config, "_attn_implementation", None) == varlen_attention.ATTENTION

    def new_cache(self, full: bool = False) -> Any:
        """A cache laid out for the model's layers (sliding-window layers keep their last W - 1 positions), or with
        full=True one that keeps every position of every layer (the masks still apply each layer's window)."""
        if full:
            return DynamicCache()
        try:
            hf: Any = self.model  # an HF model: its config is not on nn.Module's type
            return DynamicCache(config=hf.config)
        except TypeError:  # older transformers: no config argument
            return DynamicCache()

    def prefill(
        self, prompts: Sequence[Sequence[int]], device: torch.device, full_cache: bool = False
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Left-padded forward over R distinct prompts. Returns (cache, attention_mask [R, L] long, logits [R, V]);
        full_cache: every position of every layer cached (`new_cache`), as a static cache copies them."""
        longest = max(len(p) for p in prompts)
        ids_RL = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        mask_RL = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids_RL[i, longest - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
            mask_RL[i, longest - len(prompt) :] = 1
        ids_RL, mask_RL = ids_RL.to(device), mask_RL.to(device)
        # Real tokens get positions 0..len-1 whatever the padding; pads get 0 (they are masked anyway).
        positions_RL = (mask_RL.cumsum(dim=-1) - 1).clamp(min=0)
        cache = self.new_cache(full=full_cache)
        logits_RV = self.forward(ids_RL, mask_RL, positions_RL, cache)
        return cache, mask_RL, logits_RV

    def prefill_packed(
        self, prompts: Sequence[Sequence[int]], device: torch.device, *, compiled: bool = False
    ) -> tuple[Any, list[int], torch.Tensor]:
        """One forward over R distinct prompts concatenated without padding (`packs_prompts` models). Returns (cache of
        every position, its keys/values [1, A, Σ lengths, F] per layer; each prompt's first position in it; logits
        [R, V] of each prompt's last token). No padded rows and no [L, L] mask: a long prompt costs its own causal
        attention, not that of the longest in the forward. compiled: run layers compiled by `compile_layers` as
        compiled (the cache starts empty at every call, so they meet one layout, not a growing cache)."""
        lengths = [len(p) for p in prompts]
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        ids_1S = torch.as_tensor([t for p in prompts for t in p], dtype=torch.long).to(device)[None]
        positions_1S = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
        packed = varlen_attention.packed_kwargs(torch.as_tensor(lengths, device=device), max(lengths))
        last_1R = torch.as_tensor([s + n - 1 for s, n in zip(starts, lengths)], device=device)
        cache = self.new_cache(full=True)
        mask = packed.pop("attention_mask")
        logits_RV = self.forward(ids_1S, mask, positions_1S, cache, keep_1R=last_1R, eager=not compiled, **packed)
        return cache, starts, logits_RV


def cached_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [R, A, S, F] of one layer of a transformers `DynamicCache` (5.x layers or 4.x lists)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]

"""What the in-process engines' sessions (`TorchGenerator.session`, `StaticGenerator.session`: the `Continues`
capability of `opd.rollout.base`) share: the keys and values each sequence holds between calls (`HeldKV`) and the
prefill of the tokens appended to them (`prefill_continued`).

A held sequence is the ids the engine has fed through the model (its context and its response but for the response's
last token, which is sampled and never fed) and their keys/values per layer, [A, tokens, F] (post-RoPE keys, as a
`transformers` cache and the static cache hold them). A later call reuses the longest common prefix of those ids and
its new context (all of them when the context extends them, as an episode's does) and prefills the rest.

Shapes (docs/design.md, "Shape letters"): P sequences prefilled together, A key/value heads, W the padded width, F
head dimension, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from opd.rollout.base import GenerationOutput, SamplingParams, StopRule
from opd.rollout.hf_model import HFModel, cached_kv, check_request

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
"""One sequence's keys and values, per layer, each [A, tokens, F]."""


@dataclass
class Held:
    """A sequence's held cache: `tokens` (the ids fed) and their keys/values per layer."""

    tokens: list[int]
    kv: LayerKV

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


class HeldKV:
    """The held caches of a session, by key. `take` removes a sequence's cache as a call starts on it (its keys and
    values move into the call's own cache, so they are not held twice), `put` holds it again when the call ends,
    `end` frees it for good. `most_samples`: the most samples a call of the session has run (its first call, an
    episode's first turn: every episode); a static engine's later calls round their rows up to the live-row buckets of
    that call's rows (`StaticGenerator.plan_rows`), counts the warm-up compiled."""

    def __init__(self) -> None:
        self._held: dict[Hashable, Held] = {}
        self.most_samples = 0

    def __len__(self) -> int:
        return len(self._held)

    def keys(self) -> list[Hashable]:
        """The keys held now."""
        return list(self._held)

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held now."""
        return sum(held.nbytes for held in self._held.values())

    def take(self, key: Hashable, context: Sequence[int]) -> tuple[int, LayerKV | None]:
        """Remove `key`'s held cache and return how much of it serves `context`: (m, its keys/values over the first m
        positions), m the longest common prefix of the held ids and the context, at most len(context) - 1 (the last
        context token is always prefilled: its logits give the first new token); (0, None) when nothing serves."""
        held = self._held.pop(key, None)
        if held is None:
            return 0, None
        limit = min(len(held.tokens), len(context) - 1)
        m = 0
        while m < limit and held.tokens[m] == context[m]:
            m += 1
        if m == 0:
            return 0, None
        return m, [(k[:, :m], v[:, :m]) for k, v in held.kv]

    def put(self, key: Hashable, tokens: list[int], kv: LayerKV) -> None:
        """Hold `kv` (copies the caller no longer writes to) as the cache of `tokens` under `key`."""
        assert all(k.shape[1] == len(tokens) for k, _ in kv), "one key/value position per held token"
        self._held[key] = Held(tokens, kv)

    def end(self, keys: Iterable[Hashable]) -> None:
        """Free these sequences' caches (keys not held are ignored)."""
        for key in keys:
            self._held.pop(key, None)

    def clear(self) -> None:
        self._held.clear()


class EngineSession:
    """`opd.rollout.base.Session` of an in-process engine: the caches it holds (`HeldKV`) and the tokens its calls'
    prefills ran. The engine that opened it runs its calls (`generate(..., session=, keys=)`)."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.held = HeldKV()
        self.prefilled = 0

    def end(self, keys: Iterable[Hashable]) -> None:
        self.held.end(keys)

    def close(self) -> None:
        self.held.clear()

    @property
    def prefilled_tokens(self) -> int:
        return self.prefilled

    @property
    def held_bytes(self) -> int:
        return self.held.nbytes


def session_call(
    engine: object, session: object, keys: Sequence[Hashable] | None, prompts: Sequence[Sequence[int]], n: int
) -> tuple[EngineSession, list[Hashable]] | None:
    """The session and keys of a `generate` call (None without a session); ValueError for a call the engines do not
    run: another engine's session, keys not one per prompt or repeated, n ≠ 1."""
    if session is None:
        if keys is not None:
            raise ValueError("generate: keys are given without a session; keys name a session's sequences")
        return None
    if not isinstance(session, EngineSession) or session.engine is not engine:
        raise ValueError("generate: the session was opened by another engine; open one with this engine's session()")
    if n != 1:
        raise ValueError(f"a session samples one continuation per prompt: SamplingParams.n must be 1, got {n}")
    if keys is None or len(keys) != len(prompts) or len(set(keys)) != len(keys):
        count = None if keys is None else len(keys)
        raise ValueError(f"a session call needs one distinct key per prompt, got {count} keys for {len(prompts)}")
    return session, list(keys)


class SessionEngine(Protocol):
    """What `generate_call` needs of an in-process engine: its EOS ids, its last call's `stats` and its `_generate`
    (the call after its checks; held: a session's caches and each prompt's key)."""

    eos_token_ids: Any
    stats: dict[str, Any]

    def _generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        caps: list[int],
        stop_when: StopRule | None,
        held: tuple[HeldKV, list[Hashable]] | None = None,
    ) -> GenerationOutput: ...


def generate_call(
    engine: SessionEngine,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    max_new_tokens_per_sample: Sequence[int] | None,
    stop_when: StopRule | None,
    session: Any,
    keys: Sequence[Hashable] | None,
) -> GenerationOutput:
    """An in-process engine's `generate`: the call checked (`session_call`, `check_request`), run by the engine's
    `_generate` (with the session's caches and keys where there is one), and the tokens it prefilled added to the
    session's count."""
    called = session_call(engine, session, keys, prompt_ids, params.n)
    caps = check_request(prompt_ids, params, engine.eos_token_ids, max_new_tokens_per_sample)
    if called is None:
        return engine._generate(prompt_ids, params, caps, stop_when)
    output = engine._generate(prompt_ids, params, caps, stop_when, (called[0].held, called[1]))
    called[0].prefilled += engine.stats.get("prefilled_tokens", 0)
    return output


def layer_count(cache: Any) -> int:
    """Layers of a `transformers` cache (5.x layers or 4.x lists)."""
    return len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)


def row_kv(
    keys_RASF: Sequence[torch.Tensor], values_RASF: Sequence[torch.Tensor], row: int, lo: int, hi: int
) -> LayerKV:
    """Copies of one row's keys/values over positions [lo, hi) of every layer (copies: the call's cache is freed)."""
    return [(k[row, :, lo:hi].clone(), v[row, :, lo:hi].clone()) for k, v in zip(keys_RASF, values_RASF)]


def prefill_continued(
    hf: HFModel, items: Sequence[tuple[int, LayerKV | None, Sequence[int]]], device: torch.device
) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Prefill P sequences, each (m, its held keys/values over m positions or None when m = 0, the ids after them),
    the held positions not run again. Returns what `HFModel.prefill(full_cache=True)` returns for the whole sequences:
    (a full cache [P, A, W, F] per layer, each sequence's m + len(new) positions right-aligned: left padding;
    its attention mask [P, W] long; the logits [P, V] of each sequence's last token).

    Forwards: one left-padded prefill of the sequences with nothing held (as `HFModel.prefill`), and one per number of
    new tokens among the others: their held caches left-padded to the longest and the new tokens right after them, so
    that every row is contiguous (no hole between held and new positions: positions and sliding windows count as in a
    prefill of the whole sequence). Padded positions are masked."""
    count = len(items)
    totals = [m + len(new) for m, _, new in items]
    width = max(totals)
    logits: list[torch.Tensor | None] = [None] * count
    parts: list[tuple[list[int], DynamicCache]] = []  # (rows, their cache: right-aligned, `width_of` wide)
    fresh = [i for i, (m, _, _) in enumerate(items) if m == 0]
    if fresh:
        cache, _, logits_FV = hf.prefill([list(items[i][2]) for i in fresh], device, full_cache=True)
        parts.append((fresh, cache))
        for j, i in enumerate(fresh):
            logits[i] = logits_FV[j]
    by_new: dict[int, list[int]] = {}
    for i, (m, _, new) in enumerate(items):
        if m:
            by_new.setdefault(len(new), []).append(i)
    for n, rows in by_new.items():
        held_width = max(items[i][0] for i in rows)
        held_kv = [kv for i in rows if (kv := items[i][1]) is not None]
        layers = []
        for layer in range(len(held_kv[0])):
            k0 = held_kv[0][layer][0]
            keys = k0.new_zeros(len(rows), k0.shape[0], held_width, k0.shape[2])
            values = torch.zeros_like(keys)
            for j, kv in enumerate(held_kv):
                m = kv[layer][0].shape[1]
                keys[j, :, held_width - m :] = kv[layer][0]
                values[j, :, held_width - m :] = kv[layer][1]
            layers.append((keys, values))
        cache = DynamicCache(ddp_cache_data=layers)
        mask = torch.zeros((len(rows), held_width + n), dtype=torch.long)
        positions = torch.zeros((len(rows), n), dtype=torch.long)
        for j, i in enumerate(rows):
            m = items[i][0]
            mask[j, held_width - m :] = 1
            positions[j] = torch.arange(m, m + n)
        ids = torch.as_tensor([list(items[i][2]) for i in rows], dtype=torch.long)
        logits_GV = hf.forward(ids.to(device), mask.to(device), positions.to(device), cache)
        parts.append((rows, cache))
        for j, i in enumerate(rows):
            logits[i] = logits_GV[j]
    # one cache [P, A, width, F]: each part's rows right-aligned, so each sequence's positions end at `width`
    merged = []
    for layer in range(layer_count(parts[0][1])):
        k0 = cached_kv(parts[0][1], layer)[0]
        keys = k0.new_zeros(count, k0.shape[1], width, k0.shape[3])
        values = torch.zeros_like(keys)
        for rows, part in parts:
            part_keys, part_values = cached_kv(part, layer)
            index = torch.as_tensor(rows, device=keys.device)
            keys[index, :, width - part_keys.shape[2] :] = part_keys
            values[index, :, width - part_values.shape[2] :] = part_values
        merged.append((keys, values))
    mask_PW = torch.zeros((count, width), dtype=torch.long, device=device)
    for i, total in enumerate(totals):
        mask_PW[i, width - total :] = 1
    logits_PV = torch.stack([row for row in logits if row is not None])
    return DynamicCache(ddp_cache_data=merged), mask_PW, logits_PV

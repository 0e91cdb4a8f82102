"""`TorchGenerator`: batched sampling from any Hugging Face causal LM with a KV cache, on CPU or GPU.

Our own decode loop rather than `model.generate()`, so that sampling is ours: an explicit seeded `torch.Generator`,
temperature / top-k / top-p, greedy at temperature 0, and the log-prob of every sampled token. Work is cut into
memory-sized chunks, each prompt prefilled once per chunk, finished rows dropped once they are `compact_fraction`
of the batch (docs/design.md, "opd.rollout.torch_engine"). The same seed, inputs and chunk sizes give the same
outputs; pin the chunks with `max_batch_tokens` where that matters.

`session()` (the `Continues` capability, `opd.rollout.base`): an episode's later turns reuse the keys and values its
earlier turns left in the cache and prefill only the tokens appended since (`generate(..., session=, keys=)`).

Omitted, on purpose: a static KV cache, CUDA graphs and refilling finished rows (`StaticGenerator`), chunked
prefill, sorting prompts by length, prefix sharing across prompts, speculative decoding, stop strings (the caller
decodes text; engines know token ids only).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from opd.models import embedding_rows
from opd.rollout import memory
from opd.rollout.base import GenerationOutput, SamplingParams, Session, StopRule
from opd.rollout.hf_model import (
    HFModel,
    batch_checks,
    cached_kv,
    check_arguments,
    generation_mode,
    seeded_generator,
    special_ids,
)
from opd.rollout.sampling import sample_next
from opd.rollout.sessions import EngineSession, HeldKV, generate_call, layer_count, prefill_continued, row_kv

# [R, V] float32 buffers alive at once while sampling (logits upcast, scaled, probabilities, log-softmax, filtered)
_SAMPLING_FLOATS = 6


class TorchGenerator(memory.ModuleMemory):
    """The `Generator` protocol over a Hugging Face causal LM that it shares with the trainer (no weight copy).

    model:            any `AutoModelForCausalLM`-like module accepting input_ids, attention_mask, position_ids, a
                      `transformers` cache and use_cache; run in eval mode under no_grad, its training flag restored
    eos_token_ids:    ids that end a sample (see `opd.models.eos_token_ids`); None → the model's config and
                      generation config
    pad_token_id:     id written into padded prompt positions (always masked); None → config pad id, else first EOS
    vocab_size:       ids ≥ vocab_size are never sampled (embedding padding rows, `VocabInfo.tokenizer_size`);
                      None → the whole output layer
    max_batch_size:   most sequences decoded together, ≥ 1
    max_batch_tokens: most KV-cache tokens per chunk, counted as rows × (longest prompt + max_new_tokens); None → as
                      many rows as fit in the device memory free at the call (CUDA; no limit on CPU). A single
                      sequence longer than it still runs, alone.
    sync_interval:    decode steps between host checks of finished rows, ≥ 1 (each check is a CPU-GPU sync; up to
                      sync_interval - 1 steps are wasted after the last row finishes)
    compact_fraction: drop finished rows from the batch once they are at least this fraction of it, in (0, 1]
    free_memory:      function of a device → its (free, total) bytes, or None for no limit; default
                      `opd.rollout.memory.device_memory` (the CUDA figures; None on CPU); the tests pass a fixed one

    `stats` (after each call): the prompt tokens its prefills ran (`prefilled_tokens`; a prompt given more than
    once in a chunk runs once) and, in a session, the held ones reused instead (`reused_tokens`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        vocab_size: int | None = None,
        max_batch_size: int = 64,
        max_batch_tokens: int | None = None,
        sync_interval: int = 8,
        compact_fraction: float = 0.25,
        free_memory: memory.MemoryFn | None = None,
    ) -> None:
        check_arguments(
            "TorchGenerator",
            [
                *batch_checks(max_batch_size, max_batch_tokens, sync_interval, vocab_size),
                ("compact_fraction", 0 < compact_fraction <= 1, "in (0, 1]", compact_fraction),
            ],
        )
        self.model = model
        self.eos_token_ids, self.pad_token_id = special_ids(model, eos_token_ids, pad_token_id)
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.sync_interval = sync_interval
        self.compact_fraction = compact_fraction
        self.free_memory = free_memory
        self.hf = HFModel(model, pad_token_id=self.pad_token_id, vocab_size=vocab_size)
        self.stats: dict[str, int] = {}

    def sync_weights(self) -> None:
        """Nothing to do: the engine runs the trainer's own module."""

    def release(self) -> None:
        """Nothing to do: a call's cache and buffers are freed when it returns (a session's when it is closed)."""

    def session(self) -> EngineSession:
        """Sequences continued across calls, each keeping its cache (`opd.rollout.base.Session`): pass it to
        `generate` with a key per prompt."""
        return EngineSession(self)

    def close(self) -> None:
        """Nothing to do: the module is the caller's."""

    # ------------------------------------------------------------------ memory

    def row_cost(self, prompt_tokens: int, new_tokens: int) -> memory.RowCost:
        """Bytes per decoding row of a chunk whose longest prompt has prompt_tokens tokens: its `DynamicCache` (plus
        one layer's copy, which `torch.cat` makes at each step), the sampling buffers over the vocabulary, and its
        share of the prefill (counted per row, though n samples share one prompt)."""
        config: Any = self.model.config  # an HF config: its fields are not on nn.Module's type
        dtype = self._cache_dtype()
        kv = memory.kv_bytes_per_token(config, dtype)
        vocab_rows = embedding_rows(self.model)
        slots = prompt_tokens + new_tokens
        return memory.RowCost(
            per_row={
                "KV cache": kv * slots + kv * slots // config.num_hidden_layers,
                "sampling buffers": _SAMPLING_FLOATS * 4 * vocab_rows,
                "prefill": (memory.prefill_bytes_per_token(config, dtype) - kv) * prompt_tokens,
            },
            per_slot=kv + kv // config.num_hidden_layers,
        )

    def _cache_dtype(self) -> torch.dtype:
        """The cache's dtype: autocast's when the caller enabled it, else the parameters'."""
        device = self.device
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return next(self.model.parameters()).dtype

    def check_fits(
        self,
        prompt_tokens: int,
        new_tokens: int,
        *,
        reserve_bytes: int = 0,
        names: tuple[str, str] = ("prompt length", "max_new_tokens"),
    ) -> None:
        """Raise ValueError (one line, saying what would fit) when not even one sequence of prompt_tokens +
        new_tokens fits in the device memory free now less reserve_bytes. Call it under the autocast that generate
        will run under (the cache's dtype follows it)."""
        free = self._memory()
        if free is not None:
            memory.check_one_row_fits(
                free,
                self.row_cost(prompt_tokens, new_tokens),
                prompt_tokens=prompt_tokens,
                new_tokens=new_tokens,
                slots=prompt_tokens + new_tokens,
                reserve_bytes=reserve_bytes,
                where=f" on {self.device}",
                names=names,
            )

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_new_tokens_per_sample: Sequence[int] | None = None,
        stop_when: StopRule | None = None,
        session: Session | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> GenerationOutput:
        """n samples for each of P prompts, prompt-major (see `GenerationOutput`). max_new_tokens_per_sample: one
        length limit per sample (prompt-major, each in [1, params.max_new_tokens]); a sample reaching it ends with
        finish reason "length" (benchmarks use it to force long-tailed lengths identically in every engine).
        stop_when: asked at each sync point at which samples of the chunk ended, and after each chunk
        (`opd.rollout.base.StopRule`). session, keys: a session of this engine (`session()`) and one key per prompt
        (n = 1): prompt i continues keys[i]'s sequence, its held positions reused (`opd.rollout.base.Session`)."""
        return generate_call(self, prompt_ids, params, max_new_tokens_per_sample, stop_when, session, keys)

    def _generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        caps: list[int],
        stop_when: StopRule | None,
        held: tuple[HeldKV, list[Hashable]] | None = None,
    ) -> GenerationOutput:
        """`generate` after its checks; held: a session's caches and the key of each prompt (n = 1), whose held
        positions are reused rather than prefilled, and where each row's cache is held again when its chunk ends.
        The chunks are those of `generate` on the same prompts, so the random draws are too."""
        generator = seeded_generator(params.seed, self.device)
        self.stats = {"prefilled_tokens": 0, "reused_tokens": 0}
        responses: list[list[int]] = []
        reasons: list[str] = []
        logprobs: list[list[float]] = []
        finished: list[str | None] = [None] * len(caps)  # what stop_when sees
        cut = False
        with generation_mode(self.model, self.device):
            lengths = [len(p) for p in prompt_ids]
            row_limit, free = None, self._memory()
            if held is not None and free is not None:
                # the caches the call holds when it ends (context and response of every row), beyond those taken
                kv = memory.kv_bytes_per_token(self.model.config, self._cache_dtype())
                free = (free[0] - kv * sum(length + cap for length, cap in zip(lengths, caps)), free[1])
            if self.max_batch_tokens is None and prompt_ids and free is not None:
                cost = self.row_cost(max(lengths), params.max_new_tokens)
                memory.check_one_row_fits(
                    free,
                    cost,
                    prompt_tokens=max(lengths),
                    new_tokens=params.max_new_tokens,
                    slots=max(lengths) + params.max_new_tokens,
                    where=f" on {self.device}",
                )
                row_limit = memory.rows_that_fit(free, cost)
            for chunk in self._chunks(lengths, params, row_limit):
                start = len(responses)
                count = sum(c for _, c in chunk)
                if cut:  # the call ended in an earlier chunk: these samples waited
                    responses += [[] for _ in range(count)]
                    logprobs += [[] for _ in range(count)]
                    reasons += ["length"] * count
                    continue
                ask = None
                if stop_when is not None:

                    def ask(chunk_reasons: list[str | None], start: int = start) -> bool:
                        finished[start : start + len(chunk_reasons)] = chunk_reasons
                        return stop_when(finished)

                ids, lps, rs, cut = self._generate_chunk(
                    [list(prompt_ids[p]) for p, _ in chunk],
                    [c for _, c in chunk],
                    caps[start : start + count],
                    params,
                    generator,
                    ask,
                    None if held is None else (held[0], [held[1][p] for p, _ in chunk]),
                )
                responses += ids
                logprobs += lps
                reasons += rs
                finished[start : start + count] = rs
                cut = cut or (stop_when is not None and stop_when(finished))
        group_ids = [p for p in range(len(prompt_ids)) for _ in range(params.n)]
        return GenerationOutput(
            response_ids=responses,
            finish_reasons=reasons,
            group_ids=group_ids,
            logprobs=logprobs if params.return_logprobs else None,
        )

    def _chunks(
        self, prompt_lengths: list[int], params: SamplingParams, row_limit: int | None = None
    ) -> list[list[tuple[int, int]]]:
        """Cut the P × n sequences, prompt-major, into chunks [(prompt index, number of samples), ...] of at most
        max_batch_size (and row_limit) rows and max_batch_tokens tokens."""
        chunks: list[list[tuple[int, int]]] = []
        current: list[tuple[int, int]] = []
        rows, longest = 0, 0
        most_rows = self.max_batch_size if row_limit is None else max(1, min(self.max_batch_size, row_limit))
        for p, length in enumerate(prompt_lengths):
            remaining = params.n
            while remaining:
                longest_if_added = max(longest, length)
                capacity = most_rows
                if self.max_batch_tokens is not None:
                    capacity = min(capacity, self.max_batch_tokens // (longest_if_added + params.max_new_tokens))
                if capacity - rows < 1 and current:
                    chunks.append(current)
                    current, rows, longest = [], 0, 0
                    continue
                take = min(max(capacity - rows, 1), remaining)
                current.append((p, take))
                rows, longest, remaining = rows + take, longest_if_added, remaining - take
        if current:
            chunks.append(current)
        return chunks

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        counts: list[int],
        caps: list[int],
        params: SamplingParams,
        generator: torch.Generator,
        ask: Callable[[list[str | None]], bool] | None = None,
        held: tuple[HeldKV, list[Hashable]] | None = None,
    ) -> tuple[list[list[int]], list[list[float]], list[str], bool]:
        """Sample counts[i] continuations of prompts[i], row j at most caps[j] tokens; rows come back in order
        (prompt 0's samples first), and whether `ask` (given each row's finish reason or None, when rows ended)
        ended the chunk early. held: a session's caches and each prompt's key (counts all 1): the prefill reuses
        them (`_continue_rows`) and each row's cache is held again once it leaves the batch (`_hold`).

        1. prefill: each distinct prompt once, its cache copied to each of its rows (`_prefill_rows`);
        2. decode: one token per step for every row still in the batch; every `sync_interval` steps, stop when all
           rows finished or `ask` ends the chunk (`_asked_to_end`), and drop finished rows once they are
           `compact_fraction` of the batch;
        3. the rows' tokens, log-probs and finish reasons as lists (`_chunk_results`).
        """
        device = self.device
        num_rows, steps = sum(counts), max(caps)
        if held is None:
            cache, logits_bV, mask_bS, positions_b, prompt_width = self._prefill_rows(prompts, counts, steps)
        else:
            cache, logits_bV, mask_bS, positions_b, prompt_width = self._continue_rows(prompts, *held, steps)
        caps_R = torch.as_tensor(caps, device=device)
        can_end_early = params.stop_at_eos or min(caps) < steps
        # Chunk rows are R; the rows still in the batch are b (R until finished rows are dropped), `rows_b` maps b → R.
        rows_b = torch.arange(num_rows, device=device)
        eos_ids = torch.as_tensor(self.eos_token_ids, dtype=torch.long, device=device)
        out_ids_RT = torch.full((num_rows, steps), self.pad_token_id, dtype=torch.long, device=device)
        out_lps_RT = torch.zeros((num_rows, steps), dtype=torch.float32, device=device)
        lengths_R = torch.zeros(num_rows, dtype=torch.long, device=device)
        finished_R = torch.zeros(num_rows, dtype=torch.bool, device=device)
        stopped_R = torch.zeros(num_rows, dtype=torch.bool, device=device)  # finished on an EOS

        asked_at, cut = [0], False  # rows ended when `ask` was last asked; whether it ended the chunk
        for t in range(steps):
            tokens_b, lps_b = sample_next(logits_bV, params, generator)
            alive_b = ~finished_R[rows_b]  # rows that finished but are not dropped yet keep decoding; ignored here
            out_ids_RT[rows_b, t] = torch.where(alive_b, tokens_b, self.pad_token_id)
            out_lps_RT[rows_b, t] = torch.where(alive_b, lps_b, 0.0)
            lengths_R[rows_b] += alive_b.long()
            if params.stop_at_eos:
                stopped_R[rows_b] |= alive_b & torch.isin(tokens_b, eos_ids)
            finished_R[rows_b] = stopped_R[rows_b] | (lengths_R[rows_b] >= caps_R[rows_b])
            if t == steps - 1:
                break
            if can_end_early and (t + 1) % self.sync_interval == 0:
                done_b = finished_R[rows_b]
                num_done = int(done_b.sum())  # CPU-GPU sync point
                if num_done == rows_b.numel():
                    break
                if ask is not None and _asked_to_end(ask, finished_R, stopped_R, asked_at):
                    cut = True
                    break
                if num_done >= self.compact_fraction * rows_b.numel():
                    keep_b = (~done_b).nonzero().squeeze(-1)
                    if held is not None:
                        dropped_b = done_b.nonzero().squeeze(-1)
                        self._hold(cache, rows_b, dropped_b, lengths_R, out_ids_RT, prompts, prompt_width, *held)
                    cache.reorder_cache(keep_b)
                    rows_b, tokens_b, positions_b, mask_bS = (
                        rows_b[keep_b],
                        tokens_b[keep_b],
                        positions_b[keep_b],
                        mask_bS[keep_b],
                    )
            logits_bV = self.hf.forward(
                tokens_b[:, None], mask_bS[:, : prompt_width + t + 1], positions_b[:, None], cache
            )
            positions_b = positions_b + 1
        if held is not None:
            everyone_b = torch.arange(rows_b.numel(), device=device)
            self._hold(cache, rows_b, everyone_b, lengths_R, out_ids_RT, prompts, prompt_width, *held)
        return (*_chunk_results(out_ids_RT, out_lps_RT, lengths_R, stopped_R, params.return_logprobs), cut)

    def _prefill_rows(
        self, prompts: list[list[int]], counts: list[int], steps: int
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Prefill each distinct prompt once and copy its KV cache to each of its counts[i] rows (a prompt given
        several times, as a partial-rollout stream sends a group's fresh samples, is prefilled once too).

        Returns the cache, the first token's logits [R, V], the attention mask [R, S] of the whole decode (allocated
        once; decode step t uses its first prompt_width + t + 1 columns), each row's next position [R] (its number
        of real tokens so far) and prompt_width, the prompts' padded width."""
        device = self.device
        distinct: dict[tuple[int, ...], int] = {}
        distinct_of_prompt = [distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts]
        # prefill_mask: [distinct prompts, prompt_width]; prefill_logits: [distinct prompts, V]
        cache, prefill_mask, prefill_logits = self.hf.prefill(list(distinct), device)
        self.stats["prefilled_tokens"] += sum(len(prompt) for prompt in distinct)
        return self._rows_of(cache, prefill_mask, prefill_logits, distinct_of_prompt, counts, steps)

    def _continue_rows(
        self, prompts: list[list[int]], store: HeldKV, keys: list[Hashable], steps: int
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """`_prefill_rows` for a session's rows (one each): each distinct prompt's held positions are taken from
        `store` (the longest common prefix with what its key holds, `HeldKV.take`) and only the rest is prefilled
        (`opd.rollout.sessions.prefill_continued`), in one full cache that keeps every position (they are held
        again when the chunk ends)."""
        distinct: dict[tuple[int, ...], int] = {}
        items: list[tuple[int, Any, list[int]]] = []
        distinct_of_prompt = []
        for prompt, key in zip(prompts, keys):
            m, kv = store.take(key, prompt)  # a duplicate's own cache is dropped: the first's serves both
            if tuple(prompt) not in distinct:
                distinct[tuple(prompt)] = len(items)
                items.append((m, kv, prompt[m:]))
            distinct_of_prompt.append(distinct[tuple(prompt)])
        cache, prefill_mask, prefill_logits = prefill_continued(self.hf, items, self.device)
        self.stats["prefilled_tokens"] += sum(len(new) for _, _, new in items)
        self.stats["reused_tokens"] += sum(m for m, _, _ in items)
        return self._rows_of(cache, prefill_mask, prefill_logits, distinct_of_prompt, [1] * len(prompts), steps)

    def _hold(
        self,
        cache: Any,
        rows_b: torch.Tensor,
        leaving_b: torch.Tensor,
        lengths_R: torch.Tensor,
        out_ids_RT: torch.Tensor,
        prompts: list[list[int]],
        prompt_width: int,
        store: HeldKV,
        keys: list[Hashable],
    ) -> None:
        """Hold the caches of the batch rows `leaving_b` (dropped as finished, or every row at the chunk's end) under
        their keys: each row's prompt and response but its last token (sampled, never fed), i.e. its cache's
        columns [prompt_width - prompt length, prompt_width + response length - 1)."""
        layers = [cached_kv(cache, i) for i in range(layer_count(cache))]
        keys_b, values_b = [k for k, _ in layers], [v for _, v in layers]
        chunk_rows = rows_b[leaving_b].tolist()
        lengths = lengths_R[rows_b[leaving_b]].tolist()
        for b, row, n in zip(leaving_b.tolist(), chunk_rows, lengths):
            fed = max(n - 1, 0)
            tokens = prompts[row] + out_ids_RT[row, :fed].tolist()
            kv = row_kv(keys_b, values_b, b, prompt_width - len(prompts[row]), prompt_width + fed)
            store.put(keys[row], tokens, kv)

    def _rows_of(
        self,
        cache: Any,
        prefill_mask: torch.Tensor,
        prefill_logits: torch.Tensor,
        distinct_of_prompt: list[int],
        counts: list[int],
        steps: int,
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """A prefill of distinct prompts spread to the chunk's rows (counts[i] for prompt i): see `_prefill_rows`."""
        device = self.device
        source_R = torch.repeat_interleave(
            torch.as_tensor(distinct_of_prompt, device=device), torch.as_tensor(counts, device=device)
        )
        cache.reorder_cache(source_R)
        num_rows, prompt_width = source_R.numel(), prefill_mask.shape[1]
        mask_RS = torch.ones((num_rows, prompt_width + steps), dtype=torch.long, device=device)
        mask_RS[:, :prompt_width] = prefill_mask[source_R]
        positions_R = prefill_mask[source_R].sum(dim=-1)
        return cache, prefill_logits[source_R], mask_RS, positions_R, prompt_width


def _asked_to_end(
    ask: Callable[[list[str | None]], bool], finished_R: torch.Tensor, stopped_R: torch.Tensor, asked_at: list[int]
) -> bool:
    """Whether `ask` ends the chunk: asked (with each row's finish reason, None for rows still decoding) only when
    rows ended since it was last asked; `asked_at` ([the number of ended rows then]) is updated in place."""
    ended_R = finished_R.tolist()
    if sum(ended_R) <= asked_at[0]:
        return False
    asked_at[0] = sum(ended_R)
    reasons_R = zip(ended_R, stopped_R.tolist())
    return bool(ask([("stop" if stop else "length") if end else None for end, stop in reasons_R]))


def _chunk_results(
    out_ids_RT: torch.Tensor,
    out_lps_RT: torch.Tensor,
    lengths_R: torch.Tensor,
    stopped_R: torch.Tensor,
    return_logprobs: bool,
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Each row's response ids and log-probs (empty lists unless `return_logprobs`), cut to its length, and its
    finish reason ("stop" on an EOS, else "length")."""
    lengths = lengths_R.tolist()
    ids_rows = out_ids_RT.tolist()
    lps_rows = out_lps_RT.tolist() if return_logprobs else [[] for _ in lengths]
    responses = [row[:n] for row, n in zip(ids_rows, lengths)]
    logprobs = [row[:n] for row, n in zip(lps_rows, lengths)]
    reasons = ["stop" if done else "length" for done in stopped_R.tolist()]
    return responses, logprobs, reasons

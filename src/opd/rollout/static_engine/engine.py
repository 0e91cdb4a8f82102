"""`StaticGenerator`, the engine's API: its options and their checks, the row counts a call runs at (the rounding
ladder, live-row buckets, the memory and token caps), the memory a row costs, the compiled step functions and
`generate`, which runs one `_Run` (`run`).

Shapes (docs/design.md, "Shape letters"): R rows of the engine call, S cache slots, V vocabulary, A key/value heads,
F head dimension.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch

from opd.kernels import decode_attention as triton_attention
from opd.rollout import memory
from opd.rollout.base import GenerationOutput, SamplingParams, Session, StopRule
from opd.rollout.hf_model import (
    HFModel,
    batch_checks,
    check_arguments,
    generation_mode,
    seeded_generator,
    special_ids,
)
from opd.rollout.sessions import EngineSession, HeldKV, generate_call
from opd.rollout.static_engine.families import HFModule, _gate_up, _head_dim, _Layout, _qkv, unsupported_reason
from opd.rollout.static_engine.layers import _ATTENTION_CHOICES
from opd.rollout.static_engine.rows import _round_rows, _row_buckets, _settle_limit
from opd.rollout.static_engine.run import _FIRST_TOKEN_ROWS, _plain_step_fns, _prefill_autocast, _Run
from opd.scoring import recompile_limit_at_least

# [V]-sized float32 buffers per row the sampling holds at its peak (upcast logits, scaled, Gumbel noise transform,
# noisy logits, the split-reduction padding), on top of the uniform-noise buffer and the head's logits
_SAMPLING_FLOATS = 6


def _check_options(
    max_batch_size: int,
    max_batch_tokens: int | None,
    sync_interval: int,
    vocab_size: int | None,
    kv_bucket: int,
    prefill_tokens: int,
) -> None:
    """Raise ValueError naming each numeric option of `StaticGenerator` out of its range."""
    check_arguments(
        "StaticGenerator",
        [
            *batch_checks(max_batch_size, max_batch_tokens, sync_interval, vocab_size),
            ("kv_bucket", kv_bucket >= 1, "an integer ≥ 1", kv_bucket),
            ("prefill_tokens", prefill_tokens >= 1, "an integer ≥ 1", prefill_tokens),
        ],
    )


def _check_choices(
    attention: str, round_rows: bool | None, packed_prefill: bool | None, attention_splits: int | None
) -> None:
    """Raise ValueError naming each choice option of `StaticGenerator` that is not one of its values."""
    splits_ok = attention_splits is None or (
        isinstance(attention_splits, int) and attention_splits >= 1 and attention_splits & (attention_splits - 1) == 0
    )
    check_arguments(
        "StaticGenerator",
        [
            ("attention", attention in _ATTENTION_CHOICES, f"one of {', '.join(_ATTENTION_CHOICES)}", attention),
            ("round_rows", round_rows is None or isinstance(round_rows, bool), "None, True or False", round_rows),
            (
                "packed_prefill",
                packed_prefill is None or isinstance(packed_prefill, bool),
                "None, True or False",
                packed_prefill,
            ),
            ("attention_splits", splits_ok, "None or a power of two ≥ 1", attention_splits),
        ],
    )


class StaticGenerator(memory.ModuleMemory):
    """`Generator` with a static KV cache, continuous batching and CUDA-graph decode steps; the results contract of
    `TorchGenerator` (prompt-major outputs, EOS kept, log-probs before top-k/top-p filtering, seeded), see the module
    docstring for how a call runs and its determinism contract.

    eos_token_ids, pad_token_id, vocab_size: as `TorchGenerator`
    max_batch_size:   most rows (slots) decoding at once, ≥ 1
    max_batch_tokens: most KV-cache slots at once, counted as rows × (longest prompt + max_new_tokens); None = as many
                      rows as fit in the device memory free at the call (CUDA; no limit on CPU). One row always runs.
    sync_interval:    decode steps between host checks, ≥ 1: finished rows are refilled there (each check is one
                      CPU-GPU sync; a row that finishes waits up to sync_interval - 1 steps for its refill)
    kv_bucket:        with "sdpa" / "matmul" attention, decode steps attend over the cache rounded up to a multiple of
                      this many slots (one graph each); smaller buckets read less cache per step but capture more
                      graphs, ≥ 1. Unused by the Triton kernel, which reads each row's exact slots
    cuda_graphs:      capture and replay the decode step (CUDA only); None = on CUDA
    compile:          `torch.compile` the two halves of a layer and the sampling (CUDA only; the first call per row
                      count pays the compile, or `warm_up_decode` before work starts, as the trainer does); None =
                      on CUDA, falling back to the plain step with a warning if
                      compilation fails. Results agree with the uncompiled step to bf16 rounding
    fuse_weights:     True = per call, build one q/k/v and one gate/up matrix per layer and cast every weight the step
                      uses to the compute dtype once (autocast's dtype when autocast is on at generate time, else the
                      parameters'), then decode without autocast. Extra memory while a call runs: the concatenations
                      are copies, and so is o_proj with its input columns reordered to the layout SDPA writes
                      (together about 80% of the layer weights: 0.7 GB for Qwen3-0.6B in bf16); with float32
                      parameters under bf16 autocast every GEMM weight is copied once in bf16 (1.2 GB for
                      Qwen3-0.6B), while the embedding table, the norms and the residual stream stay float32 as
                      autocast keeps them (the teacher-forced forward the trainer compares log-probs with).
                      False = one GEMM per projection on the module's own tensors, under the caller's autocast
    attention:        "auto" = "triton" on CUDA when Triton is installed and the head size is a power of two in
                      [16, 256], else "sdpa"; "triton" = the split-KV kernel `opd.kernels.decode_attention` (CUDA, or
                      CPU under Triton's interpreter: the tests); "sdpa" = one masked `scaled_dot_product_attention`
                      call per layer; "matmul" = explicit matmul / float32 softmax / matmul (the reference)
    prefill_tokens:   most prompt tokens per Hugging Face prefill forward, padding included when the prompts are
                      padded (one prompt always fits), ≥ 1
    packed_prefill:   True = prefill prompts packed into one row without padding (`HFModel.prefill_packed`; needs a
                      model loaded with `opd_varlen` attention, as `opd.models.load_model` does on CUDA): no padded
                      rows and no [L, L] mask, each prompt costs its own causal attention (a stream's continued
                      samples are prefilled again at every call, from the bare prompt to thousands of tokens long).
                      False = left-padded rows under a mask. None (default) = packed when the model packs prompts
                      (`opd_varlen`), else padded. Both give the same keys, values and first tokens up to the
                      rounding of another attention kernel; packed is faster (`benchmarks/prefill.py`,
                      docs/performance.md)
    compiled_prefill: True = packed prefills run the decoder layers compiled by `opd.models.compile_layers` (the
                      trainer's, on CUDA) as compiled, fusing the element-wise work between the GEMMs, a large share
                      of an eager prefill's CUDA time (the figures: docs/performance.md; `rollout.compiled_prefill`,
                      whose warm-up builds the prefill's graphs
                      through `warm_up_prefill`); False (default) = eagerly, as every other call through the Hugging
                      Face model. Needs packed prefills; no effect on layers not compiled
    free_memory:      function of a device → its (free, total) bytes, or None for no limit; default
                      `opd.rollout.memory.device_memory` (the CUDA figures; None on CPU); the tests pass a fixed one
    row_buckets:      True (default) = once no sample is pending, decode steps run over the smallest live-row
                      bucket (the call's rows, or a power of two ≥ 4 below it) that holds the rows still decoding:
                      they are moved to the first rows at a host check, so that the tail of a long-tailed call costs
                      what its live rows cost (the figures: docs/performance.md; the first call of a process pays
                      each bucket's compile and capture). False = every step runs over all rows (one shape)
    round_rows:       True = a call of fewer samples than max_batch_size runs on rows rounded up to the ladder 1, 2,
                      4, 8, 16, 32, 48, ... (`_round_rows`; the rows beyond the samples stay empty slots), and a
                      binding max_batch_tokens cap is rounded down as the memory cap is: calls of varying sample
                      counts (partial rollouts continue the samples still running) meet a few row counts, each
                      compiled once per process, rather than a compile per new count and, past dynamo's recompile
                      limit, an eager step. False = min(samples, max_batch_size) rows. None (default) = True exactly
                      when the compiled step functions run (CUDA, compile not False). Either way the rows, and so the
                      live-row buckets and the shape of the sampling noise, are a function of the samples,
                      max_batch_size, max_batch_tokens, this option and the free memory: sampled draws depend on the
                      option, greedy tokens agree (up to the rounding of sums over another row count)
    attention_splits: the Triton kernel's splits per row (a power of two); None (default) = `default_splits` of
                      the rows and the cache's length (opd.kernels.decode_attention), fixed for a call's graphs

    `stats` (after each call): rows, slots per row, decode steps, refills (samples placed into a freed slot),
    prefill forwards and the prompt tokens they ran (a prompt given more than once runs once), CUDA graphs
    captured, occupancy (decoded tokens / (steps × rows)), decode steps per live-row bucket, the rows the steps ran
    over (`row_steps`) and their occupancy, KV-cache bytes.
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
        sync_interval: int = 32,
        kv_bucket: int = 128,
        cuda_graphs: bool | None = None,
        compile: bool | None = None,
        fuse_weights: bool = True,
        attention: Literal["auto", "triton", "sdpa", "matmul"] = "auto",
        prefill_tokens: int = 8192,
        free_memory: memory.MemoryFn | None = None,
        row_buckets: bool = True,
        round_rows: bool | None = None,
        attention_splits: int | None = None,
        packed_prefill: bool | None = None,
        compiled_prefill: bool = False,
    ) -> None:
        """1. check the options' values, 2. the model and the attention asked for, 3. keep the options, 4. the
        Hugging Face model and its prefill (packed or padded, compiled or eager)."""
        _check_options(max_batch_size, max_batch_tokens, sync_interval, vocab_size, kv_bucket, prefill_tokens)
        _check_choices(attention, round_rows, packed_prefill, attention_splits)
        self.model = model
        self._check_model(attention)
        self.eos_token_ids, self.pad_token_id = special_ids(model, eos_token_ids, pad_token_id)
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.sync_interval = sync_interval
        self.kv_bucket = kv_bucket
        self.cuda_graphs = cuda_graphs
        self.compile = compile
        self.fuse_weights = fuse_weights
        self.attention = attention
        self.prefill_tokens = prefill_tokens
        self.free_memory = free_memory
        self.row_buckets = row_buckets
        self.round_rows = round_rows
        self.attention_splits = attention_splits
        self.hf = HFModel(model, pad_token_id=self.pad_token_id, vocab_size=vocab_size)
        self.packed_prefill: bool = self._packs_prefill(packed_prefill)
        if not isinstance(compiled_prefill, bool) or (compiled_prefill and not self.packed_prefill):
            raise ValueError(
                f"StaticGenerator compiled_prefill={compiled_prefill!r}: True or False, and True needs packed prefills "
                f"(a model set to opd_varlen, packed_prefill None or True); use False"
            )
        self.compiled_prefill = compiled_prefill
        self.stats: dict[str, Any] = {}
        self._compiled: tuple[Callable, Callable, Callable] | None = None

    def _check_model(self, attention: str) -> None:
        """Raise when the step cannot run the model, or not with the attention asked for."""
        model = self.model
        if attention == "triton" and not triton_attention.available(self.device):
            raise ValueError(
                f"StaticGenerator attention='triton' needs Triton and a CUDA model (device {self.device}, "
                f"Triton {'installed' if triton_attention.triton else 'not installed'}); use 'auto'"
            )
        reason = unsupported_reason(model)
        if reason is not None:
            raise NotImplementedError(
                f"StaticGenerator cannot run {type(model).__name__}: {reason} (engine 'auto' or "
                "'torch' runs any causal LM)"
            )
        softcap = _Layout.of(model.config).attn_softcap
        if attention == "sdpa" and softcap is not None:
            raise ValueError(
                f"StaticGenerator attention='sdpa' cannot soft-cap attention scores "
                f"(attn_logit_softcapping={softcap}); use 'auto', 'triton' or 'matmul'"
            )
        if attention == "triton" and not triton_attention.supports(_head_dim(model)):
            raise ValueError(
                f"StaticGenerator attention='triton' needs a power-of-two head size in [16, 256], this "
                f"model's is {_head_dim(model)}; use 'auto'"
            )

    def _packs_prefill(self, packed_prefill: bool | None) -> bool:
        """Whether prefills run packed: as asked, None = when the model packs prompts (`opd_varlen`)."""
        if packed_prefill and not self.hf.packs_prompts():
            implementation = getattr(self.model.config, "_attn_implementation", None)
            raise ValueError(
                f"StaticGenerator packed_prefill=True needs a model loaded with attn_implementation='opd_varlen' "
                f"(opd.models.load_model's choice on CUDA), this one has {implementation!r}; use None or False"
            )
        return self.hf.packs_prompts() if packed_prefill is None else packed_prefill

    def prefill_groups(self, lengths: Sequence[int]) -> list[list[int]]:
        """How a call cuts the distinct prompts of these lengths into prefill forwards: indices by ascending length
        (stable), a forward holding at most `prefill_tokens` tokens (packed: their sum; padded: rows × the longest),
        or one prompt alone where it is longer."""
        groups: list[list[int]] = []
        used = 0
        for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
            group = groups[-1] if groups else None
            width = lengths[i]  # the longest so far: prompts come in ascending length
            cost = used + width if self.packed_prefill else (len(group or ()) + 1) * width
            if group is None or cost > self.prefill_tokens:
                groups.append([i])
                used = width
            else:
                group.append(i)
                used += width
        return groups

    def warm_up_prefill(self, prompt_ids: Sequence[Sequence[int]]) -> int:
        """Prefill these prompts as a call would place them (`prefill_groups`) and discard the result, so that the
        graphs of `compiled_prefill` are built before work starts (`opd.train.step.warm_up` runs it over its warm-up
        layouts). Call it under the autocast generation runs under. Returns the tokens prefilled: none unless the
        engine's prefills run compiled."""
        if not self.compiled_prefill or not prompt_ids:
            return 0
        prompts = [list(p) for p in prompt_ids]
        device = next(self.model.parameters()).device
        autocast = torch.is_autocast_enabled(device.type)
        with generation_mode(self.model, device), _prefill_autocast(device, autocast, self.compute_dtype()):
            for group in self.prefill_groups([len(p) for p in prompts]):
                self.hf.prefill_packed([prompts[i] for i in group], device, compiled=True)
        return sum(len(p) for p in prompts)

    def decode_rows(self, samples: Iterable[int]) -> list[int]:
        """The row counts this engine's decode step runs at in calls of these sample counts, largest first: each
        call's rows (`plan_rows` before its memory cap: rounded up to the ladder where calls round) and, with live-row
        buckets, the buckets below them. A call capped by the memory free at the time may meet another count
        (`capped_rows`)."""
        counts: set[int] = set()
        for count in samples:
            rows = self._asked_rows(count)
            counts.update(_row_buckets(rows) if self.row_buckets else (rows,))
        return sorted(counts, reverse=True)

    def capped_rows(
        self, samples: int, prompt_tokens: int, new_tokens: int, slots: range, *, reserve_bytes: int = 0
    ) -> list[int]:
        """The row counts, largest first, that the memory free now less reserve_bytes, or a binding max_batch_tokens,
        can cap calls of up to `samples` samples to (`plan_rows`: below the rows the samples ask for), for rows of any
        KV slot count in `slots`, after the step weights each call builds; with live-row buckets, their buckets too.
        The warm-up compiles them (`opd.train.step.decode_warm_up_rows`), so that a call sized by the memory or the
        token budget meets no new shape. A prediction: reserve_bytes is memory resident at the calls but not yet
        (optimizer state); other memory taken or freed between now and a call moves its count. Without a memory
        figure (CPU) only the token budget's counts."""
        rows = self._asked_rows(samples)
        caps = {count for n in slots if (count := self._token_capped_rows(rows, n)) < rows}  # each slot count its own
        figure = self._memory()
        if figure is not None and slots:
            dtype = self.compute_dtype()
            free = (figure[0] - reserve_bytes - self.step_weight_bytes(dtype), figure[1])
            least, most = (
                memory.rows_that_fit(free, self.row_cost(prompt_tokens, new_tokens, dtype, n)) or 0
                for n in (slots[-1], slots[0])
            )
            # fewer slots a row, more rows: every fit between
            caps.update(_settle_limit(fit) for fit in range(max(1, least), min(most, rows - 1) + 1))
        counts: set[int] = set()
        for count in caps:
            counts.update(_row_buckets(count) if self.row_buckets else (count,))
        return sorted(counts, reverse=True)

    def warm_up_decode(self, prompt: Sequence[int], params: SamplingParams, rows: Sequence[int]) -> int:
        """Compile the decode step at each row count of `rows` (from `decode_rows`) before work starts: one call of
        that many copies of `prompt`, two new tokens each, sampled as `params` says (the step's graphs depend on how
        it samples, not on the seed), so that no later call pays a compile (`opd.train.step.warm_up` runs it). Call it
        under the autocast generation runs under. Returns the calls made: none where the step does not compile."""
        if not self.compiles_decode():
            return 0
        limit = self.max_batch_size
        try:
            for count in rows:
                self.max_batch_size = count  # exactly `count` rows: a count capped by memory is off the rounding ladder
                self.generate([list(prompt)] * count, replace(params, n=1, max_new_tokens=2))
        finally:
            self.max_batch_size = limit
        return len(rows)

    def sync_weights(self) -> None:
        """Nothing to do: the step weights are rebuilt from the trainer's module at every call."""

    def release(self) -> None:
        """Nothing to do: a call's static cache, step weights and CUDA graphs are freed when it returns (a session's
        held caches when it is closed)."""

    def session(self) -> EngineSession:
        """Sequences continued across calls, each keeping its cache (`opd.rollout.base.Session`): pass it to
        `generate` with a key per prompt. A sample's slot keys and values are held when it ends and copied back into
        the slot it takes in the next call, on top of which only what is not held is prefilled; the call places and
        samples as it would without the session (the same rows, prefill groups and random draws)."""
        return EngineSession(self)

    def close(self) -> None:
        """Nothing to do: the module is the caller's."""

    def _step_fns(self, on_cuda: bool) -> tuple[Callable, Callable, Callable]:
        """(attn_in, attn_out, sample): compiled on CUDA unless compile=False, else the plain functions."""
        if not self._compiles(on_cuda):
            return _plain_step_fns()
        if self._compiled is None:
            from opd.rollout import static_engine  # the process-wide set lives in the package (`_COMPILED`)

            if static_engine._COMPILED is None:  # one set for every engine of the process: each row count compiles once
                attn_in, attn_out, sample = (torch.compile(fn, dynamic=False) for fn in _plain_step_fns())
                static_engine._COMPILED = (attn_in, attn_out, sample)
                # one compiled version per row count: the live-row buckets of every call size exceed dynamo's
                # default of 8, after which the step would silently run eagerly
                for name, value in recompile_limit_at_least(64).items():
                    setattr(torch._dynamo.config, name, value)
            self._compiled = static_engine._COMPILED
        return self._compiled

    def compiles_decode(self) -> bool:
        """Whether the decode step runs compiled on this engine's device (`compile`; CUDA only)."""
        return self._compiles(self.device.type == "cuda")

    def _compiles(self, on_cuda: bool) -> bool:
        """Whether the decode step runs compiled: on CUDA unless compile=False."""
        return on_cuda and self.compile is not False

    def _asked_rows(self, samples: int, session: int = 0) -> int:
        """The rows a call of `samples` samples asks for before any cap: max_batch_size, or fewer for fewer samples
        (rounded up to the ladder of `_round_rows` when calls round). session: the most samples a call of the
        session this call runs in has run, this one included (0: no session). Where calls round, a session's call
        rounds further, up to the smallest live-row bucket of those samples' rows (`_row_buckets`; the rows
        themselves without row_buckets): counts the warm-up compiles for the step's call (`decode_rows`).

        Why: an episode's later turn continues only the episodes that called a tool, so its samples are any count up
        to the first turn's, and `_round_rows` alone gave 1, 2, 48, 80, ... rows that each compiled in a step (issue
        54). Of the two cures this is the cheaper one: it adds empty rows (fewer than the samples from 4 samples on;
        decode at these counts is bound by reading the weights, and the first turn held the most rows), where
        warming every count of the ladder, as the partial stream does, would compile about twice the counts in
        every process (docs/design.md, the static engine's determinism contract)."""
        if not self._rounds_rows():
            return min(self.max_batch_size, max(1, samples))
        rows = _round_rows(samples, self.max_batch_size)
        if ladder := self._session_ladder(samples, session):
            return min(b for b in ladder if b >= rows)
        return rows

    def _session_ladder(self, samples: int, session: int) -> tuple[int, ...]:
        """The row counts a session's call runs at where calls round (`_asked_rows`): the live-row buckets of its
        largest call's rows (the rows alone without row_buckets); () outside a session or where calls do not round."""
        if not session or not self._rounds_rows():
            return ()
        most = _round_rows(max(session, samples), self.max_batch_size)
        return _row_buckets(most) if self.row_buckets else (most,)

    def _token_capped_rows(self, rows: int, slots: int) -> int:
        """`rows` under max_batch_tokens for rows of `slots` KV slots: where it binds, the rows it holds (rounded down
        as the memory cap is, `_settle_limit`, when calls round); else `rows`."""
        if self.max_batch_tokens is None or (limit := max(1, self.max_batch_tokens // slots)) >= rows:
            return rows
        return _settle_limit(limit) if self._rounds_rows() else limit

    def _rounds_rows(self) -> bool:
        """Whether calls round their rows (`round_rows`; None: when the step compiles)."""
        if self.round_rows is not None:
            return self.round_rows
        return self._compiles(self.device.type == "cuda")

    # ------------------------------------------------------------------ memory

    def compute_dtype(self) -> torch.dtype:
        """The dtype the step's GEMMs and the cache use: autocast's when the caller enabled it, else the parameters'."""
        device = self.device
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        model: HFModule = self.model
        return model.get_decoder().layers[0].self_attn.o_proj.weight.dtype

    def row_cost(
        self, prompt_tokens: int, new_tokens: int, dtype: torch.dtype | None = None, slots: int | None = None
    ) -> memory.RowCost:
        """What one row of a call with this longest prompt and max_new_tokens holds: its KV slots (`slots`, default
        prompt_tokens + new_tokens), the [V]-sized sampling buffers (the head's logits, the uniform noise, the
        sampling's float32 temporaries at V = the whole vocabulary: 3.9 MB a row at Qwen3's 151,936), the decode
        step's activations and its output columns; plus what the call holds once (one prefill forward of
        `prefill_tokens`, first-token sampling, the RoPE table)."""
        model: HFModule = self.model
        config = model.config
        dtype = dtype or self.compute_dtype()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, _head_dim(model)
        hidden, inner = config.hidden_size, config.intermediate_size
        vocab_rows = model.get_output_embeddings().weight.shape[0]
        vocab = min(self.vocab_size or vocab_rows, vocab_rows)
        kv = memory.kv_bytes_per_token(config, dtype)
        slots = prompt_tokens + new_tokens if slots is None else slots
        sampling = vocab_rows * dtype.itemsize + 4 * vocab * (1 + _SAMPLING_FLOATS)
        prefill = max(self.prefill_tokens, prompt_tokens) * memory.prefill_bytes_per_token(config, torch.float32)
        return memory.RowCost(
            per_row={
                "KV cache": kv * slots,
                "sampling buffers": sampling,
                "decode activations": 4 * (8 * hidden + 4 * inner + 2 * (heads + 2 * kv_heads) * head_dim),
                "outputs": 12 * (new_tokens + 1),
            },
            fixed={"prefill": prefill + _FIRST_TOKEN_ROWS * sampling, "RoPE table": 8 * slots * head_dim},
            per_slot=kv + 12 + 8 * head_dim,
        )

    def step_weight_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the weight copies a call builds (`fuse_weights`): q/k/v and gate/up concatenations, o_proj
        reordered when query heads are grouped, and every other GEMM weight not already in the compute dtype."""
        if not self.fuse_weights:
            return 0
        dtype = dtype or self.compute_dtype()
        model: HFModule = self.model
        body, head = model.get_decoder(), model.get_output_embeddings()
        grouped = model.config.num_attention_heads != model.config.num_key_value_heads
        total = 0
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            total += sum(m.weight.numel() for m in _qkv(attn))
            total += attn.o_proj.weight.numel() if grouped or attn.o_proj.weight.dtype != dtype else 0
            if hasattr(mlp, "experts"):  # the stacked experts are copied only into another dtype
                experts = (mlp.experts.gate_up_proj, mlp.experts.down_proj)
                total += sum(w.numel() for w in experts if w.dtype != dtype)
                continue
            total += sum(m.weight.numel() for m in _gate_up(mlp))
            total += mlp.down_proj.weight.numel() if mlp.down_proj.weight.dtype != dtype else 0
        total += head.weight.numel() if head.weight.dtype != dtype else 0  # the embedding table is not copied
        return total * dtype.itemsize

    def check_fits(
        self,
        prompt_tokens: int,
        new_tokens: int,
        *,
        reserve_bytes: int = 0,
        names: tuple[str, str] = ("prompt length", "max_new_tokens"),
    ) -> None:
        """Raise ValueError (one line, saying what would fit) when not even one row of prompt_tokens + new_tokens
        fits in the device memory free now, less reserve_bytes (memory taken before the first call, e.g. optimizer
        state) and the step weights the call will build. Call it under the autocast generate will run under."""
        dtype, free = self.compute_dtype(), self._memory()
        if free is None:
            return
        memory.check_one_row_fits(
            free,
            self.row_cost(prompt_tokens, new_tokens, dtype),
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            slots=prompt_tokens + new_tokens,
            reserve_bytes=reserve_bytes + self.step_weight_bytes(dtype),
            where=f" on {self.device}",
            names=names,
        )

    def plan_rows(
        self,
        samples: int,
        prompt_tokens: int,
        new_tokens: int,
        dtype: torch.dtype | None = None,
        slots: int | None = None,
        reserve_bytes: int = 0,
        session: int = 0,
    ) -> int:
        """Rows of a call with `samples` samples: max_batch_size, capped by the samples (rounded up to the ladder of
        `_round_rows` when `round_rows` is on; a session's call, up to the live-row buckets of its largest, `session`
        samples: `_asked_rows`), by max_batch_tokens and by `opd.rollout.memory.rows_that_fit` on the
        memory free now less reserve_bytes (a session's: the caches its samples will hold when the call ends).
        Memory-limited counts of 16 or more are rounded down to a multiple of 8 (`_settle_limit`; with `round_rows`
        on, a binding max_batch_tokens cap too), so that calls whose free memory differs a little run (and compile)
        the same shape; a session's capped call rounds further down, to a count of its ladder of at most the cap
        (`_session_ladder`: the warm-up compiled them; its held caches take memory the warm-up's prediction of the
        capped counts, `capped_rows`, does not know of, and a continued context is longer than a prompt and its
        response). slots: KV slots per row (default prompt_tokens + new_tokens)."""
        slots = prompt_tokens + new_tokens if slots is None else slots
        asked = self._asked_rows(samples, session)
        rows = self._token_capped_rows(asked, slots)
        free = self._memory()
        if free is not None and reserve_bytes:
            free = (free[0] - reserve_bytes, free[1])
        cost = self.row_cost(prompt_tokens, new_tokens, dtype, slots)
        fit = memory.rows_that_fit(free, cost)
        if fit is not None and fit < rows:
            if fit < 1:
                memory.check_one_row_fits(
                    free,
                    cost,
                    prompt_tokens=prompt_tokens,
                    new_tokens=new_tokens,
                    slots=slots,
                    where=f" on {self.device}",
                )
            rows = _settle_limit(fit)
        if rows < asked:
            rows = max((b for b in self._session_ladder(samples, session) if b <= rows), default=rows)
        return rows

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
        stop_when: asked after each sync interval in which samples ended (`opd.rollout.base.StopRule`). session, keys:
        a session of this engine (`session()`) and one key per prompt (n = 1): prompt i continues keys[i]'s
        sequence, its held positions reused (`opd.rollout.base.Session`)."""
        return generate_call(self, prompt_ids, params, max_new_tokens_per_sample, stop_when, session, keys)

    def _generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        caps: list[int],
        stop_when: StopRule | None,
        held: tuple[HeldKV, list[Hashable]] | None = None,
    ) -> GenerationOutput:
        """`generate` after its checks; held: a session's caches and the key of each prompt (n = 1), see `_Run`."""
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        reasons: list[str] = []
        self.stats = {}  # a call without prompts decodes nothing
        if prompt_ids:
            generator = seeded_generator(params.seed, self.device)
            with generation_mode(self.model, self.device):
                run = _Run(self, [list(p) for p in prompt_ids], params, caps, generator, stop_when, held)
                responses, logprobs, reasons = run.run()
            self.stats = run.stats
        return GenerationOutput(
            response_ids=responses,
            finish_reasons=reasons,
            group_ids=[p for p in range(len(prompt_ids)) for _ in range(params.n)],
            logprobs=logprobs if params.return_logprobs else None,
        )

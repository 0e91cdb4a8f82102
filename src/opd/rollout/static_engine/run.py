"""`_Run`, one `StaticGenerator.generate` call: its step weights, its slots (the static KV cache and the device-side
row state), the samples still pending, the decode step, its CUDA graphs and the loop that refills finished rows.

Shapes (docs/design.md, "Shape letters"): R rows of the engine call, B the samples being placed, P prompt positions,
D model width, H query heads, A key/value heads, G query heads per key/value head, F head dimension, S cache slots,
T output columns (response positions), V vocabulary.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from opd.kernels import decode_attention as triton_attention
from opd.rollout import memory
from opd.rollout.base import SamplingParams, StopRule
from opd.rollout.hf_model import HFModel, cached_kv
from opd.rollout.sessions import HeldKV, LayerKV, prefill_continued
from opd.rollout.static_engine.families import (
    HFModule,
    _cast,
    _embedding_scale,
    _eps,
    _gate_up,
    _gelu_gate,
    _head_dim,
    _Layer,
    _layer_windows,
    _Layout,
    _norm_weight,
    _projection_weights,
    _qkv,
    _rope_by_layer_type,
)
from opd.rollout.static_engine.layers import _ATTENTION, _rms, _rms_weight_first, _scaled
from opd.rollout.static_engine.rows import _row_buckets
from opd.rollout.static_engine.sample import _sample


class RunEngine(Protocol):
    """What a call reads of the engine that runs it (`StaticGenerator` is one): its settings, its model and Hugging
    Face wrapper, how it plans rows and prefills, and its step functions (compiled once per engine)."""

    model: Any
    hf: HFModel
    vocab_size: int | None
    eos_token_ids: list[int]
    pad_token_id: int
    sync_interval: int
    kv_bucket: int
    cuda_graphs: bool | None
    compile: bool | None
    fuse_weights: bool
    attention: Literal["auto", "triton", "sdpa", "matmul"]
    row_buckets: bool
    attention_splits: int | None
    packed_prefill: bool
    compiled_prefill: bool
    _compiled: tuple[Callable, Callable, Callable] | None

    @property
    def device(self) -> torch.device: ...

    def compute_dtype(self) -> torch.dtype: ...

    def plan_rows(
        self,
        samples: int,
        prompt_tokens: int,
        new_tokens: int,
        dtype: torch.dtype | None = None,
        slots: int | None = None,
        reserve_bytes: int = 0,
        session: int = 0,
    ) -> int: ...

    def prefill_groups(self, lengths: Sequence[int]) -> list[list[int]]: ...

    def _step_fns(self, on_cuda: bool) -> tuple[Callable, Callable, Callable]: ...


_FIRST_TOKEN_ROWS = 64  # first tokens of refilled rows are sampled in groups of at most this many rows


def _plain_step_fns() -> tuple[Callable, Callable, Callable]:
    """(attn_in, attn_out, sample) uncompiled, as the package exports them (a test may have replaced one there)."""
    from opd.rollout import static_engine

    return static_engine._attn_in, static_engine._attn_out, static_engine._sample


def _prefill_autocast(device: torch.device, enabled: bool, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The caller's autocast for the Hugging Face prefill, with its weight cache off: cached casts would keep a
    second copy of every float32 weight for the rest of the call."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=False)


@dataclass(frozen=True)
class _LayerStep:
    """What every layer of one decode step shares: the step functions, the rows' RoPE rows of each table (cos, sin
    [R, 1, F]), each window's first slots or mask (`_Run._windows`), the slots attended over, the rows."""

    attn_in: Callable
    attn_out: Callable
    rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]]
    starts: dict[int | None, torch.Tensor]
    biases: dict[int | None, torch.Tensor]
    span: int
    rows: int


class _Run:
    """The state of one call: step weights, slots (static cache and device-side row state), the samples still
    pending, the decode step and its graphs."""

    def __init__(
        self,
        engine: RunEngine,
        prompts: list[list[int]],
        params: SamplingParams,
        caps: list[int],
        generator: torch.Generator,
        stop_when: StopRule | None = None,
        held: tuple[HeldKV, list[Hashable]] | None = None,
    ):
        """1. the attention path (`_pick_attention`), 2. the step weights, read now so that a call sees the latest
        optimizer step (before sizing: they take memory; `_read_step_weights`), 3. the samples, the rows and the
        static cache (`_size_slots`), 4. the RoPE tables over every slot (`_rope_tables`), 5. the device-side row
        state (`_row_state`), 6. the host-side bookkeeping (`_bookkeeping`).

        held: a session's caches and each prompt's key (n = 1): each distinct prompt's held positions are taken out
        of the session now (`HeldKV.take`; `prefixes`), copied into its slot when it is placed, where only the rest
        is prefilled (`_place`), and each sample's slot is held again when it ends (`_harvest`)."""
        self.engine, self.params, self.generator, self.stop_when = engine, params, generator, stop_when
        self.held = held
        model: HFModule = engine.model
        self.device = engine.device
        self._pick_attention(model)
        self.autocast = torch.is_autocast_enabled(self.device.type)
        self.dtype = engine.compute_dtype()
        self.fused = engine.fuse_weights
        # GEMM weights in the compute dtype; the embedding table and the norms keep the parameters' dtype, and so does
        # the residual stream: float32 under autocast (as autocast computes the teacher-forced forward), the model's
        # dtype otherwise.
        self._read_step_weights(model, self.dtype if self.fused else None)  # None: the module's own tensors
        self._size_slots(model, prompts, caps)
        self._rope_tables(model.get_decoder())
        self._row_state(model.get_output_embeddings())
        self._bookkeeping()

    def _pick_attention(self, model: HFModule) -> None:
        """The heads, the family's layout, and the attention path: `engine.attention`, "auto" resolved to the Triton
        kernel on CUDA where it supports the head size, else SDPA (matmul for soft-capped models)."""
        config = model.config
        device = self.device
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        kernel_ok = triton_attention.available(device) and triton_attention.supports(_head_dim(model))
        # SDPA has no soft-cap: soft-capped models (Gemma 2) take the matmul path off the Triton kernel
        self.layout = _Layout.of(config)
        fallback = "matmul" if self.layout.attn_softcap is not None else "sdpa"
        auto = "triton" if kernel_ok and device.type == "cuda" else fallback
        self.attention = auto if self.engine.attention == "auto" else self.engine.attention
        self.attend = _ATTENTION.get(self.attention)  # None: the Triton kernel

    def _size_slots(self, model: HFModule, prompts: list[list[int]], caps: list[int]) -> None:
        """The samples and the slots: each slot holds one sample's prompt at [0, L) and its tokens after it. Sizes
        the rows (`StaticGenerator.plan_rows`) and allocates each layer's static cache, [R, A, S, F]."""
        self.prompts, self.caps = prompts, caps
        # a prompt given twice is prefilled once (a stream's samples that have no tokens yet come one prefix each)
        first: dict[tuple[int, ...], int] = {}
        canonical = [first.setdefault(tuple(prompt), p) for p, prompt in enumerate(prompts)]
        self.sample_prompt = [c for c in canonical for _ in range(self.params.n)]
        # a session's held positions of each distinct prompt (a duplicate's own cache is dropped: the first's serves),
        # kept until its last sample is placed (a prompt's samples may be placed in several refills)
        self.prefixes: dict[int, tuple[int, LayerKV | None]] = {}
        self.unplaced = {p: self.sample_prompt.count(p) for p in set(self.sample_prompt)}
        reserve = 0
        if self.held is not None:
            store, keys = self.held
            for p, prompt in enumerate(prompts):
                taken = store.take(keys[p], prompt)
                if canonical[p] == p:
                    self.prefixes[p] = taken
            # what the samples' caches will hold when the call ends (context and response each), not yet held
            kv = memory.kv_bytes_per_token(model.config, self.dtype)
            reserve = kv * sum(len(prompts[p]) + cap for p, cap in zip(self.sample_prompt, caps))
        self.width, self.steps = max(len(p) for p in prompts), max(caps)
        # slots: the longest sample, its prompt and its own limit (a stream's longest continued prefix has a short
        # limit left); the last sampled token is never fed back, so one spare
        self.capacity = max(len(prompts[p]) + cap for p, cap in zip(self.sample_prompt, caps))
        # a session's later call (an episode's later turn: the episodes that called a tool) rounds up to the live-row
        # buckets of its largest call, which the warm-up compiled (`StaticGenerator.plan_rows`)
        session = 0
        if self.held is not None:
            session = self.held[0].most_samples = max(self.held[0].most_samples, len(caps))
        self.rows = rows = self.engine.plan_rows(
            len(caps), self.width, self.steps, self.dtype, slots=self.capacity, reserve_bytes=reserve, session=session
        )
        head_dim = _head_dim(model)
        for layer in self.layers:
            # zeros, not empty: the SDPA path reads whole buckets (masked slots must hold finite values)
            layer.keys = torch.zeros(rows, self.kv_heads, self.capacity, head_dim, dtype=self.dtype, device=self.device)
            layer.values = torch.zeros_like(layer.keys)

    def _rope_tables(self, body: HFModule) -> None:
        """RoPE tables over every slot position, computed by the model's own rotary module (float32, cast per step):
        one, or one per layer type where the module takes it (Gemma 3: its sliding and full layers' bases)."""
        positions_1S = torch.arange(self.capacity, device=self.device)[None]
        probe = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.rope_SF: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        for table in dict.fromkeys(layer.rope_table for layer in self.layers):
            cos_1SF, sin_1SF = body.rotary_emb(probe, positions_1S, *([] if table is None else [table]))
            self.rope_SF[table] = (cos_1SF[0].float(), sin_1SF[0].float())

    def _row_state(self, head: HFModule) -> None:
        """Device-side row state: static buffers the graphs read and write, refilled in place between replays."""
        rows, device, long = self.rows, self.device, torch.long
        self.rows_R = torch.arange(rows, device=device)
        self.zeros_R = torch.zeros(rows, dtype=long, device=device)  # every row's first slot (prompts start at 0)
        self.slots_S = torch.arange(self.capacity, device=device)
        self.position_R = torch.zeros(rows, dtype=long, device=device)  # slot = RoPE position of the next fed token
        self.tokens_R = torch.zeros(rows, dtype=long, device=device)  # the next fed token
        # tokens sampled so far = the output column the next one takes
        self.lengths_R = torch.zeros(rows, dtype=long, device=device)
        self.limit_R = torch.ones(rows, dtype=long, device=device)  # the row's length limit
        self.alive_R = torch.zeros(rows, dtype=torch.bool, device=device)  # holds a sample still decoding
        self.stopped_R = torch.zeros(rows, dtype=torch.bool, device=device)  # its sample ended on an EOS
        # one spare column: rows that are not alive write their (discarded) token there
        self.out_ids_RT = torch.full((rows, self.steps + 1), self.engine.pad_token_id, dtype=long, device=device)
        self.out_lps_RT = torch.zeros((rows, self.steps + 1), dtype=torch.float32, device=device)
        self.eos_ids = torch.as_tensor(self.engine.eos_token_ids or [-1], dtype=long, device=device)  # one a stop id
        vocab_rows = head.weight.shape[0]
        self.vocab = min(self.engine.vocab_size or vocab_rows, vocab_rows)  # sampled ids are < vocab
        self.noise_RV = None if self.params.temperature == 0 else torch.zeros(rows, self.vocab, device=device)

    def _bookkeeping(self) -> None:
        """Host-side bookkeeping (no sync needed to read it)."""
        rows = self.rows
        self.slot_sample: list[int | None] = [None] * rows  # sample index held by each slot
        self.slot_position = [0] * rows  # bound on the slot's next fed position
        self.slot_last = [0] * rows  # the last position its sample can feed
        self.pending = 0  # next sample index to place
        self.results: list[tuple[list[int], list[float], str] | None] = [None] * len(self.caps)
        self.counters = {
            "decode_steps": 0,
            "refills": 0,
            "prefills": 0,
            "prefilled_tokens": 0,
            "reused_tokens": 0,
            "graphs": 0,
            "decoded_tokens": 0,
            "cut": 0,
        }
        self.live = rows  # decode steps run over rows [0, live): the live-row bucket (`_shrink`)
        self.buckets = _row_buckets(rows) if self.engine.row_buckets else (rows,)
        self.bucket_steps: dict[int, int] = {}  # decode steps run at each bucket

    def _read_step_weights(self, model: HFModule, shadow: torch.dtype | None) -> None:
        """The step's weights (`_Layer` per decoder layer, norms, embedding, head, RoPE-table keys) from the module."""
        body, head = model.get_decoder(), model.get_output_embeddings()
        layout = self.layout
        # layer i's next norm: i + 1 (post-norm layers: the norm of the MLP's output, the final norm on its own)
        if layout.post_norm:
            input_norms = [None] + [layer.post_feedforward_layernorm for layer in body.layers]
        else:
            input_norms = [layer.input_layernorm for layer in body.layers] + [body.norm]
        norm = _norm_weight if layout.sandwich else (lambda module: module.weight)
        self.first_norm = None if layout.post_norm else (norm(input_norms[0]), _eps(input_norms[0]))
        self.final_norm = (body.norm.weight, _eps(body.norm)) if layout.post_norm else None
        self.embed_VD = body.embed_tokens.weight
        self.embedding_scale = _embedding_scale(body.embed_tokens, layout)
        self.head_w, self.head_b = _cast(head.weight, shadow), _cast(head.bias, shadow)
        rope_layers = layout.rope_layers or (True,) * len(body.layers)
        windows = _layer_windows(model)
        gelu = _gelu_gate(body.layers[0].mlp)
        self.layers: list[_Layer] = []
        for i, layer in enumerate(body.layers):
            attn, mlp, post, following = layer.self_attn, layer.mlp, layer.post_attention_layernorm, input_norms[i + 1]
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            # q/k-norm's eps: the input norm's (Qwen3: the same rms_norm_eps), OLMo 2's and Gemma's own norms
            norm_eps = _eps(qn or post) if layout.post_norm or layout.sandwich else _eps(input_norms[i])
            w_qkv, b_qkv = _projection_weights(_qkv(attn), shadow)
            moe = None
            if hasattr(mlp, "experts"):  # Qwen3-MoE's sparse block (`_mlp`)
                moe = (mlp.gate.weight, mlp.gate.top_k, mlp.gate.norm_topk_prob)
                w_gu, b_gu = _cast(mlp.experts.gate_up_proj, shadow), None
                w_down, b_down = _cast(mlp.experts.down_proj, shadow), None
            else:
                w_gu, b_gu = _projection_weights(_gate_up(mlp), shadow)
                w_down, b_down = _cast(mlp.down_proj.weight, shadow), _cast(mlp.down_proj.bias, shadow)
            ins = (
                w_qkv,
                b_qkv,
                None if qn is None else norm(qn),
                None if kn is None else norm(kn),
                norm_eps,
            )
            w_o = _cast(attn.o_proj.weight, shadow)
            if shadow is not None:  # input columns in (G, A) head order, see `_layer_step` (a copy when G > 1)
                w_o = w_o.unflatten(1, (self.kv_heads, self.heads // self.kv_heads, -1)).transpose(1, 2).flatten(1)
            sandwich = None
            if layout.sandwich:
                sandwich = (
                    _norm_weight(layer.pre_feedforward_layernorm),
                    _norm_weight(layer.post_feedforward_layernorm),
                )
            outs = (
                w_o,
                _cast(attn.o_proj.bias, shadow),
                norm(post),
                _eps(post),
                w_gu,
                b_gu,
                w_down,
                b_down,
                norm(following),
                _eps(following),
                layout.residual_scale,
                layout.post_norm,
                moe,
                sandwich,
                gelu,
            )
            table = getattr(attn, "layer_type", None) if _rope_by_layer_type(body.rotary_emb) else None
            self.layers.append(_Layer(ins, outs, rope=rope_layers[i], window=windows[i], rope_table=table))
            self.scaling = attn.scaling

    @property
    def stats(self) -> dict[str, Any]:
        steps = self.counters["decode_steps"]
        occupancy = self.counters["decoded_tokens"] / (steps * self.rows) if steps else None
        row_steps = sum(b * n for b, n in self.bucket_steps.items())
        return {
            "rows": self.rows,
            "slots_per_row": self.capacity,
            "attention": self.attention,
            **self.counters,
            "occupancy": occupancy,
            "bucket_steps": dict(sorted(self.bucket_steps.items(), reverse=True)),
            "row_steps": row_steps,  # Σ bucket × its decode steps: the rows the decode steps ran over
            "bucket_occupancy": self.counters["decoded_tokens"] / row_steps if row_steps else None,
            "kv_cache_bytes": sum(keys.nbytes + values.nbytes for keys, values in (la.cache() for la in self.layers)),
        }

    # ------------------------------------------------------------------ filling slots

    def _admit(self, free: list[int]) -> None:
        """Place pending samples into the free slots (ascending), prefill their prompts (once per prompt and
        refill), sample their first tokens; samples that end at once are harvested and their slots reused."""
        free = sorted(free)
        while free and self.pending < len(self.caps):
            take = min(len(free), len(self.caps) - self.pending)
            samples = list(range(self.pending, self.pending + take))
            slots, free = free[:take], free[take:]
            if self.counters["prefills"]:
                self.counters["refills"] += take
            self.pending += take
            # distinct prompts by length (stable), cut into forwards of ≤ prefill_tokens tokens (padded ones when
            # padded: neighbours in length pad little; a stream's continued samples range from the bare prompt to
            # max_new_tokens longer)
            distinct = list(dict.fromkeys(self.sample_prompt[s] for s in samples))
            lengths = [len(self.prompts[p]) for p in distinct]
            groups = [[distinct[i] for i in group] for group in self.engine.prefill_groups(lengths)]
            placed = dict(zip(samples, slots))
            for group in groups:
                in_group = set(group)
                members = [s for s in samples if self.sample_prompt[s] in in_group]
                self._place(group, members, [placed[s] for s in members])
            ended = [slot for slot, alive in zip(slots, self.alive_R[torch.as_tensor(slots)].tolist()) if not alive]
            if ended:  # host sync above; samples that ended on their first token free their slot again
                self._harvest(ended)
                free = sorted(free + ended)

    def _place(self, group: list[int], samples: list[int], slots: list[int]) -> None:
        """One prefill of the prompts in `group`; copy each sample's prompt keys/values to slots [0, L) of its slot
        and sample its first token from the prefill logits (`prompt_logits`: [prompts of the group, V]). The B
        samples placed here go to the rows `slots`."""
        device, engine, params = self.device, self.engine, self.params
        prompts = [self.prompts[p] for p in group]
        held = [self.prefixes.get(p, (0, None)) for p in group]
        for s in samples:  # a prompt's held positions go once its last sample has them in its slot
            self.unplaced[self.sample_prompt[s]] -= 1
            if not self.unplaced[self.sample_prompt[s]]:
                self.prefixes.pop(self.sample_prompt[s], None)
        packed = engine.packed_prefill and not any(m for m, _ in held)
        with _prefill_autocast(self.device, self.autocast, self.dtype):
            if packed:
                cache, starts, prompt_logits = engine.hf.prefill_packed(
                    prompts, device, compiled=engine.compiled_prefill
                )
            elif any(m for m, _ in held):  # a session's held positions reused, the rest prefilled (left-padded)
                items = [(m, kv, prompt[m:]) for (m, kv), prompt in zip(held, prompts)]
                cache, _, prompt_logits = prefill_continued(engine.hf, items, device)
            else:
                cache, _, prompt_logits = engine.hf.prefill(prompts, device, full_cache=True)
        reused = sum(m for m, _ in held)
        del held
        self.counters["prefills"] += 1
        self.counters["prefilled_tokens"] += sum(len(p) for p in prompts) - reused
        self.counters["reused_tokens"] += reused
        width = max(len(p) for p in prompts)
        index = {p: i for i, p in enumerate(group)}
        source_B = torch.as_tensor([index[self.sample_prompt[s]] for s in samples], device=device)
        lengths = [len(self.prompts[self.sample_prompt[s]]) for s in samples]
        lengths_B = torch.as_tensor(lengths, device=device)
        slots_B = torch.as_tensor(slots, device=device)
        # Slot j of a sample takes its prompt's position j: in a packed prefill at its prompt's start + j, in a
        # left-padded one at j + (width - L) of its prompt's row. Slots ≥ L take a clamped copy, overwritten by decode
        # tokens before any step reads them.
        slot_P = torch.arange(width, device=device)
        if packed:
            starts_B = torch.as_tensor(starts, device=device)[source_B]
            from_BP = starts_B[:, None] + torch.minimum(slot_P[None], lengths_B[:, None] - 1)
            row_B = torch.zeros_like(source_B)  # the cache's one packed row
        else:
            from_BP = (slot_P[None] + (width - lengths_B)[:, None]).clamp(max=width - 1)
            row_B = source_B
        for i, layer in enumerate(self.layers):
            keys_RASF, values_RASF = layer.cache()
            # the prefill's cache: [prefill rows (its prompts, or one packed row), A, positions, F]
            prefill_keys, prefill_values = cached_kv(cache, i)
            keys_RASF[slots_B, :, :width] = prefill_keys[row_B[:, None], :, from_BP].transpose(1, 2).to(self.dtype)
            values_RASF[slots_B, :, :width] = prefill_values[row_B[:, None], :, from_BP].transpose(1, 2).to(self.dtype)
        del cache
        caps_B = torch.as_tensor([self.caps[s] for s in samples], device=device)
        for lo in range(0, len(samples), _FIRST_TOKEN_ROWS):
            part = slice(lo, lo + _FIRST_TOKEN_ROWS)
            logits_BV = prompt_logits[source_B[part]]
            noise_BV = None
            if params.temperature != 0:
                noise_BV = torch.empty(logits_BV.shape[0], self.vocab, device=device).uniform_(generator=self.generator)
            tokens_B, logprobs_B = _sample(
                logits_BV, noise_BV, params.temperature, self.vocab, params.top_k, params.top_p
            )
            rows_B = slots_B[part]
            stopped_B = (
                (tokens_B[:, None] == self.eos_ids[None]).any(-1)
                if params.stop_at_eos
                else torch.zeros_like(tokens_B, dtype=torch.bool)
            )
            self.tokens_R[rows_B] = tokens_B
            self.position_R[rows_B] = lengths_B[part]
            self.lengths_R[rows_B] = 1
            self.limit_R[rows_B] = caps_B[part]
            self.out_ids_RT[rows_B, 0] = tokens_B
            self.out_lps_RT[rows_B, 0] = logprobs_B
            self.stopped_R[rows_B] = stopped_B
            self.alive_R[rows_B] = ~stopped_B & (caps_B[part] > 1)
        for sample, slot, length in zip(samples, slots, lengths):
            self.slot_sample[slot] = sample
            self.slot_position[slot] = length
            self.slot_last[slot] = length + max(self.caps[sample] - 2, 0)

    def _cut(self) -> None:
        """End the call now (`stop_when`): the samples decoding return their tokens so far, those waiting none, all
        with reason "length"; no slot is occupied afterwards, so the decode loop ends."""
        occupied = [r for r in range(self.rows) if self.slot_sample[r] is not None]
        self.counters["cut"] = len(occupied) + len(self.caps) - self.pending
        if occupied:  # all alive: the rows that ended were harvested
            self._harvest(occupied)
        for sample in range(self.pending, len(self.caps)):
            self.results[sample] = ([], [], "length")
        self.pending = len(self.caps)

    def _caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's static keys and values [R, A, S, F]."""
        return [layer.cache() for layer in self.layers]

    def _harvest(self, slots: list[int]) -> None:
        """Copy the finished samples of these slots to the results (one device-to-host copy) and free the slots; in a
        session, hold each one's keys and values under its key."""
        index = torch.as_tensor(slots, device=self.device)
        lengths, stopped = self.lengths_R[index].tolist(), self.stopped_R[index].tolist()
        longest = max(lengths)
        ids_rows = self.out_ids_RT[index, :longest].tolist()
        lps_rows = self.out_lps_RT[index, :longest].tolist() if self.params.return_logprobs else [[] for _ in slots]
        for slot, n, done, ids, lps in zip(slots, lengths, stopped, ids_rows, lps_rows):
            sample = self.slot_sample[slot]
            assert sample is not None, "only occupied slots are harvested"
            self.results[sample] = (ids[:n], lps[:n], "stop" if done else "length")
            if self.held is not None:  # its prompt and response but the last token (sampled, never fed): [0, fed)
                prompt = self.prompts[self.sample_prompt[sample]]
                fed = len(prompt) + max(n - 1, 0)
                kv = [(keys[slot, :, :fed].clone(), values[slot, :, :fed].clone()) for keys, values in self._caches()]
                self.held[0].put(self.held[1][sample], prompt + ids[: max(n - 1, 0)], kv)
            self.slot_sample[slot] = None
            self.slot_position[slot] = self.slot_last[slot] = 0
        # An empty slot keeps computing (static shapes) until it is refilled: at position 0 its attention reads one
        # slot instead of its last sample's whole sequence (the tail of a long-tailed call runs mostly empty slots).
        self.position_R[index] = 0

    # ------------------------------------------------------------------ one step

    def _record(self, tokens_R: torch.Tensor, logprobs_R: torch.Tensor, rows: int) -> None:
        """Write each alive row's sampled token and log-prob at its own column, then advance lengths, finished rows
        and positions of the first `rows` rows; no host sync. Rows not alive write into the spare column and do not
        move. A row that ends here moves once more, past the last token it fed: the steps it runs until its slot is
        refilled write their (discarded) keys and values there, not over its sequence's (which a session holds)."""
        alive_R, lengths_R, stopped_R = self.alive_R[:rows], self.lengths_R[:rows], self.stopped_R[:rows]
        fed_R = alive_R.long()  # rows whose fed token was their sample's
        column_R = torch.where(alive_R, lengths_R, self.steps)[:, None]
        self.out_ids_RT[:rows].scatter_(1, column_R, tokens_R[:, None])
        self.out_lps_RT[:rows].scatter_(1, column_R, logprobs_R[:, None])
        lengths_R.add_(fed_R)
        if self.params.stop_at_eos:
            stopped_R.logical_or_(alive_R & (tokens_R[:, None] == self.eos_ids[None]).any(-1))
        alive_R.logical_and_(~stopped_R & (lengths_R < self.limit_R[:rows]))
        self.position_R[:rows].add_(fed_R)
        self.tokens_R[:rows].copy_(tokens_R)

    def _decode_step(self, span: int, fns: tuple[Callable, Callable, Callable], rows: int) -> None:
        """Feed tokens_R at each of the first `rows` rows' position_R, attending over the first `span` slots;
        sample; record. (Views of the first rows: the live-row bucket, see `_shrink`.)

        1. embed the fed tokens and norm them for the first layer, 2. each row's RoPE rows of every table, 3. each
        window's first slots or mask (`_windows`), 4. per layer: q/k/v, attention over the cache, o-projection and
        MLP (`_layer_step`), 5. the head's logits (`_logits`), 6. sample and record (`_record`)."""
        attn_in, attn_out, sample = fns
        params = self.params
        position_R = self.position_R[:rows]
        x_RD = _scaled(F.embedding(self.tokens_R[:rows], self.embed_VD), self.embedding_scale)
        if self.first_norm is not None:
            h_RD = (_rms_weight_first if self.layout.sandwich else _rms)(x_RD, *self.first_norm)
        else:
            h_RD = x_RD
        rope = {
            table: (cos_SF[position_R][:, None].to(x_RD.dtype), sin_SF[position_R][:, None].to(x_RD.dtype))
            for table, (cos_SF, sin_SF) in self.rope_SF.items()
        }
        starts, biases = self._windows(span, rows)
        step = _LayerStep(attn_in, attn_out, rope, starts, biases, span, rows)
        for layer in self.layers:
            x_RD, h_RD = self._layer_step(layer, step, x_RD, h_RD)
        logits_RV = self._logits(x_RD, h_RD)
        noise_RV = None if self.noise_RV is None else self.noise_RV[:rows]
        tokens_R, logprobs_R = sample(logits_RV, noise_RV, params.temperature, self.vocab, params.top_k, params.top_p)
        self._record(tokens_R, logprobs_R, rows)

    def _windows(self, span: int, rows: int) -> tuple[dict[int | None, torch.Tensor], dict[int | None, torch.Tensor]]:
        """Per window (None: full attention; a sliding window W reads slots (position - W, position]): the Triton
        kernel's first slot [R] (it reads slots [start_R, position_R] itself: no mask), or one 0 / -inf mask
        [R, A, G, S] for every layer of that window. SDPA's memory-efficient kernel wants the mask in q's dtype with
        every dimension (expand is a view). → (starts, biases), one of them empty."""
        position_R, heads, kv_heads = self.position_R[:rows], self.heads, self.kv_heads
        starts: dict[int | None, torch.Tensor] = {}
        biases: dict[int | None, torch.Tensor] = {}
        for window in dict.fromkeys(layer.window for layer in self.layers):
            first_R = self.zeros_R[:rows] if window is None else (position_R - (window - 1)).clamp(min=0)
            if self.attend is None:
                starts[window] = first_R
                continue
            slots_1S = self.slots_S[None, :span]
            valid_RS = (slots_1S <= position_R[:, None]) & (slots_1S >= first_R[:, None])
            biases[window] = (
                torch.zeros(valid_RS.shape, dtype=self.dtype, device=self.device)
                .masked_fill_(~valid_RS, float("-inf"))[:, None, None]
                .expand(rows, kv_heads, heads // kv_heads, span)
            )
        return starts, biases

    def _layer_step(
        self, layer: _Layer, step: _LayerStep, x_RD: torch.Tensor, h_RD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer of the step: q/k/v, the new token's keys/values into the cache, attention over it,
        o-projection, MLP and the next layer's input norm: (x [R, D], normed x [R, D]) → the same for the next."""
        rows, heads, kv_heads = step.rows, self.heads, self.kv_heads
        position_R = self.position_R[:rows]
        keys, values = layer.cache()
        keys_RASF, values_RASF = keys[:rows], values[:rows]
        cos_R1F, sin_R1F = step.rope[layer.rope_table]
        q_RHF, k_RAF, v_RAF = step.attn_in(
            h_RD,
            *layer.attn_in,
            cos_R1F,
            sin_R1F,
            heads,
            kv_heads,
            keys.shape[-1],
            layer.rope,
            self.layout.post_norm,
            self.layout.sandwich,
        )
        # Grouped-query attention without repeating the cache: query head h uses kv head h // (heads / kv_heads).
        # Under autocast q/k-norm and RoPE return float32 (float32 norm weights): attention runs in the compute
        # dtype, as autocast runs SDPA, the new token's k/v rounded like the cached ones.
        q_RAGF = q_RHF.to(self.dtype).reshape(rows, kv_heads, heads // kv_heads, -1)
        k_RAF, v_RAF = k_RAF.to(self.dtype), v_RAF.to(self.dtype)
        if self.attend is None:  # the Triton kernel also writes k and v into the cache at position_R
            attn_RAGF = triton_attention.decode_attention(
                q_RAGF,
                keys_RASF,
                values_RASF,
                step.starts[layer.window],
                position_R,
                self.scaling,
                k_RAF,
                v_RAF,
                splits=self.engine.attention_splits,
                softcap=self.layout.attn_softcap,
            )
        else:
            rows_R = self.rows_R[:rows]
            keys_RASF[rows_R, :, position_R] = k_RAF
            values_RASF[rows_R, :, position_R] = v_RAF
            attn_RAGF = self.attend(
                q_RAGF,
                keys_RASF[:, :, : step.span],
                values_RASF[:, :, : step.span],
                step.biases[layer.window],
                self.scaling,
                self.layout.attn_softcap,
            )
        # SDPA's memory-efficient kernel (and the Triton kernel) writes [R, G, A, F] and returns a transposed
        # view: flattened in that order it needs no copy (fused o-proj columns are permuted to match); the
        # module's own o-proj needs (A, G) order. Either way the heads flattened: [R, H·F].
        if self.fused:
            attn_heads = attn_RAGF.transpose(1, 2).reshape(rows, -1)
        else:
            attn_heads = attn_RAGF.reshape(rows, -1)
        return step.attn_out(x_RD, attn_heads, *layer.attn_out)

    def _logits(self, x_RD: torch.Tensor, h_RD: torch.Tensor) -> torch.Tensor:
        """The head's logits [R, V] of the last layer's output (OLMo 2: after the final norm, here), with Granite's
        divisor and Gemma 2's final soft-cap."""
        if self.final_norm is not None:
            h_RD = _rms_weight_first(x_RD, *self.final_norm)
        logits_RV = F.linear(h_RD.to(self.head_w.dtype), self.head_w, self.head_b)
        if self.layout.logits_divisor != 1.0:
            logits_RV = logits_RV / self.layout.logits_divisor
        if self.layout.logits_softcap is not None:  # Gemma 2's final soft-cap, in the head's dtype as transformers
            logits_RV = torch.tanh(logits_RV / self.layout.logits_softcap) * self.layout.logits_softcap
        return logits_RV

    # ------------------------------------------------------------------ the loop

    def _span(self) -> int:
        """Slots the next `sync_interval` steps attend over: every occupied row's last position in the interval + 1,
        rounded up to kv_bucket (the whole cache for the Triton kernel, which reads each row's length on the device:
        one graph for the call)."""
        if self.attend is None:
            return self.capacity
        interval = self.engine.sync_interval
        needed = 1 + max(
            min(self.slot_position[r] + interval - 1, self.slot_last[r])
            for r in range(self.rows)
            if self.slot_sample[r] is not None
        )
        bucket = self.engine.kv_bucket
        return min(self.capacity, -(-needed // bucket) * bucket)

    def _shrink(self) -> None:
        """With no sample pending, move the occupied slots to the first rows of the smallest bucket that holds them
        (`_row_buckets`) when that is smaller than the current one, so that decode steps run over those rows only: the
        row state, the output columns and the cache rows move with their samples (one copy each, at most once per
        bucket). Rows in [occupied, bucket) are empty; rows ≥ the bucket are never read again."""
        if self.pending < len(self.caps):  # the common case: samples still to place, so no list work at all
            return
        occupied = [r for r in range(self.live) if self.slot_sample[r] is not None]
        bucket = min(b for b in self.buckets if b >= len(occupied))
        if bucket >= self.live:
            return
        n, source = len(occupied), torch.as_tensor(occupied, device=self.device)
        tensors = [self.position_R, self.tokens_R, self.lengths_R, self.limit_R, self.alive_R, self.stopped_R]
        tensors += [self.out_ids_RT, self.out_lps_RT]
        tensors += [t for layer in self.layers for t in layer.cache()]
        for tensor in tensors:
            tensor[:n] = tensor[source]  # advanced indexing copies first: no overlap between source and target
        self.alive_R[n : self.live] = False
        self.position_R[n : self.live] = 0  # an empty row reads one slot (see `_harvest`)
        for name in ("slot_sample", "slot_position", "slot_last"):
            column = getattr(self, name)
            moved = [column[r] for r in occupied]
            column[: self.live] = moved + [None if name == "slot_sample" else 0] * (self.live - n)
        self.live = bucket

    def _capture(self, span: int, fns, pool) -> Any:
        """A CUDA graph of the decode step over `span` slots and the first `live` rows. Warm-up runs change the row
        state, so it is saved and restored (their cache and output writes land where the replayed step writes again)."""
        state = [self.position_R, self.tokens_R, self.lengths_R, self.alive_R, self.stopped_R]
        saved = [s.clone() for s in state]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiled functions compile on their first call, outside the capture
                    self._decode_step(span, fns, self.live)
                    for s, v in zip(state, saved):
                        s.copy_(v)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: with rollout.overlap this capture runs in a background thread while the main thread
            # scores and updates; the default ("global") mode makes the main thread's allocations fail the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._decode_step(span, fns, self.live)
        finally:
            for s, v in zip(state, saved):
                s.copy_(v)
        self.counters["graphs"] += 1
        return graph

    def run(self) -> tuple[list[list[int]], list[list[float]], list[str]]:
        engine = self.engine
        on_cuda = self.device.type == "cuda"
        fns = engine._step_fns(on_cuda)
        use_graphs = on_cuda and engine.cuda_graphs is not False
        # Fused weights are already in the compute dtype: decode without autocast. Otherwise under the caller's
        # autocast, with its weight cache off while capturing (cached casts would be freed after the capture); warm-up
        # runs and captures share this state so that compiled functions are not recompiled during a capture.
        amp_dtype, amp_on = torch.get_autocast_dtype(self.device.type), self.autocast and not self.fused
        graphs: dict[tuple[int, int], Any] = {}  # (rows, span) → graph
        pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self._admit(list(range(self.rows)))
        while any(s is not None for s in self.slot_sample):
            if engine.row_buckets:
                self._shrink()
            span = self._span()
            key = (self.live, span)
            with torch.autocast(self.device.type, dtype=amp_dtype, enabled=amp_on, cache_enabled=not use_graphs):
                if use_graphs and key not in graphs:
                    try:
                        graphs[key] = self._capture(span, fns, pool)
                    except Exception as error:  # compile=None: a failing torch.compile falls back to the plain step
                        if engine.compile is not None or fns[0] is _plain_step_fns()[0]:
                            raise
                        warnings.warn(
                            f"StaticGenerator: torch.compile of the decode step failed "
                            f"({type(error).__name__}: {error}); decoding without it",
                            RuntimeWarning,
                            stacklevel=3,
                        )
                        engine._compiled = fns = _plain_step_fns()
                        graphs = {key: self._capture(span, fns, pool)}
                for _ in range(engine.sync_interval):
                    if self.noise_RV is not None:  # uniforms for the rows the step runs over only
                        self.noise_RV[: self.live].uniform_(generator=self.generator)
                    if use_graphs:
                        graphs[key].replay()
                    else:
                        self._decode_step(span, fns, self.live)
            self.counters["decode_steps"] += engine.sync_interval
            self.bucket_steps[self.live] = self.bucket_steps.get(self.live, 0) + engine.sync_interval
            alive = self.alive_R.tolist()  # host sync: which rows finished
            ended = [r for r in range(self.rows) if self.slot_sample[r] is not None and not alive[r]]
            for r in range(self.rows):
                self.slot_position[r] = min(self.slot_position[r] + engine.sync_interval, self.slot_last[r])
            if ended:
                self._harvest(ended)
                # asked before the refill: a sample placed now would come back cut at its first token, its prefill
                # spent for nothing
                if self.stop_when is not None and self.stop_when([None if r is None else r[2] for r in self.results]):
                    self._cut()
                else:
                    self._admit(ended)
        results = [result for result in self.results if result is not None]
        assert len(results) == len(self.results), "every sample has its result once no slot is occupied"
        self.counters["decoded_tokens"] = sum(len(ids) - 1 for ids, _, _ in results if ids)
        responses, logprobs, reasons = (list(column) for column in zip(*results))
        return responses, logprobs, reasons

"""Log-probs, top-k, gathers and entropy over the full vocabulary, computed in chunks of positions from the final
hidden states and the output embedding, so that no `[N, V]` float32 tensor for all positions ever exists (SPEC §1).

Notation: `N` scored positions, `D` hidden size, `V` vocabulary rows used (`vocab_size`), `C` positions per chunk,
`K` top-k, `Q` requested ids, `J` candidate ids, `U` gathered ids (targets and requested, or candidates); the
project's legend: docs/design.md, "Shape letters". Logits as the Hugging Face heads compute them,
`z = softcap(logit_scale · (h Wᵀ + b)) / temperature`, the matmul in the model's dtype and the rest in float32;
padding rows never selected, zero gradient. Per chunk one matmul and two small pure functions, compiled on CUDA,
eager on row slices elsewhere; the top-k in two stages. How, and why: docs/design.md, "opd.scoring".

Omitted on purpose: a hand-written kernel for the reductions (inductor's fusion is enough next to the model body),
a per-position temperature, sparse or quantised heads; other heads than linear (+ bias) with a scale and tanh
soft-capping are refused (`opd.teacher.local.output_head`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import overload

import torch

from opd.types import TokenScores

CHUNK_BYTES = 1 << 30
"""Budget of one chunk's raw logits `[C, V]` in the dtype the head matmul returns (the model's, or autocast's):
C = CHUNK_BYTES // (V · itemsize), i.e. 3,533 positions for V = 151,936 in bf16 (1,766 in float32).
Peak extra memory of a chunk is about 2× this (~2 GiB), whatever N is: the logits plus at most one more buffer of the
same size (compiled, backward only: the logits' gradient in the model dtype; eagerly: float32 temporaries of row
slices). The weight gradient adds a `[V, D]` float32 accumulator when the weight is bf16/fp16 (see `add_outer`)."""

COMPILE = True
"""Run the per-chunk functions through `torch.compile(dynamic=False)` on CUDA. False = always eager (same results to
float32 rounding). CPU and float64 inputs always run eagerly."""

_TOPK_PIECE = 512  # columns per piece of the two-stage top-k (`_piece_topk`)
_COMPILE_DEVICES = ("cuda",)  # device types that compile; the tests add "cpu"
_MIN_BUCKET = 256  # a partial chunk is padded to a power of two ≥ this (≤ the chunk) before a compiled call
_FWD_TEMPS = 4  # [rows, V] temporaries alive at once in eager `_forward_chunk` (3, and the top-k's padded copy)
_BWD_TEMPS = 8  # the same for eager `_grad_chunk`, its output included (≤ 6, plus margin)


@dataclass(frozen=True)
class OutputHead:
    """The vocabulary projection of a causal LM: `z = softcap(logit_scale · (h Wᵀ + b))`.

    weight:      [V_model, D] the output embedding (tied or not), in the model's dtype
    bias:        [V_model] or None
    logit_scale: multiplier applied before capping (Cohere `logit_scale`, Granite `1 / logits_scaling`); 1.0 = none
    softcap:     `final_logit_softcapping` (Gemma 2/3): z = c · tanh(z / c); None = none
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    logit_scale: float = 1.0
    softcap: float | None = None

    def restricted(self, vocab_size: int | None) -> OutputHead:
        """The same head over the first `vocab_size` rows only (views, no copy); None keeps all rows."""
        v_model = self.weight.shape[0]
        if vocab_size is None or vocab_size == v_model:
            return self
        if not 0 < vocab_size <= v_model:
            raise ValueError(f"vocab_size must be in [1, {v_model}] (the output embedding's rows), got {vocab_size}")
        bias = None if self.bias is None else self.bias[:vocab_size]
        return OutputHead(self.weight[:vocab_size], bias, self.logit_scale, self.softcap)


def _as_head(head: OutputHead | torch.Tensor) -> OutputHead:
    return head if isinstance(head, OutputHead) else OutputHead(head)


def default_chunk_size(vocab_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Positions per chunk so that one chunk's raw logits `[C, V]` in `dtype` (the head matmul's output dtype) stay
    within `CHUNK_BYTES`: 3,533 for V = 151,936 in bf16. The float32 default is the conservative choice."""
    return max(1, CHUNK_BYTES // (dtype.itemsize * max(1, vocab_size)))


# ---------------------------------------------------------------------------------------------------------------
# per-chunk functions: pure, row-wise, over the raw logits in the model dtype (compiled on CUDA, see docs/design.md)


def head_transform(raw: torch.Tensor, scale: float, softcap: float | None, temperature: float) -> torch.Tensor:
    """z = softcap(scale · raw) / temperature in the compute dtype (float32, or float64 for float64 raw)."""
    z = raw.to(torch.promote_types(raw.dtype, torch.float32))
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if temperature != 1.0:
        z = z / temperature
    return z


def _forward_chunk(raw_aligned, ids_CU, top_k, scale, softcap, temperature, with_entropy, vocab_size):
    """Row statistics of z = `head_transform(raw_CV)` with raw_CV = raw_aligned[:, :vocab_size] (raw_aligned: [C, ≥ V],
    the matmul ran over an aligned row count, see `_aligned_rows`): (lse_C, entropy_C or None, log-probs at ids_CU
    [C, U], top-k ids [C, K] and log-probs [C, K] descending, or None when top_k = 0), all in the compute dtype."""
    raw_CV = raw_aligned[:, :vocab_size]
    x_CV = head_transform(raw_CV, scale, softcap, temperature)
    max_C1 = x_CV.amax(dim=-1, keepdim=True)
    x_CV = x_CV - max_C1  # ≤ 0, so exp never overflows; log p = x - log S with S = Σ exp(x) ∈ [1, V]
    exp_CV = x_CV.exp()
    sum_C = exp_CV.sum(-1)
    log_sum_C = sum_C.log()
    lse_C1 = max_C1 + log_sum_C[:, None]
    # H = log S - Σ exp(x) x / S (= lse - Σ p z): two non-negative terms, so no cancellation.
    entropy_C = log_sum_C - (exp_CV * x_CV).sum(-1) / sum_C if with_entropy else None
    # Gathers and top-k read the raw logits and transform only what they pick. z is monotone in raw (non-decreasing
    # for scale > 0 and any cap, temperature > 0; non-increasing for scale < 0), so the top-k of raw are the top-k
    # of z and of log p: same values, ids equal up to ties.
    lp_CU = head_transform(raw_CV.gather(1, ids_CU), scale, softcap, temperature) - lse_C1
    topk_ids_CK = topk_lp_CK = None
    if top_k:
        values_CK, topk_ids_CK = _piece_topk(raw_CV, top_k, largest=scale >= 0)  # sorted: z descending
        topk_lp_CK = head_transform(values_CK, scale, softcap, temperature) - lse_C1
    return lse_C1[:, 0], entropy_C, lp_CU, topk_ids_CK, topk_lp_CK


def _piece_topk(x_CV: torch.Tensor, k: int, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`x_CV.topk(k, dim=-1, largest=largest)` (values sorted best first, ids equal up to ties) in two stages: cut each
    row into pieces of `_TOPK_PIECE` columns, take the k pieces with the best extremes, then the top k of only their
    columns. Exact: a member of the row's top k lying in any other piece would be beaten by k piece extremes, i.e. k
    other entries. Reads the row once for the extremes, then k · `_TOPK_PIECE` entries per row (8,192 of 151,669
    for k = 16) instead of selecting over all of them."""
    rows, cols = x_CV.shape
    width = _TOPK_PIECE
    pieces = -(-cols // width)
    if pieces <= k:
        return x_CV.topk(k, dim=-1, largest=largest)
    fill = float("-inf") if largest else float("inf")
    # x by piece [C, pieces, width], each piece's extreme [C, pieces], the k best pieces [C, K] and their columns
    # [C, K · width] (past the row's end: filled so as never to be picked)
    by_piece = torch.nn.functional.pad(x_CV, (0, pieces * width - cols), value=fill).view(rows, pieces, width)
    extremes = by_piece.amax(-1) if largest else by_piece.amin(-1)
    best_pieces = extremes.topk(k, dim=-1, largest=largest).indices
    columns = (best_pieces[:, :, None] * width + torch.arange(width, device=x_CV.device)).flatten(1)
    candidates = x_CV.gather(1, columns.clamp(max=cols - 1)).masked_fill(columns >= cols, fill)
    values_CK, where_CK = candidates.topk(k, dim=-1, largest=largest)
    return values_CK, columns.gather(1, where_CK)


def _grad_chunk(raw_CV, ids_CJ, lse_C, entropy_C, grad_lp_CJ, grad_entropy_C, scale, softcap, temperature, vocab_size):
    """Gradient of Σ_j grad_lp_j · log p(id_j) + grad_entropy · H wrt the raw logits: (g_CV in raw_CV's dtype, for
    the backward GEMMs, and its values at ids_CJ [C, J] in that dtype, or None without grad_lp). Columns at or
    beyond `vocab_size` (alignment padding of the matmul, `_aligned_rows`) are not part of the softmax: zero there.

    dL/dz = Σ_j g_j (e_{id_j} - p) + g_H · (-p (log p + H)) = p · (-Σ_j g_j - g_H (log p + H)) + Σ_j g_j e_{id_j},
    then times dz/draw = scale / temperature · (1 - tanh²). The dense part is rounded to the model dtype once; the
    candidate entries are recomputed exactly in float32 and written over it by the caller (`scatter_`), because a
    bf16 scatter-add would lose (1 - p) · g to cancellation when p ≈ 1. Duplicate ids get equal, summed values."""
    cd = torch.promote_types(raw_CV.dtype, torch.float32)
    coeff_C1 = torch.zeros_like(lse_C[:, None]) if grad_lp_CJ is None else -grad_lp_CJ.to(cd).sum(1, keepdim=True)

    def grad_of(raw, onehot):  # elementwise in the vocabulary dimension: the same math for [C, V] and [C, J]
        z = head_transform(raw, scale, softcap, temperature)
        chain = scale / temperature
        if softcap is not None:  # d(c·tanh(x/c))/dx = 1 - tanh² = 1 - (capped / c)², and capped = z · temperature
            chain = (1 - (z * (temperature / softcap)) ** 2) * chain
        z = z - lse_C[:, None]  # log p
        coeff = coeff_C1
        if grad_entropy_C is not None:
            coeff = coeff - grad_entropy_C.to(cd)[:, None] * (z + entropy_C[:, None])
        g = z.exp() * coeff
        if onehot is not None:
            g = g + onehot
        return g * chain

    in_vocab_1V = torch.arange(raw_CV.shape[1], device=raw_CV.device)[None] < vocab_size
    g_CV = torch.where(in_vocab_1V, grad_of(raw_CV, None), 0.0).to(raw_CV.dtype)
    if grad_lp_CJ is None:
        return g_CV, None
    # Σ_{j'} [id_j' = id_j] g_j': the one-hot term at each slot, duplicates summed
    onehot_CJ = ((ids_CJ[:, :, None] == ids_CJ[:, None, :]).to(cd) * grad_lp_CJ.to(cd)[:, None, :]).sum(-1)
    return g_CV, grad_of(raw_CV.gather(1, ids_CJ), onehot_CJ).to(raw_CV.dtype)


# ---------------------------------------------------------------------------------------------------------------
# compilation and chunk plumbing

_COMPILED: dict[Callable, Callable | None] = {}  # fn -> its compiled version; None once compiling it failed
_BACKEND = "inductor"  # torch.compile's backend for them; the tests use aot_eager (the same graphs and guards)
_MET: dict[tuple, set[int]] = {}  # (fn, chunk, `_variant` of the call) -> the row counts its compiled calls ran at


def _compiles(device: torch.device, dtype: torch.dtype) -> bool:
    return COMPILE and device.type in _COMPILE_DEVICES and dtype != torch.float64


def recompile_limit_at_least(minimum: int) -> dict[str, int]:
    """{name: value} raising dynamo's per-function limit of compiled versions to at least `minimum` (torch renamed
    the setting from cache_size_limit to recompile_limit)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return {name: max(getattr(config, name), minimum)}


def _variant(args: tuple) -> tuple:
    """What a compiled call's graph depends on besides its row count: each tensor argument's shape past its rows,
    dtype and device, every other argument's value, and the grad mode and autocast state of the caller."""
    device_type = args[0].device.type  # the raw logits
    state = (torch.is_grad_enabled(), torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    parts = tuple((tuple(a.shape[1:]), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args)
    return parts, tuple(isinstance(a, torch.Tensor) for a in args), state


def _compiled_call(fn: Callable, *args, chunk: int):
    """fn(*args) through `torch.compile(dynamic=False)` (built on first use), or None once compiling fn failed: then
    one warning, and the caller runs fn eagerly (from now on too). `chunk`: the caller's chunk rows (the largest
    bucket), recorded with the call's variant for `warm_up_row_buckets`."""
    if fn in _COMPILED and _COMPILED[fn] is None:
        return None
    try:
        compiled = _COMPILED.get(fn)
        if compiled is None:
            compiled = _COMPILED[fn] = torch.compile(fn, dynamic=False, backend=_BACKEND)
        # Shapes: the chunk plus a few buckets for the last one, per (U, K, J, flags, dtype) variant, can exceed
        # dynamo's default of 8 compiled versions per function, after which it would silently run eagerly.
        with torch._dynamo.config.patch(recompile_limit_at_least(64)):
            out = compiled(*args)
        _MET.setdefault((fn, chunk, _variant(args)), set()).add(args[0].shape[0])
        return out
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 -- any compiler failure; the functions are pure, so rerunning is safe
        _COMPILED[fn] = None
        warnings.warn(
            f"opd.scoring: torch.compile of {fn.__name__} failed, running it eagerly from now on "
            f"({type(err).__name__}: {str(err)[:500]})",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _bucket(rows: int, chunk: int) -> int:
    """Rows a compiled call sees: a partial chunk is padded to a power of two (≥ `_MIN_BUCKET`, ≤ chunk), so that
    `dynamic=False` compiles a handful of shapes rather than one per N; padding wastes at most half the rows."""
    return min(chunk, max(_MIN_BUCKET, 1 << (rows - 1).bit_length()))


def _buckets_up_to(rows: int, chunk: int) -> list[int]:
    """Every row count `_bucket` gives for calls of 1 to `rows` positions, ascending."""
    top, bucket, buckets = _bucket(rows, chunk), min(chunk, _MIN_BUCKET), []
    while bucket < top:
        buckets.append(bucket)
        bucket *= 2
    return [*buckets, top]


def warm_up_row_buckets(max_rows: int) -> int:
    """Compile each variant of the per-chunk functions that compiled calls have met so far (`opd.train.step.warm_up`'s
    batches) at every row bucket a call of up to `max_rows` positions can reach and none has run at yet, on zero
    inputs of the same shapes past the rows, under the grad mode and autocast state it was met under: so that a
    step scoring more positions in one call than any warm-up batch did compiles nothing. Returns the calls made."""
    calls = 0
    for (fn, chunk, (parts, is_tensor, state)), met in list(_MET.items()):
        for rows in _buckets_up_to(max_rows, chunk):
            if rows in met or _COMPILED.get(fn) is None:
                continue
            args = [torch.zeros((rows, *p[0]), dtype=p[1], device=p[2]) if t else p for p, t in zip(parts, is_tensor)]
            grad, autocast, dtype = state
            with torch.set_grad_enabled(grad), torch.autocast(args[0].device.type, dtype=dtype, enabled=autocast):
                calls += _compiled_call(fn, *args, chunk=chunk) is not None
    return calls


@overload
def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor: ...
@overload
def _pad_rows(x: None, rows: int) -> None: ...
def _pad_rows(x: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """x with zero rows appended up to `rows` (their results are computed and dropped)."""
    if x is None or x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + x.shape[1:])])


def _eager_rows(raw_CV: torch.Tensor, temps: int) -> int:
    """Rows per eager slice so that `temps` compute-dtype `[rows, V]` buffers fit in the raw chunk's bytes."""
    compute_bytes = torch.promote_types(raw_CV.dtype, torch.float32).itemsize
    return max(1, raw_CV.shape[0] * raw_CV.element_size() // (temps * compute_bytes))


def _aligned_rows(vocab_size: int, rows: int) -> int:
    """Rows of the output embedding the head matmul runs over: `vocab_size` rounded up to a multiple of 64, within the
    embedding's `rows`. Why: the logits' row stride must be a multiple of 8 elements for cuBLAS's fast tensor-core
    kernels; an odd one (Qwen3's tokenizer range, 151,669) ran the [C, V] matmul far slower (docs/performance.md).
    The extra columns are sliced off (forward) or given zero gradient (backward)."""
    return min(rows, -(-vocab_size // 64) * 64)


def _matmul_dtype(hidden_ND: torch.Tensor, head: OutputHead) -> torch.dtype:
    """The dtype the head matmul returns here (the model's, or autocast's), from a 1 × 1 product."""
    with torch.no_grad():
        return torch.nn.functional.linear(hidden_ND[:1], head.weight[:1]).dtype


def _chunk_forward(hidden_CD, head, ids_CU, top_k, temperature, with_entropy, compiled, chunk, vocab_size):
    """`_forward_chunk` over one chunk of hidden states: one matmul (over `head`'s aligned rows), then compiled on the
    whole (padded) chunk, or eagerly on row slices. Returns its outputs for the chunk's real rows."""
    rows = hidden_CD.shape[0]
    consts = (top_k, head.logit_scale, head.softcap, temperature, with_entropy, vocab_size)
    padded = _bucket(rows, chunk) if compiled else rows
    raw_CV = torch.nn.functional.linear(_pad_rows(hidden_CD, padded), head.weight, head.bias)  # model dtype
    ids_CU = _pad_rows(ids_CU, padded)
    out = _compiled_call(_forward_chunk, raw_CV, ids_CU, *consts, chunk=chunk) if compiled else None
    if out is None:
        step = _eager_rows(raw_CV, _FWD_TEMPS)
        parts = [_forward_chunk(raw_CV[a : a + step], ids_CU[a : a + step], *consts) for a in range(0, rows, step)]
        out = tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))
    return tuple(None if x is None else x[:rows] for x in out)


def run_chunk(fn: Callable, row_args: tuple[torch.Tensor, ...], consts: tuple, *, chunk: int):
    """fn(*row_args, *consts) for one chunk whose first row argument is its raw logits: compiled where this module's
    own chunk functions compile (`torch.compile(dynamic=False)` on CUDA), on the row arguments padded to the chunk's
    row bucket, so a step meets a handful of shapes and the trainer's warm-up compiles them all
    (`warm_up_row_buckets`); eagerly elsewhere or once compiling fn failed. `fn` is pure and row-wise; its tensor
    output(s) are returned for the real rows."""
    rows = row_args[0].shape[0]
    out = None
    if _compiles(row_args[0].device, row_args[0].dtype):
        padded = _bucket(rows, chunk)
        out = _compiled_call(fn, *(_pad_rows(a, padded) for a in row_args), *consts, chunk=chunk)
    if out is None:
        return fn(*row_args, *consts)
    return out[:rows] if isinstance(out, torch.Tensor) else tuple(x[:rows] for x in out)


def add_outer(acc_VD: torch.Tensor, g_CV: torch.Tensor, h_CD: torch.Tensor, slice_of_chunk: bool) -> None:
    """acc_VD += g_CVᵀ h_CD, accumulated in acc's dtype. In place when the dtypes agree; else (bf16 g, float32
    accumulator) through `addmm(out_dtype=)` where the backend has it (CUDA, recent torch); else for an eager row
    slice by upcasting it (small, and the many slices' sum must not be rounded to bf16 slice by slice); else via a
    `[V, D]` product in g's dtype, rounded once per chunk as a plain bf16 GEMM would be."""
    if g_CV.dtype == acc_VD.dtype:
        acc_VD.addmm_(g_CV.T, h_CD)
    elif _mixed_addmm_ok(acc_VD.device, g_CV.dtype, acc_VD.dtype):
        torch.addmm(acc_VD, g_CV.T, h_CD, out_dtype=acc_VD.dtype, out=acc_VD)
    elif slice_of_chunk:
        acc_VD.addmm_(g_CV.T.to(acc_VD.dtype), h_CD.to(acc_VD.dtype))
    else:
        acc_VD += g_CV.T @ h_CD


_MIXED_ADDMM: dict[tuple[str, torch.dtype, torch.dtype], bool] = {}


def _mixed_addmm_ok(device: torch.device, in_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether `torch.addmm(acc, a, b, out_dtype=, out=acc)` works and is right here (probed once per key)."""
    key = (device.type, in_dtype, out_dtype)
    if key not in _MIXED_ADDMM:
        try:
            a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, dtype=in_dtype)
            acc = torch.ones(2, 2, device=device, dtype=out_dtype)
            torch.addmm(acc, a, a, out_dtype=out_dtype, out=acc)
            _MIXED_ADDMM[key] = acc.tolist() == [[8.0, 11.0], [16.0, 23.0]]
        except Exception:  # noqa: BLE001 -- unsupported op, overload or backend
            _MIXED_ADDMM[key] = False
    return _MIXED_ADDMM[key]


def _check_ids(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    # One host sync per call; an out-of-range id would otherwise be a device-side assert (GPU) or a silent padding row.
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{name} must lie in [0, {vocab_size}) (the scored vocabulary range), "
            f"got ids in [{int(ids.min())}, {int(ids.max())}]"
        )


def _check_common(hidden_ND: torch.Tensor, head: OutputHead, temperature: float) -> None:
    if hidden_ND.ndim != 2 or hidden_ND.shape[1] != head.weight.shape[1]:
        raise ValueError(f"hidden must be [N, D] with D = {head.weight.shape[1]}, got {tuple(hidden_ND.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


# ---------------------------------------------------------------------------------------------------------------
# public functions


@torch.no_grad()
def _requested_ids(requested_ids_NQ: torch.Tensor | None, old_name_NR: torch.Tensor | None) -> torch.Tensor | None:
    """`score_hidden`'s requested ids, given by their keyword or, deprecated, by its old name `requested_ids_NR`."""
    if old_name_NR is None:
        return requested_ids_NQ
    if requested_ids_NQ is not None:
        raise TypeError("pass requested_ids_NQ or its old name requested_ids_NR, not both")
    warnings.warn(
        "score_hidden(requested_ids_NR=…) is deprecated: the keyword is requested_ids_NQ (Q: requested ids, "
        "docs/design.md 'Shape letters')",
        DeprecationWarning,
        stacklevel=3,
    )
    return old_name_NR


def score_hidden(
    hidden_ND: torch.Tensor,
    head: OutputHead | torch.Tensor,
    *,
    targets_N: torch.Tensor,
    top_k: int = 0,
    requested_ids_NQ: torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    requested_ids_NR: torch.Tensor | None = None,
) -> TokenScores:
    """Full-vocabulary log-probs at N positions, without gradient, chunk by chunk.

    hidden_ND:        [N, D] final (normed) hidden states, model dtype
    head:             `OutputHead`, or a bare `[V_model, D]` output-embedding weight
    targets_N:        [N] long, the token whose log-prob is wanted (the sampled token)
    top_k:            K ≥ 0; 0 = no top-k
    requested_ids_NQ: [N, Q] long or None, extra ids whose log-probs are wanted (e.g. the student's top-k)
    vocab_size:       scored range; rows ≥ it are padding (never selected, no mass). None = all rows
    chunk_size:       positions per chunk; None = `default_chunk_size(vocab_size, dtype=<matmul dtype>)`
    requested_ids_NR: deprecated, the old name of `requested_ids_NQ` (a DeprecationWarning; not both)

    Memory: one chunk's raw logits `[C, V]` in the model dtype, plus (eagerly) at most one more buffer of that size
    for row slices' float32 temporaries; compiled, nothing else `[C, V]`. See `CHUNK_BYTES`.

    Returns a `TokenScores` whose tensors are flat, `[N, ...]` instead of `[B, T, ...]`: sampled_logprobs [N],
    topk_ids [N, K] / topk_logprobs [N, K] descending (None when K = 0), entropy [N] (None unless asked),
    requested_logprobs [N, Q] (None unless asked); float32 (float64 for float64 inputs). N = 0 gives empty tensors.
    """
    full = _as_head(head)
    head = full.restricted(vocab_size)
    _check_common(hidden_ND, head, temperature)
    n_pos, v_used = hidden_ND.shape[0], head.weight.shape[0]
    head = full.restricted(_aligned_rows(v_used, full.weight.shape[0]))
    if not 0 <= top_k <= v_used:
        raise ValueError(f"top_k must be in [0, {v_used}], got {top_k}")
    _check_ids(targets_N, v_used, "targets_N")
    requested_ids_NQ = _requested_ids(requested_ids_NQ, requested_ids_NR)
    if requested_ids_NQ is not None:
        _check_ids(requested_ids_NQ, v_used, "requested_ids_NQ")
    mm_dtype = _matmul_dtype(hidden_ND, head)
    chunk = chunk_size or default_chunk_size(v_used, mm_dtype)
    compiled = _compiles(hidden_ND.device, mm_dtype)

    dev = hidden_ND.device
    dtype = torch.promote_types(hidden_ND.dtype, torch.float32)
    sampled_N = torch.zeros(n_pos, dtype=dtype, device=dev)
    topk_ids_NK = torch.zeros(n_pos, top_k, dtype=torch.long, device=dev) if top_k else None
    topk_lp_NK = torch.zeros(n_pos, top_k, dtype=dtype, device=dev) if top_k else None
    entropy_N = torch.zeros(n_pos, dtype=dtype, device=dev) if with_entropy else None
    requested_NQ = None
    ids_NU = targets_N[:, None]  # one gather for the targets and the requested ids
    if requested_ids_NQ is not None:
        requested_NQ = torch.zeros(requested_ids_NQ.shape, dtype=dtype, device=dev)
        ids_NU = torch.cat([ids_NU, requested_ids_NQ], dim=1)

    for s in range(0, n_pos, chunk):
        e = min(s + chunk, n_pos)
        _, entropy_C, lp_CU, topk_ids_CK, topk_lp_CK = _chunk_forward(
            hidden_ND[s:e], head, ids_NU[s:e], top_k, temperature, with_entropy, compiled, chunk, v_used
        )
        sampled_N[s:e] = lp_CU[:, 0]
        if requested_NQ is not None:
            requested_NQ[s:e] = lp_CU[:, 1:]
        if topk_ids_NK is not None and topk_lp_NK is not None:
            topk_ids_NK[s:e] = topk_ids_CK
            topk_lp_NK[s:e] = topk_lp_CK
        if entropy_N is not None:
            entropy_N[s:e] = entropy_C
    return TokenScores(sampled_N, topk_ids_NK, topk_lp_NK, entropy_N, requested_NQ)


class _CandidateLogprobs(torch.autograd.Function):
    """log_softmax(z)[ids] (and optionally the entropy) with a backward that recomputes each chunk's logits.

    Memory: forward keeps only `lse` [N] (and H [N]) besides the inputs; backward rebuilds one chunk's `[C, V]` raw
    logits at a time, in the model dtype, plus at most one more buffer of that size (the logits' gradient g in the
    model dtype; eagerly, float32 temporaries of row slices and g's slice), never `[N, V]`. The weight gradient is
    accumulated in float32: in the gradient itself for float32 weights, in a `[V, D]` float32 accumulator for
    bf16/fp16 ones (plus a `[V, D]` product per chunk where `addmm(out_dtype=)` is missing, see `add_outer`). The
    price is one extra head matmul per chunk (4 instead of 3 for forward + backward), small next to the model body.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # backward then recomputes under the forward's autocast state
    def forward(
        ctx,
        hidden_ND,
        weight_VD,
        bias_V,
        ids_NJ,
        logit_scale,
        softcap,
        temperature,
        chunk,
        with_entropy,
        compiled,
        vocab_size,
    ):
        head = OutputHead(weight_VD, bias_V, logit_scale, softcap)
        n_pos = hidden_ND.shape[0]
        dtype = torch.promote_types(hidden_ND.dtype, torch.float32)
        lp_NJ = torch.zeros(ids_NJ.shape, dtype=dtype, device=hidden_ND.device)
        lse_N = torch.zeros(n_pos, dtype=dtype, device=hidden_ND.device)
        entropy_N = torch.zeros(n_pos if with_entropy else 0, dtype=dtype, device=hidden_ND.device)
        for s in range(0, n_pos, chunk):
            e = min(s + chunk, n_pos)
            lse_N[s:e], entropy_C, lp_NJ[s:e], _, _ = _chunk_forward(
                hidden_ND[s:e], head, ids_NJ[s:e], 0, temperature, with_entropy, compiled, chunk, vocab_size
            )
            if with_entropy:
                entropy_N[s:e] = entropy_C
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, ids_NJ, lse_N, entropy_N)
        ctx.params = (logit_scale, softcap, temperature, chunk, with_entropy, compiled, vocab_size)
        ctx.set_materialize_grads(False)  # an unused output's grad arrives as None: skip its term
        return lp_NJ, entropy_N

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_lp_NJ, grad_entropy_N):
        hidden_ND, weight_VD, bias_V, ids_NJ, lse_N, entropy_N = ctx.saved_tensors
        logit_scale, softcap, temperature, chunk, with_entropy, compiled, vocab_size = ctx.params
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not with_entropy:
            grad_entropy_N = None
        n_pos = hidden_ND.shape[0]
        grad_h_ND = torch.zeros_like(hidden_ND) if need_h else None
        # float32 accumulators: summing per-chunk bf16 products in bf16 would lose the small chunks' contributions.
        # For a float32 weight the accumulator is the gradient itself.
        acc_dtype = torch.promote_types(weight_VD.dtype, torch.float32)
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=acc_dtype, device=weight_VD.device) if need_w else None
        grad_b_V = torch.zeros(weight_VD.shape[0], dtype=acc_dtype, device=weight_VD.device) if need_b else None
        if grad_lp_NJ is None and grad_entropy_N is None:
            return (grad_h_ND, grad_w_VD, grad_b_V) + (None,) * 8

        dev = hidden_ND.device
        head = OutputHead(weight_VD, bias_V, logit_scale, softcap)
        consts = (logit_scale, softcap, temperature, vocab_size)
        # The GEMMs run in the logits' dtype (the model's, or autocast's: then W and h are cast once here, as autocast
        # would per call), with autocast off so that the float32 accumulation below is not cast down.
        mm_dtype = _matmul_dtype(hidden_ND, head)
        weight_mm, hidden_mm = weight_VD.to(mm_dtype), hidden_ND.to(mm_dtype)
        for s in range(0, n_pos, chunk):
            e = min(s + chunk, n_pos)
            rows = e - s
            padded = _bucket(rows, chunk) if compiled else rows
            raw_CV = torch.nn.functional.linear(_pad_rows(hidden_ND[s:e], padded), weight_VD, bias_V)
            ids_CJ = _pad_rows(ids_NJ[s:e], padded)
            row_args = [ids_CJ] + [
                _pad_rows(None if x is None else x[s:e], padded)
                for x in (lse_N, entropy_N if with_entropy else None, grad_lp_NJ, grad_entropy_N)
            ]
            out = _compiled_call(_grad_chunk, raw_CV, *row_args, *consts, chunk=chunk) if compiled else None
            slices: Iterable[tuple[int, tuple]]
            if out is not None:
                slices = [(0, out)]  # the whole chunk at once
            else:  # eagerly, slice by slice (lazily, so that one slice's buffers live at a time)
                step = _eager_rows(raw_CV, _BWD_TEMPS)
                slices = (
                    (
                        a,
                        _grad_chunk(
                            *(
                                raw_CV[a : a + step],
                                *[None if x is None else x[a : a + step] for x in row_args],
                                *consts,
                            )
                        ),
                    )
                    for a in range(0, rows, step)
                )
            for a, (g_CV, g_ids_CJ) in slices:
                if g_ids_CJ is not None:
                    g_CV.scatter_(1, ids_CJ[a : a + g_CV.shape[0]], g_ids_CJ)
                g_CV = g_CV[: rows - a]  # drop the padding rows
                r0, r1 = s + a, s + a + g_CV.shape[0]
                with torch.autocast(device_type=dev.type, enabled=False):
                    if grad_h_ND is not None:
                        grad_h_ND[r0:r1] = g_CV @ weight_mm
                    if grad_w_VD is not None:
                        add_outer(grad_w_VD, g_CV, hidden_mm[r0:r1], slice_of_chunk=out is None)
                    if grad_b_V is not None:
                        grad_b_V += g_CV.sum(0, dtype=acc_dtype)
                del g_CV, g_ids_CJ  # before the next slice's (or chunk's) buffers exist
            del raw_CV, out, slices
        if grad_w_VD is not None:
            grad_w_VD = grad_w_VD.to(weight_VD.dtype)
        if grad_b_V is not None:
            grad_b_V = grad_b_V.to(bias_V.dtype)
        return grad_h_ND, grad_w_VD, grad_b_V, None, None, None, None, None, None, None, None


def _candidate(hidden_ND, head, ids_NJ, temperature, vocab_size, chunk_size, with_entropy):
    full = _as_head(head)
    head = full.restricted(vocab_size)
    _check_common(hidden_ND, head, temperature)
    if ids_NJ.ndim != 2 or ids_NJ.shape[0] != hidden_ND.shape[0]:
        raise ValueError(f"ids must be [N, J] with N = {hidden_ND.shape[0]}, got {tuple(ids_NJ.shape)}")
    _check_ids(ids_NJ, head.weight.shape[0], "ids_NJ")
    v_used = head.weight.shape[0]
    head = full.restricted(_aligned_rows(v_used, full.weight.shape[0]))  # its padding rows get zero gradient
    mm_dtype = _matmul_dtype(hidden_ND, head)
    chunk = chunk_size or default_chunk_size(head.weight.shape[0], mm_dtype)
    return _CandidateLogprobs.apply(
        hidden_ND,
        head.weight,
        head.bias,
        ids_NJ,
        float(head.logit_scale),
        head.softcap,
        float(temperature),
        int(chunk),
        with_entropy,
        _compiles(hidden_ND.device, mm_dtype),
        v_used,
    )


def candidate_logprobs(
    hidden_ND: torch.Tensor,
    head: OutputHead | torch.Tensor,
    ids_NJ: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """[N, J] full-vocabulary log-probs `log_softmax(z / temperature)[ids]`, differentiable wrt `hidden_ND` and the
    head's weight and bias (for the training loss).

    hidden_ND: [N, D] final hidden states (with grad), ids_NJ: [N, J] long in [0, vocab_size).
    Memory: never keeps `[N, V]` for backward; each chunk's logits are recomputed in backward (see
    `_CandidateLogprobs`). Returns float32 (float64 for float64 inputs); N = 0 gives `[0, J]`.
    """
    lp_NJ, _ = _candidate(hidden_ND, head, ids_NJ, temperature, vocab_size, chunk_size, False)
    return lp_NJ


def candidate_logprobs_and_entropy(
    hidden_ND: torch.Tensor,
    head: OutputHead | torch.Tensor,
    ids_NJ: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`candidate_logprobs` plus the full-vocabulary entropy `[N]` (for an entropy bonus), both differentiable,
    from one pass over the vocabulary per chunk (dH/dz = -p (log p + H))."""
    return _candidate(hidden_ND, head, ids_NJ, temperature, vocab_size, chunk_size, True)

"""Decode attention: one query token per row against a static KV cache, grouped-query, as a split-KV ("flash
decoding") Triton kernel that reads only each row's valid slots.

Why: in `StaticGenerator`'s decode step the attention is the one part that grows with the sequence, and SDPA's
masked kernel reads the whole bucketed cache, padding included, well below bandwidth. Here each program streams the
keys and values of one (row, kv head, split) once, the kv head's G query heads forming one tensor-core tile. Row r
attends over slots [start[r], last[r] + 1), both read on the device, so rows at different positions share one launch
and one CUDA graph serves every step; with few rows × kv heads each row's slots are cut into `splits` pieces that a
second kernel combines (docs/design.md, "opd.kernels.decode_attention").

Where it runs (CUDA, or CPU under Triton's interpreter for the tests) and why tiles are upcast there: `opd.kernels`.
"""

from __future__ import annotations

import contextlib

import torch

from opd.kernels import available, interpreted, tl, triton

__all__ = ["available", "decode_attention", "default_splits", "split_count", "supports"]

BLOCK_N = 64  # slots per tile; with 4 warps and 2 stages the fastest launch measured (docs/performance.md)
SPLIT_SLOTS = 2048  # cache slots per split at most, up to 16 splits (`default_splits`; docs/performance.md)


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head size: a power of two in [16, 256] (one tensor-core tile wide, in
    registers)."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def default_splits(rows: int, kv_heads: int, device: torch.device, slots: int | None = None) -> int:
    """`split_count` for this device's multiprocessors (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    return split_count(rows, kv_heads, torch.cuda.get_device_properties(device).multi_processor_count, slots)


def split_count(rows: int, kv_heads: int, multiprocessors: int, slots: int | None = None) -> int:
    """Splits per row (a power of two, at most 16): the fewest that give every multiprocessor a (row, kv head, split)
    program, and with `slots` (the cache's length) at least one split per SPLIT_SLOTS of it.

    Why the second rule: rows of unequal lengths (a long tail, a partial-rollout stream) give the programs of one
    (row, kv head) very unequal work, so without splits the few longest rows set the kernel's end; the split count is
    a launch constant (one CUDA graph serves every step), so it follows the cache's length, which bounds every row's
    (docs/performance.md, "decode attention over ragged rows")."""
    splits = 1
    while splits < 16 and (
        rows * kv_heads * splits < multiprocessors or (slots is not None and splits * SPLIT_SLOTS < slots)
    ):
        splits *= 2
    return splits


if triton is not None:

    @triton.jit
    def _soft_cap(s, cap):
        """cap · tanh(s / cap), tanh as 2 / (1 + e^(-2y)) - 1 (exact to float32 rounding; saturates without NaN)."""
        return cap * (2.0 / (1.0 + tl.exp(-2.0 * (s / cap))) - 1.0)

    @triton.jit
    def _partial_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        kn_ptr,
        vn_ptr,
        start_ptr,
        last_ptr,
        out_ptr,
        lse_ptr,
        q_sr,
        q_sk,
        q_sg,
        k_sr,
        k_sk,
        k_ss,
        v_sr,
        v_sk,
        v_ss,
        kn_sr,
        kn_sk,
        vn_sr,
        vn_sk,
        o_sr,
        o_sk,
        o_sg,
        scale,
        softcap,
        kv_heads,
        groups,
        HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        HAS_NEW: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One (row, kv head) per program along axis 0, one split along axis 1. HAS_NEW: the row's slot `last` is taken
        from kn/vn (and written to the cache by split 0) instead of read from the cache. SPLITS == 1: the normalised
        output goes straight to out (strided, q's dtype). Else out is float32 [R, A, SPLITS, G, F] and lse float32
        [R, A, SPLITS, G] (−inf for an empty split). SOFTCAP: scores become softcap · tanh(score / softcap).

        Phases (helpers that Triton inlines): the split's slots (`_split_slots`), the start of the running softmax
        (`_softmax_start`: the new token), the cache's tiles (`_attend_tiles`), the output (`_store_split`)."""
        pid, split = tl.program_id(0), tl.program_id(1)
        row, kv = pid // kv_heads, pid % kv_heads
        last, lo, hi = _split_slots(start_ptr, last_ptr, row, split, HAS_NEW, SPLITS, BLOCK_N)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + row * q_sr + kv * q_sk + g[:, None] * q_sg + d[None, :], mask=g[:, None] < groups, other=0.0
        )
        if UPCAST:
            q = q.to(tl.float32)
        k_base = k_ptr + row * k_sr + kv * k_sk
        v_base = v_ptr + row * v_sr + kv * v_sk
        kn_row, vn_row = kn_ptr + row * kn_sr + kv * kn_sk, vn_ptr + row * vn_sr + kv * vn_sk
        k_last, v_last = k_base + last * k_ss, v_base + last * v_ss
        m, denom, acc = _softmax_start(
            q, kn_row, vn_row, k_last, v_last, d, split, scale, softcap, BLOCK_G, HEAD_DIM, HAS_NEW, SOFTCAP
        )
        m, denom, acc = _attend_tiles(
            q, k_base, v_base, k_ss, v_ss, lo, hi, m, denom, acc, d, scale, softcap, BLOCK_N, SOFTCAP, UPCAST, PRECISION
        )
        out_offset, base = row * o_sr + kv * o_sk, (pid * SPLITS + split) * groups
        _store_split(out_ptr, out_offset, lse_ptr, acc, m, denom, base, g, d, groups, o_sg, HEAD_DIM, SPLITS)

    @triton.jit
    def _split_slots(
        start_ptr, last_ptr, row, split, HAS_NEW: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        """(the row's last slot, the split's first cache slot, its end): whole tiles of BLOCK_N per split."""
        start = tl.load(start_ptr + row)
        last = tl.load(last_ptr + row)
        end = last if HAS_NEW else last + 1  # slots read from the cache: [start, end)
        per_split = tl.cdiv(tl.cdiv(end - start, SPLITS), BLOCK_N) * BLOCK_N
        lo = start + split * per_split
        hi = tl.minimum(lo + per_split, end)
        return last, lo, hi

    @triton.jit
    def _softmax_start(
        q,
        k_new_ptr,
        v_new_ptr,
        k_slot_ptr,
        v_slot_ptr,
        d,
        split,
        scale,
        softcap,
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HAS_NEW: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        """The running softmax (m, denom, acc) a split starts from: empty, or (HAS_NEW, split 0) the new token's,
        whose key and value that split also writes into their cache slot."""
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        if HAS_NEW:
            if split == 0:  # the new token starts the running softmax; its keys/values go into the cache
                k_new = tl.load(k_new_ptr + d)
                v_new = tl.load(v_new_ptr + d)
                tl.store(k_slot_ptr + d, k_new.to(k_slot_ptr.dtype.element_ty))
                tl.store(v_slot_ptr + d, v_new.to(v_slot_ptr.dtype.element_ty))
                m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
                if SOFTCAP:
                    m = _soft_cap(m, softcap)
                denom = tl.full([BLOCK_G], 1.0, tl.float32)
                acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32) + v_new.to(tl.float32)[None, :]
        return m, denom, acc

    @triton.jit
    def _attend_tiles(
        q,
        k_base,
        v_base,
        k_ss,
        v_ss,
        lo,
        hi,
        m,
        denom,
        acc,
        d,
        scale,
        softcap,
        BLOCK_N: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """The running softmax (m, denom, acc) carried over the cache slots [lo, hi), BLOCK_N per tile."""
        n = tl.arange(0, BLOCK_N)
        for n0 in range(lo, hi, BLOCK_N):  # every tile holds at least one valid slot, so m becomes finite at once
            slots = n0 + n
            valid = slots < hi
            k = tl.load(k_base + slots[:, None] * k_ss + d[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if SOFTCAP:
                s = _soft_cap(s, softcap)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(v_base + slots[:, None] * v_ss + d[None, :], mask=valid[:, None], other=0.0)
            if UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        return m, denom, acc

    @triton.jit
    def _store_split(
        out_ptr,
        out_offset,
        lse_ptr,
        acc,
        m,
        denom,
        base,
        g,
        d,
        groups,
        o_sg,
        HEAD_DIM: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """SPLITS == 1: the normalised output into out (strided; `out_offset`: the program's row and kv head). Else
        out is the float32 partial buffer: the split's normalised output and log-sum-exp at `base` (its first group),
        zero and −inf when the split is empty."""
        if SPLITS == 1:
            out = acc / denom[:, None]
            tl.store(
                out_ptr + out_offset + g[:, None] * o_sg + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=g[:, None] < groups,
            )
        else:
            nonempty = denom > 0
            out = tl.where(nonempty[:, None], acc / tl.where(nonempty, denom, 1.0)[:, None], 0.0)
            lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, denom, 1.0)), float("-inf"))
            tl.store(out_ptr + (base + g[:, None]) * HEAD_DIM + d[None, :], out, mask=g[:, None] < groups)
            tl.store(lse_ptr + base + g, lse, mask=g < groups)

    @triton.jit
    def _combine_kernel(
        part_ptr,
        lse_ptr,
        out_ptr,
        o_sr,
        o_sk,
        o_sg,
        kv_heads,
        groups,
        HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        """Softmax-weighted sum of one (row, kv head)'s SPLITS partial outputs → out (strided, out's dtype)."""
        pid = tl.program_id(0)
        row, kv = pid // kv_heads, pid % kv_heads
        p = tl.arange(0, SPLITS)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        in_group = g < groups
        lse = tl.load(
            lse_ptr + (pid * SPLITS + p[:, None]) * groups + g[None, :], mask=in_group[None, :], other=0.0
        )  # [SPLITS, G]; split 0 is never empty, so the max is finite
        weight = tl.exp(lse - tl.max(lse, 0)[None, :])
        part = tl.load(
            part_ptr + ((pid * SPLITS + p[:, None, None]) * groups + g[None, :, None]) * HEAD_DIM + d[None, None, :],
            mask=in_group[None, :, None],
            other=0.0,
        )  # [SPLITS, G, F]
        out = tl.sum(weight[:, :, None] * part, 0) / tl.sum(weight, 0)[:, None]
        tl.store(
            out_ptr + row * o_sr + kv * o_sk + g[:, None] * o_sg + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=in_group[:, None],
        )


def decode_attention(
    q_RAGF: torch.Tensor,
    keys_RASF: torch.Tensor,
    values_RASF: torch.Tensor,
    start_R: torch.Tensor,
    last_R: torch.Tensor,
    scale: float,
    new_keys_RAF: torch.Tensor | None = None,
    new_values_RAF: torch.Tensor | None = None,
    splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    num_stages: int = 2,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ · scale) · v over slots [start_R[r], last_R[r]] of each row r, per kv head and query head
    (softcap: of softcap · tanh(q·kᵀ · scale / softcap), Gemma 2's soft-capped scores).

    q [R, A, G, F] (any strides, last one 1); keys, values [R, A, S, F] (last stride 1); start_R and last_R [R]
    integer tensors on the same device (start ≤ last < S, per row). With new_keys / new_values [R, A, F] (last
    stride 1), slot last_R[r] is theirs: they are written into the cache there (the step's cache write, in the same
    kernel) and used directly. Returns [R, A, G, F] in q's dtype, a transposed view of a [R, G, A, F] tensor:
    flattened as (G, A, F) per row it needs no copy (the layout SDPA returns, which `StaticGenerator`'s fused
    o-projection expects). splits None = `default_splits` over the cache's length S. float32 inputs multiply in full
    float32 (no TF32). block_n (slots per tile), num_warps, num_stages: the kernel's launch configuration.
    """
    if triton is None:
        raise RuntimeError("decode_attention needs Triton (pip install triton, CUDA)")
    splits = _checked_splits(q_RAGF, keys_RASF, values_RASF, start_R, last_R, new_keys_RAF, new_values_RAF, splits)
    rows, kv_heads, groups, head_dim = q_RAGF.shape
    out_RAGF = q_RAGF.new_empty(rows, groups, kv_heads, head_dim).transpose(1, 2)
    has_new = new_keys_RAF is not None and new_values_RAF is not None
    # without new tokens the kernel takes slot 0's keys and values as (unread) stand-ins
    new_k_RAF = new_keys_RAF if new_keys_RAF is not None else keys_RASF[:, :, 0]
    new_v_RAF = new_values_RAF if new_values_RAF is not None else values_RASF[:, :, 0]
    if splits == 1:
        part, lse = out_RAGF, out_RAGF  # the kernel writes out directly; lse unused
    else:  # the splits' outputs [R, A, splits, G, F] and log-sum-exps [R, A, splits, G], combined below
        part = q_RAGF.new_empty(rows, kv_heads, splits, groups, head_dim, dtype=torch.float32)
        lse = q_RAGF.new_empty(rows, kv_heads, splits, groups, dtype=torch.float32)
    strides = [
        *q_RAGF.stride()[:3],
        *keys_RASF.stride()[:3],
        *values_RASF.stride()[:3],
        *new_k_RAF.stride()[:2],
        *new_v_RAF.stride()[:2],
        *out_RAGF.stride()[:3],
    ]
    # Triton launches on the current CUDA device: make it the tensors' (a model on cuda:1, say).
    with torch.cuda.device(q_RAGF.device) if q_RAGF.device.type == "cuda" else contextlib.nullcontext():
        _partial_kernel[(rows * kv_heads, splits)](
            q_RAGF,
            keys_RASF,
            values_RASF,
            new_k_RAF,
            new_v_RAF,
            start_R,
            last_R,
            part,
            lse,
            *strides,
            scale,
            1.0 if softcap is None else float(softcap),
            kv_heads,
            groups,
            HEAD_DIM=head_dim,
            BLOCK_G=max(16, triton.next_power_of_2(groups)),  # 16: tl.dot's smallest tile
            BLOCK_N=block_n,
            SPLITS=splits,
            HAS_NEW=has_new,
            SOFTCAP=softcap is not None,
            UPCAST=interpreted(q_RAGF.device),
            PRECISION="ieee" if q_RAGF.dtype == torch.float32 else "tf32",
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if splits > 1:
            _combine(part, lse, out_RAGF, num_warps)
    return out_RAGF


def _combine(part: torch.Tensor, lse: torch.Tensor, out_RAGF: torch.Tensor, num_warps: int) -> None:
    """Launch `_combine_kernel`: the splits' partial outputs `part` [R, A, splits, G, F] weighted by their
    log-sum-exps `lse` [R, A, splits, G] into out."""
    assert triton is not None  # decode_attention checked
    rows, kv_heads, splits, groups, head_dim = part.shape
    _combine_kernel[(rows * kv_heads,)](
        part,
        lse,
        out_RAGF,
        *out_RAGF.stride()[:3],
        kv_heads,
        groups,
        HEAD_DIM=head_dim,
        BLOCK_G=triton.next_power_of_2(groups),
        SPLITS=splits,
        num_warps=num_warps,
    )


def _checked_splits(
    q_RAGF: torch.Tensor,
    keys_RASF: torch.Tensor,
    values_RASF: torch.Tensor,
    start_R: torch.Tensor,
    last_R: torch.Tensor,
    new_keys_RAF: torch.Tensor | None,
    new_values_RAF: torch.Tensor | None,
    splits: int | None,
) -> int:
    """The split count of a `decode_attention` call (None: `default_splits`); ValueError (one line) for inputs it
    does not take."""
    rows, kv_heads, _, head_dim = q_RAGF.shape
    tensors = [q_RAGF, keys_RASF, values_RASF] + [t for t in (new_keys_RAF, new_values_RAF) if t is not None]
    if not supports(head_dim) or any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(
            f"decode_attention needs a power-of-two head_dim in [16, 256] and unit last strides, got "
            f"head_dim {head_dim}, strides {[t.stride() for t in tensors]}"
        )
    if (new_keys_RAF is None) != (new_values_RAF is None):
        raise ValueError("decode_attention takes new_keys and new_values together")
    if start_R.shape != (rows,) or last_R.shape != (rows,):
        raise ValueError(
            f"decode_attention takes one start and one last slot per row ({rows}), got shapes "
            f"{tuple(start_R.shape)} and {tuple(last_R.shape)}"
        )
    splits = default_splits(rows, kv_heads, q_RAGF.device, keys_RASF.shape[2]) if splits is None else splits
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"decode_attention splits must be a power of two ≥ 1, got {splits}")
    return splits

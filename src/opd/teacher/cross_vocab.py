"""A teacher of another vocabulary (`tokenizer: cross`, or `auto` when the vocabularies differ; SPEC §9): it scores
the student's *text* under its own tokenization, and its scores come back at the student's positions.

`resolve_tokenizer_mode` decides same or cross per teacher before any model loads; `build_cross_vocab` reads both
tokenizers once (every token's bytes, the exact-string vocabulary map, the teacher's EOS); `start_cross_scoring`
aligns a batch (`opd.data.token_alignment`, on the CPU while the student's no-grad scores are on the GPU queue),
scores the teacher's own ids and returns `TokenScores` at the student's positions: the sampled-token log-probs carry
the span signal (`opd.objectives.cross_vocab.span_teacher_logprobs`), the requested log-probs are the teacher's at
the student's top-k where that is exact (one student and one teacher token over the same bytes, every candidate in
both vocabularies), and `exact` says where. `CrossVocab.counts` holds what `xtok/…` reports. With `span_credit:
prefix` the teacher answers with hidden states instead (`HiddenStateSource`: the same forward), from which its
scores and, at each student token that ends inside a teacher token, its log-prob of a token that begins with the text
up to there (`prefix_logprobs`, over a `PrefixIndex` of its vocabulary) are computed here.

A served cross teacher (`url` with `tokenizer_path`) is sent the teacher ids built here, with its tokenizer from
`tokenizer_path` hash-checked against the server's /info (`served_teacher_tokenizer`); the server scores ids as for
any client (docs/spec.md §9 says why ids and not text); it takes `span_credit: even | last` (prefix is refused at
startup: `resolve_tokenizer_mode`). Left out: vLLM teachers, and the teacher's own top-k in the
student's vocabulary (strategies with teacher slots are refused).
"""

from __future__ import annotations

import bisect
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from opd.config import STUDENT
from opd.data.templates import encode_prompts
from opd.data.token_alignment import ROW_STATUSES, AlignedBatch, TokenBytes, align_batch, exact_string_map, token_bytes
from opd.models import (
    TokenizerMismatchError,
    check_tokenizer_compatibility,
    eos_token_ids,
    load_tokenizer,
)
from opd.objectives.cross_vocab import SpanCredit, span_teacher_logprobs
from opd.scoring import OutputHead, default_chunk_size, head_transform
from opd.teacher.base import HiddenStateSource, PendingScores, scores_from_hidden, start_scoring
from opd.teacher.client import RemoteScorer, remote_scorer
from opd.teacher.local import LocalScorer
from opd.teacher.registry import Teacher, TeacherRequest, load_teacher_module, view_prompts
from opd.teacher.wire import tokenizer_fingerprints
from opd.types import Rollouts, TokenScores

__all__ = [
    "CrossVocab",
    "PrefixIndex",
    "build_cross_vocab",
    "check_cross_objective",
    "cross_metrics",
    "cross_teacher_prompts",
    "cross_teacher_views",
    "load_cross_teacher",
    "prefix_logprobs",
    "resolve_tokenizer_mode",
    "served_teacher_tokenizer",
    "start_alignment",
    "start_cross_scoring",
    "teacher_tokenizer_hash",
    "tokenizer_modes",
]


def teacher_tokenizer_hash(tokenizer: Any) -> str:
    """The sha256 of a tokenizer's token → id map (what `/info` reports as vocab_hash): the teacher manifest's."""
    return tokenizer_fingerprints(tokenizer)["vocab_hash"]


def resolve_tokenizer_mode(entry: Any, student_tokenizer: Any, teacher_tokenizer: Any | None = None) -> str:
    """ "same" or "cross" for a teacher entry (its `tokenizer`: auto | same | cross). auto: same when the token → id
    maps agree, cross otherwise; same: the refusal of another vocabulary (`TokenizerMismatchError`, one line).
    A cross teacher is in process (engine: local) or served with its tokenizer at hand (`tokenizer_path`, checked
    against the server's /info here: `served_teacher_tokenizer`); ValueError naming the key otherwise."""
    mode = getattr(entry, "tokenizer", "auto")
    if mode == "same":
        return "same"
    served, engine = getattr(entry, "url", None) is not None, getattr(entry, "engine", "local")
    source = getattr(entry, "tokenizer_path", None) if served else entry.path
    if engine != "local" or source is None:
        if mode == "auto":
            return "same"  # a vLLM teacher, or a served one without tokenizer_path: the student's ids and their check
        where = f"engine: {engine}" if engine != "local" else "url (a served teacher) without tokenizer_path"
        raise ValueError(
            f"teacher {getattr(entry, 'name', 'teacher')}: tokenizer: cross needs an in-process teacher (engine: "
            f"local) or a served one with its tokenizer (tokenizer_path), got {where}; a vLLM teacher, or a served "
            f"one without tokenizer_path, scores the student's own ids (tokenizer: same)"
        )
    if mode == "auto":
        if teacher_tokenizer is None:
            teacher_tokenizer = load_tokenizer(source, trust_remote_code=entry.trust_remote_code)
        try:
            check_tokenizer_compatibility(student_tokenizer, teacher_tokenizer)
            return "same"
        except TokenizerMismatchError:
            pass
    if served and getattr(entry, "span_credit", "even") == "prefix":  # before the server is asked anything
        raise ValueError(
            f"teacher {getattr(entry, 'name', 'teacher')}: span_credit: prefix needs the teacher's distribution "
            f"inside a span, which a served cross teacher (url) does not send; use span_credit: even or last with a "
            f"served teacher, or run the teacher in process (engine: local, no url)"
        )
    if served:  # the tokenizer the client aligns with must be the server's: refused before anything loads
        scorer = remote_scorer(entry)
        try:
            served_teacher_tokenizer(entry, scorer)
        finally:
            scorer.close()
    return "cross"


def served_teacher_tokenizer(entry: Any, scorer: RemoteScorer) -> Any:
    """A served cross teacher's tokenizer, read from its `tokenizer_path`, if its token → id map hashes to the
    server's /info `vocab_hash`; else a one-line ValueError naming both. Another chat template is said (the
    teacher's prompts are rendered with this copy's)."""
    tokenizer = load_tokenizer(entry.tokenizer_path, trust_remote_code=entry.trust_remote_code)
    mine, url, name = tokenizer_fingerprints(tokenizer), scorer.replicas[0].url, getattr(entry, "name", "teacher")
    if mine["vocab_hash"] != scorer.info.get("vocab_hash"):
        raise ValueError(
            f"teacher {name}: tokenizer_path {entry.tokenizer_path} is not the tokenizer the teacher at {url} "
            f"serves (its token → id map hashes to {mine['vocab_hash'][:12]}…, /info's vocab_hash is "
            f"{str(scorer.info.get('vocab_hash'))[:12]}…); give tokenizer_path the served model's tokenizer"
        )
    if mine["chat_template_hash"] != scorer.info.get("chat_template_hash"):
        scorer.log(
            f"note: teacher {name}: tokenizer_path {entry.tokenizer_path} has another chat template than the "
            f"teacher at {url}; its prompts are rendered with tokenizer_path's"
        )
    return tokenizer


@dataclass
class PrefixIndex:
    """The teacher's vocabulary sorted by bytes, so that the tokens whose bytes begin with a string are one range of
    that order (built once per teacher tokenizer; O(V) memory, no prefix → token-set table).

    keys:  the sorted bytes of every teacher token with text (special and empty tokens left out)
    rank:  [V_teacher] long: each id's place in that order, -1 for the tokens left out
    cache: prefix → (lo, hi), the ranges asked for so far
    """

    keys: list[bytes]
    rank: torch.Tensor
    cache: dict[bytes, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def build(cls, teacher: TokenBytes) -> PrefixIndex:
        ids = [i for i, b in enumerate(teacher.table) if b and not teacher.special[i]]
        ids.sort(key=teacher.table.__getitem__)
        rank = torch.full((len(teacher.table),), -1, dtype=torch.long)
        rank[torch.tensor(ids, dtype=torch.long)] = torch.arange(len(ids))
        return cls([teacher.table[i] for i in ids], rank)

    def range(self, prefix: bytes) -> tuple[int, int]:
        """[lo, hi): the places of the tokens whose bytes begin with `prefix` (non-empty)."""
        found = self.cache.get(prefix)
        if found is None:
            lo = bisect.bisect_left(self.keys, prefix)
            stem = prefix.rstrip(b"\xff")  # the least string above every one that begins with prefix
            above = stem[:-1] + bytes([stem[-1] + 1]) if stem else None
            hi = len(self.keys) if above is None else bisect.bisect_left(self.keys, above, lo)
            found = self.cache[prefix] = (lo, hi)
        return found


@dataclass
class CrossVocab:
    """What a cross-vocabulary teacher needs besides its model, read once from both tokenizers.

    teacher_tokenizer: the teacher's own tokenizer (encodes the student's text)
    student, teacher:  every id's bytes (`TokenBytes`)
    vocab_map:         [V_student] long: the teacher id of exactly the same bytes, -1 where none (special tokens
                       never map, the student's EOS ids map to the teacher's EOS)
    student_eos_ids:   the ids the student stops on
    teacher_eos_id:    the id the teacher stops on (its end of turn: its tokenizer's EOS)
    teacher_positions: the teacher's context (max_position_embeddings), None: unbounded
    credit:            how a span's teacher log-prob reaches its student tokens (`span_teacher_logprobs`)
    prefix:            the teacher's `PrefixIndex` (credit "prefix"), else None
    tokenizer_hash:    the teacher tokenizer's hash (`teacher_tokenizer_hash`)
    counts:            the tokens and rows of the calls since the last `cross_metrics` (exact, span, unmapped, …)
    pending:           (rows, the alignment in flight) started for the next scoring call (`start_alignment`)
    """

    teacher_tokenizer: Any
    student: TokenBytes
    teacher: TokenBytes
    vocab_map: torch.Tensor
    student_eos_ids: tuple[int, ...]
    teacher_eos_id: int
    teacher_positions: int | None = None
    credit: SpanCredit = "even"
    prefix: PrefixIndex | None = None
    tokenizer_hash: str = ""
    counts: dict[str, float] = field(default_factory=dict)
    pending: tuple[tuple[int, ...], Future] | None = None

    @property
    def overlap(self) -> int:
        """The exact-string map's size: student ids whose bytes are one teacher token."""
        return int((self.vocab_map >= 0).sum())


def build_cross_vocab(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    *,
    student_eos_ids: list[int],
    teacher_eos_id: int | None = None,
    teacher_positions: int | None = None,
    credit: SpanCredit = "even",
) -> CrossVocab:
    """Read both tokenizers (`token_bytes` refuses a decoder without bytes per token, one line)."""
    student, teacher = token_bytes(student_tokenizer), token_bytes(teacher_tokenizer)
    eos = teacher_eos_id if teacher_eos_id is not None else teacher_tokenizer.eos_token_id
    if eos is None:
        raise ValueError("a cross-vocabulary teacher needs an EOS token (its tokenizer's eos_token): none is set")
    mapped = exact_string_map(student, teacher)
    for i in student_eos_ids:  # an EOS of no exact counterpart stops where the teacher's own EOS does
        if 0 <= i < len(mapped) and mapped[i] < 0:
            mapped[i] = eos
    return CrossVocab(
        teacher_tokenizer=teacher_tokenizer,
        student=student,
        teacher=teacher,
        vocab_map=torch.from_numpy(mapped),
        student_eos_ids=tuple(student_eos_ids),
        teacher_eos_id=int(eos),
        teacher_positions=teacher_positions,
        credit=credit,
        prefix=PrefixIndex.build(teacher) if credit == "prefix" else None,
        tokenizer_hash=teacher_tokenizer_hash(teacher_tokenizer),
    )


@dataclass
class _Aligned:
    """One batch's alignment as tensors (on the CPU): student_span [B, T], teacher ids, span and mask [B, N], and
    per student position the teacher position of its one-to-one span (-1: none). With credit "prefix", per student
    token that ends inside a teacher token (not its span's last): that teacher position (`prefix_at_BT`, -1: none)
    and the `PrefixIndex` range of the tokens that begin with that token's text up to there (`prefix_range_BT2`)."""

    batch: AlignedBatch
    student_span_BT: torch.Tensor
    teacher_ids_BN: torch.Tensor
    teacher_span_BN: torch.Tensor
    teacher_mask_BN: torch.Tensor
    one_to_one_BT: torch.Tensor
    seconds: float = 0.0
    text_bytes: float = 0.0
    prefix_at_BT: torch.Tensor | None = None
    prefix_range_BT2: torch.Tensor | None = None


def _align(cross: CrossVocab, response_ids_BT: torch.Tensor, lengths: list[int], prompt_lengths: list[int]) -> _Aligned:
    """Align every row (its first `lengths[b]` ids) for a teacher whose prompts are `prompt_lengths` long: numpy
    buffers filled row by row, made tensors once."""
    started = time.perf_counter()
    response = response_ids_BT.numpy()
    rows = [response[b, :n].tolist() for b, n in enumerate(lengths)]
    eos = set(cross.student_eos_ids)
    ends = [bool(row) and row[-1] in eos for row in rows]
    room = [None if cross.teacher_positions is None else cross.teacher_positions - p for p in prompt_lengths]
    # the teacher's stop for each row: the exact counterpart of the student's EOS, else the teacher's own EOS
    stops = [int(cross.vocab_map[row[-1]]) if end else cross.teacher_eos_id for row, end in zip(rows, ends)]
    batch = align_batch(
        rows,
        ends,
        cross.student,
        cross.teacher,
        cross.teacher_tokenizer,
        teacher_eos_id=stops,
        max_teacher_tokens=room,
    )
    B, T = response.shape
    N = max(max((len(r.teacher_ids) for r in batch.rows), default=0), 1)
    student_span_BT = np.full((B, T), -1, dtype=np.int64)
    teacher_ids_BN = np.zeros((B, N), dtype=np.int64)
    teacher_span_BN = np.full((B, N), -1, dtype=np.int64)
    one_to_one_BT = np.full((B, T), -1, dtype=np.int64)
    prefix_at_BT = np.full((B, T), -1, dtype=np.int64)
    prefix_range_BT2 = np.zeros((B, T, 2), dtype=np.int64)
    for b, row in enumerate(batch.rows):
        n, m = len(row.student_span), len(row.teacher_ids)
        student_span_BT[b, :n] = row.student_span
        if m:
            teacher_ids_BN[b, :m] = row.teacher_ids
            teacher_span_BN[b, :m] = row.teacher_span
        if row.num_spans:
            span = row.student_span
            s_count = np.bincount(span[span >= 0], minlength=row.num_spans)
            t_count = np.bincount(row.teacher_span, minlength=row.num_spans)
            t_pos = np.full(row.num_spans, -1, dtype=np.int64)
            t_pos[row.teacher_span] = np.arange(m)
            index = np.clip(span, 0, None)
            hit = (span >= 0) & (s_count == 1)[index] & (t_count == 1)[index]
            one_to_one_BT[b, :n] = np.where(hit, t_pos[index], -1)
            if cross.prefix is not None:
                _prefix_queries(cross, row, rows[b], prefix_at_BT[b], prefix_range_BT2[b])
    teacher_span = torch.from_numpy(teacher_span_BN)
    lengths_BT = cross.student.lengths[np.where(student_span_BT >= 0, response, 0)] * (student_span_BT >= 0)
    return _Aligned(
        batch,
        torch.from_numpy(student_span_BT),
        torch.from_numpy(teacher_ids_BN),
        teacher_span,
        teacher_span >= 0,
        torch.from_numpy(one_to_one_BT),
        seconds=time.perf_counter() - started,
        text_bytes=float(lengths_BT.sum()),
        prefix_at_BT=None if cross.prefix is None else torch.from_numpy(prefix_at_BT),
        prefix_range_BT2=None if cross.prefix is None else torch.from_numpy(prefix_range_BT2),
    )


def _prefix_queries(cross: CrossVocab, row: Any, ids: list[int], at_T: np.ndarray, range_T2: np.ndarray) -> None:
    """Fill one row's prefix queries: for each student token that is not its span's last, the teacher position j
    whose token covers the token's end (a cut is never inside a span, so that end is inside a teacher token) and the
    range of the teacher tokens that begin with token j's bytes up to that end (byte offsets as `align_row` cuts)."""
    assert cross.prefix is not None
    span = row.student_span
    aligned = np.flatnonzero(span >= 0)
    if not len(aligned):
        return
    last = np.full(row.num_spans, -1, dtype=np.int64)
    np.maximum.at(last, span[aligned], aligned)
    interior = aligned[last[span[aligned]] != aligned]
    if not len(interior):
        return
    s_ids = np.asarray(ids, dtype=np.int64)
    s_len = np.where(cross.student.special[s_ids], 0, cross.student.lengths[s_ids])
    s_end = np.cumsum(s_len)
    t_ids = np.asarray(row.teacher_ids, dtype=np.int64)
    t_len = cross.teacher.lengths[t_ids].copy()
    shift = int(row.status == "prefix_space")  # its first token's bytes hold a space the text has not
    t_len[0] -= shift
    t_end = np.cumsum(t_len)
    for i in interior.tolist():
        end = int(s_end[i])
        j = int(np.searchsorted(t_end, end, side="right"))
        inside = end - int(t_end[j] - t_len[j]) + (shift if j == 0 else 0)
        at_T[i] = j
        range_T2[i] = cross.prefix.range(cross.teacher.table[int(t_ids[j])][:inside])


def prefix_logprobs(
    hidden_QE: torch.Tensor,
    head: OutputHead,
    range_Q2: torch.Tensor,
    rank_V: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """[Q] float32: at each of Q teacher positions (its final hidden state `hidden_QE`), the log of the teacher's
    probability mass on the tokens whose `rank_V` (`PrefixIndex.rank`) lies in `range_Q2` = [lo, hi): the tokens
    that begin with the query's prefix. Chunked over the Q positions (one chunk's [C, V] logits at a time, C by
    `opd.scoring.CHUNK_BYTES`), never [Q, V] at once; z = the head's logits as `score_hidden` transforms them."""
    Q, V = hidden_QE.shape[0], head.weight.shape[0]
    out = torch.zeros(Q, dtype=torch.float32, device=hidden_QE.device)
    if Q == 0:
        return out
    weight = head.weight
    rank = rank_V[:V].to(weight.device)
    if rank.shape[0] < V:  # head rows past the tokenizer: padding, no prefix
        rank = torch.cat([rank, rank.new_full((V - rank.shape[0],), -1)])
    chunk = chunk_size or max(1, default_chunk_size(V, torch.float32) // 4)  # raw, z, the masked z, exp: ~4 × [C, V]
    with torch.no_grad():
        for s in range(0, Q, chunk):
            h = hidden_QE[s : s + chunk].to(weight.device, weight.dtype)
            raw = h @ weight.T if head.bias is None else torch.addmm(head.bias, h, weight.T)
            z = head_transform(raw, head.logit_scale, head.softcap, temperature)
            lo, hi = range_Q2[s : s + chunk, :1].to(z.device), range_Q2[s : s + chunk, 1:].to(z.device)
            inside = (rank >= lo) & (rank < hi)
            picked = torch.where(inside, z, torch.full_like(z, float("-inf"))).logsumexp(-1)
            out[s : s + chunk] = (picked - z.logsumexp(-1)).float().to(out.device)
    return out


def _score_with_prefix(
    cross: CrossVocab,
    scorer: Any,
    batch: Rollouts,
    aligned: _Aligned,
    requested_BNK: torch.Tensor | None,
    temperature: float | None,
) -> tuple[TokenScores, torch.Tensor]:
    """The teacher's scores of its own batch and its prefix log-probs [B, T] at the student's positions, from one
    forward: its hidden states and head (`HiddenStateSource`), scored here (`scores_from_hidden`)."""
    assert cross.prefix is not None and aligned.prefix_at_BT is not None and aligned.prefix_range_BT2 is not None
    if not isinstance(scorer, HiddenStateSource):
        raise ValueError(
            f"span_credit: prefix needs a teacher that answers with hidden states (an in-process one), got "
            f"{type(scorer).__name__}; use span_credit: even or last"
        )
    tau = 1.0 if temperature is None else temperature
    at_BT = aligned.prefix_at_BT
    b_Q, t_Q = (at_BT >= 0).nonzero(as_tuple=True)
    with torch.no_grad():
        hidden_BNE, head = scorer.hidden_states(batch), scorer.output_head()
        scores = scores_from_hidden(
            hidden_BNE, head, batch, top_k=0, requested_ids=requested_BNK, temperature=tau, with_entropy=False
        )
        hidden_QE = hidden_BNE[b_Q.to(hidden_BNE.device), at_BT[b_Q, t_Q].to(hidden_BNE.device)]
        ranges_Q2 = aligned.prefix_range_BT2[b_Q, t_Q]
        masses_Q = prefix_logprobs(hidden_QE, head, ranges_Q2, cross.prefix.rank, temperature=tau)
    prefix_BT = torch.zeros(at_BT.shape, dtype=torch.float32)
    prefix_BT[b_Q, t_Q] = masses_Q.cpu()
    return scores, prefix_BT


def start_alignment(cross: CrossVocab, rollouts: Rollouts, prompt_lengths: list[int]) -> Future[_Aligned]:
    """`_align` of `rollouts` on the CPU in a background thread (the teacher's tokenizer releases the GIL while it
    encodes): started as soon as the rollouts exist, it runs while the student's no-grad scores are on the GPU."""
    response_ids_BT = rollouts.response_ids.cpu()
    lengths = rollouts.response_mask.sum(-1).cpu().tolist()
    return _EXECUTOR.submit(_align, cross, response_ids_BT, lengths, prompt_lengths)


_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opd-xtok")


def _teacher_rollouts(rollouts: Rollouts, aligned: _Aligned, prompt_ids: list[list[int]], pad_id: int) -> Rollouts:
    """The teacher's batch: its own prompt ids before its own response ids (the aligned text, then its EOS)."""
    lengths = aligned.teacher_mask_BN.sum(-1).tolist()
    B, N = aligned.teacher_ids_BN.shape
    width = max((len(p) + n for p, n in zip(prompt_ids, lengths)), default=1)
    input_ids_BL = torch.full((B, width), pad_id, dtype=torch.long)
    attention_BL = torch.zeros((B, width), dtype=torch.bool)
    for b, (prompt, n) in enumerate(zip(prompt_ids, lengths)):
        p = len(prompt)
        input_ids_BL[b, :p] = torch.tensor(prompt, dtype=torch.long)
        input_ids_BL[b, p : p + n] = aligned.teacher_ids_BN[b, :n]
        attention_BL[b, : p + n] = True
    device = rollouts.input_ids.device
    return Rollouts(
        input_ids=input_ids_BL.to(device),
        attention_mask=attention_BL.to(device),
        prompt_lengths=torch.tensor([len(p) for p in prompt_ids], dtype=torch.long, device=device),
        response_ids=torch.where(aligned.teacher_mask_BN, aligned.teacher_ids_BN, pad_id).to(device),
        response_mask=aligned.teacher_mask_BN.to(device),
        group_ids=rollouts.group_ids,
        truncated=rollouts.truncated,
    )


class CrossCall:
    """A cross teacher's scoring in flight: `result()` waits for the teacher and returns `TokenScores` at the
    student's positions (`start_cross_scoring`); `teacher_batch` is the teacher's own batch it scores."""

    def __init__(
        self,
        cross: CrossVocab,
        pending: Any,
        aligned: _Aligned,
        student: TokenScores,
        exact_BT: torch.Tensor,
        diagnostic_exact_BT: torch.Tensor,
        top_k: int,
        prefix_BT: torch.Tensor | None = None,
        teacher_batch: Rollouts | None = None,
    ):
        self.cross, self.pending, self.aligned, self.student = cross, pending, aligned, student
        self.exact_BT, self.diagnostic_exact_BT, self.top_k = exact_BT, diagnostic_exact_BT, top_k
        self.prefix_BT = prefix_BT
        self.teacher_batch = teacher_batch  # the rows the teacher scores: its prompt ids, then the aligned text's

    def result(self) -> TokenScores:
        teacher = self.pending.result()
        student, aligned = self.student, self.aligned
        device = student.sampled_logprobs.device
        mask_BN = aligned.teacher_mask_BN.to(teacher.sampled_logprobs.device)
        counts = self.cross.counts
        nll = -float(torch.where(mask_BN, teacher.sampled_logprobs.float(), 0.0).sum())
        counts["teacher_nll"] = counts.get("teacher_nll", 0.0) + nll
        counts["text_bytes"] = counts.get("text_bytes", 0.0) + aligned.text_bytes
        student_span_BT = aligned.student_span_BT.to(device)
        sampled_BT = span_teacher_logprobs(
            student.sampled_logprobs.float(),
            teacher.sampled_logprobs.to(device).float(),
            student_span_BT,
            aligned.teacher_span_BN.to(device),
            credit=self.cross.credit,
            prefix_at_BT=None if aligned.prefix_at_BT is None else aligned.prefix_at_BT.to(device),
            prefix_lp_BT=None if self.prefix_BT is None else self.prefix_BT.to(device),
        )
        exact_BT = self.exact_BT.to(device)
        topk_ids = topk_lp = requested = None
        if student.topk_ids is not None and student.topk_logprobs is not None:
            pos_BT = aligned.one_to_one_BT.to(device).clamp(min=0)
            K = student.topk_ids.shape[-1]
            at_BTK = teacher.requested_logprobs.to(device).gather(1, pos_BT[..., None].expand(-1, -1, K))
            diag_BT = self.diagnostic_exact_BT.to(device)
            requested = torch.where(diag_BT[..., None], at_BTK.float(), student.topk_logprobs.float())
            topk_lp, order = requested.sort(dim=-1, descending=True)
            topk_ids = student.topk_ids.gather(-1, order)
        return TokenScores(
            sampled_BT,
            topk_ids,
            topk_lp,
            None,
            requested,
            exact=exact_BT if self.top_k else None,
        )


def start_cross_scoring(
    cross: CrossVocab,
    scorer: Any,
    rollouts: Rollouts,
    student: TokenScores,
    prompt_ids: list[list[int]],
    *,
    top_k: int,
    temperature: float | None,
    alignment: Future[_Aligned] | None = None,
) -> CrossCall:
    """Align the rows of `rollouts` (with their student scores `student`), start the teacher's scoring of its own
    ids (`prompt_ids`: the teacher's rendering of each row's prompt) and count the step's `xtok/…` tokens. `top_k`:
    the objective's (0: sampled-token; exact positions are then the one-to-one spans). `alignment`: the rows'
    alignment already started (`start_alignment`), else it runs now."""
    lengths = [len(p) for p in prompt_ids]
    waited = time.perf_counter()
    aligned = (alignment or start_alignment(cross, rollouts, lengths)).result()
    counts = cross.counts
    counts["align_wait_s"] = counts.get("align_wait_s", 0.0) + time.perf_counter() - waited
    counts["align_s"] = counts.get("align_s", 0.0) + aligned.seconds
    pad_id = cross.teacher_tokenizer.pad_token_id
    batch = _teacher_rollouts(rollouts, aligned, prompt_ids, 0 if pad_id is None else pad_id)
    one_BT = aligned.one_to_one_BT >= 0
    requested_BNK = None
    diag_BT = one_BT
    if student.topk_ids is not None:
        ids_BTK = student.topk_ids.cpu()
        mapped_BTK = cross.vocab_map[ids_BTK.clamp(min=0, max=len(cross.vocab_map) - 1)]
        diag_BT = one_BT & (mapped_BTK >= 0).all(-1)
        B, N = aligned.teacher_ids_BN.shape
        requested_BNK = torch.zeros((B, N, ids_BTK.shape[-1]), dtype=torch.long)
        b_idx, t_idx = diag_BT.nonzero(as_tuple=True)
        requested_BNK[b_idx, aligned.one_to_one_BT[b_idx, t_idx]] = mapped_BTK[b_idx, t_idx]
        requested_BNK = requested_BNK.to(rollouts.input_ids.device)
    exact_BT = diag_BT if top_k else one_BT
    prefix_BT = None
    if cross.credit == "prefix":
        scores, prefix_BT = _score_with_prefix(cross, scorer, batch, aligned, requested_BNK, temperature)
        pending: Any = PendingScores.done(scores)
    else:
        pending = start_scoring(scorer, batch, top_k=0, requested_ids=requested_BNK, temperature=temperature)
    _count(cross, aligned, rollouts.response_mask.cpu(), exact_BT)
    return CrossCall(cross, pending, aligned, student, exact_BT, diag_BT, top_k, prefix_BT, batch)


def _count(cross: CrossVocab, aligned: _Aligned, mask_BT: torch.Tensor, exact_BT: torch.Tensor) -> None:
    aligned_BT = (aligned.student_span_BT >= 0) & mask_BT
    exact = float((exact_BT & aligned_BT).sum())
    counts = cross.counts
    counts["tokens"] = counts.get("tokens", 0.0) + float(mask_BT.sum())
    counts["exact"] = counts.get("exact", 0.0) + exact
    counts["span"] = counts.get("span", 0.0) + float(aligned_BT.sum()) - exact
    counts["unmapped"] = counts.get("unmapped", 0.0) + float((mask_BT & ~aligned_BT).sum())
    counts["spans"] = counts.get("spans", 0.0) + float(sum(r.num_spans for r in aligned.batch.rows))
    counts["rows"] = counts.get("rows", 0.0) + float(len(aligned.batch.rows))
    for status, n in aligned.batch.status.items():
        counts[status] = counts.get(status, 0.0) + n


def cross_metrics(crosses: list[CrossVocab]) -> dict[str, float]:
    """`xtok/exact_frac`, `xtok/span_frac`, `xtok/unmapped_frac` (shares of the cross teachers' response tokens:
    scored exactly, by span, with no teacher signal), `xtok/mean_span_len` (student tokens per span) and per row
    status `xtok/rows_<status>` other than ok, over the calls since the last one; the counts are reset. Time:
    `xtok/align_s` (the alignment's own seconds, in its thread), `xtok/align_wait_s` (what of it the step waited
    for: its share of the step's path) and `xtok/align_ms_per_1k_tokens`. `xtok/teacher_nll_per_byte`: the
    teacher's negative log-likelihood of the student's answers (its own tokens and stop) per byte of their text."""
    total: dict[str, float] = {}
    for cross in crosses:
        for key, value in cross.counts.items():
            total[key] = total.get(key, 0.0) + value
        cross.counts.clear()
    if not total.get("tokens"):
        return {}
    tokens = total["tokens"]
    out = {
        "xtok/exact_frac": total["exact"] / tokens,
        "xtok/span_frac": total["span"] / tokens,
        "xtok/unmapped_frac": total["unmapped"] / tokens,
        "xtok/mean_span_len": (total["exact"] + total["span"]) / max(total["spans"], 1.0),
        "xtok/align_s": total.get("align_s", 0.0),
        "xtok/align_wait_s": total.get("align_wait_s", 0.0),
        "xtok/align_ms_per_1k_tokens": 1e6 * total.get("align_s", 0.0) / tokens,
    }
    if total.get("text_bytes"):
        out["xtok/teacher_nll_per_byte"] = total.get("teacher_nll", 0.0) / total["text_bytes"]
    for status in ROW_STATUSES[1:]:
        out[f"xtok/rows_{status}"] = total.get(status, 0.0)
    return out


def tokenizer_modes(entries: list[Any], student_tokenizer: Any, console: Any = None) -> dict[str, str]:
    """Every teacher entry's resolved mode by name ("same" or "cross", `resolve_tokenizer_mode`); the live student
    is "same". An `auto` entry resolved to cross is said on the console."""
    modes = {}
    for entry in entries:
        if entry.path == STUDENT:
            modes[entry.name] = "same"
            continue
        modes[entry.name] = resolve_tokenizer_mode(entry, student_tokenizer)
        if console is not None and getattr(entry, "tokenizer", "auto") == "auto":
            how = (
                "its vocabulary differs from the student's: cross-tokenizer scoring of the student's text "
                f"(span_credit: {entry.span_credit})"
                if modes[entry.name] == "cross"
                else "the student's vocabulary: it scores the student's token ids"
            )
            console.print(f"teacher {entry.name}: tokenizer auto → {modes[entry.name]} ({how})", soft_wrap=True)
    return modes


def check_cross_objective(entry: Any, objective: Any) -> None:
    """A cross teacher serves what the span signal can give: the sampled-token or the student's top-k (only_stu)
    rewards of the pg loss. One line naming the key otherwise."""
    if objective.top_k and objective.strategy != "only_stu":
        raise ValueError(
            f"teacher {entry.name} has another vocabulary: objective.strategy={objective.strategy} needs its top-k in "
            f"the student's vocabulary; use strategy: only_stu (exact where the strings map, the span signal "
            f"elsewhere) or top_k: 0"
        )
    if objective.loss != "pg":
        raise ValueError(
            f"teacher {entry.name} has another vocabulary: objective.loss={objective.loss} needs its distribution "
            f"over the student's vocabulary; use loss: pg (the span signal is a reward)"
        )


def cross_teacher_prompts(
    entry: Any, prompts: list[Any], mine: list[bool], teacher_tokenizer: Any, *, template: Any, enable_thinking: Any
) -> list[list[int]]:
    """Every prompt's ids as a cross teacher renders it: its view (if any) applied to the prompts routed to it, its
    own chat template and tokenizer (`encode_prompts`, never filtered: the student's length limit already was)."""
    viewed = view_prompts(prompts, entry, mine)
    encoded = encode_prompts(
        teacher_tokenizer,
        viewed,
        max_prompt_length=1 << 30,
        enable_thinking=enable_thinking,
        template=template,
    )
    return encoded.input_ids


def load_cross_teacher(
    entry: Any, *, student_tokenizer: Any, student_eos_ids: list[int], request: TeacherRequest, own_vocab: Any
) -> tuple[Teacher, CrossVocab]:
    """A teacher of another vocabulary: its model and scorer over its own vocabulary (no tokenizer comparison), and
    its `CrossVocab`. `Teacher.vocab` is the student's own (`own_vocab`): the student's ids are the ones the run
    samples and trains. A served one (`url`): its `RemoteScorer`, its tokenizer from `tokenizer_path` checked
    against /info (`served_teacher_tokenizer`), its context the server's `max_positions`."""
    scorer: Any
    if getattr(entry, "url", None) is not None:
        scorer, module = remote_scorer(entry), None
        try:
            tokenizer = served_teacher_tokenizer(entry, scorer)
        except ValueError:
            scorer.close()
            raise
        positions = scorer.info.get("max_positions")
    else:
        module, tokenizer = load_teacher_module(request)
        rows = module.get_output_embeddings().weight.shape[0]
        scorer = LocalScorer(
            module, max_tokens_per_batch=request.max_tokens_per_batch, vocab_size=min(len(tokenizer), rows)
        )
        positions = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    teacher_eos = eos_token_ids(module, tokenizer)
    cross = build_cross_vocab(
        student_tokenizer,
        tokenizer,
        student_eos_ids=student_eos_ids,
        teacher_eos_id=teacher_eos[0] if teacher_eos else None,
        teacher_positions=positions if isinstance(positions, int) else None,
        credit=entry.span_credit,
    )
    return Teacher(scorer=scorer, module=module, vocab=own_vocab), cross


def cross_teacher_views(
    config: Any, prompts: list[Any], routes: list[int], modes: dict[str, str], views: list[Any]
) -> list[Any]:
    """`views` (`opd.teacher.routing.teacher_views`) with every cross teacher's entry replaced by its own rendering
    of every prompt (`cross_teacher_prompts`); the others unchanged."""
    out = list(views)
    for index, entry in enumerate(config.teacher_entries()):
        if modes.get(entry.name) != "cross":
            continue
        source = entry.path if entry.url is None else entry.tokenizer_path  # a served one's: hash-checked
        tokenizer = load_tokenizer(source, trust_remote_code=entry.trust_remote_code)
        out[index] = cross_teacher_prompts(
            entry,
            prompts,
            [r == index for r in routes],
            tokenizer,
            template=config.data.template,
            enable_thinking=config.data.enable_thinking,
        )
    return out

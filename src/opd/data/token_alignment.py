"""Student tokens ↔ teacher tokens of another vocabulary, by the bytes they cover (SPEC §9): the alignment a
cross-vocabulary teacher scores through. Pure CPU, no models.

Every token id has the bytes it adds to a continuation (`token_bytes`: byte-level BPE through the GPT-2 byte
alphabet, SentencePiece `▁` as a space and `<0xNN>` byte fallback, added tokens as their content). A student
response is the concatenation of its tokens' bytes; the teacher re-encodes that text with its own tokenizer, and the
two token sequences are cut at the byte offsets where both have a boundary: the **spans**, the smallest groups of
consecutive student and teacher tokens that cover the same bytes. The student's EOS is one last span with the
teacher's EOS (the teacher's probability of stopping there).

What is not aligned is never guessed: a response whose bytes are not valid UTF-8 is aligned up to the last student
boundary before the first bad byte; a teacher encoding whose bytes are not the text's (normalisation, an unknown
character without byte fallback) leaves its row unaligned; student special tokens inside a response are unaligned.
Every such token is counted (`AlignedBatch.status`), and the caller scores it with no teacher signal.

Left out on purpose: WordPiece-style decoders (`##` continuations, spaces inserted between tokens) have no
context-free bytes per token; `token_bytes` refuses them in one line.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = [
    "ROW_STATUSES",
    "AlignedBatch",
    "RowAlignment",
    "TokenBytes",
    "align_batch",
    "align_row",
    "exact_string_map",
    "response_text",
    "token_bytes",
]

_BYTE_FALLBACK = "<0x"
ROW_STATUSES = ("ok", "prefix_space", "invalid_utf8", "round_trip", "teacher_context")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable alphabet for the 256 bytes, inverted (character → byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _decoder_kinds(tokenizer: Any) -> list[dict]:
    """The backend decoder's parts (a Sequence flattened), from the fast tokenizer's JSON; [] without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no fast (Rust) tokenizer; a cross-vocabulary teacher or student "
            "needs one to know each token's bytes"
        )
    decoder = json.loads(backend.to_str()).get("decoder")
    if decoder is None:
        return []
    return list(decoder.get("decoders", [])) if decoder.get("type") == "Sequence" else [decoder]


@dataclass(frozen=True)
class TokenBytes:
    """Every id's bytes in a continuation, and which ids are special (never text).

    table:   per id below `len(tokenizer)`, its bytes (special tokens: b"")
    lengths: [V] int64, len(table[id])
    special: [V] bool, the tokenizer's special tokens (EOS, pad, BOS, …)
    kind:    the decoder the table was read from ("byte_level", "metaspace", "plain")
    special_names: the special tokens' strings by id (`exact_string_map` maps a special token to the other
             vocabulary's special token of the same string)
    """

    table: list[bytes]
    lengths: np.ndarray
    special: np.ndarray
    kind: str
    special_names: dict[int, str] = field(default_factory=dict)

    def join(self, ids: Sequence[int]) -> bytes:
        table = self.table
        return b"".join([table[i] for i in ids])


def token_bytes(tokenizer: Any) -> TokenBytes:
    """The bytes of every token id of `tokenizer` as it continues a text (`TokenBytes`). Raises ValueError (one
    line) for a decoder without context-free bytes per token (WordPiece, CTC)."""
    parts = _decoder_kinds(tokenizer)
    types = {str(p.get("type")) for p in parts}
    unsupported = types - {"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"}
    if unsupported:
        raise ValueError(
            f"tokenizer decoder {sorted(unsupported)} has no context-free bytes per token; a cross-vocabulary "
            "teacher needs a byte-level BPE, SentencePiece (▁) or plain-piece tokenizer"
        )
    replaces = [
        (p["pattern"].get("String", ""), p.get("content", ""))
        for p in parts
        if p.get("type") == "Replace" and "String" in p.get("pattern", {})
    ]
    if "Metaspace" in types:
        replaces.append(("▁", " "))
    byte_level, fallback = "ByteLevel" in types, "ByteFallback" in types
    kind = "byte_level" if byte_level else ("metaspace" if replaces else "plain")
    size = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    special_ids = set(getattr(tokenizer, "all_special_ids", []))
    decoder = _byte_decoder() if byte_level else {}
    table: list[bytes] = []
    for i, piece in enumerate(pieces):
        if piece is None or i in special_ids:
            table.append(b"")
        elif i in added:
            table.append(piece.encode())
        elif byte_level:
            table.append(bytes(decoder[c] for c in piece) if all(c in decoder for c in piece) else piece.encode())
        elif fallback and len(piece) == 6 and piece.startswith(_BYTE_FALLBACK) and piece.endswith(">"):
            table.append(bytes([int(piece[3:5], 16)]))
        else:
            for old, new in replaces:
                piece = piece.replace(old, new)
            table.append(piece.encode())
    lengths = np.fromiter((len(b) for b in table), dtype=np.int64, count=size)
    special = np.zeros(size, dtype=bool)
    special[[i for i in special_ids if i < size]] = True
    names = {i: pieces[i] for i in special_ids if i < size and pieces[i] is not None}
    return TokenBytes(table, lengths, special, kind, names)


def exact_string_map(student: TokenBytes, teacher: TokenBytes) -> np.ndarray:
    """[V_student] int64: the teacher id whose bytes are exactly the student id's, else -1 (a special token maps to
    the teacher's special token of the same string, empty pieces never map; where several teacher ids share the
    bytes, the lowest id, the base vocabulary's). A string that longer tokens begin with maps only when the same
    longer tokens exist in both vocabularies: its token's probability leaves out theirs ("4" beside "47")."""
    by_bytes: dict[bytes, int] = {}
    for i, b in enumerate(teacher.table):
        if b and not teacher.special[i] and b not in by_bytes:
            by_bytes[b] = i
    specials = {name: i for i, name in sorted(teacher.special_names.items(), reverse=True)}
    # a string that begins longer tokens has its probability split over them too (the digit "4" and the pair "47"):
    # its token's probability means the same in both vocabularies only when the same longer tokens extend it
    student_ext, teacher_ext = _extensions(student), _extensions(teacher)
    out = np.full(len(student.table), -1, dtype=np.int64)
    for i, b in enumerate(student.table):
        if student.special[i]:
            out[i] = specials.get(student.special_names.get(i, ""), -1)
        elif b and student_ext.get(b) == teacher_ext.get(b):
            out[i] = by_bytes.get(b, -1)
    return out


def _extensions(vocab: TokenBytes) -> dict[bytes, tuple[int, int]]:
    """Per proper, non-empty prefix of a (non-special) token: (how many tokens extend it, a hash of which)."""
    out: dict[bytes, tuple[int, int]] = {}
    for i, b in enumerate(vocab.table):
        if vocab.special[i] or len(b) < 2:
            continue
        h = hash(b)
        for n in range(1, len(b)):
            count, total = out.get(b[:n], (0, 0))
            out[b[:n]] = (count + 1, total ^ h)
    return out


@dataclass
class RowAlignment:
    """One response aligned.

    teacher_ids:  the teacher's response ids (its tokens of the aligned text, then its EOS when the student ended)
    student_span: [n_student] int64, the span of each student token; -1: unaligned (no teacher signal)
    teacher_span: [n_teacher] int64, the span of each teacher token
    num_spans:    spans of the row (the EOS span included)
    status:       "ok", "prefix_space" (the teacher prepended a space the text has not: its first token is aligned
                  without it), "invalid_utf8" (a bad byte: the tokens from it on are unaligned), "round_trip" (the
                  teacher's tokens do not cover the text: the row is unaligned) or "teacher_context" (the teacher's
                  tokens were cut to its context at a span boundary)
    """

    teacher_ids: list[int]
    student_span: np.ndarray
    teacher_span: np.ndarray
    num_spans: int
    status: str = "ok"


def _valid_prefix(data: bytes) -> int:
    """Length of the longest prefix of `data` that is valid UTF-8."""
    try:
        data.decode("utf-8")
        return len(data)
    except UnicodeDecodeError as error:
        return error.start


def align_row(
    student_ids: Sequence[int],
    teacher_text_ids: Sequence[int],
    student: TokenBytes,
    teacher: TokenBytes,
    *,
    student_eos: bool,
    teacher_eos_id: int,
    aligned_bytes: int | None = None,
    max_teacher_tokens: int | None = None,
) -> RowAlignment:
    """Align one response: `student_ids` (its tokens, the EOS last when `student_eos`) against `teacher_text_ids`
    (the teacher's encoding of the text of its first `aligned_bytes` bytes: `response_text`). The spans are cut where
    both cumulative byte offsets agree (`np.intersect1d`); the student's EOS and the teacher's `teacher_eos_id`
    form one last span. `max_teacher_tokens`: the teacher's room after its prompt; past it the row is cut at the
    last span boundary that fits."""
    ids = np.asarray(student_ids, dtype=np.int64)
    n = len(ids)
    text_n = n - 1 if student_eos and n else n
    s_len = student.lengths[ids[:text_n]].copy()
    s_len[student.special[ids[:text_n]]] = 0  # a special token mid-response is not text
    s_end = np.cumsum(s_len)
    total = int(s_end[-1]) if text_n else 0
    good = total if aligned_bytes is None else aligned_bytes
    student_span = np.full(n, -1, dtype=np.int64)
    t_ids = np.asarray(teacher_text_ids, dtype=np.int64)
    t_len = teacher.lengths[t_ids] if len(t_ids) else np.zeros(0, dtype=np.int64)
    prefix_space = int(t_len.sum()) == good + 1 and teacher.table[int(t_ids[0])][:1] == b" "
    if prefix_space:  # a SentencePiece teacher that prepends "▁" to a text: its first token starts one byte early
        t_len = t_len.copy()
        t_len[0] -= 1
    if int(t_len.sum()) != good:
        return RowAlignment([], student_span, np.zeros(0, dtype=np.int64), 0, "round_trip")
    # student tokens wholly inside the good bytes, non-empty; a boundary only after a token that ends within them
    inside = (s_end <= good) & (s_len > 0)
    t_end = np.cumsum(t_len)
    cuts = np.intersect1d(s_end[inside], t_end, assume_unique=False)
    status = "ok" if good == total else "invalid_utf8"
    status = "prefix_space" if prefix_space and status == "ok" else status
    num_teacher = len(t_ids)
    if max_teacher_tokens is not None and num_teacher + (student_eos and good == total) > max_teacher_tokens:
        fitting = np.intersect1d(cuts, t_end[: max(max_teacher_tokens, 0)])  # the EOS span is left out
        last = int(fitting[-1]) if len(fitting) else 0
        cuts = cuts[cuts <= last]
        num_teacher = int(np.searchsorted(t_end, last, side="right")) if last else 0
        inside &= s_end <= last
        status = "teacher_context"
    teacher_span = np.searchsorted(cuts, t_end[:num_teacher], side="left").astype(np.int64)
    student_span[:text_n][inside] = np.searchsorted(cuts, s_end[inside], side="left")
    num_spans = len(cuts)
    teacher_ids = t_ids[:num_teacher].tolist()
    if student_eos and status in ("ok", "prefix_space"):
        student_span[n - 1] = num_spans
        teacher_ids.append(int(teacher_eos_id))
        teacher_span = np.append(teacher_span, num_spans)
        num_spans += 1
    return RowAlignment(teacher_ids, student_span, teacher_span, num_spans, status)


@dataclass
class AlignedBatch:
    """A batch of rows aligned (`align_batch`), with what the metrics count.

    rows:      one `RowAlignment` per response
    status:    counts of rows per status (`ROW_STATUSES`)
    """

    rows: list[RowAlignment]
    status: dict[str, int] = field(default_factory=dict)


def response_text(ids: Sequence[int], student: TokenBytes) -> tuple[str, int]:
    """The text of a response's tokens (EOS excluded by the caller) and how many of its bytes it holds: the longest
    valid UTF-8 prefix, cut back to the last student token boundary (never half a token)."""
    ids_a = np.asarray(ids, dtype=np.int64)
    keep = ids_a[~student.special[ids_a]] if len(ids_a) else ids_a
    data = student.join(keep.tolist())
    good = _valid_prefix(data)
    if good < len(data):
        ends = np.cumsum(student.lengths[keep])
        good = int(ends[ends <= good][-1]) if (ends <= good).any() else 0
    return data[:good].decode("utf-8"), good


def align_batch(
    responses: Sequence[Sequence[int]],
    ends_with_eos: Sequence[bool],
    student: TokenBytes,
    teacher: TokenBytes,
    teacher_tokenizer: Any,
    *,
    teacher_eos_id: int | Sequence[int],
    max_teacher_tokens: Sequence[int | None] | None = None,
) -> AlignedBatch:
    """Align every response (its token ids, the EOS last where `ends_with_eos`): one batched call of the teacher's
    tokenizer on all the texts, then `align_row` per row (numpy on offsets). `teacher_eos_id`: the teacher's stop,
    one for every row or one per row."""
    stops = [teacher_eos_id] * len(responses) if isinstance(teacher_eos_id, int) else list(teacher_eos_id)
    texts, goods = [], []
    for ids, eos in zip(responses, ends_with_eos):
        text, good = response_text(ids[: len(ids) - 1] if eos and len(ids) else ids, student)
        texts.append(text)
        goods.append(good)
    encoded = teacher_tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    rows, status = [], dict.fromkeys(ROW_STATUSES, 0)
    for b, (ids, eos) in enumerate(zip(responses, ends_with_eos)):
        row = align_row(
            ids,
            encoded[b],
            student,
            teacher,
            student_eos=eos,
            teacher_eos_id=stops[b],
            aligned_bytes=goods[b],
            max_teacher_tokens=None if max_teacher_tokens is None else max_teacher_tokens[b],
        )
        rows.append(row)
        status[row.status] += 1
    return AlignedBatch(rows, status)

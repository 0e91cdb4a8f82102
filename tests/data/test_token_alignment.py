import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_cross_vocab import KINDS, byte_bpe, characters, sentencepiece
from opd.data.token_alignment import align_batch, align_row, exact_string_map, token_bytes
from opd.objectives.cross_vocab import span_sums

PAIRS = [(s, t) for s, t in itertools.product(KINDS, KINDS) if s != t] + [("byte_bpe", "byte_bpe")]
TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("abc xyz 0123456789.,;=+\n")),
        st.characters(min_codepoint=0x20, max_codepoint=0x2FFFF, exclude_categories=("Cs", "Cc")),
    ),
    max_size=40,
)


def _align_text(text, student_tok, teacher_tok):
    s, t = token_bytes(student_tok), token_bytes(teacher_tok)
    ids = student_tok(text, add_special_tokens=False)["input_ids"] + [student_tok.eos_token_id]
    batch = align_batch([ids], [True], s, t, teacher_tok, teacher_eos_id=teacher_tok.eos_token_id)
    return ids, batch.rows[0], s, t


def _assert_tiles(text, ids, row, s, t):
    """Spans tile the response: each span is ≥ 1 student and ≥ 1 teacher token of the same bytes, in order, the
    EOS span last, and together they are the text's bytes exactly (nothing lost or counted twice)."""
    assert row.status == "ok"
    assert (row.student_span >= 0).all()
    assert (np.diff(row.student_span) >= 0).all() and (np.diff(row.teacher_span) >= 0).all()
    assert set(row.student_span.tolist()) == set(range(row.num_spans)) == set(row.teacher_span.tolist())
    joined = b""
    for span in range(row.num_spans - 1):
        s_bytes = s.join([i for i, k in zip(ids, row.student_span) if k == span])
        t_bytes = t.join([i for i, k in zip(row.teacher_ids, row.teacher_span) if k == span])
        assert s_bytes == t_bytes and s_bytes
        joined += s_bytes
    assert joined == text.encode()
    assert row.student_span[-1] == row.teacher_span[-1] == row.num_spans - 1  # EOS ↔ EOS


@pytest.mark.parametrize("student_kind,teacher_kind", PAIRS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, seed=st.integers(0, 2**16))
def test_spans_tile_the_response_and_sum_to_the_teachers_logprob(student_kind, teacher_kind, text, seed):
    student_tok, teacher_tok = KINDS[student_kind](), KINDS[teacher_kind]()
    ids, row, s, t = _align_text(text, student_tok, teacher_tok)
    _assert_tiles(text, ids, row, s, t)
    # any teacher log-probs of its own tokens: the spans' sums add up to the whole text's (float64, exact order)
    teacher_lp_N = -torch.rand(len(row.teacher_ids), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    spans_S = span_sums(teacher_lp_N[None], torch.from_numpy(row.teacher_span)[None], row.num_spans)[0]
    assert torch.allclose(spans_S.sum(), teacher_lp_N.sum(), atol=1e-12, rtol=0)


def test_known_conventions_align_span_by_span():
    """Byte-level `Ġ` against SentencePiece `▁`, byte fallback and a multi-byte character split over byte tokens."""
    text = "Café 数学 🙂 x = 3"
    for student_tok, teacher_tok in [(byte_bpe(), sentencepiece()), (characters(), byte_bpe())]:
        ids, row, s, t = _align_text(text, student_tok, teacher_tok)
        _assert_tiles(text, ids, row, s, t)


def test_a_teacher_that_prepends_a_space_is_aligned_without_it_and_counted():
    teacher_tok = sentencepiece(prepend=True)
    ids, row, s, t = _align_text("hello world", byte_bpe(), teacher_tok)
    assert row.status == "prefix_space"
    assert (row.student_span >= 0).all()


def test_identical_tokenizers_map_every_id_to_itself():
    tok = byte_bpe()
    mapped = exact_string_map(token_bytes(tok), token_bytes(tok))
    assert mapped.tolist() == list(range(len(tok)))  # special tokens by their string too


def test_unknown_characters_without_byte_fallback_fail_the_round_trip():
    teacher_tok = characters(byte_fallback=False)
    ids, row, s, t = _align_text("x = 数", byte_bpe(), teacher_tok)
    assert row.status == "round_trip" and (row.student_span == -1).all() and row.teacher_ids == []


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 399), max_size=30))
def test_random_student_tokens_with_invalid_utf8_are_aligned_up_to_the_first_bad_byte(ids):
    student_tok, teacher_tok = byte_bpe(), sentencepiece()
    s, t = token_bytes(student_tok), token_bytes(teacher_tok)
    batch = align_batch([ids], [False], s, t, teacher_tok, teacher_eos_id=teacher_tok.eos_token_id)
    row = batch.rows[0]
    data = s.join(ids)
    try:
        data.decode("utf-8")
        assert row.status == "ok"
    except UnicodeDecodeError:
        assert row.status == "invalid_utf8" and batch.status["invalid_utf8"] == 1
    aligned = [i for i, k in zip(ids, row.student_span) if k >= 0]
    assert aligned == ids[: len(aligned)]  # a prefix of the response
    assert s.join(aligned) == t.join(row.teacher_ids)


def test_a_teacher_context_cuts_the_row_at_a_span_boundary():
    student_tok, teacher_tok = byte_bpe(), characters()
    s, t = token_bytes(student_tok), token_bytes(teacher_tok)
    text = "the answer is 47"
    ids = student_tok(text, add_special_tokens=False)["input_ids"] + [student_tok.eos_token_id]
    teacher_ids = teacher_tok(text, add_special_tokens=False)["input_ids"]
    row = align_row(ids, teacher_ids, s, t, student_eos=True, teacher_eos_id=2, max_teacher_tokens=7)
    assert row.status == "teacher_context" and 0 < len(row.teacher_ids) <= 7
    aligned = [i for i, k in zip(ids, row.student_span) if k >= 0]
    assert s.join(aligned) == t.join(row.teacher_ids) and row.student_span[-1] == -1  # no EOS span

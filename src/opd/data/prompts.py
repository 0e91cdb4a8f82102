"""Load prompt sets into `Prompt` records, and save them back.

Sources (`load_prompts`): parquet in the verl layout (`prompt`, `reward_model.ground_truth`, `data_source`,
`extra_info.index`; other layouts through a column mapping), JSONL / JSON / CSV with the same columns, and Hugging
Face `datasets` (a `save_to_disk` directory or a hub id). A ground truth is a string, a number or a list meaning "any
of these"; a row without one is an error naming it, or dropped, or kept (`on_missing_answer`). Dotted keys reach into
nested columns, and unused columns go to `Prompt.meta`, so `save_prompts` writes a file that loads back to the same
records (docs/design.md, "opd.data.prompts").

Omitted on purpose: streaming (prompt sets fit in memory), shuffling and sampling (the trainer's seeded sampler owns
the order), and any rewriting of the text (instruction templates live in `opd.data.templates`, so a set can be
re-templated explicitly and the change is visible).
"""

from __future__ import annotations

import csv
import difflib
import errno
import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from opd.io import atomic_path
from opd.types import Prompt

ROW_ID = "#row"
"""`id_key` value that makes the row number (0-based, in the file) the prompt id."""

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
CSV_SUFFIXES = (".csv", ".tsv")
_ACCEPTED = ".parquet, .jsonl, .json, .csv, a `datasets` save_to_disk directory, or a Hugging Face hub id"

_log = logging.getLogger(__name__)

OnMissingAnswer = Literal["error", "skip", "keep"]
ON_MISSING_ANSWER = ("error", "skip", "keep")

_DEFAULT_SOURCE_KEY = "data_source"
_AUTO_ID_KEYS = ("extra_info.index", "id")
MISSING = object()  # a key absent from a row, as opposed to present with a null value
_PROBE_ROWS = 1000  # rows inspected to decide whether a key exists in a set


class DataError(ValueError):
    """A prompt set that cannot be loaded or saved. The message is one line naming the file, the field or row,
    the value found and what would be accepted."""


def load_prompts(
    source: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "reward_model.ground_truth",
    id_key: str | None = None,
    source_key: str = _DEFAULT_SOURCE_KEY,
    system_key: str | None = None,
    split: str = "train",
    hub_config: str | None = None,
    limit: int | None = None,
    on_missing_answer: OnMissingAnswer = "error",
) -> list[Prompt]:
    """Read a prompt set into `Prompt` records, in file order.

    source:     a file (.parquet, .jsonl, .json, .csv), a `save_to_disk` directory, or a hub id ("owner/name").
    prompt_key: column of the prompt: chat messages `[{role, content}]`, a JSON string of them, or plain text
                (→ one user message).
    answer_key: column of the ground truth: a str, a number (written with `str`) or a list of them (any of them
                is correct; kept as a list of str, a one-element list unwrapped); None for a set without answers.
    id_key:     column of the id; None picks `extra_info.index`, else `id`, else the row number; `ROW_ID` forces
                the row number. Ids must be unique.
    source_key: column naming the set; when the default `data_source` is absent the file stem is used.
    system_key: optional column of a system prompt, prepended as a system message when the row has none.
    split:      split of a hub dataset or of a saved `DatasetDict`; ignored for files.
    hub_config: configuration name of a hub dataset (e.g. "main" for "openai/gsm8k").
    limit:      keep only the first `limit` rows (≥ 1).
    on_missing_answer: a row without a ground truth (null, absent, empty, NaN) when `answer_key` is set:
                "error" (a `DataError` naming the row), "skip" (dropped; the count is logged) or "keep" (answer None).
    Returns a non-empty list of `Prompt`; raises `DataError` (one line) on anything it cannot read.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise DataError(f"load_prompts: limit must be an integer ≥ 1 or None, got {limit!r}")
    if on_missing_answer not in ON_MISSING_ANSWER:
        raise DataError(
            f"load_prompts: on_missing_answer must be one of {', '.join(ON_MISSING_ANSWER)}, got {on_missing_answer!r}"
        )
    rows, origin, stem = _read_rows(source, split=split, hub_config=hub_config, limit=limit)
    if not rows:
        raise DataError(f"{origin}: the prompt set is empty (0 rows); expected at least one row")
    columns = _resolve_columns(rows, origin, prompt_key, answer_key, id_key, source_key, system_key)
    prompts, skipped = _rows_to_prompts(rows, origin, stem, columns, on_missing_answer)
    if skipped:
        if not prompts:
            raise DataError(
                f"{origin}: every row's {answer_key!r} is empty (null, absent or blank), so "
                f"on_missing_answer=skip left no prompt; check answer_key"
            )
        _log.warning(
            "%s: skipped %d of %d rows without a ground truth in %r (first: row %d; on_missing_answer=skip)",
            origin,
            len(skipped),
            len(rows),
            answer_key,
            skipped[0],
        )
    return prompts


class _Columns(NamedTuple):
    """The columns `load_prompts` reads (`id` resolved: a column or ROW_ID)."""

    prompt: str
    answer: str | None
    id: str
    source: str
    system: str | None


def _resolve_columns(
    rows: list[dict],
    origin: str,
    prompt_key: str,
    answer_key: str | None,
    id_key: str | None,
    source_key: str,
    system_key: str | None,
) -> _Columns:
    """Check that every named column is present (the default source column may be absent) and that the prompt
    column is no other; resolve the id column (None: the first of _AUTO_ID_KEYS present, else ROW_ID)."""
    _require_key(rows, prompt_key, "prompt_key", origin)
    if answer_key is not None:
        _require_key(rows, answer_key, "answer_key", origin, hint="or answer_key=None for a set without answers")
    if system_key is not None:
        _require_key(rows, system_key, "system_key", origin)
    if source_key != _DEFAULT_SOURCE_KEY:
        _require_key(rows, source_key, "source_key", origin)
    if id_key is None:
        id_key = next((k for k in _AUTO_ID_KEYS if _has_key(rows, k)), ROW_ID)
    elif id_key != ROW_ID:
        _require_key(rows, id_key, "id_key", origin, hint=f"or id_key={ROW_ID!r} for row numbers")
    for field, key in (("answer_key", answer_key), ("id_key", id_key)):
        if key == prompt_key:
            raise DataError(
                f"{origin}: prompt_key={prompt_key!r} is also the {field} column; the prompt column must "
                f"hold the prompts: pass prompt_key=<the prompt column>"
            )
    return _Columns(prompt_key, answer_key, id_key, source_key, system_key)


def _rows_to_prompts(
    rows: list[dict], origin: str, stem: str, columns: _Columns, on_missing_answer: OnMissingAnswer
) -> tuple[list[Prompt], list[int]]:
    """The rows as `Prompt`s, and the row numbers skipped for a missing answer (on_missing_answer="skip")."""
    prompt_key, answer_key, id_key, source_key, system_key = columns
    used_keys = [k for k in columns if k and k != ROW_ID]
    prompts: list[Prompt] = []
    seen: dict[str, tuple[int, str | list[str] | None]] = {}
    skipped: list[int] = []
    for i, row in enumerate(rows):
        messages = _to_messages(get_field(row, prompt_key), origin, i, prompt_key)
        if system_key is not None:
            system = get_field(row, system_key)
            if isinstance(system, str) and system and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": system}, *messages]
        answer = None if answer_key is None else to_answer(get_field(row, answer_key), f"{origin}: row {i}", answer_key)
        raw_id = None if id_key == ROW_ID else get_field(row, id_key)
        pid = str(i) if raw_id is None or raw_id is MISSING else str(raw_id)
        if pid in seen:
            j, other = seen[pid]
            same = (
                "the same answer" if other == answer else f"answer {_short(other, 40)} there, {_short(answer, 40)} here"
            )
            raise DataError(
                f"{origin}: id {pid!r} of row {i} (field {id_key!r}) repeats row {j} ({same}); ids must be unique: "
                f"pass id_key=<unique column> or id_key={ROW_ID!r} for row numbers"
            )
        seen[pid] = (i, answer)
        if answer_key is not None and answer is None:
            if on_missing_answer == "error":
                raise DataError(
                    f"{origin}: row {i} (id {pid!r}) field {answer_key!r} is "
                    f"{describe_missing(get_field(row, answer_key))}: "
                    f"no ground truth; fix the row, or pass on_missing_answer=skip to drop such rows (keep: no answer)"
                )
            if on_missing_answer == "skip":
                skipped.append(i)
                continue
        src = get_field(row, source_key)
        prompts.append(
            Prompt(
                id=pid,
                messages=messages,
                answer=answer,
                source=stem if src is None or src is MISSING else str(src),
                meta=_leftover(row, used_keys),
            )
        )
    return prompts, skipped


def save_prompts(prompts: Iterable[Prompt], path: str | Path) -> Path:
    """Write prompts as a verl-layout file chosen by extension (.parquet, or .jsonl/.ndjson), atomically.

    Layout: `data_source`, `prompt` (messages), `reward_model` {`ground_truth`, ...}, `extra_info` {`index` = id,
    ...}, then the other `meta` columns (nested `meta` entries go back where they came from). `load_prompts` with
    its defaults reads it back to the same records. Returns the path written.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in PARQUET_SUFFIXES + JSONL_SUFFIXES:
        raise DataError(
            f"{path}: cannot save prompts as {suffix or 'a file without extension'!r}; "
            f"accepted: .parquet, .jsonl, .ndjson"
        )
    prompts = list(prompts)
    # a column mixing strings and lists has no arrow type (it would be stored as JSON text): lists for all
    as_lists = any(isinstance(p.answer, list) for p in prompts)
    records = [_to_record(p, answer_as_list=as_lists) for p in prompts]
    if not records:
        raise DataError(f"{path}: refusing to save an empty prompt set; expected at least one prompt")
    with atomic_path(path) as tmp:  # temp file + rename, with the user's umask (not mkstemp's 0600)
        if suffix in PARQUET_SUFFIXES:
            pq.write_table(_records_to_table(records), tmp, compression="zstd")
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    return path


# ---------------------------------------------------------------- reading


def _read_rows(source: str | Path, *, split: str, hub_config: str | None, limit: int | None):
    """(rows as dicts, origin for messages, stem for the default source name)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _read_saved_dataset(path, split, limit), str(path), path.name
    if path.is_file():
        suffix = path.suffix.lower()
        try:
            if suffix in PARQUET_SUFFIXES:
                table = pq.read_table(path)
                if limit is not None:
                    table = table.slice(0, limit)
                rows = table.to_pylist()
            elif suffix in JSONL_SUFFIXES:
                rows = _read_jsonl(path)
            elif suffix in JSON_SUFFIXES:
                rows = _read_json(path)
            elif suffix in CSV_SUFFIXES:
                with open(path, newline="", encoding="utf-8") as f:
                    rows = list(csv.DictReader(f, delimiter="\t" if suffix == ".tsv" else ","))
            else:
                raise DataError(f"{path}: unknown file type {suffix or '(no extension)'!r}; accepted: {_ACCEPTED}")
        except DataError:
            raise
        except (OSError, UnicodeDecodeError, pa.ArrowException) as e:
            raise DataError(f"{path}: cannot read it as {suffix[1:]}: {_first_line(e)}; accepted: {_ACCEPTED}") from e
        return (rows if limit is None else rows[:limit]), str(path), path.stem
    text = str(source)
    looks_local = (
        path.suffix.lower() in PARQUET_SUFFIXES + JSONL_SUFFIXES + JSON_SUFFIXES + CSV_SUFFIXES
        or text.startswith(("/", ".", "~"))
        or text.count("/") > 1
    )
    if path.is_symlink():  # exists() is False for a link that loops or dangles: not "no such file"
        try:
            path.resolve(strict=True)
            what = "a symbolic link that cannot be followed"
        except RuntimeError:
            what = "a symbolic link loop"
        except OSError as error:
            what = (
                "a symbolic link loop"
                if error.errno == errno.ELOOP
                else f"a symbolic link to a missing path ({os.readlink(path)})"
            )
        raise DataError(f"{text}: {what}; accepted: {_ACCEPTED}")
    if looks_local:
        raise DataError(f"{text}: no such file or directory; accepted: {_ACCEPTED}")
    return _read_hub_dataset(text, split, hub_config, limit), f"hub dataset {text!r} (split {split!r})", text


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}: line {n} is not JSON ({e.msg}): {_short(line)}; expected one JSON object per line"
                ) from e
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {n} is a {type(row).__name__}, expected a JSON object: {_short(row)}")
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines under a .json name (what `Dataset.to_json` writes)
            return _read_jsonl(path)
        raise DataError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}); expected a list of records or JSON lines"
        ) from e
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataError(f"{path}: expected a JSON list of records (objects), got {_short(data)}")
    return data


def _import_datasets(what: str):
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"{what} needs the optional package `datasets`: pip install datasets") from e
    return datasets


def _read_saved_dataset(path: Path, split: str, limit: int | None) -> list[dict]:
    markers = ("dataset_dict.json", "dataset_info.json", "state.json")
    if not any((path / m).exists() for m in markers):
        raise DataError(
            f"{path}: a directory that is not a `datasets` save_to_disk output (no {', '.join(markers)}); "
            f"accepted: {_ACCEPTED}"
        )
    datasets = _import_datasets(f"{path} (a saved dataset)")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types; report one line
        raise DataError(f"{path}: datasets.load_from_disk failed: {_first_line(e)}") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: no split {split!r}; available splits: {', '.join(ds)}")
        ds = ds[split]
    return _dataset_rows(ds, limit)


def _read_hub_dataset(name: str, split: str, hub_config: str | None, limit: int | None) -> list[dict]:
    datasets = _import_datasets(f"{name!r} (not a local file, so read as a Hugging Face hub id)")
    try:
        ds = datasets.load_dataset(name, hub_config, split=split)
    except Exception as e:
        raise DataError(
            f"{name}: not a local file, and loading it as a Hugging Face hub dataset (split {split!r}) "
            f"failed: {_first_line(e)}; accepted: {_ACCEPTED}"
        ) from e
    return _dataset_rows(ds, limit)


def _dataset_rows(ds, limit: int | None) -> list[dict]:
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds.to_list()


# ---------------------------------------------------------------- fields


def get_field(row: Any, key: str) -> Any:
    """Value at a (dotted) key of a record, `MISSING` when absent. A dict stored as a JSON string is decoded on
    the way. Public: every reader of records with column mappings uses it."""
    if isinstance(row, dict) and key in row:
        return row[key]
    node = row
    for part in key.split("."):
        if isinstance(node, str) and node.lstrip().startswith("{"):
            try:
                node = json.loads(node)
            except json.JSONDecodeError:
                return MISSING
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _has_key(rows: list[dict], key: str) -> bool:
    return any(get_field(row, key) is not MISSING for row in rows[:_PROBE_ROWS])


def _available_keys(rows: list[dict]) -> list[str]:
    keys: dict[str, None] = {}
    for row in rows[:100]:
        for k, v in row.items():
            keys[k] = None
            if isinstance(v, dict):
                for sub in v:
                    keys[f"{k}.{sub}"] = None
    return list(keys)


def _require_key(rows: list[dict], key: str, field: str, origin: str, hint: str = "") -> None:
    if _has_key(rows, key):
        return
    available = _available_keys(rows)
    close = difflib.get_close_matches(key, available, n=1, cutoff=0.5)
    close_lc = [a for a in available if a.lower() == key.lower() or a.split(".")[-1].lower() == key.lower()]
    suggestion = (close_lc or close or [""])[0]
    msg = f"{origin}: no column {key!r} ({field}); available: {', '.join(available)}"
    if suggestion:
        msg += f"; did you mean {field}={suggestion!r}?"
    if hint:
        msg += f" ({hint})"
    raise DataError(msg)


def _to_messages(value: Any, origin: str, row: int, key: str) -> list[dict[str, str]]:
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            decoded = None  # plain text that happens to start with "["
        if isinstance(decoded, list) and decoded and all(isinstance(m, dict) for m in decoded):
            value = decoded
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{origin}: row {row} field {key!r} is an empty string; expected the prompt text")
        return [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for m in value:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(
                    f"{origin}: row {row} field {key!r} has message {_short(m)}; expected "
                    f"{{'role': str, 'content': str}}"
                )
            if m["role"] in ("user", "assistant") and not m["content"].strip():
                raise DataError(
                    f"{origin}: row {row} field {key!r} has a {m['role']} message with empty content; expected its text"
                )
            messages.append({"role": m["role"], "content": m["content"]})
        return messages
    raise DataError(
        f"{origin}: row {row} field {key!r} is {_short(value)} ({type(value).__name__}); expected a "
        f"string or a non-empty list of {{'role', 'content'}} messages (or a JSON string of one)"
    )


def to_answer(value: Any, where: str, key: str) -> str | list[str] | None:
    """A ground truth as read from a record: str, list of str (any of them is correct; one element is unwrapped),
    or None when there is none (null, `MISSING`, blank, NaN, a list of those). Raises `DataError` naming `where`
    (e.g. "file: row 3") and field `key` for a bool, a dict or a nested list. Public: `opd eval --responses` uses it.
    """
    if isinstance(value, (list, tuple)):
        scalars = [_scalar_answer(v, where, key) for v in value]
        items = [v for v in scalars if v is not None]
        return None if not items else items[0] if len(items) == 1 else items
    return _scalar_answer(value, where, key)


def _scalar_answer(value: Any, where: str, key: str) -> str | None:
    if value is None or value is MISSING or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(
        f"{where} field {key!r} is {_short(value)} ({type(value).__name__}); "
        f"expected a string, a number or a list of them"
    )


def describe_missing(value: Any) -> str:
    """How a missing ground truth was written, for messages."""
    if value is MISSING:
        return "absent"
    if value is None:
        return "null"
    if isinstance(value, float):
        return "NaN"
    if isinstance(value, str):
        return "an empty string"
    return f"{_short(value, 40)} (no non-empty entry)"


def _drop_nulls(value: Any) -> Any:
    """A copy of nested dicts without null entries (a columnar file fills absent fields with nulls)."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    return value


def _leftover(row: dict, used_keys: list[str]) -> dict[str, Any]:
    """The row without the fields the mapping consumed, null fields and pandas index columns. Dicts on the path
    of a dotted key are copied (JSON strings decoded), and dropped once emptied."""
    meta = {k: _drop_nulls(v) for k, v in row.items() if v is not None and not k.startswith("__index_level_")}
    for key in used_keys:
        if key in meta:
            del meta[key]
            continue
        *path, leaf = key.split(".")
        parent = meta
        for part in path:
            child = parent.get(part)
            if isinstance(child, str) and child.lstrip().startswith("{"):
                try:
                    parent[part] = child = _drop_nulls(json.loads(child))
                except json.JSONDecodeError:
                    break
            if not isinstance(child, dict):
                break
            parent = child
        else:
            parent.pop(leaf, None)
        if path and meta.get(path[0]) == {}:
            del meta[path[0]]
    return meta


# ---------------------------------------------------------------- writing


def _to_record(p: Prompt, answer_as_list: bool = False) -> dict[str, Any]:
    """One verl-layout row; the record's own answer and id win over stale copies in `meta`."""
    meta = {k: v for k, v in p.meta.items() if k not in ("prompt", "data_source")}
    reward_model = _without(meta.pop("reward_model", None), "ground_truth")
    extra_info = _without(meta.pop("extra_info", None), "index")
    answer = [p.answer] if answer_as_list and isinstance(p.answer, str) else p.answer
    return {
        "data_source": p.source,
        "prompt": [{"role": m["role"], "content": m["content"]} for m in p.messages],
        "reward_model": {"ground_truth": answer, **reward_model},  # verl's field order
        "extra_info": {"index": p.id, **extra_info},
        **meta,
    }


def _without(value: Any, key: str) -> dict:
    return {k: v for k, v in value.items() if k != key} if isinstance(value, dict) else {}


def _records_to_table(records: list[dict]) -> pa.Table:
    """Columns typed over all rows (a key absent in a row is null); a column whose values have no common arrow
    type (e.g. int in one row, str in another) is stored as JSON strings."""
    names: dict[str, None] = {}
    for record in records:
        names.update(dict.fromkeys(record))
    columns = {}
    for name in names:
        values = [record.get(name) for record in records]
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError):
            columns[name] = pa.array([None if v is None else json.dumps(v, default=str) for v in values])
    return pa.table(columns)


# ---------------------------------------------------------------- messages


def _short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]

"""Run the whole bad-input matrix (every Case of tests/features/bad_inputs/: CASES, ONCE_ACCEPTED_CASES,
DAMAGED_CASES, TRUST_CASES, SILENT_CASES) and print the counts by class of fault (each Case's `kind`) and outcome,
measured, never written down.

    python scripts/bad_input_matrix.py                      # this checkout's src/
    python scripts/bad_input_matrix.py --src /tmp/old/src   # another opd's src/ against these cases (a "before")
    python scripts/bad_input_matrix.py -k "distill"         # a subset (pytest -k on the case names)

pass = exit code 2 and exactly one stderr line naming the culprit, no traceback (the test's own `classify` says
"clear" and its assertions hold); fail otherwise, split by what the test saw: traceback, silent (exit 0), unclear
(several lines, another exit code, or a line that does not name the culprit), or other (a later assertion of the
test, or the case could not run: an error in its setup). Exit status: 0 when every case passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
MATRIX = TESTS / "features" / "bad_inputs"
# the parametrized tests that run one Case each: the test module (under MATRIX) and the list it takes its cases from
CASE_TESTS = {
    "test_bad_input": ("test_commands", "CASES"),
    "test_once_accepted_value_fails_in_one_line": ("test_commands", "ONCE_ACCEPTED_CASES"),
    "test_damaged_run_directory": ("test_damaged_runs", "DAMAGED_CASES"),
    "test_trust_case": ("test_trust_security", "TRUST_CASES"),
    "test_silent_trust_case": ("test_trust_silent", "SILENT_CASES"),
}
FAILS = ("traceback", "silent", "unclear", "other")


def kinds(src: Path) -> dict[tuple[str, str], str]:
    """(test function, case name) → kind, from the Case lists themselves."""
    sys.path[:0] = [str(src), str(TESTS), str(MATRIX)]
    modules = {module: importlib.import_module(module) for module, _ in CASE_TESTS.values()}
    cases = {
        test: [getattr(entry, "values", [entry])[0] for entry in getattr(modules[module], listed)]  # a pytest.param
        for test, (module, listed) in CASE_TESTS.items()
    }
    return {(test, case.name): case.kind for test, listed in cases.items() for case in listed}


def run_matrix(src: Path, select: str | None, extra: list[str]) -> tuple[dict[tuple[str, str], str], dict]:
    """Run pytest once over the case tests; ((test, case) → pytest result, case name → tally record)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit, tally = Path(tmp) / "junit.xml", Path(tmp) / "tally.jsonl"
        command = [
            sys.executable,
            "-m",
            "pytest",
            *(f"{MATRIX / module}.py::{test}" for test, (module, _) in CASE_TESTS.items()),  # every parametrization
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *(["-k", select] if select else []),
            *extra,
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(src), str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "OPD_MATRIX_TALLY": str(tally),
            "COLUMNS": "200",
        }
        print("$ " + " ".join(command), file=sys.stderr, flush=True)
        subprocess.run(command, cwd=ROOT, env=env, stdout=sys.stderr, check=False)
        results: dict[tuple[str, str], str] = {}
        for testcase in ET.parse(junit).iter("testcase"):
            name = testcase.get("name", "")
            test, _, case = name.partition("[")
            if test not in CASE_TESTS or not case.endswith("]"):
                continue
            tags = {child.tag for child in testcase}
            result = (
                "failed"
                if "failure" in tags
                else "error"
                if "error" in tags
                else "skipped"
                if "skipped" in tags
                else "passed"
            )
            results[(test, case[:-1])] = result
        tallied = {}
        if tally.exists():
            for line in tally.read_text().splitlines():
                record = json.loads(line)
                tallied[record["case"]] = record
    return results, tallied


def table(kind_of: dict, results: dict, tallied: dict, *, everything: bool) -> tuple[str, bool]:
    """The counts by kind; `everything`: every case was selected, so one pytest did not report failed ("other")."""
    rows: dict[str, Counter] = defaultdict(Counter)
    for key, kind in kind_of.items():
        if key not in results and not everything:
            continue  # not selected
        row = rows[kind]
        row["cases"] += 1
        if results.get(key) == "passed":
            row["pass"] += 1
            continue
        row["fail"] += 1
        outcome = tallied.get(key[1], {}).get("outcome")
        row[outcome if outcome in FAILS[:3] else "other"] += 1
    order = ["one-line", "security", "silent-wrong", "data-loss", "traceback", "misleading", "late-error", "damaged"]
    kinds_seen = [k for k in order if k in rows] + sorted(k for k in rows if k not in order)
    columns = ["cases", "pass", "fail", *FAILS]
    width = max([len("class"), len("total"), *map(len, kinds_seen)])
    lines = [f"{'class':<{width}} " + " ".join(f"{c:>9}" for c in columns)]
    total: Counter = Counter()
    for kind in kinds_seen:
        total.update(rows[kind])
        lines.append(f"{kind:<{width}} " + " ".join(f"{rows[kind][c]:>9}" for c in columns))
    lines.append(f"{'total':<{width}} " + " ".join(f"{total[c]:>9}" for c in columns))
    return "\n".join(lines), total["fail"] == 0 and total["cases"] > 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="the opd sources to measure (default: ./src)")
    parser.add_argument("-k", dest="select", help="pytest -k expression on top of the case tests (a subset)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    src = args.src.resolve()
    kind_of = kinds(src)
    results, tallied = run_matrix(src, args.select, args.pytest_args)
    if not results:
        print("no case ran (see pytest's output above)", file=sys.stderr)
        return 1
    text, ok = table(kind_of, results, tallied, everything=args.select is None)
    print(f"bad-input matrix, {src}:")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

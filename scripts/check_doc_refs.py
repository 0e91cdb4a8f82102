"""Fail on a code reference in the docs or the source's comments that names nothing in the repository.

Usage: python scripts/check_doc_refs.py [--root REPO] [FILE ...]   (no FILE: README.md, CONTRIBUTING.md, docs/*.md
and the comments and docstrings of src/opd). One line per reference that does not resolve,
`file:line: reference: why`, and exit status 1; nothing and status 0 when every reference resolves. CHANGELOG.md is
history and is not read.

What counts as a reference (everything else is prose and is not read):

- a dotted name starting `opd.` (`opd.train.step.opd_step`): the longest prefix that is a module or package under
  src/opd must exist, and the next name must be defined at its top level (a def, a class, an assignment or an import);
  a name after a class defined there must be in the class's body. Resolved from the source's syntax trees, without
  importing anything, so the check takes a second or two.
- a repository path: a token starting `src/`, `tests/`, `benchmarks/`, `configs/`, `scripts/`, `docs/` or `.ci/`,
  a token starting `opd/` (read as src/opd/…), or a `.py` path whose first folder is a package of src/opd
  (`rollout/base.py`, read as src/opd/rollout/base.py).
  The file or folder must exist. A token holding a glob or a placeholder is a pattern, not a path, and is skipped:
  `*`, `?`, `[`, `<`, `{`, `…` or `...`, or a part that is one capital letter (`step_N`, `test_X.py`).
- a Markdown link target that is not a URL (`[spec](spec.md)`), resolved from the document's folder.
- a section of a document: a Markdown file name followed, on the same line, by a quoted title
  (`docs/design.md, "opd.train.stream"`, `docs/performance.md section "Scale"`): the title, ignoring case, backticks
  and `*`, must begin a heading of that file (read from the repository's root, its docs/ folder or the document's
  folder).
- `SPEC §N` or `spec §N` (any case, `spec.md §N` too): docs/spec.md must have a section `## N. Title`.
- `STYLE N`: the repository's STYLE.md must have an item `N.`. The project keeps no STYLE list (its style rules are
  CONTRIBUTING.md's "Style" section, which is not numbered), so while STYLE.md does not exist no `STYLE N` resolves:
  say the rule in words, or point to CONTRIBUTING.md.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOTED_DIRS = ("src", "tests", "benchmarks", "configs", "scripts", "docs", ".ci")

DOTTED_RE = re.compile(r"(?<![\w./-])opd(?:\.[A-Za-z_]\w*)+")
PATH_RE = re.compile(r"(?<![\w./-])(?:\.ci|[A-Za-z_][\w-]*)/[\w./*?<>{}…-]*")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
SPEC_RE = re.compile(r"\bspec(?:\.md)?,?\s*§§?\s*(\d+)", re.IGNORECASE)
SECTION_RE = re.compile(r'((?<![\w/.-])(?:docs/)?[\w.-]+\.md),?\s+(?:section\s+)?["“]([^"”]+)["”]')
STYLE_RE = re.compile(r"\bSTYLE\s+(\d+)\b")
PLACEHOLDER_CHARS = set("*?[<{…")


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    reference: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reference}: {self.why}"


# ---- dotted names --------------------------------------------------------------------------------------------------


def _module_file(root: Path, parts: list[str]) -> Path | None:
    base = root / "src" / Path(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _top_level(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a body binds, with their defining node; into if/try/with blocks, not into functions."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names[sub.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If):
            names.update(_top_level(node.body))
            names.update(_top_level(node.orelse))
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                names.update(_top_level(block))
        elif isinstance(node, ast.With):
            names.update(_top_level(node.body))
        elif hasattr(ast, "TypeAlias") and isinstance(node, ast.TypeAlias):  # Python 3.12
            names[node.name.id] = node
    return names


def _resolve_dotted(root: Path, ref: str) -> str | None:
    """None when `ref` resolves, else why not."""
    parts = ref.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(root, parts[:cut])
        if module is not None:
            break
    else:  # pragma: no cover - `opd` itself always exists
        return "no module opd"
    rest = parts[cut:]
    if not rest:
        return None
    module_name = ".".join(parts[:cut])
    names = _top_level(_tree(module).body)
    if rest[0] not in names:
        if "__getattr__" in names:
            return None
        return f"{module_name} has no module or top-level name {rest[0]!r}" + _defined_in(root, parts[-1])
    node = names[rest[0]]
    if len(rest) > 1 and isinstance(node, ast.ClassDef):
        members = _top_level(node.body)
        if rest[1] not in members:
            return f"class {module_name}.{rest[0]} defines no {rest[1]!r}"
    return None


@cache
def _definitions(root: Path) -> dict[str, list[str]]:
    """Every top-level name of src/opd → the modules that define it (not merely import it)."""
    found: dict[str, list[str]] = {}
    src = root / "src"
    for path in sorted((src / "opd").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for name, node in _top_level(_tree(path).body).items():
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                found.setdefault(name, []).append(module)
    return found


def _defined_in(root: Path, name: str) -> str:
    """A hint for a name that moved: where src/opd defines it now, or the modules of that name."""
    places = [f"{m}.{name}" for m in _definitions(root).get(name, [])]
    places = places or sorted(m for m in _modules(root) if m.endswith(f".{name}"))
    return f" (now {', '.join(places[:3])}?)" if places else ""


@cache
def _modules(root: Path) -> frozenset[str]:
    src = root / "src"
    return frozenset(
        ".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        for p in (src / "opd").rglob("*.py")
    )


def _words(path: Path) -> frozenset[str]:
    return frozenset(re.split(r"[/_.-]", path.with_suffix("").as_posix())) - {"", "test", "tests", "src", "opd"}


def _moved_to(root: Path, target: Path) -> str:
    """A hint for a file that moved: files of the same top folder with the same name or the same words in their path
    (tests/test_objectives_rewards.py → tests/objectives/test_rewards.py)."""
    relative = target.relative_to(root)
    top = root / relative.parts[0]
    if not top.is_dir() or target.suffix == "":
        return ""
    candidates = sorted(
        p.relative_to(root).as_posix()
        for p in top.rglob(f"*{target.suffix}")
        if p.name == target.name or _words(p.relative_to(root)) == _words(relative)
    )
    return f" (now {', '.join(candidates[:3])}?)" if candidates else ""


# ---- paths, spec sections, style items --------------------------------------------------------------------------


@cache
def _opd_packages(root: Path) -> frozenset[str]:
    src = root / "src" / "opd"
    return frozenset(p.name for p in src.iterdir() if (p / "__init__.py").is_file())


def _is_pattern(token: str) -> bool:
    if PLACEHOLDER_CHARS & set(token) or "..." in token:
        return True
    return any(re.fullmatch(r"[A-Z]", piece) for piece in re.split(r"[/_.-]", token))


def _path_target(root: Path, token: str) -> Path | None:
    """The file a path token names, or None when the token is prose (a folder name that is not the repository's)."""
    first = token.split("/", 1)[0]
    if first in ROOTED_DIRS:
        return root / token
    if first == "opd":
        return root / "src" / token
    if first in _opd_packages(root) and token.endswith(".py"):
        return root / "src" / "opd" / token
    return None


def _heading_text(text: str) -> str:
    return re.sub(r"[`*]", "", text).strip().lower()


@cache
def _headings(path: Path) -> tuple[str, ...]:
    text = path.read_text(encoding="utf-8")
    return tuple(_heading_text(h) for h in re.findall(r"^#+\s+(.*?)\s*#*$", text, flags=re.MULTILINE))


def _resolve_section(root: Path, doc: str, title: str, doc_dir: Path | None) -> str | None:
    """None when a heading of `doc` begins with `title`, else why not."""
    folders = [root, root / "docs"] + ([doc_dir] if doc_dir is not None else [])
    found = next((folder / doc for folder in folders if (folder / doc).is_file()), None)
    if found is None:
        return f"no document {doc}"
    if not any(h.startswith(_heading_text(title)) for h in _headings(found)):
        return f"no heading of {doc} begins with {title!r}"
    return None


@cache
def _spec_sections(root: Path) -> frozenset[str]:
    spec = root / "docs" / "spec.md"
    if not spec.is_file():
        return frozenset()
    return frozenset(re.findall(r"^## (\d+)\.", spec.read_text(encoding="utf-8"), flags=re.MULTILINE))


@cache
def _style_items(root: Path) -> frozenset[str] | None:
    style = root / "STYLE.md"
    if not style.is_file():
        return None
    return frozenset(re.findall(r"^\s*(\d+)\.\s", style.read_text(encoding="utf-8"), flags=re.MULTILINE))


def check_text(text: str, *, file: str, first_line: int, root: Path, doc_dir: Path | None) -> list[Problem]:
    """The unresolved references of `text`, whose first line is line `first_line` of `file`.

    `doc_dir` is the folder that Markdown link targets are read from (None: the text is not Markdown)."""
    problems: list[Problem] = []
    for offset, line in enumerate(text.splitlines()):
        where = first_line + offset

        def report(ref: str, why: str, where: int = where) -> None:
            problems.append(Problem(file, where, ref, why))

        for match in DOTTED_RE.finditer(line):
            why = _resolve_dotted(root, match.group())
            if why is not None:
                report(match.group(), why)
        for match in PATH_RE.finditer(line):
            token = match.group().rstrip(".,:;'\"")
            if _is_pattern(token):
                continue
            target = _path_target(root, token)
            if target is not None and not target.exists():
                report(token, f"no such file or folder {target.relative_to(root)}" + _moved_to(root, target))
        if doc_dir is not None:
            for match in LINK_RE.finditer(line):
                target_text = match.group(1).split("#", 1)[0]
                if not target_text or re.match(r"^[a-z][a-z0-9+.-]*:", target_text) or _is_pattern(target_text):
                    continue
                if not (doc_dir / target_text).exists():
                    report(match.group(1), f"the link's target does not exist (read from {doc_dir.name or '.'}/)")
        for match in SECTION_RE.finditer(line):
            why = _resolve_section(root, match.group(1), match.group(2), doc_dir)
            if why is not None:
                report(match.group(), why)
        for match in SPEC_RE.finditer(line):
            if match.group(1) not in _spec_sections(root):
                report(match.group(), f"docs/spec.md has no section '## {match.group(1)}.'")
        for match in STYLE_RE.finditer(line):
            items = _style_items(root)
            if items is None:
                report(match.group(), "the repository has no STYLE.md to number style rules; say the rule in words")
            elif match.group(1) not in items:
                report(match.group(), f"STYLE.md has no item {match.group(1)}.")
    return problems


def _python_prose(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of a Python file, each with the line it starts on."""
    source = path.read_text(encoding="utf-8")
    pieces = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                pieces.append((first.lineno, first.value.value))
    return pieces


def check_file(path: Path, root: Path = ROOT) -> list[Problem]:
    path = path.resolve()
    try:
        shown = str(path.relative_to(root))
    except ValueError:
        shown = str(path)
    if path.suffix == ".py":
        problems = []
        for line, text in _python_prose(path):
            problems += check_text(text, file=shown, first_line=line, root=root, doc_dir=None)
        return sorted(problems, key=lambda p: p.line)
    return check_text(path.read_text(encoding="utf-8"), file=shown, first_line=1, root=root, doc_dir=path.parent)


def default_files(root: Path = ROOT) -> list[Path]:
    docs = [root / "README.md", root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))]
    return [p for p in docs if p.is_file()] + sorted((root / "src" / "opd").rglob("*.py"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("files", nargs="*", type=Path, help="Markdown or Python files (default: the docs and src/opd)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    problems = [p for f in (args.files or default_files(root)) for p in check_file(f, root)]
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Docs that cannot drift: every repository path a doc, docstring or comment names exists.

The texts read: README.md and every .md file under the repository's folders (docs/, and any
in deploy/ and the others), and the comments and the module, class and function docstrings
of every .py file under those folders, except the generated ``*_pb2*.py``.

The rule. A candidate is a run of path characters (letters, digits, ``_ . - /`` and the
placeholder characters below) that does not follow a ``:`` or ``@`` (an address, a URL),
with a leading ``./``, Markdown's ``**`` and a trailing full stop dropped. It names a
repository path, which must exist, when it

1. starts with a repository folder and a slash (``ps_server/shard.py``, ``tests/unit/``,
   ``deploy/k8s/``, ``.ci/run``): the file or folder must exist; one ending in ``/`` must be
   a folder;
2. is a top-level file's name (`TOP_LEVEL_FILE`: ``Makefile``, ``Dockerfile``,
   ``pyproject.toml``, ...): it must exist in the repository's root;
3. is a bare Python file name (``store.py``): some file under the repository's folders must
   have that name, so a module renamed or removed is caught wherever a text names it.

A candidate with a placeholder names no path and is skipped: ``<...>``, ``*``, ``{...}``,
``$VAR``, ``~``, or a segment whose stem is in capitals (``DIR``, ``NAME.onnx``);
so are ``DIR/shard<i>``, ``stage<k>.onnx`` and ``deploy/k8s/*.yaml``. What a job writes at
run time (``runs/demo/plot.png``, ``/tmp/...``) starts with no repository folder, so it is
never a candidate. A stale reference that only its owner can fix waits in `KNOWN_STALE`.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The repository's folders: a candidate starting with one of them and a slash is a repository path.
FOLDERS = ("protos", "ps_server", "worker_client", "ps_common", "ps_tools", "models", "bench", "tests", "deploy",
           "docs", ".ci")
#: The names a file in the repository's root has: a candidate that is one of them must exist there.
TOP_LEVEL_FILE = re.compile(r"Dockerfile(\.\w+)?|Makefile|pyproject\.toml|setup\.(py|cfg)|requirements[\w-]*\.txt"
                            r"|LICENSE|README\.md|\.dockerignore|\.gitignore|tox\.ini")
#: Characters a candidate is made of: a path's, and the placeholders' (so that a placeholder stays in the candidate).
PATH_CHARS = r"\w.\-/<>*{}$~"
CANDIDATE = re.compile(rf"(?<![{PATH_CHARS}:@])[{PATH_CHARS}]+")
#: A placeholder: <...>, a glob, {...}, $VAR, ~, or a segment whose stem is in capitals (DIR, NAME.onnx).
PLACEHOLDER = re.compile(r"[<>*{}$~]|(^|/)(?!README|LICENSE)[A-Z][A-Z0-9_]+(\.|/|$)")
#: A bare Python file name.
PYTHON_FILE = re.compile(r"[\w-]+\.py")

#: Stale references waiting for the engineer who owns the change, as (text file, path named): remove an entry
#: when its text is fixed (the test fails for an entry whose text no longer names its path).
#: These wait for refactors in progress: the shard's pull cache module is being removed, and the worker's client
#: and training modules are becoming packages; the docs still name the modules as they were.
KNOWN_STALE: set[tuple[str, str]] = set()


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.md"))]


def python_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")
                  if "_pb2" not in p.name and "__pycache__" not in p.parts)


def python_texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of a Python file."""
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                for offset, line in enumerate(first.value.value.splitlines()):
                    yield first.lineno + offset, line


def texts() -> Iterator[tuple[str, int, str]]:
    """(file relative to the root, line number, text) of every text the rule applies to."""
    for path in doc_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            yield str(path.relative_to(ROOT)), number, line
    for path in python_files():
        for number, line in python_texts(path):
            yield str(path.relative_to(ROOT)), number, line


REPOSITORY_FILE_NAMES = {p.name for folder in FOLDERS for p in (ROOT / folder).rglob("*")}


def normalized(candidate: str) -> str:
    """Without a leading ``./``, Markdown's emphasis (``**``) and trailing sentence punctuation."""
    return candidate.strip("*").removeprefix("./").rstrip(".,;:")


def missing(candidate: str) -> bool:
    """Whether `candidate` names a repository path (the rule in the module docstring) that does not exist."""
    candidate = normalized(candidate)
    if not candidate or PLACEHOLDER.search(candidate):
        return False
    if candidate.split("/", 1)[0] in FOLDERS and "/" in candidate:
        path = ROOT / candidate
        return not (path.is_dir() if candidate.endswith("/") else path.exists())
    if TOP_LEVEL_FILE.fullmatch(candidate):
        return not (ROOT / candidate).is_file()
    if PYTHON_FILE.fullmatch(candidate):
        return candidate not in REPOSITORY_FILE_NAMES
    return False


def candidates() -> list[tuple[str, int, str]]:
    """(file, line number, candidate) of every candidate in the texts, normalized."""
    return [(file, number, normalized(m.group(0))) for file, number, line in texts()
            for m in CANDIDATE.finditer(line)]


def test_every_repository_path_named_in_a_doc_docstring_or_comment_exists() -> None:
    stale = [f"{file}:{number}: {path}" for file, number, path in candidates()
             if missing(path) and (file, path) not in KNOWN_STALE]
    assert not stale, "these texts name repository paths that do not exist:\n" + "\n".join(stale)


def test_every_known_stale_reference_is_still_in_its_text_so_the_list_only_shrinks() -> None:
    named = {(file, path) for file, _, path in candidates()}
    fixed = sorted(KNOWN_STALE - named)
    assert not fixed, f"no longer in their texts: remove these from KNOWN_STALE: {fixed}"


def test_the_rule_tells_repository_paths_from_placeholders_and_runtime_outputs() -> None:
    assert missing("ps_server/no_such_module.py") and missing("tests/unit/no_such_folder/")
    assert missing("docs/no-such-page.md,") and missing("./deploy/no-such.yaml")
    assert missing("Dockerfile.nosuch") and missing("no_such_module.py")
    assert missing("**ps_server/no_such_module.py**")
    assert not missing("ps_server/shard.py.") and not missing("tests/unit/") and not missing("Makefile")
    for not_a_repository_path in ("runs/demo/plot.png", "DIR/shard<i>", "stage<k>.onnx", "deploy/k8s/*.yaml",
                                  "tests/fixtures/NAME.onnx", "ps_server/checkpoints/{x}.py", "/tmp/ps_server/x.py",
                                  "$HOME/ps_server/x.py", "model.onnx", "ps_server", "docs/"):
        assert not missing(not_a_repository_path), not_a_repository_path
    line = "see https://example.com/ps_server/gone.py and host:ps_server/gone.py"
    assert [m.group(0) for m in CANDIDATE.finditer(line) if missing(m.group(0))] == []

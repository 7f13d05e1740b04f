r"""Pretrain a decoder-only LM, the T5X way: gin files, ``--gin.X=Y`` overrides, one MODEL_DIR.

    python -m sonew_pax.train \
      --gin_file=tiny.gin \
      --gin.MODEL_DIR=\"/tmp/run\" --gin.TRAIN_STEPS=500

This module is the command line: flags, gin parsing, then `sonew_pax.loop.train` (the run).
Flags: ``--gin_file`` (repeatable; looked up in ``--gin_search_paths``, which always end with
this repository's ``configs/``), ``--gin_bindings`` (repeatable), ``--gin.NAME=VALUE`` (rewritten
to the binding ``NAME = VALUE``), and ``--coordinator_address``/``--process_count``/
``--process_index`` for multi-process runs (also read from the environment, e.g. SLURM; on Cloud
TPU they are auto-detected: see `sonew_pax.distributed`).

Exit status: 0 when the run reached TRAIN_STEPS. 1, with one line ``error: ...`` and no
traceback, when it cannot start or has to stop for a reason its user can fix (`errors.RunError`:
a setting that cannot work, a misspelled macro, MODEL_DIR in use or holding another
configuration's checkpoints, a diverged run, a checkpoint that cannot be saved).
`EXIT_STOPPED` (75, ``EX_TEMPFAIL``) when SIGTERM, SIGINT or a preemption notice stopped it
after saving a checkpoint: rerun to resume (a scheduler that restarts failed jobs restarts it).
`EXIT_INTERRUPTED` (130) when SIGINT stopped it without saving: a second one, or one before the
loop's handler is installed (while the data loads).

What a run leaves in MODEL_DIR: ``config.gin`` (the operative config), ``model-info.txt``
(parameter and optimizer-state shapes, specs and counts), ``checkpoint_<step>/``,
``metrics.jsonl``, TensorBoard events under ``train/`` and ``eval/``, and ``compilation_cache/``
(JAX's persistent compilation cache). Rerunning the same command resumes from the newest complete
checkpoint, loading the compiled train step from the cache.
"""

import difflib
import logging as pylogging
import os
import pathlib
import sys
from collections.abc import Callable, Sequence

import gin
from absl import app, flags, logging

from sonew_pax import distributed, loop
from sonew_pax.errors import ConfigError, RunError

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
CONFIGS_DIR = PACKAGE_DIR.parent / "configs"

# Exit statuses besides 0 (done) and 1 (`RunError`): see the module docstring.
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("gin_file", [], "Gin config files, parsed in order.")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings, applied after the files.")
flags.DEFINE_list("gin_search_paths", ["."], "Directories searched for --gin_file and includes.")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process runs).")
flags.DEFINE_integer("process_count", None, "Number of processes (default: environment, or 1).")
flags.DEFINE_integer("process_index", None, "This process's index, in [0, process_count).")
flags.DEFINE_integer(
    "distributed_timeout_s", None, "Seconds to wait for all processes to join (default 300)."
)


def rewrite_gin_args(argv: Sequence[str]) -> list[str]:
    """``--gin.NAME=VALUE`` -> ``--gin_bindings=NAME = VALUE`` (T5X's shorthand)."""
    rewritten = []
    for arg in argv:
        if arg.startswith("--gin."):
            name, sep, value = arg.removeprefix("--gin.").partition("=")
            if not sep:
                raise ValueError(f"{arg!r}: expected --gin.NAME=VALUE")
            arg = f"--gin_bindings={name} = {value}"
        rewritten.append(arg)
    return rewritten


def _own_info_only(record: pylogging.LogRecord) -> bool:
    """Log filter: this package's INFO lines and others' warnings, minus known noise (orbax's
    INFO lines, and gin's "Path not found" for each search path it tries before the right one).
    Orbax's errors keep their line but lose their traceback, and asyncio's "exception was never
    retrieved" for orbax's abandoned writes is dropped: a checkpoint write that fails is logged
    by each thread and future it passes through (hundreds of lines), and
    `checkpoints.Checkpoints` reports it, and its retry, in one line each."""
    if record.module == "resource_reader" and str(record.msg).startswith("Path not found"):
        return False
    if record.name == "asyncio" and "exception was never retrieved" in str(record.msg):
        return False
    if f"{os.sep}orbax{os.sep}" in record.pathname:
        record.exc_info = record.exc_text = None
    return record.levelno >= pylogging.WARNING or f"{PACKAGE_DIR}/" in record.pathname


def _abandoned_write(exc_type: type, value: BaseException) -> bool:
    """Whether an exception is tensorstore completing a write of a checkpoint save that orbax
    abandoned after it failed: its callback finds orbax's event loop closed."""
    return exc_type is RuntimeError and str(value) == "Event loop is closed"


def _without_abandoned_writes(hook: Callable) -> Callable:
    """``sys.unraisablehook`` ``hook`` that prints nothing for `_abandoned_write` (tensorstore
    reports those as unraisable, one traceback per write, after `checkpoints.Checkpoints` has
    logged the failed save in one line)."""

    def unraisablehook(unraisable):
        if not _abandoned_write(unraisable.exc_type, unraisable.exc_value):
            hook(unraisable)

    return unraisablehook


def quiet_library_logs() -> None:
    """Installs `_own_info_only` on absl's log handler, and drops tensorstore's reports of
    writes orbax abandoned (`_without_abandoned_writes`)."""
    logging.get_absl_handler().addFilter(_own_info_only)
    sys.unraisablehook = _without_abandoned_writes(sys.unraisablehook)


def _tolerant(existence_check: Callable[[str], bool]) -> Callable[[str], bool]:
    """``existence_check`` that answers False where it would raise TypeError."""

    def check(path: str) -> bool:
        try:
            return existence_check(path)
        except TypeError:
            return False

    check.tolerant = True
    return check


def _harden_gin_file_readers() -> None:
    """Works around gin's package-resource reader crashing on namespace packages.

    For an include such as ``runs/pretrain.gin``, gin first asks whether ``runs`` is an importable
    package; a plain ``runs/`` directory in the working directory (``make demo`` creates one) is a
    namespace package without a file, and gin's check raises TypeError instead of answering no.
    """
    gin.config._FILE_READERS[:] = [
        (reader, check if getattr(check, "tolerant", False) else _tolerant(check))
        for reader, check in gin.config._FILE_READERS
    ]


def set_search_paths(search_paths: Sequence[str]) -> None:
    """Where gin looks for files and includes: ``search_paths``, then this repository's configs/."""
    _harden_gin_file_readers()
    for path in [*search_paths, str(CONFIGS_DIR)]:
        gin.add_config_file_search_path(path)


def _bound_macros(bindings: Sequence[str]) -> list[str]:
    """The macros that ``bindings`` set (``NAME = VALUE``, as gin's parser reads them)."""
    parser = gin.config_parser.ConfigParser("\n".join(bindings), gin.config.ParserDelegate())
    return [
        statement.selector
        for statement in parser
        if isinstance(statement, gin.config_parser.BindingStatement) and not statement.arg_name
    ]


def _used_macros() -> set[str]:
    """The macros some binding of the parsed config refers to (``%NAME``)."""
    macro = gin.config.get_configurable(gin.config.macro)
    # gin keeps its config in a module global; iterate_references walks every bound value.
    return {ref.scoped_selector.split("/")[0] for ref in gin.config.iterate_references(
        gin.config._CONFIG, to=macro)}  # fmt: skip


def check_macros_used(bindings: Sequence[str]) -> None:
    """Raises `ConfigError` for a macro set in ``bindings`` that no part of the config uses: gin
    would define it and go on (``--gin.CHEKPOINT_PERIOD=2`` would change nothing)."""
    used = _used_macros()
    for name in _bound_macros(bindings):
        if name not in used:
            close = difflib.get_close_matches(name, sorted(used), n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"--gin.{name} sets the macro {name}, which no configuration uses.{hint} "
                f"Macros in use: {', '.join(sorted(used))}."
            )


def parse_gin(files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str]) -> None:
    """Parses config files then bindings (unknown names are errors) and finalizes the config.

    Raises:
      ValueError (from gin): a misspelled configurable or parameter, or a macro left at
        ``%gin.REQUIRED``, named in the message.
      ConfigError: a binding sets a macro that nothing uses (a misspelled macro name).
    """
    set_search_paths(search_paths)
    gin.parse_config_files_and_bindings(
        list(files), list(bindings), skip_unknown=False, finalize_config=True
    )
    check_macros_used(bindings)


def _without_gin_context(message: str) -> str:
    """``message`` less the lines gin appends to errors raised in a configurable's call."""
    lines = message.splitlines()
    return "\n".join(line for line in lines if not line.startswith("  In call to configurable"))


def main(argv: Sequence[str]) -> None:
    """absl entry point: distributed set-up, gin, then `loop.train`."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    quiet_library_logs()
    distributed.initialize(
        FLAGS.coordinator_address,
        FLAGS.process_count,
        FLAGS.process_index,
        timeout_s=FLAGS.distributed_timeout_s,
    )
    try:
        parse_gin(FLAGS.gin_file, FLAGS.gin_bindings, FLAGS.gin_search_paths)
        result = loop.train()
    except RunError as error:
        sys.exit(f"error: {_without_gin_context(str(error))}")
    except KeyboardInterrupt:
        print(
            "error: interrupted; the current step was not saved (rerun to resume from the "
            "newest checkpoint).",
            file=sys.stderr,
        )
        sys.exit(EXIT_INTERRUPTED)
    if result.preempted:
        sys.exit(EXIT_STOPPED)
    logging.info("Finished at step %d (loss %s).", result.step, result.loss)


def run(argv: Sequence[str] | None = None) -> None:
    """Runs `main` with ``--gin.X=Y`` flags rewritten first."""
    app.run(main, argv=rewrite_gin_args(sys.argv if argv is None else argv))


if __name__ == "__main__":
    run()

"""The training loop: the gin-configurable `train` that ``python -m sonew_pax.train`` calls.

`train` wires the parts together in the order of a T5X run: mesh and rules (`partitioning`), the
`trainer.Trainer` (state layout and compiled steps), data, restore (`checkpoints`) or
initialisation, then the loop: step, write metrics (`metrics`), evaluate every EVAL_PERIOD, save
every CHECKPOINT_PERIOD, on SIGTERM or SIGINT (`signals.StopSignal`), at the end, and at once
after a save whose background write failed (`checkpoints.Checkpoints`). The checks that a resumed
run continues its checkpoint as trained are in `resume`; the ``non_finite`` policy that stops a
diverged run is `guard.NonFiniteGuard`. Compiled programs go to JAX's persistent
compilation cache (default ``MODEL_DIR/compilation_cache``), so that a resumed run loads its train
step instead of compiling it again. `configured_trainer` builds the `trainer.Trainer` that `train`
would from the gin config alone, reading no data: `trainer.Trainer.export_train_step` then lowers
its step for other platforms (tests/test_tpu_export.py exports it for TPU on a CPU host).

The loop is a module of its own, not part of ``train.py`` as in T5X, because ``train.py`` is the
entry point: run as ``__main__``, a gin file's ``import`` of the module that registers `train`
would load it a second time (its flags defined twice, a second ``train`` configurable). Here gin
files bind ``train.*`` after a plain ``import sonew_pax.loop``.
"""

import contextlib
import dataclasses
import inspect
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gin
import jax
from absl import logging
from etils import epath
from jax.sharding import Mesh

from sonew_pax import (
    checkpoints,
    metrics,
    optimizers,
    partitioning,
    paths,
    resume,
    run_lock,
    signals,
    train_state,
)
from sonew_pax.errors import ConfigError
from sonew_pax.guard import NON_FINITE_POLICIES, NonFiniteGuard
from sonew_pax.models import Transformer, TransformerConfig, attention_choice, flops_per_token
from sonew_pax.trainer import CacheHits, Trainer, persistent_compilation_cache

COMPILATION_CACHE = "compilation_cache"


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How `train` ended: the step reached, its loss, and whether a signal (SIGTERM, SIGINT) or
    a preemption notice stopped it early (with a checkpoint of that step)."""

    step: int
    loss: float | None
    preempted: bool


def _write_text(path: epath.Path, text: str) -> None:
    """Writes ``text`` to ``path`` from process 0 only, atomically (`paths.write_text_atomic`)."""
    if jax.process_index() == 0:
        paths.write_text_atomic(path, text)


def _due(step: int, period: int, last_step: int) -> bool:
    """Whether a ``period``-ic action falls on ``step`` (always on the last step)."""
    return step == last_step or (period > 0 and step % period == 0)


def check_settings(**settings: Any) -> None:
    """Raises `ConfigError` naming the first of `train`'s settings that cannot work (before the
    run writes anything). ``settings``: `train`'s arguments of the same names."""
    at_least = {
        "train_steps": ("TRAIN_STEPS", 1),
        "batch_size": ("BATCH_SIZE", 1),
        "seq_len": ("SEQ_LEN", 1),
        "checkpoint_period": ("CHECKPOINT_PERIOD", 0),
        "eval_period": ("EVAL_PERIOD", 0),
        "log_every": (None, 1),
        "max_skipped_steps": (None, 0),
        "keep_checkpoints": (None, 1),
        "save_retries": (None, 0),
    }
    for name, (macro, least) in at_least.items():
        value = settings[name]
        if value is None and name == "keep_checkpoints":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            label = f"{macro} (train.{name})" if macro else f"train.{name}"
            raise ConfigError(f"{label} must be an integer >= {least}, got {value!r}.")
    backoff = settings["save_retry_backoff_s"]
    if not isinstance(backoff, (int, float)) or isinstance(backoff, bool) or not backoff >= 0:
        raise ConfigError(f"train.save_retry_backoff_s must be a number >= 0, got {backoff!r}.")
    window = settings["profile_steps"]
    if window is not None and (
        len(window) != 2 or not all(isinstance(n, int) and n >= 1 for n in window)
    ):
        raise ConfigError(f"train.profile_steps must be (START, COUNT), both >= 1; got {window!r}.")
    resumable = resume.RESUMABLE_CHANGES
    unknown = set(settings["allow_resume_changes"]) - set(resumable)
    if isinstance(settings["allow_resume_changes"], str) or unknown:
        raise ConfigError(
            f"train.allow_resume_changes must be a tuple of names among {resumable}, "
            f"got {settings['allow_resume_changes']!r}."
        )
    policy = settings["non_finite"]
    if policy not in NON_FINITE_POLICIES:
        raise ConfigError(f"train.non_finite must be one of {NON_FINITE_POLICIES}, got {policy!r}.")


def compilation_cache_path(model_dir: epath.Path, setting: str | None) -> str | None:
    """Where a run's compiled programs are cached (`train`'s ``compilation_cache_dir``): None
    picks JAX's own cache directory if it has one (``JAX_COMPILATION_CACHE_DIR``), else
    ``model_dir/compilation_cache``; ``""`` turns the cache off (None is returned); anything
    else is the directory (a path or a URI)."""
    if setting is None:
        return jax.config.jax_compilation_cache_dir or str(model_dir / COMPILATION_CACHE)
    return setting or None


@contextlib.contextmanager
def first_step_log():
    """Logs before and after the block (a run's first step, whose metrics it waits for) how long
    it took, compiling included, and how many programs JAX loaded from the persistent compilation
    cache meanwhile: on a GPU, SONew's kernels make the first step of a large model take minutes
    to compile, and a resumed run should load it instead
    (`trainer.persistent_compilation_cache`)."""
    logging.info("First step: compiling the train step")
    start = time.perf_counter()
    with CacheHits() as hits:
        yield
    logging.info(
        "First step done in %.1f s, compiling included (%d program(s) loaded from the "
        "compilation cache)",
        time.perf_counter() - start,
        hits.count,
    )


def _peak_flops() -> float | None:
    """This run's devices' peak bf16 FLOP/s (`metrics.peak_flops`); says once when unknown."""
    kind = jax.devices()[0].device_kind
    peak = metrics.peak_flops(kind)
    if peak is None:
        logging.info("MFU is not reported: no peak FLOP/s is known for device kind %r.", kind)
    return peak


def _check_vocab(model_config: TransformerConfig, batches: Any) -> None:
    """Raises `ConfigError` when the tokenizer emits ids the model's embedding cannot hold."""
    vocab = batches.tokenizer.vocab_size
    if model_config.vocab_size < vocab:
        raise ConfigError(
            f"TransformerConfig.vocab_size = {model_config.vocab_size} is smaller than the "
            f"tokenizer's vocabulary ({vocab}): raise it to at least {vocab}."
        )


def check_model_dir(model_dir: str) -> epath.Path:
    """MODEL_DIR as a path, refused unless it is a URI or an absolute local path (orbax saves
    only there; a relative one would also depend on each host's working directory).

    Raises:
      ConfigError: a relative local path, named with the absolute one it could be.
    """
    path = paths.model_dir(model_dir)  # fails here if a cloud backend is missing
    if not paths.is_cloud(model_dir) and not os.path.isabs(model_dir):
        raise ConfigError(
            f"MODEL_DIR must be an absolute path or a URI, got {model_dir!r} (relative to "
            f"this directory: {os.path.abspath(model_dir)!r})."
        )
    return path


def create_model_dir(path: epath.Path) -> None:
    """Creates MODEL_DIR (and its parents) if missing and checks that a file can be written
    there.

    Raises:
      ConfigError: it cannot be created or written, with the operating system's reason.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        reason = error.strerror or str(error)
        raise ConfigError(f"MODEL_DIR {path} cannot be written: {reason}.") from None


def _make_trainer(
    *,
    model_config: TransformerConfig,
    optimizer: Callable[..., Any],
    learning_rate: optimizers.Schedule,
    batch_size: int,
    seq_len: int,
    seed: int,
    non_finite: str,
    mesh: Mesh | None,
) -> Trainer:
    """`train`'s `Trainer` for its arguments of the same names, on the gin-configured mesh
    (unless ``mesh`` is given) and logical axis rules; fails first (`ConfigError`) if
    ``seq_len`` exceeds the model's ``max_len`` or ``batch_size`` does not split over the mesh
    (`partitioning.check_batch_size`)."""
    if seq_len > model_config.max_len:
        raise ConfigError(
            f"SEQ_LEN (train.seq_len) = {seq_len} exceeds the model's TransformerConfig.max_len "
            f"= {model_config.max_len}: lower SEQ_LEN or raise max_len."
        )
    mesh = partitioning.make_mesh() if mesh is None else mesh
    rules = partitioning.logical_axis_rules()
    partitioning.check_batch_size(batch_size, mesh, rules)
    choice = attention_choice(model_config, seq_len)
    log = logging.warning if choice.fallback else logging.info
    log("Attention: %s%s", choice.implementation, f" ({choice.reason})" * bool(choice.reason))
    return Trainer(
        Transformer(model_config),
        optimizer,
        learning_rate,
        mesh,
        rules,
        (batch_size, seq_len),
        seed,
        skip_non_finite=non_finite == "skip",
    )


def configured_trainer(mesh: Mesh | None = None) -> Trainer:
    """The `Trainer` that `train` builds from the parsed gin config: its model, optimizer,
    schedule, mesh, logical axis rules, batch shape and step options, from ``train.*``'s
    bindings (and `train`'s defaults). Reads no data and allocates nothing, so a host without
    the run's devices can lower its train step (`Trainer.export_train_step`).

    Args:
      mesh: the device mesh; default `partitioning.make_mesh()` as configured in gin.

    Raises:
      ConfigError: a ``train`` argument the trainer needs is not bound, or the batch size does
        not split over the mesh.
    """
    defaults = {name: p.default for name, p in inspect.signature(train).parameters.items()}
    arguments = defaults | gin.get_bindings(train)
    names = inspect.signature(_make_trainer).parameters.keys() - {"mesh"}
    unbound = sorted(name for name in names if arguments[name] is gin.REQUIRED)
    if unbound:
        raise ConfigError(f"the gin config binds no {', '.join(f'train.{n}' for n in unbound)}.")
    return _make_trainer(mesh=mesh, **{name: arguments[name] for name in names})


@gin.configurable(denylist=["mesh"])
def train(
    *,
    model_dir: str = gin.REQUIRED,
    train_steps: int = gin.REQUIRED,
    batch_size: int = gin.REQUIRED,
    seq_len: int = gin.REQUIRED,
    checkpoint_period: int = gin.REQUIRED,
    eval_period: int = gin.REQUIRED,
    seed: int = gin.REQUIRED,
    model_config: TransformerConfig = gin.REQUIRED,
    learning_rate: optimizers.Schedule = gin.REQUIRED,
    train_data: Callable[..., Any] = gin.REQUIRED,
    eval_data: Callable[..., list[Any]] | None = None,
    optimizer: Callable[..., Any] = optimizers.make_optimizer,
    keep_checkpoints: int | None = None,
    log_every: int = 10,
    compilation_cache_dir: str | None = None,
    non_finite: str = "stop",
    max_skipped_steps: int = 10,
    save_retries: int = 3,
    save_retry_backoff_s: float = 2.0,
    allow_resume_changes: Sequence[str] = (),
    profile_steps: tuple[int, int] | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> RunResult:
    """Trains ``model_config``'s Transformer for ``train_steps`` steps, resuming from MODEL_DIR.

    Args:
      model_dir: the run directory (checkpoints, metrics, config): a local path or a gs://,
        s3:// or az:// URI (its filesystem package is checked before anything else runs).
      train_steps: total number of optimizer steps.
      batch_size: global batch size in sequences (each process reads its share).
      seq_len: tokens per sequence.
      checkpoint_period: save every this many steps (and at the end, and on SIGTERM).
      eval_period: evaluate every this many steps (and at the end); 0: only at the end.
      seed: seeds parameter init, dropout (folded with the step) and data order.
      model_config: the `TransformerConfig`.
      learning_rate: the schedule (also logged per step).
      train_data: ``f(seq_len=, batch_size=, seed=, process_index=, process_count=)`` -> iterator
        of this process's batches with ``get_state()``/``set_state()`` and ``tokenizer``.
      eval_data: ``f(seq_len=, batch_size=, process_index=, process_count=)`` -> list of this
        process's held-out batches; None: no evaluation.
      optimizer: ``f(schedule, mesh=, param_specs=)`` -> optax transformation.
      keep_checkpoints: how many checkpoints to keep (None: all).
      log_every: steps between progress lines.
      compilation_cache_dir: JAX's persistent compilation cache for this run: None (default)
        ``JAX_COMPILATION_CACHE_DIR`` if set, else ``MODEL_DIR/compilation_cache``; ``""`` off;
        else that directory. A resumed run (or a rerun of the same config) then loads its
        compiled train step: JAX keys entries by program, devices, flags and versions (and by
        the cache's own path, where it keeps XLA's autotuning cache: a moved cache misses),
        and caches compilations longer than ``jax_persistent_cache_min_compile_time_secs`` (1 s).
        Trust the directory as you trust the code: JAX runs what it loads from it.
      non_finite: what a step with a non-finite loss or gradient norm does
        (`guard.NonFiniteGuard`): ``"stop"`` (default) ends the run with `guard.NonFiniteError`
        naming the step, having saved nothing after it; ``"skip"`` keeps the parameters and
        optimizer state for that step, counts it (``skipped_steps`` in the metrics) and ends the
        run after ``max_skipped_steps`` such steps.
      max_skipped_steps: see ``non_finite``.
      save_retries: how many times a checkpoint save that fails (a full disk, a storage error)
        is tried again, with the state of that moment, before the run stops with
        `checkpoints.SaveError` (`checkpoints.Checkpoints`). A failed background write is found
        at the next step, so at most the steps since the previous successful save are lost.
      save_retry_backoff_s: seconds before the first retry; each next one waits twice as long.
      allow_resume_changes: what a resumed run may continue differently from its checkpoint,
        among `resume.RESUMABLE_CHANGES`: ``"learning_rate"`` (the schedule, e.g. a TRAIN_STEPS
        that lengthens a cosine decay: the new schedule applies from the checkpoint's step on),
        ``"data_source"`` (DataConfig.source), ``"tokenizer"``. Anything else it would continue
        differently is a `checkpoints.ConfigMismatchError` naming it (`resume.resume_changes`).
        Each segment's operative config is kept in ``config-history.gin``.
      profile_steps: ``(START, COUNT)``: trace steps ``START .. START + COUNT - 1`` with
        ``jax.profiler`` into ``MODEL_DIR/profile/`` (process 0; `metrics.ProfileWindow`);
        None (default): no trace.
      mesh: the device mesh; default `partitioning.make_mesh()` as configured in gin.

    Returns:
      A `RunResult`.

    Raises:
      ConfigError: a setting that cannot work (named), before anything is written.
      run_lock.RunLockedError: another run is using ``model_dir``.
      checkpoints.ConfigMismatchError: ``model_dir``'s checkpoints hold another model or
        optimizer.
      guard.NonFiniteError: the run diverged (see ``non_finite``).
    """
    check_settings(
        train_steps=train_steps,
        batch_size=batch_size,
        seq_len=seq_len,
        checkpoint_period=checkpoint_period,
        eval_period=eval_period,
        log_every=log_every,
        max_skipped_steps=max_skipped_steps,
        keep_checkpoints=keep_checkpoints,
        save_retries=save_retries,
        save_retry_backoff_s=save_retry_backoff_s,
        non_finite=non_finite,
        profile_steps=profile_steps,
        allow_resume_changes=allow_resume_changes,
    )
    model_dir_path = check_model_dir(model_dir)
    step_fns = _make_trainer(  # shapes only: nothing is allocated or written yet
        model_config=model_config,
        optimizer=optimizer,
        learning_rate=learning_rate,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        non_finite=non_finite,
        mesh=mesh,
    )
    data_args = {
        "seq_len": seq_len,
        "batch_size": batch_size,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
    }
    batches = train_data(seed=seed, **data_args)
    _check_vocab(model_config, batches)
    eval_batches = None if eval_data is None else eval_data(**data_args)
    stop = signals.StopSignal()
    cache = compilation_cache_path(model_dir_path, compilation_cache_dir)
    if jax.process_index() == 0:
        create_model_dir(model_dir_path)
    with (
        run_lock.held(model_dir_path),
        stop.installed(),
        persistent_compilation_cache(cache),
        # Closed on any exit, errors included: pending checkpoint writes finish.
        contextlib.closing(
            checkpoints.Checkpoints(
                model_dir_path,
                keep=keep_checkpoints,
                retries=save_retries,
                backoff_s=save_retry_backoff_s,
            )
        ) as ckpts,
    ):
        state, run_counters = resume.restore_or_init(
            step_fns,
            ckpts,
            batches,
            seed=seed,
            schedule=learning_rate,
            train_steps=train_steps,
            allowed_changes=allow_resume_changes,
        )
        step = int(state.step)
        if jax.process_index() == 0:
            resume.record_config(model_dir_path, step, gin.operative_config_str())
        _write_text(model_dir_path / "model-info.txt", train_state.describe(step_fns.layout))

        writer = metrics.MetricsWriter(
            model_dir_path, enabled=jax.process_index() == 0, resume_step=step
        )
        progress = metrics.Progress(
            train_steps,
            batch_size * seq_len,
            log_every,
            start_step=step,
            devices=jax.device_count(),
            flops_per_token=flops_per_token(model_config, seq_len),
            peak_flops_per_device=_peak_flops(),
        )
        guard = NonFiniteGuard(
            non_finite,
            max_skipped_steps,
            run_counters.get("skipped_steps", 0),
            ckpts.describe_newest,
        )

        def record(step: int, step_metrics: Mapping[str, Any]) -> float:
            """Writes one step's metrics (now on the host) and applies the guard; its loss."""
            scalars = {name: float(value) for name, value in step_metrics.items()}
            error = guard.check(step, scalars)
            writer.write(step, {**scalars, **guard.metrics()})
            if error is not None:
                raise error
            return scalars["loss"]

        profile = metrics.ProfileWindow(profile_steps, model_dir_path, jax.process_index() == 0)
        pending: tuple[int, dict[str, Any]] | None = None
        loss = None
        preempted = stop.received
        first = step
        try:
            while step < train_steps and not preempted:
                profile.before(step + 1)
                with first_step_log() if step == first else contextlib.nullcontext():
                    state, step_metrics = step_fns.step(state, next(batches))
                    if step == first:
                        jax.block_until_ready(step_metrics)
                step += 1
                profile.after(step, step_metrics)
                if pending is not None:  # the previous step's metrics are ready by now
                    record(*pending)
                pending = (step, dict(step_metrics))
                if eval_batches is not None and _due(step, eval_period, train_steps):
                    pending[1].update(step_fns.evaluate(state.params, eval_batches))
                if progress.due(step):
                    loss = float(step_metrics["loss"])
                    pending[1].update(progress.log(step, loss))
                    writer.flush(force=False)
                preempted = stop.received or ckpts.reached_preemption(step)
                last = preempted or step == train_steps
                # A failed background write is retried now, with this step's state.
                if last or ckpts.save_failed() or _due(step, checkpoint_period, train_steps):
                    # The log on disk reaches at least the checkpoint, and the guard has seen
                    # the step whose state is saved.
                    loss, pending = record(*pending), None
                    writer.flush()
                    run_state = guard.run_state() | {
                        "learning_rate": resume.schedule_probes(learning_rate, step, train_steps)
                    }
                    ckpts.save(state, batches.get_state(), run_state, wait=last)
        finally:  # also on errors: end a trace, flush the metrics
            profile.close()
            writer.close()
        _write_text(model_dir_path / resume.CONFIG_FILE, gin.operative_config_str())
        if preempted:
            saved = "checkpoint saved" if step in ckpts.steps() else "no step ran, nothing saved"
            logging.warning("Stopped at step %d, %s; rerun to resume.", step, saved)
    return RunResult(step=step, loss=loss, preempted=preempted)

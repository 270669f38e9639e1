"""Regenerate models/data/digits.npz from scikit-learn's bundled digits (sklearn is needed only here)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

#: Seed of the stratified 80/20 split; changing it changes the shipped file.
SPLIT_SEED = 20240601
TEST_FRACTION = 0.2


def stratified_split(labels: np.ndarray, *, test_fraction: float,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices (each sorted) holding `test_fraction` of every class out."""
    rng = np.random.default_rng(seed)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        cut = int(round(len(members) * test_fraction))
        test.append(members[:cut])
        train.append(members[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def make_digits(out: Path) -> Path:
    """Write the digits in the documented .npz format (see docs/data-format.md) to `out`."""
    from sklearn.datasets import load_digits  # only this script depends on scikit-learn

    bunch = load_digits()
    images = np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)  # 0..16 -> [0, 1]
    labels = np.asarray(bunch.target, dtype=np.int64)
    train, test = stratified_split(labels, test_fraction=TEST_FRACTION, seed=SPLIT_SEED)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, x_train=images[train], y_train=labels[train],
                        x_test=images[test], y_test=labels[test],
                        input_name=np.array("x"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ps_models.data.make_digits",
        description="Rebuild digits.npz (1797 8x8 images, pixels scaled to [0, 1], "
                    "stratified 80/20 split) from scikit-learn's load_digits.")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("digits.npz"),
                        help="where to write the file (default: next to this script)")
    args = parser.parse_args(argv)
    path = make_digits(args.out)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A synthetic Criteo-like click dataset in Parquet, drawn from a known logit (the DLRM example's data).

    python -m ps_models.recsys.criteo_synthetic OUT_DIR --rows 1000000 --test-rows 100000 \\
        --files 4 --row-group-rows 16384 --seed 0

writes ``OUT_DIR/train/part-00000.parquet`` ... (``--files`` files, the rows split evenly),
``OUT_DIR/test/part-00000.parquet`` and ``OUT_DIR/meta.json``. Every file has three columns,
one per input of ``models/recsys/dlrm.onnx`` and the label (docs/data-format.md, "Parquet
folders"):

* ``dense``: fixed_size_list<float32>[13], ``log(1 + count)`` of 13 heavy-tailed counts;
* ``cat``: fixed_size_list<int64>[26], the raw ids of 26 categorical fields in three kinds
  (`SMALL`, `HASHED`, `DYNAMIC` are their column ranges):

  - columns 0-12, *small*: ids in ``[0, vocab)``, the vocabularies `SMALL_VOCABS` (3 to 1000);
  - columns 13-20, *hashed*: large non-negative int64 ids (the model takes them modulo
    `HASH_BUCKETS`, so ids collide);
  - columns 21-25, *dynamic*: arbitrary int64 keys, negative ones too (hashed feature ids,
    for a table that holds a row per key);

  each field's ids are drawn with Zipf popularity (exponent ``skew``) over its vocabulary
  (small fields) or over ``universe`` distinct ids (hashed and dynamic fields);
* ``label``: int8, 0 or 1.

**The signal.** Each label is a Bernoulli draw with probability ``sigmoid(z)``, where z, the
true logit, is a function of the observed columns only, the sum of these parts (`logit_parts`):

    bias                                                   solved so that the click rate is ctr (25%)
    dense       sum_j w_j (dense_j - a_j) / b_j            linear, |w| = dense_std (0.6)
    small       sum_f e_f[id_f], f small                   an effect per id, N(0, small_std = 0.23)
    hashed      sum_f e_f[id_f], f hashed                  per raw id, N(0, hashed_std = 0.27)
    dynamic     sum_f e_f[id_f], f dynamic                 per key, N(0, dynamic_std = 0.27)
    pairs       pair_std / 2 sum_(f,g) <p_f[id_f], q_g[id_g]>   PAIRS: 4 field pairs, rank 4, pair_std 0.4
    dense_pair  dense_pair_std (dense_2 - a_2) / b_2 h[id_9]    a dense x field interaction (0.3)

with every table drawn from the seed (factors p, q, h standard normal). A hashed field's
effect belongs to its raw id, so the ids sharing a bucket modulo `HASH_BUCKETS` mix in the
model's table; a dynamic field's to its key. Each part alone ranks the labels at AUC 0.54-0.66;
together (the logit's standard deviation is 1.6) the true logits rank the test split at about
0.83: the Bayes AUC, the best any model can do, written to ``meta.json`` (``bayes_auc_test``).
A model falls short of it by the ids it sees too seldom to learn: with 2 million training rows,
knowing exactly the effects of the ids seen at least 50 times (79% of the hashed and dynamic
fields' draws) and nothing of the others ranks at 0.80.

Rows are made BLOCK_ROWS (16384) at a time, vectorized with numpy, block b of a split drawn
from the generator seeded (seed, split, b), and written ``--row-group-rows`` rows to a Parquet
row group (default 16384: 4.3 MB decoded, a small read for a worker). So the same seed gives
the same rows whatever ``--files`` and ``--row-group-rows``, and memory is bounded by a block
and a row group, not by ``--rows``: the process peaks at about 190 MB (230 MB with 65536-row
groups) whether it writes 200 thousand rows or 2 million, of which about 100 MB are the
interpreter, numpy and pyarrow and 45 MB the seed's tables. Generating runs at 700-900
thousand rows a second on one core; writing Parquet (snappy, about 140 bytes a row) halves
that: 2 million rows take about 5 s.
`write_dataset` does the same from Python; `true_logits` recomputes z from the columns, and
`logit_parts` its parts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["CAT_FIELDS", "DENSE_FEATURES", "DYNAMIC", "DYNAMIC_FIELDS", "HASHED", "HASHED_FIELDS", "HASH_BUCKETS",
           "SMALL", "SMALL_VOCABS", "Generator", "auc", "logit_parts", "true_logits", "write_dataset"]

#: Dense features per example.
DENSE_FEATURES = 13
#: The vocabularies of the 13 small fields (cat columns 0-12): ids in [0, vocab).
SMALL_VOCABS = (3, 4, 6, 10, 16, 25, 40, 64, 100, 160, 250, 500, 1000)
#: Hashed fields (cat columns 13-20) and dynamic fields (cat columns 21-25).
HASHED_FIELDS, DYNAMIC_FIELDS = 8, 5
CAT_FIELDS = len(SMALL_VOCABS) + HASHED_FIELDS + DYNAMIC_FIELDS
#: The cat columns of each kind.
SMALL = range(0, len(SMALL_VOCABS))
HASHED = range(SMALL.stop, SMALL.stop + HASHED_FIELDS)
DYNAMIC = range(HASHED.stop, HASHED.stop + DYNAMIC_FIELDS)
#: The rows of a hashed field's table: the model looks raw id % HASH_BUCKETS up (16384 x 16 float32 = 1 MiB).
HASH_BUCKETS = 16384
#: The pairs of cat columns whose ids interact (small x small, small x hashed, small x dynamic, hashed x dynamic).
PAIRS = ((8, 11), (10, 13), (12, 21), (14, 22))
#: The rank of each pair's interaction.
PAIR_RANK = 4
#: The dense feature and the cat column of the dense x field interaction.
DENSE_PAIR = (2, 9)
#: Rows made at a time (a block of rows is one draw of the generator, seeded by its index).
BLOCK_ROWS = 16384
#: Rows of the pilot sample the bias is solved on.
PILOT_ROWS = 1 << 16

_TRAIN, _TEST, _PILOT, _TABLES = 0, 1, 2, 3


@dataclass(frozen=True)
class Generator:
    """The generator's parameters (written to meta.json); `tables` draws everything else from ``seed``."""

    seed: int = 0
    #: Zipf exponent of the ids' popularity within a field.
    skew: float = 1.1
    #: Distinct ids of a hashed or of a dynamic field.
    universe: int = 1 << 17
    #: Standard deviations of the logit's parts: the dense linear term, each small / hashed / dynamic field's id
    #: effect, each id pair's interaction and the dense x field interaction.
    dense_std: float = 0.6
    small_std: float = 0.23
    hashed_std: float = 0.27
    dynamic_std: float = 0.27
    pair_std: float = 0.4
    dense_pair_std: float = 0.3
    #: The click rate the bias is solved for.
    ctr: float = 0.25

    def __post_init__(self) -> None:
        if not 1.0 < self.skew <= 3.0:
            raise ValueError(f"skew must be in (1, 3], got {self.skew}")
        if self.universe < 2:
            raise ValueError(f"universe must be at least 2, got {self.universe}")
        if not 0.0 < self.ctr < 1.0:
            raise ValueError(f"ctr must be in (0, 1), got {self.ctr}")

    def tables(self) -> "_Tables":
        return _Tables(self)


def _pad(table: np.ndarray) -> np.ndarray:
    """A per-rank table indexed by 1-based rank: its first entry repeated in front and its last behind (a rank of
    0 or vocab + 1, which float rounding could give, reads the nearest rank's entry)."""
    return np.concatenate([table[:1], table, table[-1:]])


@dataclass
class _Tables:
    """Everything drawn from the seed once: per field its ids by popularity rank and their effects, the dense
    features' offsets, scales and weights, the interaction factors, and the bias."""

    params: Generator
    vocab: np.ndarray = field(init=False)             # (26,) ids per field
    ids: list[np.ndarray] = field(init=False)         # per field: raw id of each popularity rank (padded)
    effects: list[np.ndarray] = field(init=False)     # per field: effect of each rank (float32, padded)
    bias: float = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        rng = np.random.default_rng([p.seed, _TABLES])
        self.vocab = np.array([*SMALL_VOCABS, *[p.universe] * (HASHED_FIELDS + DYNAMIC_FIELDS)], np.int64)
        self.ids, self.effects = [], []
        for f, vocab in enumerate(self.vocab):
            if f in SMALL:
                ids = rng.permutation(vocab)
                std = p.small_std
            elif f in HASHED:
                ids = rng.integers(0, 1 << 62, vocab)
                std = p.hashed_std
            else:
                ids = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, vocab, endpoint=True)
                std = p.dynamic_std
            self.ids.append(_pad(ids.astype(np.int64)))
            self.effects.append(_pad((std * rng.standard_normal(vocab)).astype(np.float32)))
        # dense: count = floor(exp(a + b g)), g standard normal; the model sees log(1 + count)
        self.dense_a = rng.uniform(0.0, 4.0, DENSE_FEATURES).astype(np.float32)
        self.dense_b = rng.uniform(0.5, 1.5, DENSE_FEATURES).astype(np.float32)
        w = rng.standard_normal(DENSE_FEATURES)
        self.dense_w = (p.dense_std * w / np.linalg.norm(w)).astype(np.float32)
        self.pair_p = [_pad(rng.standard_normal((self.vocab[f], PAIR_RANK)).astype(np.float32)) for f, _ in PAIRS]
        self.pair_q = [_pad(rng.standard_normal((self.vocab[g], PAIR_RANK)).astype(np.float32)) for _, g in PAIRS]
        self.dense_pair_h = _pad(rng.standard_normal(self.vocab[DENSE_PAIR[1]]).astype(np.float32))
        # Zipf by inversion of the continuous density x^-skew on [1, vocab + 1): the 1-based rank is floor(x)
        e = 1.0 - p.skew
        self._zipf_top = ((self.vocab + 1.0) ** e - 1.0).astype(np.float32)[:, None]
        self._zipf_power = np.float32(1.0 / e)
        self.bias = 0.0
        self.bias = self._solve_bias()

    def ranks(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """(26, n) int64 popularity ranks, field by field, Zipf-distributed, 1-based: the per-field tables are
        padded by one entry at each end (`_pad`), so float rounding at either end needs no clipping."""
        u = rng.random((CAT_FIELDS, n), dtype=np.float32)
        u *= self._zipf_top
        u += np.float32(1.0)
        np.log(u, out=u)                                 # numpy's float32 log is vectorized, log1p is not
        u *= self._zipf_power
        np.exp(u, out=u)                                 # in [1, vocab + 1]
        return u.astype(np.int64)

    def chunk(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """n rows: dense (n, 13) float32, cat (n, 26) int64, label (n,) int8 and the true logits (n,) float32."""
        g = rng.standard_normal((DENSE_FEATURES, n), dtype=np.float32)
        g *= self.dense_b[:, None]
        g += self.dense_a[:, None]
        np.exp(g, out=g)
        np.floor(g, out=g)
        g += np.float32(1.0)
        np.log(g, out=g)                                 # the observed dense values: log(1 + count)
        dense = np.ascontiguousarray(g.T)
        g -= self.dense_a[:, None]
        g /= self.dense_b[:, None]                       # standardized: what the logit reads
        z = self.dense_w @ g
        z += np.float32(self.bias)
        ranks = self.ranks(rng, n)
        cat_t = np.empty((CAT_FIELDS, n), np.int64)
        for f in range(CAT_FIELDS):
            np.take(self.ids[f], ranks[f], out=cat_t[f])
            z += self.effects[f][ranks[f]]
        p = self.params
        for (f, g_), left, right in zip(PAIRS, self.pair_p, self.pair_q):
            dot = np.einsum("nk,nk->n", left[ranks[f]], right[ranks[g_]])
            z += np.float32(p.pair_std / math.sqrt(PAIR_RANK)) * dot
        j, f = DENSE_PAIR
        z += np.float32(p.dense_pair_std) * g[j] * self.dense_pair_h[ranks[f]]
        cat = np.ascontiguousarray(cat_t.T)
        # label ~ Bernoulli(sigmoid(z)): u < sigmoid(z) <=> logit(u) < z
        u = rng.random(n, dtype=np.float32)
        label = (u < 1.0 / (1.0 + np.exp(-z))).astype(np.int8)
        return dense, cat, label, z.astype(np.float32, copy=False)

    def _solve_bias(self) -> float:
        """The bias whose mean click probability on a pilot sample is ctr (bisection)."""
        rng = np.random.default_rng([self.params.seed, _PILOT])
        z = np.concatenate([self.chunk(rng, BLOCK_ROWS)[3] for _ in range(PILOT_ROWS // BLOCK_ROWS)]).astype(np.float64)
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if np.mean(1.0 / (1.0 + np.exp(-(z + mid)))) < self.params.ctr:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)


def logit_parts(dense: np.ndarray, cat: np.ndarray, params: Generator | None = None,
                tables: _Tables | None = None) -> dict[str, np.ndarray]:
    """The true logit's parts for rows given by their columns (dense (n, 13), cat (n, 26)), float32 each:
    "bias", "dense" (the linear term), "small", "hashed", "dynamic" (the fields' id effects), "pairs" (the id pairs'
    interactions) and "dense_pair". Their sum is `true_logits`. ValueError for an id the seed never draws."""
    tables = tables if tables is not None else (params or Generator()).tables()
    p = tables.params
    cat = np.asarray(cat)
    xs = (np.asarray(dense, np.float32).T - tables.dense_a[:, None]) / tables.dense_b[:, None]
    parts = {"bias": np.full(len(cat), tables.bias, np.float32), "dense": tables.dense_w @ xs}
    ranks = np.empty((CAT_FIELDS, len(cat)), np.int64)
    for f in range(CAT_FIELDS):
        order = np.argsort(tables.ids[f])
        where = np.searchsorted(tables.ids[f], cat[:, f], sorter=order)
        ranks[f] = order[np.minimum(where, len(order) - 1)]
        if not np.array_equal(tables.ids[f][ranks[f]], cat[:, f]):
            raise ValueError(f"cat column {f} holds ids this generator's seed never draws")
    for kind, columns in (("small", SMALL), ("hashed", HASHED), ("dynamic", DYNAMIC)):
        parts[kind] = np.sum([tables.effects[f][ranks[f]] for f in columns], axis=0, dtype=np.float32)
    parts["pairs"] = np.sum([np.float32(p.pair_std / math.sqrt(PAIR_RANK))
                             * np.einsum("nk,nk->n", left[ranks[f]], right[ranks[g]])
                             for (f, g), left, right in zip(PAIRS, tables.pair_p, tables.pair_q)],
                            axis=0, dtype=np.float32)
    j, f = DENSE_PAIR
    parts["dense_pair"] = np.float32(p.dense_pair_std) * xs[j] * tables.dense_pair_h[ranks[f]]
    return {k: v.astype(np.float32, copy=False) for k, v in parts.items()}


def true_logits(dense: np.ndarray, cat: np.ndarray, params: Generator | None = None,
                tables: _Tables | None = None) -> np.ndarray:
    """The true logits z of rows given by their columns (dense (n, 13), cat (n, 26)): the signal the labels were
    drawn from (float32; equal to what the generator computed up to float rounding)."""
    return np.sum(list(logit_parts(dense, cat, params, tables).values()), axis=0, dtype=np.float32)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The area under the ROC curve of scores for binary labels (ties count a half)."""
    scores = np.asarray(scores, np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1).astype(bool)
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # average rank (1-based) of each run of equal scores
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    run_rank = (starts + ends + 1) / 2.0
    ranks = np.repeat(run_rank, ends - starts)
    rank_sum = ranks[labels[order]].sum()
    return float((rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives))


def _schema():
    import pyarrow as pa
    return pa.schema([("dense", pa.list_(pa.float32(), DENSE_FEATURES)),
                      ("cat", pa.list_(pa.int64(), CAT_FIELDS)),
                      ("label", pa.int8())])


def _table(dense: np.ndarray, cat: np.ndarray, label: np.ndarray):
    import pyarrow as pa
    return pa.Table.from_arrays(
        [pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1)), DENSE_FEATURES),
         pa.FixedSizeListArray.from_arrays(pa.array(cat.reshape(-1)), CAT_FIELDS),
         pa.array(label)], schema=_schema())


def _split_rows(rows: int, files: int) -> list[int]:
    return [rows // files + (i < rows % files) for i in range(files)]


class _Stream:
    """A split's rows in order, made BLOCK_ROWS at a time, block b from the generator seeded (seed, split, b): the
    rows do not depend on how they are cut into files and row groups."""

    def __init__(self, tables: _Tables, code: int, rows: int) -> None:
        self.tables, self.code, self.rows = tables, code, rows
        self.block = 0
        self.pending: tuple[np.ndarray, ...] = ()
        self.used = 0
        self.seconds = 0.0

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The next n rows: dense, cat, label and the true logits."""
        out = (np.empty((n, DENSE_FEATURES), np.float32), np.empty((n, CAT_FIELDS), np.int64),
               np.empty(n, np.int8), np.empty(n, np.float32))
        filled = 0
        while filled < n:
            if not self.pending or self.used == len(self.pending[0]):
                started = time.perf_counter()
                size = min(BLOCK_ROWS, self.rows - self.block * BLOCK_ROWS)
                rng = np.random.default_rng([self.tables.params.seed, self.code, self.block])
                self.pending, self.used = self.tables.chunk(rng, size), 0
                self.block += 1
                self.seconds += time.perf_counter() - started
            k = min(n - filled, len(self.pending[0]) - self.used)
            for target, source in zip(out, self.pending):
                target[filled:filled + k] = source[self.used:self.used + k]
            filled += k
            self.used += k
        return out


def write_dataset(out: str | Path, *, rows: int = 1_000_000, test_rows: int = 100_000, files: int = 1,
                  row_group_rows: int = 16384, seed: int = 0, params: Generator | None = None,
                  log=None) -> dict:
    """Write the dataset to `out` (see the module's doc) and return what meta.json holds.

    `params` overrides the generator's parameters (its seed wins over `seed`). Part files of an
    earlier run in `out` are removed first. `log`: a function given a line of progress, or None.
    The rows depend on the seed and the parameters, not on `files` or `row_group_rows`.
    """
    import pyarrow.parquet as pq

    if rows < 1 or test_rows < 1 or files < 1 or row_group_rows < 1:
        raise ValueError(f"rows, test_rows, files and row_group_rows must be positive, got {rows}, {test_rows}, "
                         f"{files}, {row_group_rows}")
    if files > rows:
        raise ValueError(f"{files} files need at least as many rows, got {rows}")
    params = params if params is not None else Generator(seed=seed)
    started = time.perf_counter()
    tables = params.tables()
    out = Path(out)
    counts: dict[str, dict] = {}
    test_z, test_y = [], []
    generating = 0.0
    for split, code, split_files in (("train", _TRAIN, _split_rows(rows, files)), ("test", _TEST, [test_rows])):
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("part-*.parquet"):
            old.unlink()
        stream = _Stream(tables, code, sum(split_files))
        clicks = 0
        for index, file_rows in enumerate(split_files):
            path = folder / f"part-{index:05d}.parquet"
            with pq.ParquetWriter(path, _schema(), compression="snappy", use_dictionary=["label"]) as writer:
                for first in range(0, file_rows, row_group_rows):
                    dense, cat, label, z = stream.take(min(row_group_rows, file_rows - first))
                    writer.write_table(_table(dense, cat, label), row_group_size=len(label))
                    clicks += int(label.sum(dtype=np.int64))
                    if code == _TEST:
                        test_z.append(z)
                        test_y.append(label)
                    del dense, cat, label, z
            if log is not None:
                log(f"wrote {path} ({file_rows} rows, {path.stat().st_size} bytes)")
        generating += stream.seconds
        counts[split] = {"rows": sum(split_files), "files": len(split_files), "ctr": clicks / sum(split_files)}
    bayes = auc(np.concatenate(test_z), np.concatenate(test_y))
    meta = {
        "generator": "ps_models.recsys.criteo_synthetic",
        "params": asdict(params),
        "bias": tables.bias,
        "row_group_rows": row_group_rows,
        "columns": {"dense": f"fixed_size_list<float32>[{DENSE_FEATURES}]",
                    "cat": f"fixed_size_list<int64>[{CAT_FIELDS}]", "label": "int8"},
        "fields": {"small": [SMALL.start, SMALL.stop], "hashed": [HASHED.start, HASHED.stop],
                   "dynamic": [DYNAMIC.start, DYNAMIC.stop], "small_vocabs": list(SMALL_VOCABS),
                   "hash_buckets": HASH_BUCKETS},
        "train": counts["train"],
        "test": counts["test"],
        "bayes_auc_test": bayes,
        "seconds": round(time.perf_counter() - started, 3),
        "generation_seconds": round(generating, 3),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps_models.recsys.criteo_synthetic",
                                description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the dataset folder to write (train/, test/, meta.json)")
    p.add_argument("--rows", type=int, default=1_000_000, help="training rows")
    p.add_argument("--test-rows", type=int, default=100_000, help="test rows")
    p.add_argument("--files", type=int, default=1, help="training files (the rows split evenly)")
    p.add_argument("--row-group-rows", type=int, default=16384,
                   help="rows per Parquet row group, and per chunk generated (memory grows with it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=Generator.skew, help="Zipf exponent of ids within a field")
    p.add_argument("--ctr", type=float, default=Generator.ctr, help="the click rate")
    args = p.parse_args(argv)
    try:
        params = Generator(seed=args.seed, skew=args.skew, ctr=args.ctr)
        meta = write_dataset(args.out, rows=args.rows, test_rows=args.test_rows, files=args.files,
                             row_group_rows=args.row_group_rows, params=params, log=print)
    except (ValueError, OSError) as exc:
        print(f"criteo_synthetic: error: {exc}", file=sys.stderr)
        return 2
    rows = meta["train"]["rows"] + meta["test"]["rows"]
    print(json.dumps({"rows": rows, "train_ctr": round(meta["train"]["ctr"], 4),
                      "bayes_auc_test": round(meta["bayes_auc_test"], 4), "seconds": meta["seconds"],
                      "rows_per_second_generated": round(rows / max(meta["generation_seconds"], 1e-9))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

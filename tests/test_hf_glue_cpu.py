"""The step runner's host read table as one numba loop (ops/read_table_ops.py, ``compiled_loop``) writes what the numpy
path of ``StepTables._fill_host`` writes, cell for cell, and refuses what would write outside the table."""

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("numba")

from kvcanary.ops.read_table_ops import compiled_loop, compiled_new_reads_match  # noqa: E402
from kvcanary.runtime.step.tables import StepTables  # noqa: E402

NUM_ROWS, NUM_SLOTS = 9, 500


def host_table(kernel, seed: int, bs: int, width: int, short: int, read_dtype) -> np.ndarray:
    """``_fill_host`` over a random batch of ``bs`` requests (rows drawn with repeats when ``bs`` exceeds
    the rows: the last request of a row wins on both paths), its read index ``short`` slots short."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(NUM_ROWS, size=bs, replace=bs > NUM_ROWS).astype(np.int64)
    prefix = rng.integers(0, 40, bs).astype(np.int64)
    extend = rng.integers(1, 5, bs).astype(np.int64)
    total = int((prefix + extend).sum())
    read = rng.integers(0, NUM_SLOTS, total + 64).astype(read_dtype)
    b = StepTables.__new__(StepTables)
    b.warned_read_size, b.host_table = False, kernel
    b.group, b.num_slots = 0, NUM_SLOTS
    out = np.full((NUM_ROWS, width), -5, dtype=np.int64)
    views = SimpleNamespace(rows=rows, prefix=prefix, extend=extend, rtt=out, read=read)
    b._fill_host(views, SimpleNamespace(true_read_sizes=[total - short]), total)
    return out, rows


@pytest.mark.parametrize("seed,bs,short", [(0, 1, 0), (1, 5, 0), (2, 9, 0), (3, 6, 7), (4, 3, 1), (5, 14, 0),
                                           (6, 12, 20)])
@pytest.mark.parametrize("width", [1, 37, 300])
@pytest.mark.parametrize("read_dtype", [np.int64, np.int32])
def test_compiled_read_table_fills_what_numpy_fills(seed, bs, short, width, read_dtype):
    compiled, rows = host_table(compiled_loop(), seed, bs, width, short, read_dtype)
    numpy_path, _ = host_table(None, seed, bs, width, short, read_dtype)
    assert np.array_equal(compiled, numpy_path)
    # (the comparison can fail: untouched rows kept their marker, request rows got slots, short ones the fill)
    untouched = sorted(set(range(NUM_ROWS)) - set(rows.tolist()) | {0})  # (row 0, the padding row: never filled)
    assert all((compiled[r] == -5).all() for r in untouched) and len(untouched) < NUM_ROWS
    assert (compiled == NUM_SLOTS).any() == (short > 0 and width > 1)


def test_compiled_read_table_refuses_rows_and_clamps_outside_its_arrays():
    out = np.zeros((3, 4), dtype=np.int64)
    read = np.arange(10, dtype=np.int64)
    one = np.ones(1, dtype=np.int64)
    with pytest.raises(IndexError, match="row outside"):
        compiled_loop()(out, np.array([3]), one, one, read, 9)
    with pytest.raises(IndexError, match="clamp outside"):
        compiled_loop()(out, np.array([1]), one, one, read, 10)
    with pytest.raises(IndexError, match="clamp outside"):
        compiled_loop()(out, np.array([1]), one, one, np.zeros(0, dtype=np.int64), -1)
    assert not out.any()  # nothing written by a refused call


@pytest.mark.parametrize("seed", range(6))
def test_compiled_new_reads_shortcut_answers_what_the_numpy_comparison_answers(seed):
    # verify_new_reads' CPU shortcut: do the new tokens' read cells hold their write slots? The loop says 1
    # or 0 where numpy says True or False, and -1 (numpy decides) for an index out of range or lengths apart
    rng = np.random.default_rng(seed)
    rtt = rng.integers(0, NUM_SLOTS, (NUM_ROWS, 20))
    rows = rng.choice(NUM_ROWS, 3, replace=False).astype(np.int64)
    token_req = np.sort(rng.integers(0, 3, 6))
    positions = rng.integers(0, 20, 6).astype(np.int32)
    loc = rtt[rows[token_req], positions].copy()

    def numpy_says():
        return np.array_equal(rtt[rows[token_req], positions], loc)

    assert compiled_new_reads_match()(rtt, rows, token_req, positions, loc) == 1 and numpy_says()
    loc[seed % 6] += 1  # one new token's read cell is not its write slot
    assert compiled_new_reads_match()(rtt, rows, token_req, positions, loc) == 0 and not numpy_says()
    loc[seed % 6] -= 1
    positions[0] = 20  # out of range: numpy raises, the loop leaves it to numpy
    assert compiled_new_reads_match()(rtt, rows, token_req, positions, loc) == -1
    with pytest.raises(IndexError):
        numpy_says()
    positions[0] = -1  # numpy wraps a negative index: the loop leaves that to numpy too
    assert compiled_new_reads_match()(rtt, rows, token_req, positions, loc) == -1
    assert compiled_new_reads_match()(rtt, rows, token_req[:-1], positions, loc) == -1  # lengths apart

"""The shard's finiteness check on gradients (ps_server.rows.all_finite): one sum first, min and max only when the
sum is not finite; it must agree with numpy's elementwise test on every array, overflowing sums included."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ps_server.rows import all_finite

SPECIALS = [np.nan, np.inf, -np.inf]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(dtype=st.sampled_from([np.float16, np.float32, np.float64]), data=st.data())
def test_it_agrees_with_numpys_elementwise_test(dtype, data) -> None:
    big = float(np.finfo(dtype).max)
    values = data.draw(hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, max_side=40),
                                  elements=st.one_of(st.floats(-big, big, width=np.finfo(dtype).bits),
                                                     st.sampled_from(SPECIALS), st.sampled_from([big, -big]))))
    assert all_finite(values) == bool(np.isfinite(values).all())


@pytest.mark.parametrize("special", SPECIALS)
def test_one_bad_element_in_a_large_gradient_is_found_wherever_it_is(special) -> None:
    values = np.ones(1 << 20, np.float32)
    assert all_finite(values)
    for at in (0, 12345, values.size - 1):
        values[at] = special
        assert not all_finite(values)
        values[at] = 1.0


def test_finite_values_whose_sum_overflows_are_finite() -> None:
    big = np.full(16, np.finfo(np.float32).max, np.float32)
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.add.reduce(big))
    assert all_finite(big)
    assert all_finite(np.empty((0, 4), np.float32))

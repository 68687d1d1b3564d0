"""JIT parity: every kernel gives the same result compiled and as plain Python."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbkit.prefill import _kernels


def plain(kernel):
    """The Python function behind a kernel (the kernel itself under NUMBA_DISABLE_JIT=1)."""
    return getattr(kernel, "py_func", kernel)


demands = st.lists(st.floats(0, 1e3), min_size=1, max_size=6).map(np.array)


@pytest.mark.jit_parity(kernels=(_kernels.divisor_apportion,))
@given(demand=demands, extra=st.integers(0, 12), offset=st.sampled_from([0.0, 0.5, 1.0]))
def test_divisor_apportion_parity(demand, extra, offset):
    n = demand.shape[0]
    lower = (demand > 0).astype(np.int64) if offset == 0.0 else np.zeros(n, dtype=np.int64)
    e = int(lower.sum()) + extra
    upper = np.full(n, e, dtype=np.int64)
    a = _kernels.divisor_apportion(demand, e, lower, upper, offset, np.zeros(n, dtype=np.int64))
    b = plain(_kernels.divisor_apportion)(
        demand, e, lower, upper, offset, np.zeros(n, dtype=np.int64)
    )
    assert a.tolist() == b.tolist()
    assert int(a.sum()) == e


@pytest.mark.jit_parity(kernels=(_kernels.partition_min_max,))
@given(demand=demands, data=st.data())
def test_partition_min_max_parity(demand, data):
    g = data.draw(st.integers(1, demand.shape[0]))
    sa, sb = np.zeros(g, dtype=np.int64), np.zeros(g, dtype=np.int64)
    va = _kernels.partition_min_max(demand, g, sa)
    vb = plain(_kernels.partition_min_max)(demand, g, sb)
    assert va == vb
    assert sa.tolist() == sb.tolist()
    assert sa[0] == 0 and (np.diff(sa) > 0).all()


def test_warmup_runs():
    _kernels.warmup()

"""Time bins of the balance-over-time series, shared by the prefill and decode pools.

A pool's ``BINS`` array (float64, shape ``(N_BIN, NUM_BINS)``) sums, per bin of ``bin_s``
seconds, the mean and the max over the engine's ranks of the rank time of every engine step
that starts in the bin (the last bin takes everything later); ``PrefillRun.bin_mean_s`` and
``bin_max_s`` (and the decode ones) are its rows.
"""

from __future__ import annotations

import numpy as np

from lbkit.core._jit import jit

__all__ = ["BIN_MAX", "BIN_MEAN", "NUM_BINS", "N_BIN", "add_step"]

#: Number of time bins of the balance-over-time series.
NUM_BINS = 200
#: Rows of ``BINS``: sums of the mean and of the max rank time.
BIN_MEAN, BIN_MAX = 0, 1
N_BIN = 2


@jit
def add_step(BINS, start_s, bin_s, mean_s, max_s):
    """Add a step that starts at ``start_s`` (mean and max rank time) to its bin."""
    j = np.int64(start_s / bin_s)
    if j >= BINS.shape[1]:
        j = BINS.shape[1] - 1
    BINS[BIN_MEAN, j] += mean_s
    BINS[BIN_MAX, j] += max_s

"""Layout of the prefill pool's state arrays: the rows of each array, named.

:class:`lbkit.sim.prefill_pool.PrefillPool` allocates these arrays and passes them to the numba
kernels (:mod:`lbkit.sim._prefill_kernels`, :mod:`lbkit.sim._plan_kernels`,
:mod:`lbkit.sim._sharing_kernels`); a pool's state lives in a few 2-D arrays whose rows are
named by the constants below, so that a kernel call passes few arguments (numba's dispatch cost
grows with their number).

=========  =======  =========================================================================
array      dtype    rows / entries
=========  =======  =========================================================================
``RI``     int64    ``RI[RI_*, i]`` per request ``i`` (trace order)
``RF``     float64  ``RF[RF_*, i]`` per request
``KI``     int64    ``KI[KI_*, f]`` per flat rank ``f = engine * ranks_per_engine + rank``
``KF``     float64  ``KF[KF_*, f]`` per flat rank
``EI``     int64    ``EI[EI_*, e]`` per engine
``EF``     float64  ``EF[EF_*, e]`` per engine
``P``      float64  ``P[P_*]``: cost coefficients and options
``ACC``    float64  ``ACC[ACC_*]``: run totals
``BINS``   float64  balance sums per time bin (rows in :mod:`lbkit.sim._bins`)
``KS``     float64  ``KS[KS_*, k]``: balance sums of the steps with ``k`` busy ranks
``EVR``,   int64    the event buffer: request, kind (``EV_*`` of :mod:`lbkit.sim.protocol`)
``EVK``,            and tokens of each event the kernels write (the caller hands them to the
``EVT``             policy's ``observe``)
``SCR``    int64    scratch space of work sharing, shape (3, max(requests, ranks_per_engine))
=========  =======  =========================================================================

Each rank's queue is a singly linked FIFO list through ``RI_NEXT`` (``KI_HEAD``, ``KI_TAIL``).
An engine is *stepping* while ``EF_END < inf``.
"""

from __future__ import annotations

#: Requests: tokens left to prefill, prefix (cached plus computed), next in the rank's queue,
#: flat rank (-1: not routed), uncached tokens at admission, tokens reported to the policy.
RI_REM, RI_PREFIX, RI_NEXT, RI_RANK, RI_UNCACHED, RI_REPORTED = 0, 1, 2, 3, 4, 5
#: ``RI_RUN``: 1 once a step that computes the request's first chunk has started (vLLM's
#: "running"; 0 while it waits).
RI_RUN = 6
N_RI = 7
#: Requests: arrival, prefill end (``nan`` until then), quota at the last progress report and
#: initial quota (the report thresholds).
RF_ARRIVAL, RF_FINISH, RF_QREPORT, RF_Q0 = 0, 1, 2, 3
N_RF = 4
#: Ranks: queue head and tail, requests, uncached tokens left, requests the step's plan
#: schedules and the last one's chunk.
KI_HEAD, KI_TAIL, KI_NREQ, KI_TOKENS, KI_SCHED, KI_LAST = 0, 1, 2, 3, 4, 5
#: ``KI_WAIT``: requests not yet running; ``KI_KV``: KV tokens of the running requests (their
#: prefix plus the tokens computed so far).
KI_WAIT, KI_KV = 6, 7
N_KI = 8
#: Ranks: planned time of the step, busy seconds of the run.
KF_TIME, KF_BUSY = 0, 1
#: ``KF_TOK``: tokens the rank's plan computes this step; ``KF_MOE``: the shared-expert seconds
#: its planned time ``KF_TIME`` includes (the balanced-engine guess, replaced at the step's start
#: by the engine's actual shared work).
KF_TOK, KF_MOE = 2, 3
N_KF = 4
#: Engines: end of the running step (``inf``: idle), time from which the next step may start.
EF_END, EF_READY = 0, 1
N_EF = 2
#: Engines: requests queued on its ranks, steps run.
EI_NREQ, EI_STEPS = 0, 1
N_EI = 2
#: Cost coefficients (``QuadraticCost``), the plan's budget, ``min_chunk`` and ``align``, ranks
#: per engine, report quantum, time-bin width, work-sharing mode (index in ``SHARING``) and the
#: context-parallel efficiency.
P_A, P_B, P_K, P_Q, P_GAMMA, P_BUDGET, P_MIN_CHUNK, P_ALIGN, P_RANKS, P_REPORT = range(10)
P_BIN_S, P_SHARE, P_CP_EFF = 10, 11, 12
#: ``P_MOE``: shared (routed-expert) seconds per token, ``b_moe * moe_lb`` (SPEC §8).
P_MOE = 13
N_P = 14
#: Totals: sums of the mean and max rank time over steps, steps, tokens computed, plans over
#: budget, events written, work-sharing moves, and the balance sums over the steps of an engine
#: holding fewer requests than ranks.
ACC_MEAN, ACC_MAX, ACC_STEPS, ACC_TOKENS, ACC_OVERRUNS, ACC_EVENTS_TOTAL = range(6)
ACC_MOVES, ACC_FEW_MEAN, ACC_FEW_MAX, ACC_FEW_STEPS = 6, 7, 8, 9
N_ACC = 10
#: ``KS[KS_*, k]``: steps with ``k`` busy ranks, and their sums of mean and max rank time.
KS_STEPS, KS_MEAN, KS_MAX = 0, 1, 2
N_KS = 3
#: Rows of the work-sharing scratch ``SCR``: the pooled requests by arrival, the flat rank each
#: joins this step (-1: none), and each rank's started head (-1: none).
SCR_POOL, SCR_JOIN, SCR_HEAD = 0, 1, 2
N_SCR = 3

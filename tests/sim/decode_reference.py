"""A plain-Python model of one decode engine (the oracle of the capacity and shared-MoE tests).

It follows the rules of :func:`lbkit.sim.engine.simulate_decode` written out directly: requests
in handover order, ``least_requests`` routing (fewest requests among the ranks with room, lowest
index), a FIFO wait queue offered after every step end where requests finished, preemption of a
rank's newest requests at a step start when the step's KV growth would overflow the capacity,
and step time ``max_r (a + local(B_r, S_r)) + b_moe * moe_lb * sum_r B_r / R``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class RefRun:
    finish_s: list[float]
    wait_s: list[float]
    refusal: list[int]
    preemptions: int = 0
    #: one entry per step: (start, duration, running requests per rank)
    steps: list[tuple[float, float, list[int]]] = field(default_factory=list)
    #: admission order of requests (a request appears again after a preemption)
    admitted: list[int] = field(default_factory=list)


def reference_decode(arrival, prompt, output, *, ranks, a, b, k, combine="sum", moe=0.0,
                     max_kv_tokens=None, watermark=0, max_batch=None):  # fmt: skip
    n = len(arrival)
    cap = max_kv_tokens
    limit = None if cap is None else cap - watermark
    B, S = [0] * ranks, [0] * ranks
    rank, kv = [-1] * n, list(prompt)
    left = [o - 1 for o in output]
    seq = [0] * n
    run = RefRun([math.nan] * n, [0.0] * n, [0] * n)
    queued_at = [0.0] * n
    active: list[int] = []
    pending: list[int] = []
    queue: deque[int] = deque()
    state = {"end": math.inf, "ready": 0.0, "seq": 0}

    def place(i, t):
        ok = [f for f in range(ranks)
              if (max_batch is None or B[f] + 1 <= max_batch)
              and (limit is None or S[f] + kv[i] <= limit)]  # fmt: skip
        if not ok:
            return False
        f = min(ok, key=lambda g: (B[g], g))
        rank[i] = f
        B[f] += 1
        S[f] += kv[i]
        seq[i] = state["seq"]
        state["seq"] += 1
        pending.append(i)
        run.admitted.append(i)
        if state["end"] == math.inf:
            state["ready"] = t
        return True

    def offer(t):
        while queue:
            i = queue[0]
            if place(i, t):
                run.wait_s[i] += t - queued_at[i]
            elif any(B):
                break
            else:
                run.refusal[i] = 3
            queue.popleft()

    def start(t):
        active.extend(pending)
        pending.clear()
        if cap is not None:
            out = []
            for f in range(ranks):
                while sum(rank[i] == f for i in active) and (
                    S[f] + sum(rank[i] == f for i in active) > cap
                ):
                    i = max((j for j in active if rank[j] == f), key=lambda j: seq[j])
                    active.remove(i)
                    B[f] -= 1
                    S[f] -= kv[i]
                    rank[i] = -1
                    queued_at[i] = t
                    out.append(i)
            out.sort(key=lambda j: seq[j])
            queue.extendleft(reversed(out))
            run.preemptions += len(out)
        count = [sum(rank[i] == f for i in active) for f in range(ranks)]
        shared = moe * sum(count) / ranks
        times = []
        for f in range(ranks):
            x, y = b * count[f], k * S[f]
            local = max(x, y) if combine == "max" else x + y
            times.append(a + local + shared)
        run.steps.append((t, max(times), count))
        state["end"] = t + max(times)

    def end():
        t = state["end"]
        done = False
        for i in list(active):
            kv[i] += 1
            S[rank[i]] += 1
            left[i] -= 1
            if left[i] == 0:
                active.remove(i)
                B[rank[i]] -= 1
                S[rank[i]] -= kv[i]
                run.finish_s[i] = t
                done = True
        state["end"] = math.inf
        state["ready"] = t
        if done and queue:
            offer(t)

    def advance(t):
        while True:
            if state["end"] < math.inf:
                if state["end"] <= t:
                    end()
                    continue
                return
            if (active or pending) and state["ready"] < t:
                start(state["ready"])
                continue
            return

    order = sorted(range(n), key=lambda i: arrival[i])
    for i in order:
        t = arrival[i]
        if output[i] == 1:
            run.finish_s[i] = t
            continue
        if limit is not None and prompt[i] > limit:
            run.refusal[i] = 1
            continue
        if cap is not None and prompt[i] + output[i] - 1 > cap:
            run.refusal[i] = 2
            continue
        advance(t)
        if queue or not place(i, t):
            queue.append(i)
            queued_at[i] = t
            if not any(B):
                offer(t)
    advance(math.inf)
    return run

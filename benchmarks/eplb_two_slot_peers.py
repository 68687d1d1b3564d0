"""Two slots per GPU: plan time and balance of lbkit against the peers' code, side by side.

Shapes: 288 slots on 144 GPUs and 320 on 160 (256 experts: DeepSeek-V3 expert loads, layers
3-60 of the trace ``prefill_in1024``, or lognormal loads with sigma 1 without the trace
directory), and 128 slots on 64 GPUs (64 experts, 26 layers: DeepSeek-V2-Lite's shape,
lognormal loads with sigma 1, seed 0), all under the global policy. Per shape the calls
alternate, ``--rounds`` times: lbkit's default and greedy methods, DeepSeek's reference
``rebalance_experts`` (``LBKIT_DEEPSEEK_EPLB`` names a copy of its ``eplb.py``; vLLM's default
policy, ``vllm/distributed/eplb/policy/default.py``, implements the same rules in numpy) and
SGLang's ``deepseek_vec`` (``LBKIT_SGLANG_DEEPSEEK_VEC`` names a copy of
``python/sglang/srt/eplb/eplb_algorithms/deepseek_vec.py``; its ``decode_rebalance_experts``,
the global policy). Each figure is the fastest round, wall clock; lbkit plans blocks of layers
on the CPUs of the process (the default ``workers``) and torch runs on its default threads.
A peer without its file is left out. The ratio columns divide by the fastest peer's time.

Run: ``LBKIT_DEEPSEEK_EPLB=/path/to/eplb.py LBKIT_SGLANG_DEEPSEEK_VEC=/path/to/deepseek_vec.py
python benchmarks/eplb_two_slot_peers.py [--rounds N] [--json out.json]``.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import lbkit
from lbkit.eplb import lower_bound, moe_lb, rebalance_experts, synthetic_expert_load
from run_record import deepseek_eplb, replan_loads, rounds_run, write_results

#: (slots, GPUs, loads) of the table; loads "v3": the DeepSeek-V3 loads, "v2lite": 26 x 64.
SHAPES = ((288, 144, "v3"), (320, 160, "v3"), (128, 64, "v2lite"))


def sglang_vec():
    """SGLang's ``deepseek_vec`` module from the file ``LBKIT_SGLANG_DEEPSEEK_VEC`` names, or
    ``None`` when the variable is unset or torch is missing."""
    path = os.environ.get("LBKIT_SGLANG_DEEPSEEK_VEC")
    if not path:
        return None
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    spec = importlib.util.spec_from_file_location("sglang_deepseek_vec", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best_of(rounds: int, calls: dict) -> dict:
    """``{name: (fastest seconds, phy2log)}`` over ``rounds`` alternating rounds of ``calls``."""
    times: dict = {name: [] for name in calls}
    plans = {}
    for _ in range(rounds):
        for name, call in calls.items():
            t = time.perf_counter()
            plans[name] = call()
            times[name].append(time.perf_counter() - t)
    return {name: (min(times[name]), plans[name]) for name in calls}


def main() -> None:
    a, start, out = rounds_run("eplb_two_slot_peers.py", __doc__.split("\n")[0], 7)
    lbkit.warmup(packages=("eplb",))
    ds, torch = deepseek_eplb()
    vec = sglang_vec()
    if torch is None and vec is not None:
        import torch
    threads = torch.get_num_threads() if torch is not None else None
    v3, _, v3_name = replan_loads()
    v2lite = synthetic_expert_load(26, 64, sigma=1.0, rng=0)
    loads = {"v3": (v3, v3_name), "v2lite": (v2lite, "lognormal sigma 1 (26 x 64)")}
    rows = []
    for slots, gpus, which in SHAPES:
        w, name = loads[which]
        groups = 8 if w.shape[1] % 8 == 0 else 1

        def ours(method, w=w, slots=slots, gpus=gpus, groups=groups):
            return rebalance_experts(w, slots, groups, 1, gpus, method=method).phy2log

        calls = {"default": lambda: ours("default"), "greedy": lambda: ours("greedy")}
        if ds is not None:
            tw = torch.tensor(w).float()
            calls["deepseek"] = lambda tw=tw, s=slots, g=gpus: ds.rebalance_experts(tw, s, 1, 1, g)[
                0
            ].numpy()
        if vec is not None:
            tv = torch.tensor(w).float()[None]
            calls["deepseek_vec"] = lambda tv=tv, s=slots, g=gpus: vec.decode_rebalance_experts(
                tv, s, s // g
            )[0].numpy()
        got = best_of(a.rounds, calls)
        bound = lower_bound(w, slots, groups, 1, gpus, policy="global").mean()
        peers = [n for n in ("deepseek", "deepseek_vec") if n in got]
        fastest = min((got[n][0] for n in peers), default=None)
        row = [f"{slots}/{gpus}", name, round(float(bound), 4)]
        for n in ("default", "greedy", "deepseek", "deepseek_vec"):
            if n in got:
                lb = float(moe_lb(w, got[n][1], num_gpus=gpus).mean())
                row += [round(got[n][0] * 1e3, 2), round(lb, 4)]
            else:
                row += [None, None]
        for n in ("default", "greedy"):
            row.append(None if fastest is None else round(got[n][0] / fastest, 2))
        rows.append(row)
        print(*row, sep=" | ", flush=True)
    table = {
        "title": "Two slots per GPU: plan time and balance against the peers",
        "note": "Global policy; fastest of "
        f"{a.rounds} alternating rounds in one process (JIT warm); both sides use the CPUs of "
        f"the process ({len(os.sched_getaffinity(0))}): lbkit plans blocks of layers on that "
        f"many threads (the default workers), torch runs on its {threads} threads; "
        "ms = whole plan of every layer; moe_lb = mean over layers; bound = mean lower bound; "
        "vs fastest peer = lbkit's time over the faster of DeepSeek's reference (the rules of "
        "vLLM's default policy) and SGLang's deepseek_vec, which need LBKIT_DEEPSEEK_EPLB and "
        "LBKIT_SGLANG_DEEPSEEK_VEC naming copies of their files.",
        "columns": [
            "slots/GPUs",
            "loads",
            "bound",
            "default ms",
            "default moe_lb",
            "greedy ms",
            "greedy moe_lb",
            "DeepSeek ms",
            "DeepSeek moe_lb",
            "deepseek_vec ms",
            "deepseek_vec moe_lb",
            "default vs fastest peer",
            "greedy vs fastest peer",
        ],
        "rows": rows,
    }
    out["tables"] = [table]
    write_results(out, Path(a.json) if a.json else None, start)


if __name__ == "__main__":
    main()

"""Cache-aware routing vs round-robin over M data-parallel replicas (issue 7).

Every replica is a real :class:`~radixkv.tree.RadixTree` over its own
:class:`~radixkv.pages.PagePool` of ``capacity`` pages (a fixed fraction of the pages the
whole trace needs: adding replicas adds memory), serving its queue first come first served.
Requests arrive in trace order, ``interval`` time units apart (``--interval 0``: an offline
batch, everything queued at once); the router sees each replica's load (requests routed and
not finished). A request's service time is its uncached prompt tokens plus
``decode_weight`` x its output tokens (decode runs batched, so it weighs less per token).

Reported per workload, router and M:

    hit      prompt tokens served from the replicas' caches / prompt tokens
    balance  busiest replica's work / mean work (1.00 = even)
    thrpt    requests per 1000 time units (makespan-based; relative figures)
    x rr     throughput / round-robin's at the same M

``--engine`` also runs the tiny random model end to end (DataParallelEngine, one CPU device
per replica; XLA_FLAGS is set for you) on a small shared-prefix trace and reports the
engines' measured hit rate and wall time, cache-aware vs round-robin.

Usage::

    python -m benchmarks.scale                      # replicas 2,4,8, the shared-prefix workloads
    python -m benchmarks.scale --replicas 2,4 --workloads shared_prefix --interval 0
    python -m benchmarks.scale --engine
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from benchmarks.hit_rate import _Replayer, chat_workload, default_workloads, required_pages
from benchmarks.workloads import Request
from radixkv.router import make_router

__all__ = ["RouteResult", "simulate_routing", "workloads", "run", "main"]

SHARED_PREFIX_WORKLOADS = (
    "shared_prefix",
    "shared_prefix_zipf",
    "few_shot",
    "agent",
    "chat",
    "chat_random",
)


def workloads(scale: float = 1.0, seed: int = 0) -> dict[str, list[Request]]:
    """The hit-rate benchmark's workloads plus ``chat_random``: the chat trace with turns
    arriving in random order (the default round-robin turn order sends conversation c to
    replica c mod M under round-robin routing whenever M divides the conversation count)."""
    w = default_workloads(scale, seed)
    w["chat_random"] = chat_workload(scale, seed, interleave="random")
    return w


@dataclass
class RouteResult:
    workload: str
    router: str
    replicas: int
    capacity_pages: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    makespan: float
    work_balance: float
    request_balance: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def throughput(self) -> float:
        return 1000.0 * self.requests / self.makespan if self.makespan else 0.0


def simulate_routing(
    reqs: Sequence[Request],
    router: str,
    replicas: int,
    capacity_pages: int,
    *,
    page_size: int = 16,
    interval: float = 0.0,
    decode_weight: float = 0.25,
    balance_weight: float = 1.0,
    workload: str = "",
) -> RouteResult:
    """Replay ``reqs`` through ``replicas`` radix-tree replicas behind ``router``."""
    kw = {}
    if router == "cache_aware":
        kw = dict(
            page_size=page_size,
            capacity_pages=capacity_pages,
            balance_weight=balance_weight,
            decode_weight=decode_weight,
        )
    rt = make_router(router, replicas, **kw)
    reps = [_Replayer("radix", capacity_pages, page_size) for _ in range(replicas)]
    free_at = [0.0] * replicas
    work = [0.0] * replicas
    done: list[tuple[float, int, float]] = []  # (finish time, replica, routed cost)
    hit = prompt = 0
    for i, r in enumerate(reqs):
        now = i * interval
        while done and done[0][0] <= now:
            _, rep, cost = heapq.heappop(done)
            rt.complete(rep, cost)
        routed = rt.route_request(r.tokens, output_tokens=len(r.output))
        rep = routed.replica
        h = reps[rep].serve(r)
        hit += h
        prompt += len(r.tokens)
        service = (len(r.tokens) - h) + decode_weight * len(r.output)
        start = max(now, free_at[rep])
        free_at[rep] = start + service
        work[rep] += service
        heapq.heappush(done, (free_at[rep], rep, routed.cost))
    mean_w = sum(work) / replicas
    counts = rt.stats()["routed"]
    mean_c = sum(counts) / replicas
    return RouteResult(
        workload=workload,
        router=router,
        replicas=replicas,
        capacity_pages=capacity_pages,
        requests=len(reqs),
        prompt_tokens=prompt,
        hit_tokens=hit,
        makespan=max(free_at),
        work_balance=max(work) / mean_w if mean_w else 1.0,
        request_balance=max(counts) / mean_c if mean_c else 1.0,
    )


def run(
    workloads: dict[str, list[Request]],
    replica_counts: Sequence[int] = (2, 4, 8),
    *,
    capacity_fraction: float = 0.25,
    page_size: int = 16,
    interval: float | None = None,
    decode_weight: float = 0.25,
    balance_weight: float = 1.0,
) -> list[dict]:
    """Rows of the table (one per workload x M x router).

    ``interval`` None: per workload, arrivals at 1.2 x the no-cache work of an average request
    divided by M (a busy but not saturated cluster under round robin with a cache).
    """
    rows = []
    for name, reqs in workloads.items():
        cap = max(8, int(required_pages(reqs, page_size) * capacity_fraction))
        cap = max(cap, max(-(-(len(r.tokens) + len(r.output)) // page_size) for r in reqs) + 1)
        mean_work = sum(len(r.tokens) + decode_weight * len(r.output) for r in reqs) / len(reqs)
        for m in replica_counts:
            iv = (mean_work / m / 1.2) if interval is None else interval
            res = {}
            for router in ("round_robin", "cache_aware"):
                res[router] = simulate_routing(
                    reqs,
                    router,
                    m,
                    cap,
                    page_size=page_size,
                    interval=iv,
                    decode_weight=decode_weight,
                    balance_weight=balance_weight,
                    workload=name,
                )
            base = res["round_robin"].throughput
            for r in res.values():
                rows.append(
                    {
                        **asdict(r),
                        "hit_rate": r.hit_rate,
                        "throughput": r.throughput,
                        "vs_round_robin": r.throughput / base if base else 0.0,
                    }
                )
    return rows


def format_rows(rows: list[dict]) -> str:
    head = (
        f"{'workload':<20}{'M':>3}  {'router':<12}{'cap pg':>7}{'hit':>8}{'balance':>9}"
        f"{'req bal':>9}{'thrpt':>9}{'x rr':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['workload']:<20}{r['replicas']:>3}  {r['router']:<12}{r['capacity_pages']:>7}"
            f"{r['hit_rate']:>8.1%}{r['work_balance']:>9.2f}{r['request_balance']:>9.2f}"
            f"{r['throughput']:>9.2f}{r['vs_round_robin']:>7.2f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- real engines


def engine_run(replicas: int = 2, groups: int = 16, per_group: int = 8) -> list[dict]:
    """Tiny random model, ``replicas`` engines on their own CPU devices: cache-aware vs
    round-robin (measured engine hit rates and wall time). Runs in a subprocess with
    XLA_FLAGS set (returns its JSON rows)."""
    import subprocess

    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={replicas}",
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
    }
    code = (
        "import json,sys; from benchmarks.scale import _engine_child; "
        f"print('RESULT ' + json.dumps(_engine_child({replicas}, {groups}, {per_group})))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _engine_child(replicas: int, groups: int, per_group: int) -> list[dict]:
    from benchmarks.workloads import generated_shared_prefix
    from models.sharding import make_mesh, replica_meshes
    from radixkv import Engine, SamplingParams
    from radixkv.router import DataParallelEngine

    reqs = generated_shared_prefix(
        groups,
        per_group,
        system_len=256,
        question_len=16,
        output_len=8,
        vocab_size=256,
        low=1,
        seed=0,
    )
    prompts = [r.tokens for r in reqs]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engines = [
        Engine.from_pretrained("tiny", mesh=m, num_pages=160, page_size=16, max_batch=8)
        for m in replica_meshes(make_mesh(1, replicas))
    ]
    wave = 16

    def one_pass(router: str) -> tuple[DataParallelEngine, int, int, float]:
        for e in engines:
            e.clear_cache()
        dp = DataParallelEngine(engines, router)
        cached = total = 0
        t0 = time.perf_counter()
        # arrive in waves (a server's view): routing sees what earlier waves cached
        for i in range(0, len(prompts), wave):
            outs = dp.generate(prompts[i : i + wave], sp)
            cached += sum(o.cached_tokens for o in outs)
            total += sum(len(o.prompt_token_ids) for o in outs)
        return dp, cached, total, time.perf_counter() - t0

    routers = ("round_robin", "cache_aware")
    for router in routers:  # compile every step shape both routings hit (CPU: compiles dominate)
        one_pass(router)
    rows = []
    for router in routers:
        dp, cached, total, wall = one_pass(router)
        rows.append(
            {
                "router": router,
                "replicas": replicas,
                "requests": len(prompts),
                "hit_rate": cached / total,
                "wall_s": wall,
                "routed": dp.router.stats()["routed"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description="Cache-aware routing vs round-robin over replicas.")
    ap.add_argument("--replicas", default="2,4,8")
    ap.add_argument("--workloads", default=",".join(SHARED_PREFIX_WORKLOADS))
    ap.add_argument("--scale", type=float, default=1.0, help="workload size multiplier")
    ap.add_argument("--capacity", type=float, default=0.25, help="replica pool / trace pages")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--interval",
        default="0",
        help="arrival gap in time units; 0 = offline batch (default), auto = 1.2x busy",
    )
    ap.add_argument("--decode-weight", type=float, default=0.25)
    ap.add_argument("--balance-weight", type=float, default=1.0)
    ap.add_argument("--engine", action="store_true", help="also run tiny-model engines")
    ap.add_argument("--engine-replicas", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    all_w = workloads(a.scale)
    names = [w for w in a.workloads.split(",") if w]
    unknown = [w for w in names if w not in all_w]
    if unknown:
        ap.error(f"unknown workloads {unknown}; choose from {sorted(all_w)}")
    rows = run(
        {w: all_w[w] for w in names},
        [int(x) for x in a.replicas.split(",")],
        capacity_fraction=a.capacity,
        page_size=a.page_size,
        interval=None if a.interval == "auto" else float(a.interval),
        decode_weight=a.decode_weight,
        balance_weight=a.balance_weight,
    )
    print(format_rows(rows))
    if a.engine:
        er = engine_run(a.engine_replicas)
        print("\nreal engines (tiny model, CPU; relative figures):")
        for r in er:
            print(
                f"  {r['router']:<12} M={r['replicas']} hit {r['hit_rate']:.1%}  "
                f"wall {r['wall_s']:.1f}s  routed {r['routed']}"
            )
        rows += [{"engine": True, **r} for r in er]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

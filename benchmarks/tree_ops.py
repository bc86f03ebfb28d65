"""Per-request cost of prefix-cache operations (host side only), next to SGLang's RadixCache.

Traces (issue 2):
    a  500 requests: one shared 2048-token prefix + 512 unique tokens each.
    b  SGLang's generated-shared-prefix: 64 groups x 16 prompts, 2048-token system prompt,
       128-token question (shuffled).
    c  multi-turn chat: 64 conversations x 10 turns, each turn extends the last (prompt and
       answer are inserted, so the next turn hits the whole conversation so far).

Each request runs the engine's protocol: ``match`` (timed), incref the matched pages, cow a
partial last page, allocate the rest (untimed), ``insert`` prompt (+ answer) (timed; page ids
passed as an int32 array, as a block-table row is). After the trace, one ``evict`` of 100k
tokens is timed. Token ids are fresh Python ints per request (as a tokenizer returns them).

Usage::

    python -m benchmarks.tree_ops                 # traces a, b, c at page sizes 1 and 16
    python -m benchmarks.tree_ops --traces a --page-sizes 16 --hash-index

This prints a table; it is not a timed test.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from benchmarks.workloads import Request, generated_shared_prefix, multi_turn_chat
from radixkv.hashing import HashIndex
from radixkv.pages import PagePool
from radixkv.tree import RadixTree

# SGLang 0.5.23 RadixCache on this machine class, trace (a) (quoted in issue 2), ms.
SGLANG_REF = {
    ("a", 1): {"insert": 0.12, "match": 0.05, "evict": 2.6},
    ("a", 16): {"insert": 0.13, "match": 0.06, "evict": 2.6},
}
EVICT_TOKENS = 100_000


def make_trace(name: str, seed: int = 0) -> list[Request]:
    if name == "a":
        return generated_shared_prefix(
            1, 500, system_len=2048, question_len=512, output_len=0, shuffle=False, seed=seed
        )
    if name == "b":
        return generated_shared_prefix(
            64, 16, system_len=2048, question_len=128, output_len=0, seed=seed
        )
    if name == "c":
        return multi_turn_chat(64, 10, system_len=256, user_len=64, assistant_len=128, seed=seed)
    raise ValueError(f"unknown trace {name!r}")


def run_trace(reqs: list[Request], page_size: int, kind: str = "radix") -> dict[str, float]:
    """Replay reqs through a fresh index; returns mean ms per request and the evict time."""
    total_tokens = sum(len(r.tokens) + len(r.output) for r in reqs)
    pool = PagePool(total_tokens // page_size + 2 * len(reqs) + 16)
    index = RadixTree(pool, page_size) if kind == "radix" else HashIndex(pool, page_size)
    t_match = t_insert = 0.0
    hit = 0
    clock = time.perf_counter
    gc.collect()
    # fresh int objects per request, as a tokenizer returns them (no identity shortcuts)
    fresh = [(np.array(r.tokens).tolist(), np.array(r.tokens + r.output).tolist()) for r in reqs]
    for toks, seq in fresh:
        t0 = clock()
        m = index.match(toks)
        t1 = clock()
        t_match += t1 - t0
        hit += m.length
        pages = m.page_array
        pool.incref(pages)
        if m.partial:
            pages = pages.copy()
            pages[-1] = pool.cow(int(pages[-1]))
            pool.take_pending_copies()
        need = -(-len(seq) // page_size) - len(pages)
        pages = np.concatenate([pages, pool.alloc_array(need)])
        t0 = clock()
        index.insert(seq, pages)
        t_insert += clock() - t0
    cached = index.cached_tokens
    n_evict = -(-EVICT_TOKENS // page_size)
    t0 = clock()
    released = index.evict(n_evict)
    t_evict = clock() - t0
    assert released >= min(n_evict, cached // page_size), (released, n_evict)
    prompt = sum(len(r.tokens) for r in reqs)
    return {
        "match": t_match / len(reqs) * 1e3,
        "insert": t_insert / len(reqs) * 1e3,
        "evict": t_evict * 1e3,
        "evicted_tokens": released * page_size,
        "hit_rate": hit / prompt,
        "cached_tokens": cached,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--traces", default="a,b,c")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--hash-index", action="store_true", help="also time HashIndex (page > 1)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell; the best is reported")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = []
    hdr = (
        f"{'trace':5} {'page':>4} {'index':6} {'reqs':>5} {'hit%':>6} "
        f"{'insert ms/req':>13} {'match ms/req':>12} {'evict 100k ms':>13}   "
        f"{'SGLang ins/match/evict':>22} {'speedup ins/match/evict':>24}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name in args.traces.split(","):
        reqs = make_trace(name, args.seed)
        for ps in (int(x) for x in args.page_sizes.split(",")):
            kinds = ["radix"] + (["hash"] if args.hash_index and ps > 1 else [])
            for kind in kinds:
                runs = [run_trace(reqs, ps, kind) for _ in range(args.repeat)]
                res = {k: min(r[k] for r in runs) for k in ("match", "insert", "evict")}
                res.update({k: runs[0][k] for k in ("hit_rate", "evicted_tokens")})
                ref = SGLANG_REF.get((name, ps)) if kind == "radix" else None
                if ref:
                    refs = f"{ref['insert']:.2f}/{ref['match']:.2f}/{ref['evict']:.1f}-3.0"
                    sp = "/".join(f"{ref[k] / res[k]:.1f}x" for k in ("insert", "match", "evict"))
                else:
                    refs = sp = "-"
                print(
                    f"{name:5} {ps:>4} {kind:6} {len(reqs):>5} {100 * res['hit_rate']:>6.1f} "
                    f"{res['insert']:>13.4f} {res['match']:>12.4f} {res['evict']:>13.2f}   "
                    f"{refs:>22} {sp:>24}",
                    flush=True,
                )
                rows.append({"trace": name, "page_size": ps, "index": kind, **res})
    return rows


if __name__ == "__main__":
    main()

"""Batch inference over many hosts (``jax.distributed``) and many replicas per host.

``radixkv batch in.jsonl -o out.jsonl`` with ``--num-processes N --process-id I
--coordinator-address HOST:PORT`` (or the ``RADIXKV_NUM_PROCESSES`` / ``RADIXKV_PROCESS_ID`` /
``RADIXKV_COORDINATOR_ADDRESS`` environment variables, or ``--multi-host`` on a TPU VM slice,
where JAX detects all three itself) runs as one of N processes; ``--data-parallel M`` runs M
engine replicas per process and ``--tensor-parallel T`` shards each over T local devices:

1. ``jax.distributed.initialize`` joins the job (CPU: gloo collectives).
2. Every process reads the whole input and computes the same deterministic, prefix-aware
   partition into ``N x data_parallel`` shares (:func:`prefix_partition`): records are ordered
   by the chained hashes of their first pages (records sharing a prefix sit together) and the
   order is cut into equal shares at the shallowest prefix boundaries near the even cut
   points, so a shared prefix stays on one host (and one replica) unless it alone outweighs a
   share.
3. Each local replica runs the ordinary single-engine batch loop over its share (a copy of the
   input with the other records blanked, so line numbers and default ids are unchanged) and
   writes ``out.jsonl.part-K-of-S`` (resumable like the plain command).
4. After a barrier the first process merges the parts into ``out.jsonl`` in input order
   (:func:`merge_outputs`; without a shared file system, copy the parts together and run
   ``python -m radixkv.distributed merge in.jsonl -o out.jsonl``).
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from radixkv.hashing import PageHasher
from radixkv.router import run_in_threads

__all__ = [
    "add_distributed_args",
    "wants_distributed",
    "init_distributed",
    "input_ids",
    "prefix_partition",
    "write_share",
    "part_path",
    "output_records",
    "merge_outputs",
    "run_batch",
    "main",
]


# ------------------------------------------------------------------------------------ flags


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """Multi-host / multi-device flags of ``radixkv batch``."""
    g = p.add_argument_group("multi-device / multi-host")
    g.add_argument("--tensor-parallel", type=int, default=1, help="devices per replica (TP)")
    g.add_argument("--data-parallel", type=int, default=1, help="engine replicas per process")
    env = os.environ.get
    g.add_argument(
        "--coordinator-address",
        default=env("RADIXKV_COORDINATOR_ADDRESS"),
        help="HOST:PORT of process 0 (env RADIXKV_COORDINATOR_ADDRESS)",
    )
    g.add_argument(
        "--num-processes",
        type=int,
        default=_env_int("RADIXKV_NUM_PROCESSES"),
        help="processes in the job (env RADIXKV_NUM_PROCESSES)",
    )
    g.add_argument(
        "--process-id",
        type=int,
        default=_env_int("RADIXKV_PROCESS_ID"),
        help="this process's index (env RADIXKV_PROCESS_ID)",
    )
    g.add_argument(
        "--multi-host",
        action="store_true",
        help="join a jax.distributed job configured by the environment (TPU VM slices)",
    )
    g.add_argument("--distributed-timeout", type=int, default=300, help="seconds to wait for peers")


def wants_distributed(args: argparse.Namespace) -> bool:
    """True when the batch needs this module (several processes or replicas)."""
    return bool(
        getattr(args, "multi_host", False)
        or getattr(args, "coordinator_address", None)
        or (getattr(args, "num_processes", None) or 1) > 1
        or (getattr(args, "data_parallel", 1) or 1) > 1
        or (getattr(args, "tensor_parallel", 1) or 1) > 1
    )


def init_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    timeout: int = 300,
) -> tuple[int, int]:
    """Join a ``jax.distributed`` job; returns ``(process_id, num_processes)``.

    With no address and ``auto`` false (or a single process) nothing is initialised and
    ``(0, 1)`` is returned. ``auto`` lets JAX detect the cluster (TPU VMs, SLURM, ...).
    """
    import jax

    if not auto and not coordinator_address and (num_processes or 1) <= 1:
        return 0, 1
    if not auto and (num_processes is None or process_id is None or not coordinator_address):
        raise ValueError(
            "multi-process batch needs --coordinator-address, --num-processes and --process-id "
            "(or --multi-host to read them from the environment)"
        )
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # pragma: no cover - option absent in this jax
        pass
    kw: dict[str, Any] = {"initialization_timeout": int(timeout)}
    if not auto:
        kw.update(
            coordinator_address=coordinator_address,
            num_processes=int(num_processes),
            process_id=int(process_id),
        )
    jax.distributed.initialize(**kw)
    return jax.process_index(), jax.process_count()


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------------ input


def input_ids(path: str) -> list[tuple[int, str]]:
    """``(line number, record id)`` of every non-blank input line, as ``radixkv batch`` names
    them (the ``id`` field of a JSON object, else ``line-N``)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rid = f"line-{lineno}"
            try:
                rec = json.loads(line)
                if isinstance(rec, dict) and "id" in rec:
                    rid = str(rec["id"])
            except json.JSONDecodeError:
                pass
            out.append((lineno, rid))
    return out


def _lcp(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prefix_partition(
    chains: Sequence[Sequence[bytes]],
    num_parts: int,
    *,
    costs: Sequence[float] | None = None,
    tolerance: float = 0.25,
) -> list[int]:
    """Assign every record (given by the chained hashes of its full pages) to one of
    ``num_parts`` shares; returns the share of each record.

    Records are sorted by their hash chains (equal first pages -> adjacent, recursively), and
    the sorted order is cut into ``num_parts`` runs of about equal cost. Each cut moves, within
    ``tolerance`` of a share's cost, to where neighbouring records share the fewest pages, so
    groups with a common prefix are not split unless they must be. Deterministic: every
    process computes the same partition.
    """
    n = len(chains)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if n == 0:
        return []
    costs = [1.0] * n if costs is None else [float(c) for c in costs]
    order = sorted(range(n), key=lambda i: (tuple(chains[i]), i))
    cum = [0.0]
    for i in order:
        cum.append(cum[-1] + costs[i])
    total = cum[-1]
    share = total / num_parts
    # depth of the prefix shared across the boundary before sorted position k (1..n-1)
    depth = [0] * (n + 1)
    for k in range(1, n):
        depth[k] = _lcp(chains[order[k - 1]], chains[order[k]])
    cuts = [0]
    for j in range(1, num_parts):
        target = share * j
        lo_c, hi_c = target - tolerance * share, target + tolerance * share
        best, best_key = None, None
        for k in range(cuts[-1], n + 1):
            if cum[k] < lo_c:
                continue
            if cum[k] > hi_c and best is not None:
                break
            key = (depth[k] if 0 < k < n else 0, abs(cum[k] - target), k)
            if best_key is None or key < best_key:
                best, best_key = k, key
        cuts.append(max(cuts[-1], best if best is not None else n))
    cuts.append(n)
    part = [0] * n
    for j in range(num_parts):
        for k in range(cuts[j], cuts[j + 1]):
            part[order[k]] = j
    return part


def part_path(output: str, k: int, n: int) -> str:
    """File of share k of n."""
    return f"{output}.part-{k:05d}-of-{n:05d}"


def write_share(input_path: str, share_path: str, keep_lines: set[int]) -> None:
    """Copy of the input with every line not in ``keep_lines`` blanked (line numbers kept)."""
    tmp = share_path + ".tmp"
    with open(input_path, encoding="utf-8") as f, open(tmp, "w", encoding="utf-8") as out:
        for lineno, line in enumerate(f, 1):
            out.write(line if lineno in keep_lines else "\n")
    os.replace(tmp, share_path)


def output_records(path: str) -> Iterator[dict]:
    """The JSON-object records with an ``id`` of a ``radixkv batch`` output file (other lines,
    such as a partial last line of an interrupted run, are skipped)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "id" in rec:
                yield rec


def merge_outputs(input_path: str, parts: Sequence[str], output: str) -> int:
    """Write the records of all ``parts`` to ``output`` in input order; returns the number
    written. Raises ValueError if an input record has no output in any part."""
    recs: dict[str, list[dict]] = {}
    for p in parts:
        for rec in output_records(p):
            recs.setdefault(str(rec["id"]), []).append(rec)
    ordered = []
    missing = []
    for _, rid in input_ids(input_path):
        got = recs.get(rid)
        if not got:
            missing.append(rid)
            continue
        # a duplicated id: the first occurrence gets the real result, later ones the error
        got.sort(key=lambda r: "error" in r)
        ordered.append(got.pop(0))
    if missing:
        raise ValueError(
            f"{len(missing)} input records have no output in the parts (first: {missing[0]!r})"
        )
    tmp = output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in ordered:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, output)
    return len(ordered)


# ------------------------------------------------------------------------------------ batch


def _chains(engine: Any, input_path: str, page_size: int) -> list[tuple[int, list[bytes]]]:
    """(line number, chained page hashes of the encoded prompt) per non-blank input line."""
    hasher = PageHasher()
    out = []
    with open(input_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            chain: list[bytes] = []
            try:
                rec = json.loads(line)
                prompt = rec.get("prompt", rec.get("messages"))
                _, ids = engine.encode_prompt(prompt)
                chain = hasher.chain(ids, page_size)
            except Exception:  # a bad record: its error is reported by the batch loop
                pass
            out.append((lineno, chain))
    return out


def run_batch(
    args: argparse.Namespace,
    *,
    batch_fn: Callable[..., int] | None = None,
    engine_factory: Callable[..., Any] | None = None,
) -> int:
    """``radixkv batch`` over processes and replicas (see the module docstring).

    ``batch_fn(args, engine=...)`` is the single-engine batch loop (default
    :func:`radixkv.cli.cmd_batch`); ``engine_factory(args, mesh)`` builds one replica.
    """
    from radixkv import cli

    if batch_fn is None:
        batch_fn = cli.cmd_batch
    pid, nproc = init_distributed(
        getattr(args, "coordinator_address", None),
        getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        auto=getattr(args, "multi_host", False),
        timeout=getattr(args, "distributed_timeout", 300),
    )
    dp = max(1, int(getattr(args, "data_parallel", 1) or 1))
    tp = max(1, int(getattr(args, "tensor_parallel", 1) or 1))
    from models.sharding import make_mesh, replica_meshes

    meshes = replica_meshes(make_mesh(tp, dp))
    if engine_factory is None:

        def engine_factory(a: argparse.Namespace, mesh: Any) -> Any:
            return cli._engine(a, mesh=mesh) if (tp > 1 or dp > 1) else cli._engine(a)

    engines = [engine_factory(args, m) for m in meshes]
    num_parts = nproc * dp
    chains = _chains(engines[0], args.input, engines[0].page_size)
    part = prefix_partition([c for _, c in chains], num_parts)
    local = [pid * dp + r for r in range(dp)]
    codes = [0] * dp

    def run(r: int) -> None:
        k = local[r]
        keep = {ln for (ln, _), p in zip(chains, part, strict=True) if p == k}
        share = part_path(args.output, k, num_parts) + ".input"
        write_share(args.input, share, keep)
        sub = argparse.Namespace(**vars(args))
        sub.input, sub.output = share, part_path(args.output, k, num_parts)
        sub.coordinator_address, sub.num_processes, sub.process_id = None, None, None
        sub.multi_host, sub.data_parallel, sub.tensor_parallel = False, 1, 1
        sub.no_progress = getattr(args, "no_progress", False) or dp > 1
        try:
            if "engine" in inspect.signature(batch_fn).parameters:
                codes[r] = int(batch_fn(sub, engine=engines[r]) or 0)
            else:  # an older batch loop that builds its own engine
                codes[r] = int(batch_fn(sub) or 0)
        finally:
            if os.path.exists(share):
                os.remove(share)

    run_in_threads(run, dp)
    print(
        f"process {pid}/{nproc}: {sum(1 for p in part if p in local)} of {len(part)} records "
        f"in shares {local}",
        file=sys.stderr,
    )
    _barrier("radixkv-batch-done")
    rc = max(codes)
    if pid == 0:
        parts = [part_path(args.output, k, num_parts) for k in range(num_parts)]
        absent = [p for p in parts if not os.path.exists(p)]
        if absent:  # no shared file system: merge by hand
            print(
                f"radixkv: parts not visible here ({absent[0]} ...): copy them next to "
                f"{args.output} and run `python -m radixkv.distributed merge "
                f"{args.input} -o {args.output}`",
                file=sys.stderr,
            )
            rc = rc or 3
        else:
            n = merge_outputs(args.input, parts, args.output)
            print(f"merged {n} records from {num_parts} parts into {args.output}", file=sys.stderr)
    _barrier("radixkv-batch-merged")  # nobody exits (shutting the job down) before the merge
    return rc


# ------------------------------------------------------------------------------------ merge CLI


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m radixkv.distributed merge in.jsonl -o out.jsonl [parts...]``"""
    p = argparse.ArgumentParser(prog="python -m radixkv.distributed")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge part files into the output, in input order")
    m.add_argument("input")
    m.add_argument("-o", "--output", required=True)
    m.add_argument("parts", nargs="*", help="default: OUTPUT.part-*-of-*")
    a = p.parse_args(argv)
    parts = a.parts or sorted(
        x for x in glob.glob(glob.escape(a.output) + ".part-*-of-*") if not x.endswith(".input")
    )
    if not parts:
        print("no part files found", file=sys.stderr)
        return 2
    n = merge_outputs(a.input, parts, a.output)
    print(f"merged {n} records from {len(parts)} parts into {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Multi-host batch: prefix-aware partition, shares, merge, and a real two-process
``jax.distributed`` job on localhost (CPU, gloo; two replicas per process) whose merged output
equals one process's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from radixkv.distributed import (
    input_ids,
    merge_outputs,
    part_path,
    prefix_partition,
    wants_distributed,
    write_share,
)
from radixkv.hashing import PageHasher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _chains(prompts, ps=4):
    h = PageHasher()
    return [h.chain(p, ps) for p in prompts]


def test_partition_keeps_prefix_groups_together_and_balances():
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 500, 16).tolist() for _ in range(8)]
    prompts, groups = [], []
    for i in rng.permutation(64):
        g = int(i) % 8
        prompts.append(prefixes[g] + rng.integers(0, 500, 6).tolist())
        groups.append(g)
    part = prefix_partition(_chains(prompts), 4)
    for g in range(8):
        assert len({p for p, gg in zip(part, groups, strict=True) if gg == g}) == 1, g
    counts = np.bincount(part, minlength=4)
    assert counts.tolist() == [16, 16, 16, 16]
    # deterministic (every process computes the same partition)
    assert prefix_partition(_chains(prompts), 4) == part


def test_partition_splits_a_group_larger_than_a_share():
    rng = np.random.default_rng(1)
    hot = rng.integers(0, 500, 16).tolist()
    prompts = [hot + rng.integers(0, 500, 5).tolist() for _ in range(30)]
    prompts += [rng.integers(0, 500, 21).tolist() for _ in range(10)]
    part = prefix_partition(_chains(prompts), 4)
    counts = np.bincount(part, minlength=4)
    # within the cut tolerance (25% of a 10-record share) of an even split
    assert all(abs(int(c) - 10) <= 3 for c in counts), counts
    # the hot group (3 shares' worth) spreads; the cold prompts sit at the ends of the order
    assert len({part[i] for i in range(30)}) >= 3
    assert len({part[i] for i in range(30, 40)}) <= 2
    assert prefix_partition([], 3) == []
    with pytest.raises(ValueError):
        prefix_partition(_chains(prompts), 0)


def test_share_and_merge_in_input_order(tmp_path):
    inp = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"prompt": "a"}),
        "",
        json.dumps({"id": "x", "prompt": "b"}),
        "{broken",
        json.dumps({"prompt": "c"}),
    ]
    inp.write_text("\n".join(lines) + "\n")
    ids = input_ids(str(inp))
    assert ids == [(1, "line-1"), (3, "x"), (4, "line-4"), (5, "line-5")]
    share = tmp_path / "share"
    write_share(str(inp), str(share), {3, 5})
    got = share.read_text().split("\n")
    assert got[:5] == ["", "", lines[2], "", lines[4]]
    out = str(tmp_path / "out.jsonl")
    p0, p1 = part_path(out, 0, 2), part_path(out, 1, 2)
    with open(p0, "w") as f:
        for rid in ("line-5", "x"):
            f.write(json.dumps({"id": rid, "text": rid.upper()}) + "\n")
        f.write('{"id": "trunc')  # an interrupted part's partial last line
    with open(p1, "w") as f:
        for rid in ("line-4", "line-1"):
            f.write(json.dumps({"id": rid, "text": rid.upper()}) + "\n")
    assert merge_outputs(str(inp), [p0, p1], out) == 4
    merged = [json.loads(x)["id"] for x in open(out)]
    assert merged == ["line-1", "x", "line-4", "line-5"]
    os.remove(p1)
    with pytest.raises(ValueError, match="no output"):
        merge_outputs(str(inp), [p0], out)


def test_wants_distributed_flags():
    import argparse

    assert not wants_distributed(argparse.Namespace())
    assert wants_distributed(argparse.Namespace(num_processes=2))
    assert wants_distributed(argparse.Namespace(data_parallel=2))
    assert wants_distributed(argparse.Namespace(coordinator_address="h:1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch_cmd(inp, out, *extra):
    return [
        sys.executable,
        "-m",
        "radixkv.cli",
        "batch",
        str(inp),
        "-o",
        str(out),
        "--model",
        "tiny",
        "--num-pages",
        "128",
        "--page-size",
        "4",
        "--max-tokens",
        "5",
        "--no-progress",
        *extra,
    ]


def test_two_process_batch_equals_single_process(tmp_path):
    rng = np.random.default_rng(7)
    systems = ["System A: answer briefly. ", "System B: another preamble, longer. ", "Q: "]
    inp = tmp_path / "in.jsonl"
    with open(inp, "w") as f:
        for i in rng.permutation(12):
            rec = {"prompt": systems[i % 3] + f"item {i} {rng.integers(0, 1000)}?"}
            if i % 4 == 0:
                rec.update(id=f"r{i}", max_tokens=3)
            f.write(json.dumps(rec) + "\n")
        f.write("not json\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    single = tmp_path / "single.jsonl"
    r = subprocess.run(
        _batch_cmd(inp, single), cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-3000:]
    multi = tmp_path / "multi.jsonl"
    port = _free_port()
    # two hosts x two replicas (one virtual CPU device each): four prefix-aware shares
    menv = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [
        subprocess.Popen(
            _batch_cmd(
                inp,
                multi,
                "--coordinator-address",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(pid),
                "--distributed-timeout",
                "60",
                "--data-parallel",
                "2",
            ),
            cwd=ROOT,
            env=menv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    logs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=240)
            logs.append(err)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-2000:] for x in logs)
    # each process ran a non-empty share, split over its two replicas
    assert all("records in shares" in x for x in logs)
    shares = [int(x.split("records in shares")[0].split(":")[-1].split("of")[0]) for x in logs]
    assert all(s > 0 for s in shares) and sum(shares) == 13
    assert "shares [0, 1]" in logs[0] and "shares [2, 3]" in logs[1]
    assert "merged 13 records from 4 parts" in logs[0]

    def load(p):
        return [json.loads(x) for x in open(p)]

    a, b = load(single), load(multi)
    order = [rid for _, rid in input_ids(str(inp))]
    assert [x["id"] for x in b] == order  # merged output in input order
    drop = lambda r: {k: v for k, v in r.items() if k != "cached_tokens"}  # noqa: E731
    assert {x["id"]: drop(x) for x in a} == {x["id"]: drop(x) for x in b}
    assert any("error" in x for x in b) and sum("token_ids" in x for x in b) == 12


def test_merge_cli_and_env_flags(tmp_path, monkeypatch):
    import argparse

    from radixkv.distributed import add_distributed_args, main

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "p"}) + "\n" for i in range(3)))
    out = str(tmp_path / "out.jsonl")
    for k, ids in enumerate((["q2"], ["q0", "q1"])):
        with open(part_path(out, k, 2), "w") as f:
            f.writelines(json.dumps({"id": i, "text": i}) + "\n" for i in ids)
    assert main(["merge", str(inp), "-o", out]) == 0  # finds OUTPUT.part-*-of-*
    assert [json.loads(x)["id"] for x in open(out)] == ["q0", "q1", "q2"]
    monkeypatch.setenv("RADIXKV_NUM_PROCESSES", "4")
    monkeypatch.setenv("RADIXKV_PROCESS_ID", "3")
    monkeypatch.setenv("RADIXKV_COORDINATOR_ADDRESS", "10.0.0.1:8476")
    p = argparse.ArgumentParser()
    add_distributed_args(p)
    a = p.parse_args([])
    assert (a.num_processes, a.process_id, a.coordinator_address) == (4, 3, "10.0.0.1:8476")
    assert wants_distributed(a)

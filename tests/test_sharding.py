"""Tensor parallelism: head layouts in-process; TP 2/4/8 vs single-device generation in a
subprocess with 8 virtual CPU devices (the rest of the suite stays on one device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from models.sharding import plan_heads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("hq,hkv", [(4, 2), (9, 3), (8, 8), (12, 4), (6, 1)])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_plan_heads_covers_every_head_once(hq, hkv, tp):
    lay = plan_heads(hq, hkv, tp)
    assert lay.kv_heads.shape == (tp, lay.kv_per_device)
    assert lay.q_heads.shape == (tp, lay.q_per_device)
    q = lay.q_heads.reshape(-1)
    assert sorted(q[q >= 0].tolist()) == list(range(hq))  # every q head exactly once
    g = hq // hkv
    # every real q head sits in a slot whose kv head is its GQA kv head
    slot_kv = np.repeat(lay.kv_heads.reshape(-1), lay.q_per_kv)
    assert all(slot_kv[i] == q[i] // g for i in range(q.size) if q[i] >= 0)
    assert set(lay.kv_heads.reshape(-1).tolist()) == set(range(hkv))
    if hkv % tp == 0:  # divisible: plain sharding, no replication, no padding
        assert lay.kv_per_device == hkv // tp and (q >= 0).all()


def _worker(*args: str, timeout: int = 300) -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": ROOT,
    }
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "sharding_worker.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _check(res: dict, tps: list[int], rtol: float) -> None:
    assert res["devices"] == 8
    for tp in tps:
        r = res["tp"][str(tp)]
        assert r["tokens_equal"], (tp, r)
        assert r["max_abs_diff"] <= rtol * r["logit_scale"], (tp, r)
        # the pool is sharded over kv heads: every device holds its own heads' pages
        assert r["pool_shape"][0] == tp * r["pool_shard_shape"][0]
        assert r["pool_shard_shape"][1:] == r["pool_shape"][1:]


def test_tensor_parallel_tiny_matches_single_device():
    res = _worker("tiny", "2,4,8", "engine")
    _check(res, [2, 4, 8], 1e-5)
    e = res["engine"]
    # Engine.from_pretrained(tensor_parallel=4): same greedy generations
    assert e["tp_runner"] == "ShardedModelRunner" and e["tp_equal"], e
    # tensor_parallel=2 x data_parallel=2: a DataParallelEngine, same generations, and the
    # prompts sharing a prefix were served partly from the replicas' caches
    assert e["dp_is_data_parallel"] and e["dp_equal"], e
    assert set(e["dp_routes"]) == {0, 1}
    assert sum(e["dp_cached"]) > 0


def test_tensor_parallel_smollm2_matches_single_device():
    # 9 q heads / 3 kv heads: TP 2 pads (kv slots [0, 0] [1, 2]), TP 4 replicates kv head 0
    # twice, TP 8 replicates every kv head (3 + 3 + 2 copies) and splits its q heads
    _check(_worker("smollm2", "2,4,8", timeout=400), [2, 4, 8], 2e-5)

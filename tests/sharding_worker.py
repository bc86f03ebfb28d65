"""Multi-device checks, run in a subprocess by tests/test_sharding.py (XLA_FLAGS must give the
CPU several devices before jax is imported, and the rest of the suite runs on one device).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_worker.py tiny 2,4,8
    ... sharding_worker.py tiny 2,4,8 engine     # + Engine.from_pretrained(tensor/data_parallel)

Prints one JSON object: per tensor-parallel degree, the largest logit difference against the
single-device runner and whether the greedy tokens agree.
"""

from __future__ import annotations

import json
import sys
import time


def script(
    runner, prompts: list[list[int]], decode_steps: int, page_size: int, cow: bool = True
) -> dict:
    """Prefill (one mixed step), greedy decode, then a copy-on-write + chunked-prefill step."""
    import numpy as np

    from models import SeqInput

    pages_per = -(-(max(len(p) for p in prompts) + decode_steps + 1) // page_size)
    tables = [list(range(i * pages_per, (i + 1) * pages_per)) for i in range(len(prompts))]
    logits = []
    toks = [list(p) for p in prompts]
    pairs = zip(toks, tables, strict=True)
    out = runner.step([SeqInput(p, 0, t, all_logits=True) for p, t in pairs])
    logits += [o for o in out]
    nxt = [int(np.argmax(o[-1])) for o in out]
    for _ in range(decode_steps):
        seqs = [SeqInput([n], len(t), tb) for n, t, tb in zip(nxt, toks, tables, strict=True)]
        for t, n in zip(toks, nxt, strict=True):
            t.append(n)
        out = runner.step(seqs)
        logits += [o for o in out]
        nxt = [int(np.argmax(o[-1])) for o in out]
    if not cow:
        return {"logits": logits, "tokens": toks}
    # copy-on-write: copy seq 0's first page, then compute its next page's tokens on the copy
    free = len(prompts) * pages_per
    runner.copy_pages([(tables[0][0], free)])
    chunk = toks[0][page_size : 2 * page_size]
    out = runner.step([SeqInput(chunk, page_size, [free, free + 1], all_logits=True)])
    logits.append(out[0])
    return {"logits": logits, "tokens": toks}


def compare(ref: dict, got: dict) -> dict:
    import numpy as np

    pairs = zip(ref["logits"], got["logits"], strict=True)
    diff = max(float(np.max(np.abs(a - b))) for a, b in pairs)
    scale = max(float(np.max(np.abs(a))) for a in ref["logits"])
    same = ref["tokens"] == got["tokens"]
    return {"max_abs_diff": diff, "logit_scale": scale, "tokens_equal": same}


def run_runner(model: str, tps: list[int]) -> dict:
    import jax
    import numpy as np

    import models
    from models.sharding import ShardedModelRunner, make_mesh

    rng = np.random.default_rng(0)
    if model == "tiny":
        cfg = models.ModelConfig.tiny()
        params = models.init_params(cfg, seed=3)
        prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (13, 7, 10)]
        steps, ps, cow = 4, 4, True
    else:
        loaded = models.load_model()
        cfg, params = loaded.config, loaded.params
        prompts = [loaded.tokenizer.encode("The capital of France is")]
        prompts.append(rng.integers(100, cfg.vocab_size, 9).tolist())
        steps, ps, cow = 2, 4, False  # few compiles: 30 layers compile slowly on CPU
    kw = dict(num_pages=32, page_size=ps, min_token_bucket=32, min_batch_bucket=4)
    t0 = time.perf_counter()
    ref = script(models.ModelRunner(cfg, params, **kw), prompts, steps, ps, cow)
    res: dict = {"devices": len(jax.devices()), "single_s": time.perf_counter() - t0, "tp": {}}
    for tp in tps:
        t0 = time.perf_counter()
        r = ShardedModelRunner(cfg, params, mesh=make_mesh(tp), **kw)
        got = script(r, prompts, steps, ps, cow)
        shard_shape = r.pool[0][0].addressable_shards[0].data.shape
        res["tp"][str(tp)] = {
            **compare(ref, got),
            "pool_shard_shape": list(shard_shape),
            "pool_shape": list(r.pool[0][0].shape),
            "seconds": time.perf_counter() - t0,
        }
    return res


def run_engine() -> dict:
    """Engine.from_pretrained with tensor_parallel / data_parallel vs the single-device engine."""
    from radixkv import Engine, SamplingParams
    from radixkv.router import DataParallelEngine

    sp = SamplingParams(temperature=0.0, max_tokens=6)
    shared = "You are a terse assistant. Answer in one word. "
    prompts = [shared + q for q in ("Sky?", "Grass?", "Snow?", "Coal?")] + ["Other prefix."]
    kw = dict(num_pages=64, page_size=4, max_batch=4)
    ref = [o.token_ids for o in Engine.from_pretrained("tiny", **kw).generate(prompts, sp)]
    tp = Engine.from_pretrained("tiny", tensor_parallel=4, **kw)
    got_tp = [o.token_ids for o in tp.generate(prompts, sp)]
    dp = Engine.from_pretrained("tiny", tensor_parallel=2, data_parallel=2, **kw)
    outs = dp.generate(prompts, sp)
    return {
        "tp_runner": type(tp.runner).__name__,
        "tp_equal": got_tp == ref,
        "dp_type": type(dp).__name__,
        "dp_is_data_parallel": isinstance(dp, DataParallelEngine),
        "dp_equal": [o.token_ids for o in outs] == ref,
        "dp_routes": dp.last_routes,
        "dp_cached": [o.cached_tokens for o in outs],
    }


def main(argv: list[str]) -> None:
    what = argv[0]
    if what == "engine":
        res = run_engine()
    else:
        tps = [int(x) for x in argv[1].split(",")] if len(argv) > 1 else [2, 4, 8]
        res = run_runner(what, tps)
        if "engine" in argv[2:]:
            res["engine"] = run_engine()
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    sys.path.insert(0, ".")
    main(sys.argv[1:])

"""The `radixkv demo` workloads: few-shot and agent-style, run with the prefix cache on and off.

Both workloads are text, so the model sees real prompts:

- few-shot: an instruction + k labelled examples shared by every request, then a new review.
- agent: a shared system prompt + tool descriptions; each task's trajectory grows step by step
  (the model's own output + a canned tool observation are appended, token-exactly), and at one
  step every trajectory branches into two alternatives (different hints) that continue apart.

`run_demo` runs each workload on a fresh engine (fresh pool and tree) per mode, on one shared
model runner, and returns rows for `format_table`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from radixkv.engine import Engine
from radixkv.sampling import SamplingParams

__all__ = [
    "DEMO_CONTEXT",
    "DemoRow",
    "demo_runner_kwargs",
    "fresh_engine",
    "few_shot_prompts",
    "run_agent",
    "run_demo",
    "format_table",
]

_ADJ = (
    "wonderful dull gripping tedious charming clumsy brilliant forgettable moving shallow "
    "delightful confusing elegant bloated heartfelt predictable stunning lifeless witty bland"
).split()
_NOUN = (
    "plot acting soundtrack dialogue pacing ending cinematography cast script direction "
    "characters humour visuals story"
).split()
_GOOD = set(_ADJ[0::2])


def _review(rng: np.random.Generator, n: int = 3) -> tuple[str, str]:
    parts, score = [], 0
    for _ in range(n):
        a = _ADJ[int(rng.integers(len(_ADJ)))]
        parts.append(f"the {_NOUN[int(rng.integers(len(_NOUN)))]} was {a}")
        score += 1 if a in _GOOD else -1
    text = "; ".join(parts).capitalize() + "."
    return text, "positive" if score > 0 else "negative"


def few_shot_prompts(num_requests: int = 12, *, k: int = 8, seed: int = 0) -> list[str]:
    """Sentiment classification prompts sharing an instruction and k labelled examples."""
    rng = np.random.default_rng(seed)
    head = (
        "You are a film critic's assistant. Classify the sentiment of each movie review as "
        "positive or negative. Answer with one word.\n\n"
    )
    shots = ""
    for _ in range(k):
        text, label = _review(rng, 4)
        shots += f"Review: {text}\nSentiment: {label}\n\n"
    return [f"{head}{shots}Review: {_review(rng, 3)[0]}\nSentiment:" for _ in range(num_requests)]


_SYSTEM = (
    "You are a careful research agent. Solve the user's task step by step. At each step write "
    "one Thought and one Action, then wait for the Observation. Use the tools below; call "
    "exactly one tool per step, as Action: tool_name(arguments). When you know the answer, "
    "call finish(answer).\n\n"
)
_TOOLS = (
    "Tools:\n"
    "- search(query): searches an encyclopedia and returns the first paragraph of the best "
    "matching article.\n"
    "- lookup(term): returns the next sentence containing term in the last article found.\n"
    "- calculator(expression): evaluates an arithmetic expression and returns the number.\n"
    "- weather(city, date): returns the recorded weather for a city on a date.\n"
    "- finish(answer): returns the final answer to the user and ends the task.\n\n"
)
_TASKS = [
    "How many years passed between the first Moon landing and the launch of the Hubble "
    "Space Telescope?",
    "Which is longer, the Nile or the Amazon, and by how many kilometres?",
    "What was the population of the capital of Australia in 2021, divided by 1000?",
    "Who wrote the novel that the film Blade Runner is based on, and in which year was it "
    "published?",
]
_OBS = [
    "Observation: The article says the event took place in 1969, during the Apollo program.",
    "Observation: The article lists two figures: 6,650 km and 6,400 km, depending on the source.",
    "Observation: The result is 30. The tool also notes that rounding was applied.",
    "Observation: No exact match. Similar articles: Space telescope, Canberra, River lengths.",
]


#: longest sequence of the demo workloads (bounds the compiled block-table widths)
DEMO_CONTEXT = 1024


@dataclass
class DemoRow:
    """One line of the demo table."""

    workload: str
    cache: bool
    requests: int
    prompt_tokens: int
    cached_tokens: int
    prefill_computed: int
    generated: int
    wall: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.generated) / self.wall if self.wall else 0.0


def run_agent(
    engine: Engine, *, num_tasks: int = 3, steps: int = 3, branch_at: int = 1, max_tokens: int = 16
) -> list:
    """Agent trajectories: shared system + tools, growing by output + observation, branching."""
    tok = engine.tokenizer
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    live = []
    for t in range(num_tasks):
        text = f"{_SYSTEM}{_TOOLS}Task: {_TASKS[t % len(_TASKS)]}\n\nThought:"
        live.append(list(tok.encode(text, add_special_tokens=True)))
    outputs = []
    for step in range(steps):
        if step == branch_at:
            hints = [" (plan A: search first)", " (plan B: calculate first)"]
            live = [p + list(tok.encode(h)) for p in live for h in hints]
        outs = engine.generate(live, sp)
        outputs.extend(outs)
        obs = _OBS[step % len(_OBS)]
        live = [
            o.prompt_token_ids + o.token_ids + list(tok.encode(f"\n{obs}\nThought:")) for o in outs
        ]
    return outputs


def _row(name: str, engine: Engine, outs: list, wall: float) -> DemoRow:
    st = engine.stats()
    return DemoRow(
        workload=name,
        cache=engine.prefix_cache,
        requests=len(outs),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        cached_tokens=sum(o.cached_tokens for o in outs),
        prefill_computed=st.prefill_tokens_computed,
        generated=sum(len(c.token_ids) for o in outs for c in o.outputs),
        wall=wall,
    )


def run_demo(
    engine: Engine,
    *,
    quick: bool = False,
    warmup: bool = True,
    log=print,
) -> list[DemoRow]:
    """Run both workloads with the cache off and on (fresh pool + tree each, shared runner)."""
    n_fs, k = (4, 2) if quick else (12, 8)
    fs_prompts = few_shot_prompts(n_fs, k=k)
    fs_sp = SamplingParams(max_tokens=3 if quick else 4, temperature=0.0, ignore_eos=True)
    agent_kw = dict(num_tasks=2, steps=2, max_tokens=6) if quick else dict(num_tasks=4, steps=3)
    workloads = {
        "few-shot": lambda e: e.generate(fs_prompts, fs_sp),
        "agent": lambda e: run_agent(e, **agent_kw),
    }
    rows: list[DemoRow] = []
    if warmup:
        # compile every step shape up front so that no timed run pays for compilation
        t0 = time.perf_counter()
        n = engine.warmup(max_context=DEMO_CONTEXT)
        log(f"  compiled {n} step shapes in {time.perf_counter() - t0:.1f} s")
    for name, fn in workloads.items():
        for cache in (False, True):
            eng = fresh_engine(engine, cache)
            t0 = time.perf_counter()
            outs = fn(eng)
            wall = time.perf_counter() - t0
            rows.append(_row(name, eng, outs, wall))
            log(f"  {name:9s} cache {'on ' if cache else 'off'}: {wall:6.1f} s")
    return rows


def demo_runner_kwargs(max_batch: int, page_size: int) -> dict:
    """Model-runner buckets for the demo: one batch bucket and one block-table width, so the
    warm-up compiles only the token buckets (a handful of shapes instead of dozens)."""
    pages = 1
    while pages * page_size < DEMO_CONTEXT:
        pages *= 2
    return {"min_batch_bucket": max_batch, "min_page_bucket": pages}


def fresh_engine(engine: Engine, prefix_cache: bool) -> Engine:
    """A fresh engine (pool + tree) on the same model runner (compiled steps are shared), with
    the same pool size, batch limits and policy, and the prefix cache on or off."""
    sch = engine.scheduler
    return Engine(
        engine.runner,
        engine.tokenizer,
        num_pages=engine.num_pages,
        page_size=engine.page_size,
        max_batch=sch.max_batch,
        max_num_batched_tokens=sch.max_num_batched_tokens,
        policy=sch.policy,
        prefix_cache=prefix_cache,
        vocab_size=engine.vocab_size,
        model_id=engine.model_id,
    )


def format_table(rows: list[DemoRow]) -> str:
    """The demo table: per workload, cache off then on, with the speed-up of on over off."""
    head = (
        f"{'workload':10s} {'cache':5s} {'requests':>8s} {'prompt tok':>10s} {'cached tok':>10s} "
        f"{'hit rate':>8s} {'prefill tok':>11s} {'wall s':>7s} {'tok/s':>7s} {'speed-up':>8s}"
    )
    lines = [head, "-" * len(head)]
    off_wall: dict[str, float] = {}
    for r in rows:
        if not r.cache:
            off_wall[r.workload] = r.wall
        base = off_wall.get(r.workload)
        speed = f"{base / r.wall:7.2f}x" if base and r.wall else "       -"
        lines.append(
            f"{r.workload:10s} {'on' if r.cache else 'off':5s} {r.requests:8d} "
            f"{r.prompt_tokens:10d} {r.cached_tokens:10d} {r.hit_rate:8.1%} "
            f"{r.prefill_computed:11d} {r.wall:7.1f} {r.tokens_per_s:7.0f} {speed}"
        )
    return "\n".join(lines)

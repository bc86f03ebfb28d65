"""Seeded workload generators shared by notebooks, the CLI demo and the benchmarks.

Token-level generators return a list of :class:`Request` (prompt token ids, the output tokens a
model would generate, and group / parent annotations); they take ``vocab_size`` (ids are drawn
from ``[low, vocab_size)``) so traces can target a real tokenizer's id range. Unique parts that
could otherwise share a token by chance (questions, system prompts of different groups, first
user turns, agent tasks, branch outputs) start with tokens distinct among their siblings, so the
sharing structure is exact: e.g. two prompts of one generated-shared-prefix group share exactly
the system prompt, never a token more.

Text-level generators (:func:`few_shot_texts`, :func:`chat_texts`) produce strings / chat
messages with the same shapes for the real tokenizer and the CLI demo.

Shapes:
    few_shot                  k shared examples + varying question (MMLU 5-shot).
    generated_shared_prefix   SGLang's bench_serving "generated-shared-prefix": groups x prompts
                              per group, system prompt, question, output; uniform or Zipf groups.
    multi_turn_chat           each turn extends the previous conversation (+ its answer).
    agent                     shared system prompt + tool list, ReAct trajectories growing step
                              by step, some tree-of-thought branching into k branches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Request",
    "few_shot",
    "generated_shared_prefix",
    "multi_turn_chat",
    "agent",
    "WORKLOADS",
    "make_workload",
    "trace_stats",
    "few_shot_texts",
    "chat_texts",
]


@dataclass
class Request:
    """One request of a trace.

    Attributes:
        tokens: prompt token ids.
        output: the tokens the model answers with (pre-sampled, so traces are replayable; the
            next turn of a conversation contains them).
        group: sharing group (few-shot task, system prompt, conversation, agent).
        parent: index (in the returned list) of the request this one extends, or None. A
            request must run after its parent (its prompt contains the parent's output).
        shared_len: tokens of the prompt shared by construction with the rest of its group
            (system prompt / examples / previous turns).
        meta: generator-specific details (turn, step, branch, ...).
    """

    tokens: list[int]
    output: list[int] = field(default_factory=list)
    group: int = 0
    parent: int | None = None
    shared_len: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)


class _Tokens:
    """Seeded token source: random runs plus distinct leading tokens."""

    def __init__(self, seed: int, vocab_size: int, low: int) -> None:
        if vocab_size - low < 16:
            raise ValueError(f"vocab range [{low}, {vocab_size}) too small")
        self.rng = np.random.default_rng(seed)
        self.low = low
        self.high = vocab_size

    def run(self, n: int) -> list[int]:
        return self.rng.integers(self.low, self.high, size=n).tolist()

    def distinct_heads(self, n: int) -> list[int]:
        """n distinct token ids (first tokens of unique parts); repeats only past the vocab."""
        span = self.high - self.low
        if n <= span:
            return (self.rng.choice(span, size=n, replace=False) + self.low).tolist()
        return self.rng.integers(self.low, self.high, size=n).tolist()

    def unique_parts(self, n: int, length: int) -> list[list[int]]:
        """n runs of ``length`` tokens, pairwise different in their first token."""
        if length <= 0:
            return [[] for _ in range(n)]
        heads = self.distinct_heads(n)
        return [[h] + self.run(length - 1) for h in heads]


# ---------------------------------------------------------------------------- generators


def few_shot(
    num_requests: int = 500,
    *,
    k: int = 5,
    num_tasks: int = 1,
    header_len: int = 16,
    example_len: int = 120,
    question_len: int = 100,
    output_len: int = 1,
    vocab_size: int = 32000,
    low: int = 0,
    seed: int = 0,
) -> list[Request]:
    """MMLU k-shot shape: per task a header + k examples shared by all its questions.

    Requests of one task share exactly ``header_len + k * example_len`` tokens; tasks are
    assigned round-robin (task ``i % num_tasks``) so the trace interleaves them.
    """
    src = _Tokens(seed, vocab_size, low)
    prefixes = []
    heads = src.distinct_heads(num_tasks)
    for t in range(num_tasks):
        p = [heads[t]] + src.run(header_len - 1) if header_len else []
        for _ in range(k):
            p += src.run(example_len)
        prefixes.append(p)
    per_task = [sum(1 for i in range(num_requests) if i % num_tasks == t) for t in range(num_tasks)]
    questions = [src.unique_parts(per_task[t], question_len) for t in range(num_tasks)]
    out: list[Request] = []
    seen = [0] * num_tasks
    for i in range(num_requests):
        t = i % num_tasks
        q = questions[t][seen[t]]
        seen[t] += 1
        out.append(
            Request(
                tokens=prefixes[t] + q,
                output=src.run(output_len),
                group=t,
                shared_len=len(prefixes[t]),
                meta={"task": t},
            )
        )
    return out


def generated_shared_prefix(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    *,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    popularity: str = "uniform",
    zipf_a: float = 1.2,
    num_requests: int | None = None,
    shuffle: bool = True,
    vocab_size: int = 32000,
    low: int = 0,
    seed: int = 0,
) -> list[Request]:
    """SGLang's generated-shared-prefix dataset: groups of prompts behind a system prompt.

    ``popularity="uniform"`` gives every group ``prompts_per_group`` prompts (SGLang's shape);
    ``"zipf"`` draws the group of each of ``num_requests`` (default groups x prompts) requests
    from a Zipf(``zipf_a``) law over groups (group 0 most popular). ``shuffle`` randomises the
    arrival order, as SGLang's benchmark does.
    """
    src = _Tokens(seed, vocab_size, low)
    total = num_requests if num_requests is not None else num_groups * prompts_per_group
    if popularity == "uniform":
        groups = [g for g in range(num_groups) for _ in range(prompts_per_group)][:total]
        while len(groups) < total:
            groups.append(len(groups) % num_groups)
    elif popularity == "zipf":
        w = 1.0 / np.arange(1, num_groups + 1) ** zipf_a
        groups = src.rng.choice(num_groups, size=total, p=w / w.sum()).tolist()
    else:
        raise ValueError(f"popularity must be 'uniform' or 'zipf', got {popularity!r}")
    heads = src.distinct_heads(num_groups)
    systems = [[heads[g]] + src.run(system_len - 1) for g in range(num_groups)]
    counts = np.bincount(np.asarray(groups, dtype=np.int64), minlength=num_groups)
    questions = {g: src.unique_parts(int(counts[g]), question_len) for g in range(num_groups)}
    used = [0] * num_groups
    out: list[Request] = []
    for g in groups:
        q = questions[g][used[g]]
        used[g] += 1
        out.append(
            Request(
                tokens=systems[g] + q,
                output=src.run(output_len),
                group=g,
                shared_len=system_len,
                meta={"group": g},
            )
        )
    if shuffle:
        order = src.rng.permutation(len(out))
        out = [out[i] for i in order]
    return out


def multi_turn_chat(
    num_conversations: int = 32,
    turns: int = 8,
    *,
    system_len: int = 256,
    shared_system: bool = True,
    user_len: int = 64,
    assistant_len: int = 128,
    role_header_len: int = 3,
    interleave: str = "round_robin",
    vocab_size: int = 32000,
    low: int = 0,
    seed: int = 0,
) -> list[Request]:
    """Conversations whose every turn extends the previous one (prompt + answer + new message).

    Turn t's prompt = system prompt + (user_i + assistant_i for i < t) + user_t, where each user
    message starts with the same ``role_header_len`` template tokens (as chat templates do) and
    then a token distinct across conversations. ``interleave``: ``"round_robin"`` (turn 1 of all
    conversations, then turn 2, ...), ``"random"`` (random order respecting turn order) or
    ``"sequential"`` (one conversation after the other).
    """
    src = _Tokens(seed, vocab_size, low)
    user_hdr = src.run(role_header_len)
    asst_hdr = src.run(role_header_len)
    if shared_system:
        systems = [src.run(system_len)] * num_conversations
    else:
        systems = src.unique_parts(num_conversations, system_len)
    heads = src.distinct_heads(num_conversations)  # first user messages differ
    convs: list[list[Request]] = []
    for c in range(num_conversations):
        ctx = list(systems[c])
        reqs = []
        for t in range(turns):
            user = src.run(user_len)
            if t == 0 and user:
                user[0] = heads[c]
            if t == 0:
                shared = len(ctx) + role_header_len if shared_system else 0
            else:
                shared = len(ctx)
            prompt = ctx + user_hdr + user + asst_hdr
            answer = src.run(assistant_len)
            reqs.append(
                Request(
                    tokens=prompt,
                    output=answer,
                    group=c,
                    shared_len=shared,
                    meta={"conversation": c, "turn": t},
                )
            )
            ctx = prompt + answer
        convs.append(reqs)
    order = _interleave([len(r) for r in convs], interleave, src.rng)
    out: list[Request] = []
    index: dict[tuple[int, int], int] = {}
    for c, t in order:
        r = convs[c][t]
        r.parent = index.get((c, t - 1))
        index[(c, t)] = len(out)
        out.append(r)
    return out


def _interleave(lengths: list[int], how: str, rng: np.random.Generator) -> list[tuple[int, int]]:
    if how == "sequential":
        return [(c, t) for c, n in enumerate(lengths) for t in range(n)]
    if how == "round_robin":
        rounds = range(max(lengths, default=0))
        return [(c, t) for t in rounds for c, n in enumerate(lengths) if t < n]
    if how == "random":
        pos = [0] * len(lengths)
        bag = [c for c, n in enumerate(lengths) for _ in range(n)]
        rng.shuffle(bag)
        out = []
        for c in bag:
            out.append((c, pos[c]))
            pos[c] += 1
        return out
    raise ValueError(f"interleave must be round_robin, random or sequential, got {how!r}")


def agent(
    num_agents: int = 16,
    steps: int = 6,
    *,
    system_len: int = 512,
    tools_len: int = 1024,
    task_len: int = 64,
    step_len: int = 48,
    observation_len: int = 96,
    branch_prob: float = 0.2,
    branches: int = 3,
    max_trajectories: int = 8,
    vocab_size: int = 32000,
    low: int = 0,
    seed: int = 0,
) -> list[Request]:
    """ReAct agents: shared system prompt + tool list, trajectories growing step by step.

    Every agent's first prompt is system + tools + its task (distinct first token). A step's
    prompt is the previous prompt + the model's thought/action (``step_len`` output tokens) +
    the tool observation. With probability ``branch_prob`` a trajectory branches
    (tree-of-thought): ``branches`` requests with the same prompt sample different outputs and
    each continues on its own (at most ``max_trajectories`` live per agent). Requests are
    ordered step by step across agents (breadth first).
    """
    src = _Tokens(seed, vocab_size, low)
    prefix = src.run(system_len) + src.run(tools_len)
    tasks = src.unique_parts(num_agents, task_len)
    out: list[Request] = []
    # live trajectory: (agent, branch id, prompt tokens, parent request index)
    live = [(a, 0, prefix + tasks[a], None) for a in range(num_agents)]
    next_branch = [1] * num_agents
    for step in range(steps):
        nxt = []
        per_agent = {a: sum(1 for x in live if x[0] == a) for a in range(num_agents)}
        for a, b, prompt, parent in live:
            room = max_trajectories - per_agent[a]
            fan = branches if (room >= branches - 1 and src.rng.random() < branch_prob) else 1
            if fan > 1:
                per_agent[a] += fan - 1
            outs = src.unique_parts(fan, step_len)  # branches answer differently
            for j in range(fan):
                bid = b if j == 0 else next_branch[a]
                if j:
                    next_branch[a] += 1
                out.append(
                    Request(
                        tokens=list(prompt),
                        output=outs[j],
                        group=a,
                        parent=parent,
                        shared_len=len(prefix),
                        meta={"agent": a, "step": step, "branch": bid, "fan": fan},
                    )
                )
                idx = len(out) - 1
                if step + 1 < steps:
                    nxt.append((a, bid, prompt + outs[j] + src.run(observation_len), idx))
        live = nxt
    return out


WORKLOADS = {
    "few_shot": few_shot,
    "shared_prefix": generated_shared_prefix,
    "chat": multi_turn_chat,
    "agent": agent,
}


def make_workload(name: str, **kwargs) -> list[Request]:
    """Build a workload by name (``few_shot``, ``shared_prefix``, ``chat``, ``agent``)."""
    try:
        fn = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}") from None
    return fn(**kwargs)


def trace_stats(reqs: list[Request]) -> dict[str, float]:
    """Request and token counts, and the hit rate of an unbounded token-granular cache.

    ``ideal_hit_rate``: fraction of prompt tokens already seen (as a prefix) in an earlier
    prompt or output, i.e. the hit rate of a prefix cache that never evicts.
    """
    seen: set = set()
    misses = 0
    for r in reqs:
        h = 0
        seq = r.tokens + r.output
        for i, t in enumerate(seq):
            h = hash((h, t))
            if h not in seen:
                seen.add(h)
                if i < len(r.tokens):
                    misses += 1
    prompt = sum(len(r.tokens) for r in reqs)
    return {
        "requests": len(reqs),
        "prompt_tokens": prompt,
        "output_tokens": sum(len(r.output) for r in reqs),
        "ideal_hit_rate": 1 - misses / prompt if prompt else 0.0,
    }


# ---------------------------------------------------------------------------- text level

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "what so no out up into them can more some time could these two may then do first any "
    "my now such like our over man me even most made after also did many before must through "
    "years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since "
    "against go came right used take three"
).split()
_SUBJECTS = (
    "astronomy biology chemistry economics geography history law logic mathematics medicine "
    "music philosophy physics psychology sociology statistics"
).split()


def _sentence(rng: np.random.Generator, n: int) -> str:
    words = [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n)]
    return " ".join(words).capitalize()


def few_shot_texts(
    num_requests: int = 20, *, k: int = 5, num_tasks: int = 2, seed: int = 0
) -> list[tuple[int, str]]:
    """MMLU-style k-shot prompts as text: ``(task, prompt)`` pairs sharing each task's examples."""
    rng = np.random.default_rng(seed)

    def question() -> str:
        q = _sentence(rng, int(rng.integers(8, 16))) + "?"
        choices = "\n".join(f"{c}. {_sentence(rng, int(rng.integers(2, 5)))}" for c in "ABCD")
        return f"{q}\n{choices}\nAnswer:"

    prefixes = []
    for t in range(num_tasks):
        subject = _SUBJECTS[t % len(_SUBJECTS)]
        head = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
        shots = "".join(f"{question()} {'ABCD'[int(rng.integers(0, 4))]}\n\n" for _ in range(k))
        prefixes.append(head + shots)
    return [(i % num_tasks, prefixes[i % num_tasks] + question()) for i in range(num_requests)]


def chat_texts(
    num_conversations: int = 4, turns: int = 3, *, seed: int = 0
) -> list[list[dict[str, str]]]:
    """Chat conversations as message lists (system + alternating user / assistant turns).

    Conversation ``c`` turn ``t`` is ``messages[: 2 * t + 2]`` of ``result[c]`` (ending with a
    user message); the assistant messages are canned answers so prompts are reproducible.
    """
    rng = np.random.default_rng(seed)
    system = "You are a helpful assistant. " + _sentence(rng, 24) + "."
    convs = []
    for _ in range(num_conversations):
        msgs = [{"role": "system", "content": system}]
        for _ in range(turns):
            msgs.append({"role": "user", "content": _sentence(rng, int(rng.integers(6, 14))) + "?"})
            msgs.append({"role": "assistant", "content": _sentence(rng, int(rng.integers(10, 30)))})
        convs.append(msgs)
    return convs

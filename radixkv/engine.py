"""The radixkv Engine: radix-tree prefix cache + paged KV pool + model runner + scheduler.

    from radixkv import Engine, SamplingParams
    engine = Engine.from_pretrained()                    # embedded SmolLM2-135M-Instruct
    outs = engine.generate(["Hello", "Hello there"], SamplingParams(temperature=0, max_tokens=20))
    print(outs[0].text, outs[0].cached_tokens, engine.stats().prefix_cache_hit_rate)

Prompts are strings, token-id lists or chat message lists. `stream()` yields tokens as they are
produced, `score()` returns the logits of every position, `Session` keeps a conversation whose
turns reuse the previous turns' pages and `Session.fork(n)` branches it. `cache_salt` (alias
`extra`) namespaces the cache: requests with different salts never share a page.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixkv.metrics import Counters, Stats
from radixkv.sampling import InvalidSamplingParams, SamplingParams, sample_batch
from radixkv.scheduler import Request, RequestRejected, RequestStatus, ScheduledSeq, Scheduler

__all__ = [
    "CompletionOutput",
    "Engine",
    "InvalidPrompt",
    "RequestOutput",
    "Session",
    "StreamDelta",
    "Timings",
    "TokenLogprob",
    "ByteTokenizer",
]

Prompt = str | Sequence[int] | Sequence[dict]


class InvalidPrompt(ValueError):
    """A prompt the engine cannot run (empty, ids out of vocabulary, malformed messages)."""


# ---------------------------------------------------------------------------------------- outputs


@dataclass
class TokenLogprob:
    """Logprob of a generated token under the model's raw distribution, plus the top ones."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class Timings:
    """Seconds since arrival: queue (until first scheduled), ttft (first token), total."""

    queue: float | None = None
    ttft: float | None = None
    total: float | None = None


@dataclass
class CompletionOutput:
    """One sample (continuation) of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: str | int | None = None  # the stop string / stop token that ended it
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    """Result of one prompt. `text`, `token_ids`, ... are those of the first sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_tokens: int  # prompt tokens served from the prefix cache
    timings: Timings
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def error(self) -> str | None:
        return self.outputs[0].error


@dataclass
class StreamDelta:
    """New tokens of one sample, yielded by `Engine.stream` (index = prompt index)."""

    index: int
    sample: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None  # set on the last delta of a prompt (all samples done)


# ---------------------------------------------------------------------------------------- tokenizer


class ByteTokenizer:
    """A tiny byte-level tokenizer for random test models (ids 0..255 = bytes; EOS = 0)."""

    def __init__(self, vocab_size: int = 256) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = None
        self.eos_token_id = 0
        self.eos_token_ids = {0}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(int(i) % 256 for i in ids if not (skip_special_tokens and int(i) == 0))
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, tokenize: bool = False
    ):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


# ---------------------------------------------------------------------------------------- groups


@dataclass(eq=False)
class _Group:
    """All samples of one submitted prompt."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    reqs: list[Request]
    index: int = 0
    forked: bool = False
    score: bool = False
    done: bool = False

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.reqs) and (self.forked or self.params.n == 1)


def _available_memory_bytes() -> int:
    try:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    except Exception:  # pragma: no cover - backend without memory stats
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 4 << 30


class Engine:
    """Prefix-cached LLM inference: continuous batching over a radix tree and a paged KV pool.

    Build one with `Engine.from_pretrained(...)`; the constructor takes an existing runner (an
    object with `step(list[SeqInput])`, `copy_pages(pairs)`, `num_compilations`, `max_context`,
    and optionally `pool_is_valid()` + `reset_pool()` so a step that loses the device KV pool is
    recovered from) and tokenizer.
    """

    def __init__(
        self,
        runner,
        tokenizer,
        *,
        num_pages: int,
        page_size: int = 16,
        max_batch: int = 32,
        max_num_batched_tokens: int = 512,
        policy: str = "lpm",
        prefix_cache: bool = True,
        vocab_size: int | None = None,
        seed: int = 0,
        model_id: str = "",
        tree_factory: Callable | None = None,
        pool_factory: Callable | None = None,
        seq_input: Callable | None = None,
        starvation_steps: int = 32,
        in_batch_sharing: bool = True,
    ) -> None:
        if pool_factory is None:
            from radixkv.pages import PagePool as pool_factory
        if tree_factory is None:
            from radixkv.tree import RadixTree as tree_factory
        if seq_input is None:
            from models import SeqInput as seq_input
        self.runner = runner
        self.tokenizer = tokenizer
        self.page_size = page_size
        self.num_pages = num_pages
        self.model_id = model_id
        vocab = vocab_size or getattr(runner, "vocab_size", 0) or tokenizer.vocab_size
        self.vocab_size = int(vocab)
        self.pool = pool_factory(num_pages)
        self.tree = tree_factory(self.pool, page_size=page_size)
        self.counters = Counters()
        self.scheduler = Scheduler(
            self.pool,
            self.tree,
            page_size=page_size,
            max_batch=max_batch,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=policy,
            prefix_cache=prefix_cache,
            max_context=runner.max_context,
            counters=self.counters,
            starvation_steps=starvation_steps,
            in_batch_sharing=in_batch_sharing,
        )
        self.prefix_cache = prefix_cache
        self._seq_input = seq_input
        self._rng = np.random.default_rng(seed)
        self._groups: dict[str, _Group] = {}
        self._by_req: dict[int, _Group] = {}
        self._ids = itertools.count()
        self._eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self._eos.add(tokenizer.eos_token_id)
        #: test hook: called with the step's ScheduledSeq list before the model runs
        self.fault_hook: Callable[[list[ScheduledSeq]], None] | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(
        cls,
        model: Any = None,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_memory_fraction: float = 0.25,
        max_batch: int = 32,
        max_num_batched_tokens: int = 512,
        policy: str = "lpm",
        prefix_cache: bool = True,
        dtype: Any = None,
        attn_impl: str = "auto",
        interpret: bool = False,
        seed: int = 0,
        max_kv_tokens: int | None = None,
        runner_kwargs: dict | None = None,
        mesh: Any = None,
        tensor_parallel: int | None = None,
        data_parallel: int | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Load a model and build an Engine.

        Args:
            model: None (the embedded SmolLM2-135M-Instruct), a path to a .gguf file or a
                Hugging Face folder, a `models.LoadedModel`, a `models.ModelConfig` (random
                weights, byte tokenizer when the vocabulary is small), or "tiny" (test-only:
                a tiny random model with a byte tokenizer).
            page_size: tokens per KV page.
            num_pages: pages in the KV pool; default from kv_memory_fraction of the free
                device memory, capped at max_kv_tokens (default max_batch * context; on CPU
                at most 32768 tokens).
            max_batch: most running requests; max_num_batched_tokens: token budget per step.
            policy: "lpm" | "fcfs" | "dfs-weight".
            prefix_cache: False disables the radix-tree cache (for comparisons).
            dtype: compute / KV dtype (default float32).
            runner_kwargs: extra `models.ModelRunner` arguments (e.g. minimum bucket sizes).
            mesh, tensor_parallel, data_parallel: multi-device serving (models.sharding): a
                (data, model) jax Mesh, or the two sizes (over the local devices). Tensor
                parallelism shards the model and the KV pool over the model axis; with more
                than one data row this returns a radixkv.router.DataParallelEngine (one engine
                per row behind a cache-aware router).
            Other keyword arguments go to `Engine` (seed, starvation_steps, ...).
        """
        call_args = dict(locals())  # forwarded to the data-parallel replicas
        if (data_parallel or 1) > 1 or (mesh is not None and dict(mesh.shape).get("data", 1) > 1):
            from radixkv.router import DataParallelEngine

            fwd = {k: v for k, v in call_args.items() if k not in ("cls", "kwargs")}
            return DataParallelEngine.from_pretrained(**fwd, **kwargs)
        import jax
        import jax.numpy as jnp

        import models

        dtype = jnp.float32 if dtype is None else dtype
        tokenizer = None
        if isinstance(model, str) and model == "tiny" and not os.path.exists(model):
            # test-only: a tiny random Llama (byte tokenizer, 2048-token context)
            model = models.ModelConfig.tiny(max_position_embeddings=2048)
        if isinstance(model, models.ModelConfig):
            config = model
            params = models.init_params(config, seed=seed, dtype=dtype)
            tokenizer = ByteTokenizer(config.vocab_size) if config.vocab_size <= 512 else None
            model_id = f"random:{config.name or 'model'}:{seed}"
            if tokenizer is None:
                raise ValueError("a random ModelConfig needs vocab_size <= 512 (byte tokenizer)")
        else:
            loaded = model if hasattr(model, "params") else models.load_model(model, dtype=dtype)
            config, params, tokenizer = loaded.config, loaded.params, loaded.tokenizer
            model_id = str(getattr(loaded, "source_path", "") or config.name)
        bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
        bytes_per_token *= jnp.dtype(dtype).itemsize
        if num_pages is None:
            cap_tokens = max_kv_tokens or max_batch * config.max_context
            if max_kv_tokens is None and jax.default_backend() == "cpu":
                cap_tokens = min(cap_tokens, 32768)  # host RAM: keep the pool modest
            avail = int(_available_memory_bytes() * kv_memory_fraction)
            tokens = max(page_size * 4, min(avail // bytes_per_token, cap_tokens))
            num_pages = max(4, tokens // page_size)
        runner_kw = dict(
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            attn_impl=attn_impl,
            interpret=interpret,
            **(runner_kwargs or {}),
        )
        if mesh is not None or (tensor_parallel or 1) > 1:
            from models.sharding import ShardedModelRunner, make_mesh

            mesh = mesh if mesh is not None else make_mesh(tensor_parallel)
            runner = ShardedModelRunner(config, params, mesh=mesh, **runner_kw)
        else:
            runner = models.ModelRunner(config, params, **runner_kw)
        return cls(
            runner,
            tokenizer,
            num_pages=num_pages,
            page_size=page_size,
            max_batch=max_batch,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=policy,
            prefix_cache=prefix_cache,
            vocab_size=config.vocab_size,
            seed=seed,
            model_id=model_id,
            **kwargs,
        )

    # ------------------------------------------------------------------ prompts

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Token ids of a prompt (string, ids, or chat messages), validated."""
        text = None
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidPrompt("empty prompt")
            text = prompt
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        elif isinstance(prompt, np.ndarray) or (
            isinstance(prompt, Sequence) and all(isinstance(t, int | np.integer) for t in prompt)
        ):
            ids = [int(t) for t in prompt]
            if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
                raise InvalidPrompt("token-id prompts must be 1-D")
        elif isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if "role" not in m or "content" not in m:
                    raise InvalidPrompt(f"chat messages need 'role' and 'content', got {m!r}")
            r = self.tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=True, tokenize=False
            )
            text = r if isinstance(r, str) else None
            if isinstance(r, str):
                ids = list(self.tokenizer.encode(r, add_special_tokens=False))
            else:
                ids = list(r)
        else:
            raise InvalidPrompt(
                "a prompt must be a string, a list of token ids or a list of chat messages, "
                f"got {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidPrompt("empty prompt: it encodes to no tokens")
        bad = [t for t in ids if not (0 <= t < self.vocab_size)]
        if bad:
            raise InvalidPrompt(
                f"token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}"
                + (" ..." if len(bad) > 5 else "")
            )
        return text, ids

    # ------------------------------------------------------------------ submission

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: Hashable = None,
        request_id: str | None = None,
        _score: bool = False,
    ) -> str:
        """Queue one prompt; returns its request id. Raises ValueError subclasses on bad input."""
        params = params if params is not None else SamplingParams()
        try:
            if not isinstance(params, SamplingParams):
                raise InvalidSamplingParams(f"expected SamplingParams, got {type(params).__name__}")
            text, ids = self.encode_prompt(prompt)
        except ValueError:
            self.counters.requests_rejected += 1
            raise
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._groups:
            raise ValueError(f"duplicate request id {rid!r}")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
        req = Request(
            rid,
            ids,
            params,
            extra=cache_salt,
            seed=seed,
            all_logits=_score,
            use_cache=not _score,
        )
        try:
            if _score:
                if not ids:
                    raise RequestRejected("empty prompt")
                self.scheduler.check_fits(len(ids), 0)
                req.status = RequestStatus.WAITING
                self.scheduler.waiting.append(req)
            else:
                self.scheduler.add(req)
        except RequestRejected:
            self.counters.requests_rejected += 1
            raise
        self.counters.requests_submitted += 1
        group = _Group(rid, text, ids, params, [req], score=_score)
        self._groups[rid] = group
        self._by_req[id(req)] = group
        return rid

    def abort(self, request_id: str) -> None:
        """Cancel a request (all its samples). Unknown / finished ids are ignored."""
        g = self._groups.get(request_id)
        if g is None:
            return
        for r in g.reqs:
            self.scheduler.abort(r)
        g.forked = True  # no more samples will be spawned

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ the step

    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one scheduling step + model step; returns (request, new token ids) updates."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        copies = self.pool.take_pending_copies()
        if copies:
            batch = self._copy(batch, copies)
            if not batch:
                return []
        logits = self._run(batch)
        updates: list[tuple[Request, list[int]]] = []
        to_sample: list[tuple[ScheduledSeq, np.ndarray]] = []
        for seq, lg in zip(batch, logits, strict=True):
            req = seq.request
            if lg is None or req.finished:
                continue
            self.scheduler.on_computed(seq)
            if req.all_logits:
                # by position: a preempted score request recomputes rows, overwriting them
                buf = req.data.get("logits")
                if buf is None:
                    buf = req.data["logits"] = np.empty(
                        (len(req.tokens), lg.shape[-1]), dtype=np.float32
                    )
                buf[seq.start_pos : seq.start_pos + len(seq.token_ids)] = lg
                if seq.sample:
                    self.scheduler.finish(req, "length")
                    updates.append((req, []))
                continue
            if seq.sample:
                to_sample.append((seq, lg[-1]))
        if to_sample:
            updates.extend(self._sample(to_sample))
        return updates

    def _copy(self, batch: list[ScheduledSeq], copies: list[tuple[int, int]]):
        """Apply the copy-on-write copies; on failure fail the sequences whose pages they were
        filling (recovering the pool if it was lost). Returns the sequences that may still run."""
        try:
            self.runner.copy_pages(copies)
            return batch
        except Exception as e:
            self.counters.step_failures += 1
            dst = {d for _, d in copies}
            keep = []
            for seq in batch:
                if dst.intersection(seq.pages):
                    self._fail(seq.request, e)
                else:
                    keep.append(seq)
            if self._pool_lost():
                self._recover_pool()
                return []
            return keep

    def _pool_lost(self) -> bool:
        """True when the runner's device KV pool is unusable (e.g. donated to a call that then
        raised). Runners without `pool_is_valid()` are assumed to keep their pool."""
        check = getattr(self.runner, "pool_is_valid", None)
        return check is not None and not check()

    def _recover_pool(self) -> None:
        """The KV pool is gone: requeue every running request to recompute from scratch, empty
        the prefix cache and rebuild the pool (the caller already failed the step's requests)."""
        self.scheduler.drop_all_kv()
        self.runner.reset_pool()
        self.counters.kv_pool_resets += 1

    def _run(self, batch: list[ScheduledSeq]) -> list[np.ndarray | None]:
        """Run the model step. A failing step is retried one sequence at a time and only the
        sequences that fail again are failed. If a failure loses the device KV pool, the
        sequences of the failing call are failed, every other running request is requeued to
        recompute, the cache is emptied and the pool rebuilt; the step then yields nothing."""
        inputs = [
            self._seq_input(s.token_ids, s.start_pos, s.pages, all_logits=s.all_logits)
            for s in batch
        ]
        lost: list[np.ndarray | None] = [None] * len(batch)
        try:
            if self.fault_hook is not None:
                self.fault_hook(batch)
            return list(self.runner.step(inputs))
        except Exception as e:
            self.counters.step_failures += 1
            if len(batch) == 1 or self._pool_lost():
                for seq in batch:
                    self._fail(seq.request, e)
                if self._pool_lost():
                    self._recover_pool()
                return lost
        # isolate: retry each sequence alone; only the ones that fail again are failed
        out: list[np.ndarray | None] = []
        for seq, inp in zip(batch, inputs, strict=True):
            try:
                if self.fault_hook is not None:
                    self.fault_hook([seq])
                out.append(self.runner.step([inp])[0])
            except Exception as e:
                self._fail(seq.request, e)
                if self._pool_lost():  # the KV of the sequences computed so far is gone too
                    self._recover_pool()
                    return lost
                out.append(None)
        return out

    def _fail(self, req: Request, error: BaseException) -> None:
        self.scheduler.fail(req, error)
        g = self._by_req.get(id(req))
        if g is not None and not g.forked and g.params.n > 1:
            g.forked = True

    def _sample(self, items: list[tuple[ScheduledSeq, np.ndarray]]) -> list:
        rows: list[np.ndarray] = []
        reqs: list[Request] = []
        for seq, row in items:
            req = seq.request
            g = self._by_req[id(req)]
            if g.params.n > 1 and not g.forked and req.num_outputs == 0:
                children = [
                    Request(
                        req.request_id,
                        req.prompt_ids,
                        req.params,
                        extra=req.extra,
                        seed=req.seed,
                        sub=i,
                    )
                    for i in range(1, g.params.n)
                ]
                self.scheduler.fork(req, children)
                self.counters.requests_submitted += len(children)
                for c in children:
                    self._by_req[id(c)] = g
                    c.arrival = req.arrival
                g.reqs.extend(children)
                g.forked = True
                for r in [req, *children]:
                    rows.append(row)
                    reqs.append(r)
            else:
                rows.append(row)
                reqs.append(req)
        res = sample_batch(
            np.stack(rows),
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.sub for r in reqs],
            [r.num_outputs for r in reqs],
        )
        now = time.perf_counter()
        updates = []
        for i, req in enumerate(reqs):
            tok = int(res.tokens[i])
            req.tokens.append(tok)
            self.counters.generation_tokens += 1
            if req.first_token is None:
                req.first_token = now
            if req.params.logprobs is not None and res.logprobs is not None:
                k = req.params.logprobs
                ids_k, lps_k = res.top_ids[i][:k], res.top_logprobs[i][:k]
                top = {int(t): float(v) for t, v in zip(ids_k, lps_k, strict=True)}
                req.data.setdefault("logprobs", []).append(
                    TokenLogprob(tok, float(res.logprobs[i]), top)
                )
            self._check_stop(req, tok)
            updates.append((req, [tok]))
        return updates

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        if not p.ignore_eos and tok in self._eos:
            self.scheduler.finish(req, "stop")
            return
        if tok in p.stop_token_ids:
            req.data["stop_reason"] = tok
            self.scheduler.finish(req, "stop")
            return
        if p.stop:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            longest = max(len(s) for s in p.stop)
            start = max(0, req.data.get("_scanned", 0) - longest)
            hits = [(text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            req.data["_scanned"] = len(text)
            if hits:
                i, s = min(hits)
                req.data["stop_text"] = text[:i]
                req.data["stop_reason"] = s
                self.scheduler.finish(req, "stop")
                return
        if req.num_outputs >= p.max_tokens:
            self.scheduler.finish(req, "length")

    # ------------------------------------------------------------------ outputs

    def _completion(self, req: Request, index: int) -> CompletionOutput:
        text = req.data.get("stop_text")
        if text is None:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        lps = list(req.data.get("logprobs", [])) if req.params.logprobs is not None else None
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.data.get("stop_reason"),
            logprobs=lps,
            error=None if req.error is None else f"{type(req.error).__name__}: {req.error}",
        )

    def _output(self, g: _Group) -> RequestOutput:
        first = g.reqs[0]
        reqs = sorted(g.reqs, key=lambda r: r.sub)
        ends = [r.finished_at for r in reqs if r.finished_at is not None]
        tt = [r.first_token for r in reqs if r.first_token is not None]
        timings = Timings(
            queue=None if first.first_scheduled is None else first.first_scheduled - first.arrival,
            ttft=None if not tt else min(tt) - first.arrival,
            total=None if not ends or not g.finished else max(ends) - first.arrival,
        )
        return RequestOutput(
            request_id=g.request_id,
            prompt=g.prompt,
            prompt_token_ids=list(g.prompt_ids),
            outputs=[self._completion(r, r.sub) for r in reqs],
            cached_tokens=first.cached_tokens or 0,
            timings=timings,
            finished=g.finished,
        )

    def get_output(self, request_id: str, *, release: bool = True) -> RequestOutput:
        """The (possibly partial) output of a request; finished ones are forgotten on release."""
        g = self._groups[request_id]
        out = self._output(g)
        if release and g.finished:
            self._forget(g)
        return out

    def _forget(self, g: _Group) -> None:
        self._groups.pop(g.request_id, None)
        for r in g.reqs:
            self._by_req.pop(id(r), None)

    # ------------------------------------------------------------------ high-level API

    def _params_list(self, prompts: list, sampling_params) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * len(prompts)
        sp = list(sampling_params)
        if len(sp) != len(prompts):
            raise InvalidSamplingParams(f"got {len(sp)} SamplingParams for {len(prompts)} prompts")
        return sp

    def _submit_all(self, prompts, sampling_params, cache_salt, extra) -> list[str]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence)
            and prompts
            and (isinstance(prompts[0], int | np.integer) or isinstance(prompts[0], dict))
        ):
            prompts = [prompts]
        prompts = list(prompts)
        salt = cache_salt if cache_salt is not None else extra
        params = self._params_list(prompts, sampling_params)
        # validate everything before queueing anything
        try:
            for p, sp in zip(prompts, params, strict=True):
                if not isinstance(sp, SamplingParams):
                    raise InvalidSamplingParams(f"expected SamplingParams, got {type(sp).__name__}")
                _, ids = self.encode_prompt(p)
                self.scheduler.check_fits(len(ids), sp.max_tokens)
        except ValueError:
            self.counters.requests_rejected += 1
            raise
        return [
            self.add_request(p, sp, cache_salt=salt) for p, sp in zip(prompts, params, strict=True)
        ]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        extra: Hashable = None,
        cache_salt: Hashable = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order."""
        ids = self._submit_all(prompts, sampling_params, cache_salt, extra)
        pending = set(ids)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate")
        while pending:
            self.step()
            done = [i for i in pending if self._groups[i].finished]
            for i in done:
                pending.discard(i)
            if bar is not None and done:
                bar.update(len(done))
                bar.set_postfix(hit_rate=f"{self.stats().prefix_cache_hit_rate:.1%}")
            if pending and not self.scheduler.has_unfinished:
                raise RuntimeError("engine has no work left but requests are unfinished")
        if bar is not None:
            bar.close()
        return [self.get_output(i) for i in ids]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        extra: Hashable = None,
        cache_salt: Hashable = None,
    ) -> Iterator[StreamDelta]:
        """Yield new tokens per sample as they are produced (index = position in prompts).

        Closing the iterator early aborts the unfinished requests.
        """
        ids = self._submit_all(prompts, sampling_params, cache_salt, extra)
        index = {rid: i for i, rid in enumerate(ids)}
        pending = list(ids)
        try:
            while pending:
                self.step()
                for g_id in list(pending):
                    g = self._groups[g_id]
                    for r in sorted(g.reqs, key=lambda x: x.sub):
                        delta = self._delta(r, index[g_id])
                        if delta is not None:
                            yield delta
                    if g.finished:
                        pending.remove(g_id)
                        out = self.get_output(g_id)
                        yield StreamDelta(
                            index[g_id], -1, [], "", True, out.finish_reason, output=out
                        )
                if pending and not self.scheduler.has_unfinished:
                    raise RuntimeError("engine has no work left but requests are unfinished")
        finally:
            for g_id in pending:
                self.abort(g_id)
                self._forget(self._groups[g_id])

    def _delta(self, r: Request, index: int) -> StreamDelta | None:
        st = r.data.setdefault("_stream", [0, 0, False])  # tokens sent, chars sent, final sent
        if st[2]:
            return None
        new_ids = r.output_ids[st[0] :]
        text = r.data.get("stop_text")
        if text is None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            if not r.finished:
                # hold back what may be the start of a stop string or an incomplete character
                hold = max((len(s) for s in r.params.stop), default=1) - 1
                cut = len(text) - hold
                while cut > 0 and text[cut - 1] == "\ufffd":
                    cut -= 1
                text = text[: max(cut, st[1])]
        d = text[st[1] :]
        if not new_ids and not d and not r.finished:
            return None
        st[0], st[1], st[2] = len(r.output_ids), len(text), r.finished
        return StreamDelta(index, r.sub, new_ids, d, r.finished, r.finish_reason)

    async def astream(self, *args: Any, **kwargs: Any) -> AsyncIterator[StreamDelta]:
        """asyncio variant of `stream` (yields control to the loop after every delta)."""
        for delta in self.stream(*args, **kwargs):
            yield delta
            await asyncio.sleep(0)

    def score(self, token_ids: Prompt, *, cache_salt: Hashable = None) -> np.ndarray:
        """Logits [len(token_ids), vocab] of every position (float32), via the paged step.

        Row i is the model's next-token distribution after token_ids[: i + 1]. The sequence is
        computed in full (no cache lookup) and then cached for later requests.
        """
        rid = self.add_request(
            token_ids,
            SamplingParams(max_tokens=1, temperature=0.0),
            cache_salt=cache_salt,
            _score=True,
        )
        g = self._groups[rid]
        req = g.reqs[0]
        while not req.finished:
            self.step()
        self._forget(g)
        if req.finish_reason == "error":
            raise RuntimeError(f"score failed: {req.error}") from req.error
        return req.data["logits"]

    def session(self, *, system: str | None = None, cache_salt: Hashable = None) -> Session:
        """A multi-turn chat Session (each turn reuses the previous turns' cached pages)."""
        msgs = [{"role": "system", "content": system}] if system else []
        return Session(self, messages=msgs, cache_salt=cache_salt)

    def warmup(self, *, max_context: int | None = None) -> int:
        """Compile the model-step shapes serving can hit (up to `max_context` tokens per
        sequence) and the sampler's batch buckets, so later steps never compile. Returns the
        number of model-step compilations. Cost grows with the runner's bucket counts."""
        sch = self.scheduler
        n = 0
        if hasattr(self.runner, "warmup"):
            n = self.runner.warmup(
                max_tokens=sch.max_num_batched_tokens,
                max_batch=sch.max_batch,
                max_context=max_context or self.runner.max_context,
            )
        rng = np.random.default_rng(0)
        b = 1
        while True:
            logits = rng.normal(size=(b, self.vocab_size)).astype(np.float32)
            sample_batch(logits, [SamplingParams(temperature=1.0)] * b, [0] * b, [0] * b, [0] * b)
            if b >= sch.max_batch:
                break
            b *= 2
        return n

    # ------------------------------------------------------------------ introspection

    def stats(self) -> Stats:
        """Counters (monotonic) + gauges (pages, requests) + compilations."""
        tree = self.tree
        return Stats.from_counters(
            self.counters,
            pages_total=self.num_pages,
            pages_free=self.pool.num_free,
            pages_used=self.pool.num_used,
            pages_cached=int(getattr(tree, "cached_pages", 0)),
            pages_evictable=int(getattr(tree, "evictable_pages", 0)),
            cached_tokens=int(getattr(tree, "cached_tokens", 0)),
            requests_running=len(self.scheduler.running),
            requests_waiting=len(self.scheduler.waiting),
            compilations=int(getattr(self.runner, "num_compilations", 0)),
        )

    def clear_cache(self) -> int:
        """Evict every unlocked page from the prefix cache; returns pages released."""
        return int(self.tree.evict(self.num_pages))


class Session:
    """A conversation whose turns reuse the cached pages of the previous turns.

    Chat mode (`messages`): each `chat(text)` renders the whole conversation with the chat
    template; the previous turn's prompt + answer were inserted into the tree, so the new prompt
    hits everything up to the new user message. Token mode (`tokens`): `send(text_or_ids)`
    appends to the exact token history (prompt + generated tokens), so every turn hits exactly.
    `fork(n)` branches the state into n independent sessions sharing all cached pages.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        messages: list[dict] | None = None,
        tokens: list[int] | None = None,
        cache_salt: Hashable = None,
    ) -> None:
        self.engine = engine
        self.messages = list(messages or [])
        self.tokens = list(tokens or [])
        self.cache_salt = cache_salt
        self.history: list[RequestOutput] = []

    def chat(self, content: str, params: SamplingParams | None = None) -> RequestOutput:
        """Add a user message, generate the assistant's answer, append it; return the output."""
        self.messages.append({"role": "user", "content": content})
        out = self.engine.generate([self.messages], params, cache_salt=self.cache_salt)[0]
        self.messages.append({"role": "assistant", "content": out.text})
        self.tokens = out.prompt_token_ids + out.token_ids
        self.history.append(out)
        return out

    def send(self, text_or_ids: str | Sequence[int], params: SamplingParams | None = None):
        """Token mode: append text (encoded) or ids to the history, generate, append the output."""
        if isinstance(text_or_ids, str):
            add = self.engine.tokenizer.encode(text_or_ids, add_special_tokens=not self.tokens)
        else:
            add = [int(t) for t in text_or_ids]
        prompt = self.tokens + list(add)
        out = self.engine.generate([prompt], params, cache_salt=self.cache_salt)[0]
        self.tokens = prompt + out.token_ids
        self.history.append(out)
        return out

    def fork(self, n: int) -> list[Session]:
        """n copies of this session's state (they share every cached page; writes copy-on-write)."""
        if n < 1:
            raise ValueError(f"fork(n) needs n >= 1, got {n}")
        return [
            Session(
                self.engine,
                messages=[dict(m) for m in self.messages],
                tokens=list(self.tokens),
                cache_salt=self.cache_salt,
            )
            for _ in range(n)
        ]

"""The trace-replay simulator: the engine's own scheduler and KV manager, a cost model instead of the model.

`SimulatedEngine` stands in for an `LLMEngine` wherever one is driven step by step (`bench.offline.
run_offline` takes it as it is, with the simulator's clock and sleep): requests go to the real
`Scheduler` (or `StaticScheduler`) over a real `KVManager` of the block count a setting gives, each step
runs the scheduler's own rule (admission, chunked prompts, prefix-cache hits, preemption), and instead
of a forward the simulated clock moves on by what `StepCost` predicts for the step's chunks (and, for the
first few decode-only steps after a step that ran prompt tokens, what they cost more after it:
`StepCost.after_prompt`; on short outputs those steps are most inter-token gaps). Every
sampling chunk "samples" a token (a negative id of its own per request, which no prompt holds: the
outputs' blocks take room and hash as real ones do, and never match a prompt). Requests generate
max_tokens tokens (as with ignore_eos), so a trace states each request's output length as max_tokens.
The result is the run's records, as a measured run's: TTFT, TPOT, throughput and KV use, for any
setting, in a fraction of the time the run would take (a discrete-event simulation, as Vidur's).
A step's outputs are only those of requests it gave a token or finished, each request's one object
updated in place step after step (the caller reads them before the next step, as `run_offline` does).

Fast-forward: given the run's arrival times (`arrivals`, which the replay knows before it starts), a
stretch of steps in which nothing can change but the decoding requests' lengths runs as one call: after
a step that decoded every running request, finished none, preempted none, and left nothing waiting
that a later step could admit (nothing waits, or the batch is full), with the after-prompt term spent
(the next steps steady), the same step repeats until the
first of: a request's last token (that step runs normally), the step that ends at or past the next
arrival, the free blocks running out. Those k steps are priced at once (a decode step's cost being
affine in its rows' context, as `StepCost`'s is) and applied to the scheduler at once
(`Scheduler.advance_decodes`): the same times, tokens, blocks and KV statistics as k steps, but each
request's k tokens come as one output (its inter-token gaps merge; TTFT, TPOT and end-to-end are exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.doctor.step_cost import CostModel, after_prompt, step_chunks
from tokenmill.outputs import (
    CompletionOutput,
    EngineStats,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    StepOutput,
    StepStats,
)
from tokenmill.request import Request, RequestStatus, RequestTimes
from tokenmill.sampling_params import SamplingParams
from tokenmill.sched.kv_manager import KVManager
from tokenmill.sched.scheduler import Scheduler, SchedulerConfig
from tokenmill.sched.static import StaticScheduler


@dataclass
class SimulatedSteps:
    """What the simulated run's steps did, for the report."""

    steps: int = 0
    busy_seconds: float = 0.0  # simulated time spent in steps
    peak_blocks: int = 0  # the most KV blocks held at once
    live_tokens: int = 0  # summed over steps: tokens whose KV is live
    allocated_slots: int = 0  # summed over steps: slots in the blocks held
    decode_only_steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # requests in each step


class WatchedKV(KVManager):
    """A replay's KV manager that also notes what a larger cache could have done otherwise: an allocation
    it refused (a preemption, an admission that waited on blocks), a prefix lookup cut short by an
    eviction (its first missing block was cached once), a block cached again after its eviction (a
    larger cache would still hold the first copy, which later hits would share instead), and the most
    blocks held after an admission (against a larger cache's watermark). A cache that never evicts (at
    least every block the trace's requests can ask for) replays the trace exactly as this one did, every
    request holding as many blocks at every step, where none of the three happened and its watermark
    still admits at that peak (`same_with`): each block's hash then lives on the block its first writer
    filled in both, so every lookup finds as much, and shares as much, in both."""

    def __init__(self, num_blocks: int, block_size: int, watermark_blocks: int, enable_prefix_caching: bool) -> None:
        super().__init__(num_blocks, block_size, watermark_blocks, enable_prefix_caching)
        self.refused = False  # an allocation refused
        self.lost_hit = False  # a lookup cut short by an eviction
        self.recached = False  # a block cached again after its eviction
        self.admitted_peak = 0  # the most blocks held right after an admission's allocation
        self._ever_cached: set[bytes] = set()

    def allocate(self, request_id: str, num_tokens: int, keep_watermark: bool = False) -> bool:
        if not super().allocate(request_id, num_tokens, keep_watermark):
            self.refused = True
            return False
        if keep_watermark:
            self.admitted_peak = max(self.admitted_peak, self.num_blocks - self.num_free_blocks)
        return True

    def lookup_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        blocks = super().lookup_prefix(hashes)
        if len(blocks) < len(hashes) and hashes[len(blocks)] in self._ever_cached:
            self.lost_hit = True
        return blocks

    def cache_blocks(self, request_id: str, hashes: Sequence[bytes]) -> None:
        for h in hashes[self.num_hashed_blocks(request_id) :]:
            if h in self._ever_cached:
                self.recached = self.recached or self.pool.lookup(h) is None  # (evicted, now cached again)
            else:
                self._ever_cached.add(h)
        super().cache_blocks(request_id, hashes)

    def same_with(self, blocks: int) -> bool:
        """A cache of `blocks` blocks (never evicting: at least every block the requests can ask for)
        replays the trace as this one did."""
        clean = not (self.refused or self.lost_hit or self.recached)
        return clean and self.admitted_peak + max(1, blocks // 100) <= blocks


class SimulatedEngine:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        cost: CostModel,
        weight_bytes: int = 0,
        watch_kv: bool = False,
    ) -> None:
        """`watch_kv`: the KV manager a `WatchedKV` (for a plain `Scheduler` without drafts only)."""
        self.config = config
        self.cost = cost
        self.max_model_len = max_model_len
        self.weight_bytes = weight_bytes
        watched = watch_kv and config.scheduling != "static" and config.speculative_config is None
        kv = (WatchedKV if watched else KVManager)(
            num_blocks,
            config.block_size,
            watermark_blocks=max(1, num_blocks // 100),
            enable_prefix_caching=config.enable_prefix_caching,
        )
        scheduler_cls = StaticScheduler if config.scheduling == "static" else Scheduler
        self.scheduler: Scheduler = scheduler_cls(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, max_model_len), kv
        )
        self.now = 0.0
        self.last_step = StepStats(0, 0, 0.0, 0.0, 0, 0)
        self.record = SimulatedSteps()
        self.tokenizer = None  # prompts come as token ids
        self._reported: dict[str, int] = {}  # request -> output tokens already returned
        self._token: dict[str, int] = {}  # request -> the token id its simulated outputs carry
        self._outputs: dict[str, RequestOutput] = {}  # request -> its output object, until it finishes
        self.arrivals: list[float] | None = None  # the run's arrival times, ascending: fast-forward on
        self._next_arrival = 0  # index of the first arrival not yet passed
        self._stable = False  # the last step can repeat as it is (see the module docstring)
        # (tokens of the last step that ran prompt tokens, decode-only steps since): the next decode step's extra
        self._after = (0, 0)

    # -- the simulated clock (run_offline's `clock` and `sleep`) ----------------------------------

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    # -- LLMEngine's interface, as run_offline uses it --------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
    ) -> None:
        if isinstance(prompt, str) or not prompt:
            raise ValueError("prompt: the simulator takes a non-empty list of token ids")
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise ValueError(f"prompt: {len(prompt)} tokens leave no room under max_model_len {self.max_model_len}")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            seed=0,
            max_tokens=min(params.max_tokens or room, room),
            eos_token_ids=(),
            times=RequestTimes(arrival=self.now if arrival_time is None else arrival_time),
            cache_salt=cache_salt,
        )
        self.scheduler.add_request(request)
        self._stable = False
        self._reported[request_id] = 0
        self._token[request_id] = -1 - len(self._token)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        return self.scheduler.stats(self.weight_bytes)

    def step(self) -> list[RequestOutput]:
        if self._stable and self.arrivals is not None:
            fused = self._fast_forward()
            if fused is not None:
                return fused
        scheduler = self.scheduler
        preemptions = scheduler.num_preemptions
        scheduled = scheduler.schedule(self.now)
        chunks, decoding = step_chunks(scheduled, scheduler.requests)
        seconds = self.cost.predict(chunks, decoding) if chunks else 0.0
        tokens = sum(q for q, _ in chunks)
        if chunks and decoding:
            seconds += after_prompt(self.cost, *self._after)
            self._after = (self._after[0], self._after[1] + 1)
        elif chunks:
            self._after = (tokens, 0)
        self.now += seconds
        result = StepOutput()
        for c in scheduled.chunks:
            if c.sample:
                result.sampled[c.request_id] = [self._token[c.request_id]]
        changed = scheduler.update(scheduled, result, self.now)
        kv = scheduler.kv
        live = sum(r.num_computed_tokens for r in scheduler.running)
        self.last_step = StepStats(len(chunks), tokens, seconds, seconds, live, kv.num_allocated_slots())
        rec = self.record
        rec.steps += 1
        rec.busy_seconds += seconds
        rec.peak_blocks = max(rec.peak_blocks, kv.num_blocks - kv.num_free_blocks)
        rec.live_tokens += live
        rec.allocated_slots += self.last_step.kv_allocated_slots
        rec.decode_only_steps += bool(chunks) and decoding
        rec.batch_sizes.append(len(chunks))
        self._stable = (
            bool(chunks)
            and decoding
            and len(chunks) == len(scheduler.running)
            and scheduler.num_preemptions == preemptions
            and all(not r.status.finished for r in changed)
            and self._nothing_admissible(len(chunks))
            and after_prompt(self.cost, *self._after) == 0.0  # (the steps to come steady: priced as one)
        )
        return [out for r in changed if (out := self._output(r)) is not None]

    def _nothing_admissible(self, batch: int) -> bool:
        """No step of the same batch can admit a waiting request (nor touch its cached prefix): nothing
        waits, or the batch is full, or its decodes take the whole budget. A plain `Scheduler` only (no
        drafts, no static batches)."""
        s = self.scheduler
        if type(s) is not Scheduler or self.config.speculative_config is not None:
            return False
        return not s.waiting or batch >= s.config.max_num_seqs or batch >= s.config.max_num_batched_tokens

    def _fast_forward(self) -> list[RequestOutput] | None:
        """The next steps, as many as can repeat the last one (see the module docstring), in one call;
        None when fewer than two can."""
        s = self.scheduler
        running = s.running
        bs = s.kv.block_size
        contexts = [r.num_computed_tokens for r in running]
        held = [len(s.kv.block_table(r.request_id)) for r in running]
        limit = min(min(r.max_tokens - len(r.output_token_ids), self.max_model_len - r.num_tokens) for r in running)
        k = _most_steps(contexts, held, bs, limit - 1, s.kv.num_free_blocks)
        if k < 2:
            return None
        base = self.cost.predict([(1, c) for c in contexts], True)
        slope = self.cost.predict([(1, c + 1) for c in contexts], True) - base
        arrivals = self.arrivals or []
        while self._next_arrival < len(arrivals) and arrivals[self._next_arrival] <= self.now:
            self._next_arrival += 1
        due = arrivals[self._next_arrival] if self._next_arrival < len(arrivals) else float("inf")
        seconds: list[float] = []
        end = self.now
        while len(seconds) < k and end < due:  # (the step that reaches the arrival runs, then it is admitted)
            seconds.append(base + slope * len(seconds))
            end += seconds[-1]
        k = len(seconds)
        if k < 2:
            return None
        live = sum(contexts) * k + len(running) * k * (k + 1) // 2
        allocated = s.kv.num_allocated_slots() * k + bs * sum(
            _new_blocks_summed(c, h, bs, k) for c, h in zip(contexts, held, strict=True)
        )
        s.advance_decodes(k, {r.request_id: self._token[r.request_id] for r in running})
        for t in seconds:
            self.now += t
        total = sum(seconds)
        self.last_step = StepStats(len(running), len(running) * k, total, total, live, allocated)
        rec = self.record
        rec.steps += k
        rec.busy_seconds += total
        rec.peak_blocks = max(rec.peak_blocks, s.kv.num_blocks - s.kv.num_free_blocks)
        rec.live_tokens += live
        rec.allocated_slots += allocated
        rec.decode_only_steps += k
        rec.batch_sizes.extend([len(running)] * k)
        return [out for r in running if (out := self._output(r)) is not None]

    def _output(self, request: Request) -> RequestOutput | None:
        """The request's output for this step: its own object, updated in place (read before the next
        step, as `run_offline` does); None when the step gave it no token and did not finish it."""
        rid = request.request_id
        had = self._reported[rid]
        tokens = request.output_token_ids
        finished = request.status.finished
        if len(tokens) == had and not finished:
            return None  # (a prompt chunk that samples nothing: nothing for the caller)
        self._reported[rid] = len(tokens)
        out = self._outputs.get(rid)
        if out is None:
            out = RequestOutput(
                rid, None, request.prompt_token_ids, None, [CompletionOutput(0, "", [], None, None)], False,
                RequestMetrics(request.times.arrival, None, None, None),
            )  # fmt: skip
            self._outputs[rid] = out
        completion = out.outputs[0]
        completion.token_ids = tokens[had:]
        times, metrics = request.times, out.metrics
        metrics.first_scheduled_time, metrics.first_token_time = times.first_scheduled, times.first_token
        out.num_cached_tokens = request.num_cached_tokens
        if finished:
            completion.finish_reason = {
                RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort",
            }.get(request.status, "stop")
            out.finished, metrics.finished_time = True, times.finished
            del self._outputs[rid]
        return out


def _most_steps(contexts: list[int], held: list[int], block_size: int, limit: int, free: int) -> int:
    """The most decode steps, up to `limit`, whose new blocks the `free` ones cover: request i has
    computed contexts[i] tokens and holds held[i] blocks; step j needs blocks for contexts[i] + j."""

    def need(k: int) -> int:
        return sum(max(0, -(-(c + k) // block_size) - h) for c, h in zip(contexts, held, strict=True))

    if limit < 1 or need(limit) <= free:
        return max(0, limit)
    lo, hi = 0, limit  # need(lo) <= free < need(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid) <= free else (lo, mid)
    return lo


def _ceil_sum(n: int, block_size: int) -> int:
    """The sum of ceil(t / block_size) for t = 1 .. n."""
    q, r = divmod(n, block_size)
    return block_size * q * (q + 1) // 2 + r * (q + 1)


def _new_blocks_summed(context: int, held: int, block_size: int, steps: int) -> int:
    """Summed over steps j = 1 .. `steps`: the blocks a request holding `held` and `context` computed
    tokens has newly allocated by the end of step j (it then holds blocks for context + j tokens)."""
    first = held * block_size - context + 1  # the first step that needs a block past those held
    if first > steps:
        return 0
    first = max(first, 1)
    count = steps - first + 1
    return _ceil_sum(context + steps, block_size) - _ceil_sum(context + first - 1, block_size) - count * held

"""Iteration-level (continuous-batching) scheduler.

Every step re-decides the batch: running groups first (growing their block tables, and
preempting the lowest-priority newest group when blocks run out), then swapped groups
coming back, then new prompts. A finished sequence frees its blocks at once (apply),
so a waiting request can join on the very next step.

The scheduler owns admission, budgets, preemption, swapping and every change to sequences
and blocks. A step is ``out = scheduler.schedule()``, the worker runs ``out``, the
engine's output processor decides what each request's new tokens mean (stop rules,
forks, beams) as a list of updates, and ``scheduler.apply(out, updates)`` carries them
out in one call.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Container, Iterable, Mapping, Sequence as Seq
from types import MappingProxyType

from vllm_lite.config.schema import CacheConfig, SchedulerConfig
from vllm_lite.core.block_manager import AllocStatus, BlockMapping, BlockSpaceManager
from vllm_lite.core.policy import running_key, waiting_key
from vllm_lite.core.prefix_cache import PrefixCacheStats
from vllm_lite.errors import InternalError
from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import SeqOutputState, Sequence, SequenceGroup, SequenceStatus, next_seq_id

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's work in a step: compute tokens [num_computed_tokens,
    num_computed_tokens + num_new_tokens) of its token ids, with KV slots from block_table."""

    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int
    # Physical device block of each logical block, as it stands for this step. A plain
    # decode gets the block manager's own list, uncopied: read it during the step (it
    # may grow in place afterwards; any other change replaces it, never this list).
    block_table: list[int]
    is_prompt: bool
    # This step computes the sequence's last token, so its logits are sampled.
    do_sample: bool


@dataclass
class ScheduledSequenceGroup:
    seq_group: SequenceGroup
    seqs: list[ScheduledSequence] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.seq_group.request_id

    @property
    def is_prompt(self) -> bool:
        return any(s.is_prompt for s in self.seqs)

    @property
    def token_chunk_size(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


@dataclass(slots=True)
class DecodeLane:
    """The step's plain decodes as columns, one row per request: row i is request
    ``groups[i]``'s only sequence ``seqs[i]`` (id ``seq_ids[i]``), computing its last
    token at position ``computed[i]`` (its computed tokens: one token is left) into the
    block manager's own table ``tables[i]`` (uncopied: it only grows in place), and
    sampling. A plain decode is a running request of one sequence, no beams, past its
    first sample, with one token to compute: the usual step of nearly every request,
    served without an object per request."""

    groups: list[SequenceGroup]
    seqs: list[Sequence]
    seq_ids: list[int]
    computed: list[int]
    tables: list[list[int]]

    def __len__(self) -> int:
        return len(self.seqs)

    def scheduled_groups(self) -> list[ScheduledSequenceGroup]:
        """The rows as the per-request path's records (for consumers off the hot path)."""
        return [ScheduledSequenceGroup(g, [ScheduledSequence(s.seq_id, c, 1, t, False, True)])
                for g, s, c, t in zip(self.groups, self.seqs, self.computed, self.tables)]

    def without(self, request_ids: Container[str]) -> DecodeLane:
        keep = [i for i, g in enumerate(self.groups) if g.request_id not in request_ids]
        return DecodeLane(*([col[i] for i in keep] for col in (
            self.groups, self.seqs, self.seq_ids, self.computed, self.tables)))


@dataclass
class SchedulerOutput:
    """What one step runs. Apply the block operations in this order before the forward:
    blocks_to_swap_out (GPU->CPU), blocks_to_swap_in (CPU->GPU), blocks_to_copy (GPU->GPU,
    copy-on-write): a block swapped out may be handed out again in the same step.

    The step's plain decodes come as one columnar ``lane`` (its rows first in the batch),
    every other request as a ScheduledSequenceGroup in ``groups`` (prefill chunks,
    recomputes, forked and beam requests, first samples); ``scheduled_seq_groups`` has
    them all as records, the lane's rows first."""

    step: int
    groups: list[ScheduledSequenceGroup]
    num_batched_tokens: int
    blocks_to_swap_in: BlockMapping
    blocks_to_swap_out: BlockMapping
    blocks_to_copy: BlockMapping
    # Finished this step without running (FINISHED_IGNORED; the reason is in group.error).
    ignored_seq_groups: list[SequenceGroup]
    num_preempted: int
    lane: DecodeLane | None = None
    _records: list[ScheduledSequenceGroup] | None = field(default=None, init=False,
                                                          repr=False, compare=False)

    @property
    def scheduled_seq_groups(self) -> list[ScheduledSequenceGroup]:
        """Every request of the step as a ScheduledSequenceGroup, the lane's rows first
        (built on first read; the hot path reads ``lane`` and ``groups``)."""
        if self.lane is None:
            return self.groups
        if self._records is None:
            self._records = self.lane.scheduled_groups() + self.groups
        return self._records

    def num_requests(self) -> int:
        return len(self.groups) + (len(self.lane) if self.lane is not None else 0)

    def seq_groups(self) -> list[SequenceGroup]:
        """The requests of the step, in batch order."""
        rest = [s.seq_group for s in self.groups]
        return self.lane.groups + rest if self.lane is not None else rest

    def request_ids(self) -> list[str]:
        return [g.request_id for g in self.seq_groups()]

    def only(self, request_ids: Container[str]) -> SchedulerOutput:
        """The same step restricted to ``request_ids`` (the engine's re-runs of a step
        that failed), the lane kept a lane."""
        lane = self.lane
        if lane is not None:
            lane = lane.without(_Complement(request_ids))
        groups = [g for g in self.groups if g.request_id in request_ids]
        return dataclasses.replace(self, groups=groups, lane=lane or None,
                                   num_batched_tokens=sum(g.token_chunk_size for g in groups)
                                   + (len(lane) if lane else 0))


class _Complement:
    """Membership in the complement of a container."""

    __slots__ = ("ids",)

    def __init__(self, ids: Container[str]) -> None:
        self.ids = ids

    def __contains__(self, item: object) -> bool:
        return item not in self.ids


# A finished status and its stop reason (a stop token id, a stop string, or None).
Finish = tuple[SequenceStatus, int | str | None]


# The update records are built once per sequence per step and never changed afterwards:
# plain slotted dataclasses (a frozen one costs several times as much to build).
@dataclass(slots=True)
class AppendToken:
    """A running sequence takes its sampled token (and its logprob); ``output`` is the
    sequence's output state with the token (None: unchanged); ``finish`` ends it."""

    seq_id: int
    token_id: int
    logprob: float = 0.0
    output: SeqOutputState | None = None
    finish: Finish | None = None


@dataclass(slots=True)
class ForkSeq:
    """A new running sequence ``seq_id`` sharing every block of its running parent (n /
    best_of children, beams; blocks are copied on write), then taking its own token."""

    parent_seq_id: int
    seq_id: int
    token_id: int
    logprob: float = 0.0
    output: SeqOutputState | None = None
    finish: Finish | None = None


@dataclass(slots=True)
class NewHypothesis:
    """A finished beam: a copy of the running parent plus one token, holding no blocks."""

    parent_seq_id: int
    seq_id: int
    token_id: int
    logprob: float
    finish: Finish
    output: SeqOutputState | None = None


@dataclass(slots=True)
class DropSeq:
    """A sequence leaves its request: a beam that lost (its blocks are freed) or a
    hypothesis pushed out of the best."""

    seq_id: int


SeqUpdate = AppendToken | ForkSeq | NewHypothesis | DropSeq


@dataclass(slots=True)
class GroupUpdate:
    """What one step changes in one request: its sequences' updates, and the chunk of
    prompt logprobs the step computed."""

    request_id: str
    seqs: list[SeqUpdate] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Any] | None] | None = None


@dataclass(slots=True)
class LaneUpdate:
    """What one step changes in the rows of its DecodeLane, as columns in row order: row
    i's sequence takes token ``token_ids[i]`` of logprob ``logprobs[i]``, except the rows
    in ``skip`` (their request failed this step). ``finishes``: the rows whose token ends
    their sequence, with the finish; ``outputs``: the rows whose output state (text,
    logprob entries) moved, with the new state."""

    token_ids: list[int]
    logprobs: list[float]
    finishes: dict[int, Finish] = field(default_factory=dict)
    outputs: dict[int, SeqOutputState] = field(default_factory=dict)
    skip: set[int] = field(default_factory=set)


@dataclass
class _StepState:
    token_budget: int
    num_batched_tokens: int = 0
    # A sequence did not get its tokens: admit nothing more, or it could starve.
    blocked: bool = False
    scheduled: dict[str, ScheduledSequenceGroup] = field(default_factory=dict)
    swap_in: BlockMapping = field(default_factory=list)
    swap_out: BlockMapping = field(default_factory=list)
    copies: BlockMapping = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)
    num_preempted: int = 0
    lane: DecodeLane = field(default_factory=lambda: DecodeLane([], [], [], [], []))

    @property
    def tokens_left(self) -> int:
        return self.token_budget - self.num_batched_tokens


@dataclass
class SchedulerStats:
    """A snapshot of the queues and the KV pools (the engine's stats(), the metrics).
    "device" is the pool the model attends over (GPU memory, or CPU memory on a CPU);
    "cpu" is the swap pool."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    device_blocks_total: int = 0
    device_blocks_free: int = 0
    cpu_blocks_total: int = 0
    cpu_blocks_free: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class Scheduler:
    # Plain decodes go in the step's DecodeLane; False: the same rows, in the same order,
    # as ScheduledSequenceGroups on the per-request path (tests compare the two).
    _decode_lane = True

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = BlockSpaceManager(cache_config)
        if scheduler_config.max_model_len > cache_config.num_gpu_blocks * cache_config.block_size:
            logger.warning(
                "max_model_len %d exceeds the KV cache (%d tokens): long requests will end "
                "with an error",
                scheduler_config.max_model_len,
                cache_config.num_gpu_blocks * cache_config.block_size,
            )
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        # Whether running is in service order (running_key): a group joining unsorts it.
        self._running_sorted = True
        self.swapped: list[SequenceGroup] = []
        self._requests: dict[str, SequenceGroup] = {}
        self._arrivals = itertools.count()
        self._step = 0
        self._pending_output: SchedulerOutput | None = None
        # Requests aborted so far: a step that sees it unchanged since schedule() knows
        # every sequence it scheduled is still running.
        self.num_aborted = 0
        self.num_preemptions: dict[str, int] = {"recompute": 0, "swap": 0}

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | bytes | None = None,
        eos_token_id: int | None = None,
        prompt: str | None = None,
    ) -> SequenceGroup:
        """Build the request's group (one sequence holding the prompt) and queue it. The
        request was admitted (vllm_lite.engine.admission): one that breaks what admission
        guarantees is a bug upstream (InternalError), and changes nothing."""
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise InternalError("prompt_token_ids must be a non-empty list of token ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prompt_token_ids):
            raise InternalError("prompt_token_ids must hold non-negative ints")
        if isinstance(cache_salt, str):
            cache_salt = cache_salt.encode()
        seq = Sequence(next_seq_id(), prompt_token_ids, cache_salt)
        group = SequenceGroup(
            request_id,
            [seq],
            sampling_params if sampling_params is not None else SamplingParams(),
            arrival_time=arrival_time,
            priority=priority,
            eos_token_id=eos_token_id,
            prompt=prompt,
        )
        self.add_seq_group(group)
        return group

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        if not isinstance(seq_group.request_id, str) or not seq_group.request_id:
            raise InternalError(f"request_id must be a non-empty str, got {seq_group.request_id!r}")
        if seq_group.request_id in self._requests:
            raise InternalError(f"request_id {seq_group.request_id!r} is already in the scheduler")
        if isinstance(seq_group.priority, bool) or not isinstance(seq_group.priority, int):
            raise InternalError(f"priority must be an int, got {seq_group.priority!r}")
        for seq in seq_group.get_seqs():
            if seq.status != SequenceStatus.WAITING or self.block_manager.has_blocks(seq):
                raise InternalError(f"seq {seq.seq_id} of a new request must be WAITING without blocks")
        if seq_group.sampling_params.best_of > self.config.max_num_seqs:
            raise InternalError(f"request {seq_group.request_id!r} runs "
                                f"{seq_group.sampling_params.best_of} sequences; max_num_seqs "
                                f"is {self.config.max_num_seqs}")
        if seq_group.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position's logits: no prefix-cache reads
            # (as vLLM's v1 engine; the request still publishes its blocks for others).
            for seq in seq_group.get_seqs():
                seq.read_prefix_cache = False
        seq_group.arrival_index = next(self._arrivals)
        seq_group.waiting_steps = 0
        self._requests[seq_group.request_id] = seq_group
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_id: str | Iterable[str],
                        error: str | None = None) -> list[SequenceGroup]:
        """Finish the request(s) as aborted and free their blocks; the request leaves the
        engine with everything it held. ``error``: why (the request's output reports it).
        Returns the groups aborted; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = []
        for rid in ids:
            group = self._requests.pop(rid, None)
            if group is None:
                continue
            for queue in (self.waiting, self.running, self.swapped):
                if group in queue:
                    queue.remove(group)
            self._finish_all(group, SequenceStatus.FINISHED_ABORTED)
            if error is not None:
                group.error = error
            aborted.append(group)
            self.num_aborted += 1
        return aborted

    def _finish_all(self, group: SequenceGroup, status: SequenceStatus) -> None:
        for seq in group.get_unfinished_seqs():
            self.block_manager.free(seq)
            seq.status = status

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def usable_device_blocks(self) -> int:
        """KV blocks one request may ever hold at once (the pool less the watermark)."""
        bm = self.block_manager
        return bm.num_total_device_blocks - bm.watermark_blocks

    def get_seq_group(self, request_id: str) -> SequenceGroup | None:
        return self._requests.get(request_id)

    @property
    def requests(self) -> Mapping[str, SequenceGroup]:
        """Every request in the engine (waiting, running or swapped out), by request_id."""
        return MappingProxyType(self._requests)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        prefix = bm.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            device_blocks_total=bm.num_total_device_blocks,
            device_blocks_free=bm.get_num_free_device_blocks(),
            cpu_blocks_total=bm.num_total_cpu_blocks,
            cpu_blocks_free=bm.get_num_free_cpu_blocks(),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=sum(self.num_preemptions.values()),
        )

    def kv_slot_usage(self) -> tuple[int, int]:
        """(allocated, live) KV slots of the device pool right now.

        Allocated: blocks held by some sequence (free and evictable prefix-cache blocks
        excluded) times the block size. Live: the slots of those blocks that hold a
        computed token of a running sequence; a block shared by several sequences (prefix
        caching, forks) counts once, with its fullest use.
        """
        bm = self.block_manager
        block_size = self.cache_config.block_size
        allocated = (bm.num_total_device_blocks - bm.get_num_free_device_blocks()) * block_size
        fill: dict[int, int] = {}
        for group in self.running:
            for seq in group.get_unfinished_seqs():
                table = bm.get_block_table(seq) if bm.has_blocks(seq) else []
                n = seq.num_computed_tokens
                full = min(n // block_size, len(table))
                for block in table[:full]:
                    fill[block] = block_size
                if full < len(table) and n % block_size:
                    block = table[full]
                    fill[block] = max(fill.get(block, 0), n % block_size)
        return allocated, sum(fill.values())

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block not in use; returns how many were dropped."""
        return self.block_manager.reset_prefix_cache()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.block_manager.prefix_cache_stats

    # -- scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step += 1
        state = _StepState(token_budget=self.config.max_num_batched_tokens)
        self._schedule_running(state)
        if state.num_preempted == 0:
            # A preemption means blocks are short: bringing groups back would only thrash.
            self._schedule_swapped(state)
        self._schedule_waiting(state)
        for group in self.waiting:
            group.waiting_steps += 1
        lane: DecodeLane | None = state.lane if state.lane.seqs else None
        groups = list(state.scheduled.values())
        if lane is not None and not self._decode_lane:
            groups = lane.scheduled_groups() + groups
            lane = None
        out = SchedulerOutput(
            step=self._step,
            groups=groups,
            num_batched_tokens=state.num_batched_tokens,
            blocks_to_swap_in=state.swap_in,
            blocks_to_swap_out=state.swap_out,
            blocks_to_copy=state.copies,
            ignored_seq_groups=state.ignored,
            num_preempted=state.num_preempted,
            lane=lane,
        )
        self._pending_output = out
        return out

    def _schedule_running(self, state: _StepState) -> None:
        # Decodes before prefill chunks: a long prompt must not stall the running batch.
        # Groups are served in order, each growing its block table first; when blocks run
        # out, victims come from the back only: groups already served this step keep their
        # slots, so nothing scheduled is taken away again.
        if not self._running_sorted:
            self.running.sort(key=running_key)  # stays sorted until a group joins
            self._running_sorted = True
        # A preemption takes its victim out of self.running, which is then the groups kept.
        queue = self.running[:]
        rest: list[SequenceGroup] = []
        append_slots = self.block_manager.try_append_slots
        tables = self.block_manager.device_block_tables
        bs = self.cache_config.block_size
        running = SequenceStatus.RUNNING
        groups, seqs, seq_ids, computed_col, table_col = (
            state.lane.groups, state.lane.seqs, state.lane.seq_ids, state.lane.computed,
            state.lane.tables)
        budget = state.token_budget
        num_batched = state.num_batched_tokens
        head, end = 0, len(queue)  # queue[head:end] still to serve; victims come off the end
        while head < end:
            group = queue[head]
            head += 1
            seq = group.plain_seq
            if seq is not None:
                # A plain decode (see DecodeLane) goes in the lane; one whose token fits
                # its last block asks the block manager for nothing: a sequence alone in
                # its request never shares the block it writes (prefix-cache hits are
                # full computed blocks, and forks make a request of several sequences).
                output = seq.output_token_ids
                computed = seq.num_computed_tokens
                if (seq.status is running and output
                        and len(seq.prompt_token_ids) + len(output) - computed == 1):
                    table = tables[seq.seq_id]
                    if computed < len(table) * bs:
                        if num_batched < budget:
                            num_batched += 1
                            groups.append(group)
                            seqs.append(seq)
                            seq_ids.append(seq.seq_id)
                            computed_col.append(computed)
                            table_col.append(table)
                        else:
                            state.blocked = True
                        continue
                else:
                    seq = None
            while (copies := append_slots(group)) is None:
                if head < end:
                    end -= 1
                    victim = queue[end]
                else:
                    victim = group
                state.num_batched_tokens = num_batched
                self._preempt(victim, state)
                if victim is group:
                    break
            else:
                if copies:
                    state.copies.extend(copies)
                if seq is not None:  # a plain decode that took a new block
                    if num_batched < budget:
                        num_batched += 1
                        groups.append(group)
                        seqs.append(seq)
                        seq_ids.append(seq.seq_id)
                        computed_col.append(seq.num_computed_tokens)
                        table_col.append(tables[seq.seq_id])
                    else:
                        state.blocked = True
                    continue
                state.num_batched_tokens = num_batched
                self._assign_tokens(group, state, decodes=True)
                num_batched = state.num_batched_tokens
                rest.append(group)
        state.num_batched_tokens = num_batched
        for group in rest:
            self._assign_tokens(group, state, decodes=False)

    def _schedule_swapped(self, state: _StepState) -> None:
        self.swapped.sort(key=running_key)
        while self.swapped and not state.blocked:
            group = self.swapped[0]
            status = self.block_manager.can_swap_in(group)
            if status == AllocStatus.NEVER:
                self.swapped.pop(0)
                self._ignore(group, "it no longer fits the device KV cache", state)
                continue
            if status == AllocStatus.LATER or not self._fits_budgets(group, SequenceStatus.SWAPPED, state):
                break
            self.swapped.pop(0)
            state.swap_in.extend(self.block_manager.swap_in(group))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            state.copies.extend(self.block_manager.append_slots(group))
            self.running.append(group)
            self._running_sorted = False
            self._assign_tokens(group, state)

    def _schedule_waiting(self, state: _StepState) -> None:
        # Hopeless requests end now, wherever they stand in the queue.
        for group in list(self.waiting):
            reason = self._never_reason(group)
            if reason is not None:
                self.waiting.remove(group)
                self._ignore(group, reason, state)
        if self.swapped:
            return  # swapped groups come back before any new prompt
        self.waiting.sort(
            key=lambda g: waiting_key(
                self.config.scheduling_policy, g, self.config.max_model_len, self.config.max_wait_steps
            )
        )
        while self.waiting and not state.blocked:
            group = self.waiting[0]
            if self.block_manager.can_allocate(group) != AllocStatus.OK:
                break  # head of line waits: nothing may overtake it on memory
            if not self._fits_budgets(group, SequenceStatus.WAITING, state):
                break
            self.waiting.pop(0)
            self.block_manager.allocate(group)
            for seq in group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.RUNNING
            group.waiting_steps = 0
            self.running.append(group)
            self._running_sorted = False
            self._assign_tokens(group, state)

    def _never_reason(self, group: SequenceGroup) -> str | None:
        prompt_len = len(group.prompt_token_ids)
        if prompt_len > self.config.max_model_len:
            return f"prompt length {prompt_len} exceeds max_model_len {self.config.max_model_len}"
        if self.block_manager.can_allocate(group) == AllocStatus.NEVER:
            return (
                f"it needs more KV blocks than the cache has "
                f"({self.block_manager.num_total_device_blocks} blocks of "
                f"{self.cache_config.block_size} tokens, {self.block_manager.watermark_blocks} "
                f"held back)"
            )
        return None

    def _ignore(self, group: SequenceGroup, reason: str, state: _StepState) -> None:
        logger.warning("request %s finished without running: %s", group.request_id, reason)
        group.error = reason
        self._finish_all(group, SequenceStatus.FINISHED_IGNORED)
        self._requests.pop(group.request_id, None)
        state.ignored.append(group)

    def _num_running_seqs(self) -> int:
        return sum(g.get_max_num_running_seqs() for g in self.running)

    def _fits_budgets(self, group: SequenceGroup, status: SequenceStatus, state: _StepState) -> bool:
        if self._num_running_seqs() + group.get_max_num_running_seqs() > self.config.max_num_seqs:
            return False
        # At least one sequence must make progress, or admitting it only pins blocks.
        if self.config.enable_chunked_prefill:
            needed = 1
        else:
            needed = min(s.get_len() - s.num_computed_tokens for s in group.get_seqs(status))
        return state.tokens_left >= needed

    def _assign_tokens(self, group: SequenceGroup, state: _StepState, decodes: bool | None = None) -> None:
        """Give the group's running sequences their tokens for this step, within the budget.

        decodes=True only serves sequences with a single token to compute, False only the
        others, None both.
        """
        if group.sampling_params.use_beam_search:
            self._assign_beam_tokens(group, state, decodes)
            return
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            need = seq.get_num_uncomputed_tokens()
            if need <= 0 or (decodes is not None and decodes != (need == 1)):
                continue
            take = self._take(need, state)
            if take:
                self._schedule_seq(group, seq, take, take == need, state)

    def _take(self, need: int, state: _StepState) -> int:
        """Tokens a sequence needing ``need`` gets this step: a chunk under chunked prefill,
        else all or none. None left blocks the step's admissions."""
        if self.config.enable_chunked_prefill:
            take = min(need, state.tokens_left)
        else:
            take = need if need <= state.tokens_left else 0
        if take == 0:
            state.blocked = True
        return take

    def _schedule_seq(self, group: SequenceGroup, seq: Sequence, take: int, do_sample: bool,
                      state: _StepState) -> None:
        state.num_batched_tokens += take
        entry = state.scheduled.get(group.request_id)
        if entry is None:
            entry = state.scheduled[group.request_id] = ScheduledSequenceGroup(group, [])
        entry.seqs.append(ScheduledSequence(seq.seq_id, seq.num_computed_tokens, take,
                                            self.block_manager.get_block_table(seq),
                                            seq.is_prefill(), do_sample))

    def _assign_beam_tokens(self, group: SequenceGroup, state: _StepState,
                            decodes: bool | None) -> None:
        """A beam step ranks the candidates of all live beams together, so the beams of a
        group sample in the same step or not at all. Beams with more than one token to
        compute (a recompute after preemption) compute all but their last token first;
        once every beam has one token left, they decode together."""
        seqs = [s for s in group.get_seqs(SequenceStatus.RUNNING) if s.get_num_uncomputed_tokens() > 0]
        if not seqs:
            return
        all_decode = all(s.get_num_uncomputed_tokens() == 1 for s in seqs)
        if decodes is not None and decodes != all_decode:
            return
        if all_decode:
            if len(seqs) > state.tokens_left:
                state.blocked = True
                return
            for seq in seqs:
                self._schedule_seq(group, seq, 1, True, state)
            return
        # A lone beam (the prompt) samples at the end of its prefill.
        hold_back = 0 if len(seqs) == 1 else 1
        for seq in seqs:
            need = seq.get_num_uncomputed_tokens() - hold_back
            take = self._take(need, state) if need > 0 else 0
            if take:
                self._schedule_seq(group, seq, take, hold_back == 0 and take == need, state)

    def _preemption_mode(self, group: SequenceGroup) -> str:
        mode = self.config.preemption_mode
        if mode is None:
            mode = "recompute" if group.get_max_num_running_seqs() == 1 else "swap"
        if mode == "swap" and not self.block_manager.can_swap_out(group):
            logger.debug("no CPU room to swap out %s; recomputing it instead", group.request_id)
            mode = "recompute"
        elif mode == "recompute" and not self._recompute_fits(group) and self.block_manager.can_swap_out(group):
            # Recomputed sequences no longer share their prompt blocks: a forked group whose
            # separate copies could never fit would end with an error, so it swaps.
            logger.debug("%s could not be recomputed in the cache; swapping it", group.request_id)
            mode = "swap"
        return mode

    def _recompute_fits(self, group: SequenceGroup) -> bool:
        bm = self.block_manager
        bs = self.cache_config.block_size
        needed = sum(-(-s.get_len() // bs) for s in group.get_seqs(SequenceStatus.RUNNING))
        return needed <= bm.num_total_device_blocks - bm.watermark_blocks

    def _preempt(self, group: SequenceGroup, state: _StepState) -> None:
        mode = self._preemption_mode(group)
        seqs = group.get_seqs(SequenceStatus.RUNNING)
        if mode == "swap":
            state.swap_out.extend(self.block_manager.swap_out(group))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
        else:
            for seq in seqs:
                self.block_manager.free(seq)
                seq.reset_state_for_recompute()
                seq.status = SequenceStatus.WAITING
            self.waiting.append(group)
        if group in self.running:
            self.running.remove(group)
        group.num_preemptions += 1
        self.num_preemptions[mode] += 1
        state.num_preempted += 1
        logger.debug("preempted %s by %s", group.request_id, mode)

    # -- after the model ran -----------------------------------------------------------
    def apply(self, output: SchedulerOutput, updates: Iterable[GroupUpdate],
              lane: LaneUpdate | None = None) -> None:
        """Records the step ``output`` once it ran: the scheduled tokens of every group
        still in the scheduler are in the KV cache now (full blocks become prefix-cache
        hits for others), then each group's updates change its sequences and blocks
        (``lane``: those of the step's DecodeLane rows, as columns; a lane row may also
        get a GroupUpdate instead). Every update names sequences as they stood before
        this step's updates: forks and hypotheses copy their parent before the parent
        takes its own token, and dropped sequences go last. A request whose sequences
        have all finished leaves the scheduler. Anything inconsistent with the
        scheduler's state is a bug upstream (InternalError)."""
        if output is not self._pending_output:
            raise InternalError("a step must be recorded once, after the latest schedule()")
        self._pending_output = None
        running = SequenceStatus.RUNNING
        mark_computed = self.block_manager.mark_computed
        for sched in output.groups:
            seqs = sched.seq_group.seqs_dict
            # A sequence aborted since it was scheduled is no longer RUNNING.
            for s in sched.seqs:
                seq = seqs.get(s.seq_id)
                if seq is not None and seq.status is running:
                    seq.num_computed_tokens += s.num_new_tokens
                    mark_computed(seq)
        if output.lane is not None:
            self._apply_lane(output.lane, lane)
        elif lane is not None:
            raise InternalError("a lane update for a step without a decode lane")
        for update in updates:
            group = self._requests.get(update.request_id)
            if group is None:
                raise InternalError(f"an update for {update.request_id!r}, not in the scheduler")
            self._apply_group(group, update)

    def _apply_lane(self, lane: DecodeLane, update: LaneUpdate | None) -> None:
        """The lane's rows computed their token; each takes its new one (the columns of
        ``update``). Blocks are published in the prefix cache as they become full."""
        running = SequenceStatus.RUNNING
        bs = self.cache_config.block_size
        caching = self.block_manager.enable_caching
        mark_computed = self.block_manager.mark_computed
        seqs = lane.seqs
        if update is None:
            for seq in seqs:
                if seq.status is running:
                    n = seq.num_computed_tokens = seq.num_computed_tokens + 1
                    if caching and not n % bs:
                        mark_computed(seq)
            return
        if len(update.token_ids) != len(seqs) or len(update.logprobs) != len(seqs):
            raise InternalError(f"a lane update of {len(update.token_ids)} tokens for "
                                f"{len(seqs)} rows")
        skip = update.skip
        for i, (seq, token, logprob) in enumerate(zip(seqs, update.token_ids,
                                                      update.logprobs)):
            if seq.status is running:  # else aborted since it was scheduled
                n = seq.num_computed_tokens = seq.num_computed_tokens + 1
                if caching and not n % bs:
                    mark_computed(seq)
                if skip and i in skip:
                    continue
                seq.output_token_ids.append(token)
                seq.cumulative_logprob += logprob
        for i, state in update.outputs.items():
            seq = seqs[i]
            if seq.status is running and i not in skip:
                seq.output = state
        for i, finish in update.finishes.items():
            seq = seqs[i]
            if seq.status is not running or i in skip:
                continue
            self._finish_seq(seq, finish)
            self._retire_if_finished(lane.groups[i])

    def _apply_group(self, group: SequenceGroup, update: GroupUpdate) -> None:
        if update.prompt_logprobs:
            if group.prompt_logprobs is None:
                group.prompt_logprobs = []
            group.prompt_logprobs.extend(update.prompt_logprobs)
        ups = update.seqs
        if len(ups) == 1 and type(ups[0]) is AppendToken:
            # A request's usual step, one sequence taking one token: no copies to order.
            u = ups[0]
            seq = group.seqs_dict.get(u.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                raise InternalError(f"no running seq {u.seq_id} in request {group.request_id!r}")
            self._take_token(seq, u)
            if u.finish is not None:
                self._retire_if_finished(group)
            return
        before = dict(group.seqs_dict)

        def running(seq_id: int) -> Sequence:
            seq = before.get(seq_id)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                raise InternalError(f"no running seq {seq_id} in request {group.request_id!r}")
            return seq

        extended: list[tuple[Sequence, SeqUpdate]] = []
        for u in update.seqs:  # copies first, of the parents as they stand
            if isinstance(u, ForkSeq):
                parent = running(u.parent_seq_id)
                child = parent.fork(u.seq_id)
                self.block_manager.fork(parent, child)
                group.add(child)
                extended.append((child, u))
            elif isinstance(u, NewHypothesis):
                hyp = running(u.parent_seq_id).fork(u.seq_id)
                group.add(hyp)  # holds no blocks: it only reports its tokens
                extended.append((hyp, u))
        for u in update.seqs:
            if isinstance(u, AppendToken):
                extended.append((running(u.seq_id), u))
        for seq, u in extended:
            self._take_token(seq, u)
        for u in update.seqs:
            if isinstance(u, DropSeq):
                seq = group.get_seq(u.seq_id)
                if seq is None or seq.seq_id not in before:
                    raise InternalError(f"no seq {u.seq_id} to drop in request {group.request_id!r}")
                if not seq.is_finished():
                    self.block_manager.free(seq)
                    seq.status = SequenceStatus.FINISHED_ABORTED
                group.remove(u.seq_id)
            elif not isinstance(u, (ForkSeq, NewHypothesis, AppendToken)):
                raise InternalError(f"unknown update {u!r}")
        self._retire_if_finished(group)

    def _take_token(self, seq: Sequence, u: AppendToken | ForkSeq | NewHypothesis) -> None:
        """``seq`` takes the update's token, output state and finish (a running sequence
        that finishes frees its blocks)."""
        seq.append_token_id(u.token_id, u.logprob)
        if u.output is not None:
            seq.output = u.output
        if u.finish is not None:
            self._finish_seq(seq, u.finish)

    def _finish_seq(self, seq: Sequence, finish: Finish) -> None:
        """``seq`` ends with ``finish`` (a running sequence frees its blocks)."""
        status, reason = finish
        if not SequenceStatus.is_finished(status):
            raise InternalError(f"status must be a finished status, got {status}")
        if seq.status == SequenceStatus.RUNNING:
            self.block_manager.free(seq)
        seq.status = status
        seq.stop_reason = reason

    def _retire_if_finished(self, group: SequenceGroup) -> bool:
        if not group.is_finished():
            return False
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        self._requests.pop(group.request_id, None)
        return True

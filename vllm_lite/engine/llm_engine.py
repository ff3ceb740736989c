"""LLMEngine: the step loop.

    add_request(...)   admitted (engine/admission.py: ValueError naming the field)
                       -> scheduler queue
    step():            scheduler.schedule()
                       -> executor: cache block ops, then forward + sampler (complete
                          per-row results: tokens, logprobs, beam candidates)
                       -> output processor: per request, the stop checks, new text and
                          logprobs, forks and beams -> a list of updates
                       -> scheduler.apply(updates): every sequence and block change
                       -> request_output(group) for each request that ran and wants
                          one now (every step, or only its last: output_kind)
Each request's state is its SequenceGroup in the scheduler: aborting it there forgets
everything the request held (its sequences, text, logprobs and random generator).
A request that breaks a step fails alone (see step()).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable
from collections.abc import Mapping, Sequence as Seq

import torch

from vllm_lite.core.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from vllm_lite.config.schema import EngineConfig
from vllm_lite.engine.admission import Admission
from vllm_lite.engine.output_processor import DeferredText, OutputProcessor
from vllm_lite.engine.stop_checker import StopChecker
from vllm_lite.outputs import RequestOutput, request_output, request_outputs
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams
from vllm_lite.sequence import SequenceGroup, SequenceStatus
from vllm_lite.errors import DistributedError
from vllm_lite.worker.executor import Executor, make_executor
from vllm_lite.worker.model_runner import RunnerOutput

logger = logging.getLogger(__name__)


_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def _output_due(group: SequenceGroup) -> bool:
    """Whether a request that ran gets its RequestOutput from this step: every step, or
    for FINAL_ONLY (LLM.generate) only once finished; nobody reads the others, so they
    are not built."""
    return group.sampling_params.output_kind is not _FINAL_ONLY or group.is_finished()


def _due(groups: list[SequenceGroup]) -> list[SequenceGroup]:
    """The groups of ``groups`` whose output is due (_output_due), in order."""
    return [g for g in groups if g.sampling_params.output_kind is not _FINAL_ONLY
            or g.is_finished()]


class EngineStepError(RuntimeError):
    """A step failed. ``request_ids``: the requests it aborted (the others are intact);
    ``outputs``: what the step still produced (requests it ignored as too long)."""

    def __init__(self, request_ids: list[str], cause: Exception,
                 outputs: list[RequestOutput] | None = None) -> None:
        super().__init__(f"engine step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = list(request_ids)
        self.cause = cause
        self.outputs = list(outputs or [])


@dataclass
class _Pending:
    """A step whose outputs the next step makes (async output processing): the requests
    that ran, their deferred text, and those aborted since (no output is due for them)."""

    groups: list[SequenceGroup]
    deferred: list[DeferredText]
    # The groups whose output is due (_output_due), as the step left them.
    due: list[SequenceGroup]
    aborted: set[str] = field(default_factory=set)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any = None,
                 model: torch.nn.Module | None = None) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = tokenizer
        self.executor: Executor = make_executor(config, model)
        try:
            num_gpu_blocks, num_cpu_blocks = self.executor.determine_num_blocks()
            self.cache_config = dataclasses.replace(
                config.cache_config, num_gpu_blocks=num_gpu_blocks,
                num_cpu_blocks=num_cpu_blocks)
            self.executor.init_cache(num_gpu_blocks, num_cpu_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(config.scheduler_config, self.cache_config)
        # Every request is checked here before it reaches the scheduler.
        self.admission = Admission(config, self.cache_config.block_size,
                                   self.scheduler.usable_device_blocks, tokenizer)
        # Requests _execute_isolated took out of the scheduler, until the step reports them.
        self._isolated: dict[str, SequenceGroup] = {}
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_id: int | None = tokenizer.eos_token_id
        else:
            self.eos_token_id = mc.eos_token_id
        self.output_processor = OutputProcessor(
            StopChecker(config.scheduler_config.max_model_len), tokenizer)
        self.async_output_proc = config.scheduler_config.async_output_proc
        # The last step's requests and deferred text, when async_output_proc: their
        # outputs are made during the next step's forward and returned by it.
        self._pending: _Pending | None = None
        self._forward_pool: ThreadPoolExecutor | None = None
        logger.info("engine: %d KV blocks of %d tokens on %s, %d CPU swap blocks",
                    num_gpu_blocks, self.cache_config.block_size, config.device, num_cpu_blocks)

    def shutdown(self) -> None:
        """Stops the executor's worker processes (tensor parallel; nothing otherwise). The
        engine cannot step afterwards."""
        if self._forward_pool is not None:
            self._forward_pool.shutdown(wait=True)
            self._forward_pool = None
        self.executor.shutdown()

    # The worker's parts, for callers that inspect them (tests, benchmarks).
    @property
    def model(self) -> torch.nn.Module:
        return self.executor.worker.model

    @property
    def dtype(self) -> torch.dtype:
        return self.executor.worker.dtype

    @property
    def runner(self) -> Any:
        return self.executor.worker.runner

    @property
    def cache_engine(self) -> Any:
        return self.executor.worker.cache_engine

    @property
    def _requests(self) -> Mapping[str, SequenceGroup]:
        return self.scheduler.requests

    # -- state, for outer layers (metrics, server, benchmarks) ---------------------------------
    def stats(self) -> SchedulerStats:
        """Queue lengths, KV pool usage, prefix-cache counters, preemptions."""
        return self.scheduler.stats()

    def kv_usage(self) -> tuple[int, int]:
        """(allocated, live) KV slots of the device pool (Scheduler.kv_slot_usage)."""
        return self.scheduler.kv_slot_usage()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block no request holds (benchmarks between runs)."""
        return self.scheduler.reset_prefix_cache()

    def num_prompt_tokens(self, request_id: str) -> int:
        """The prompt length of a request in the engine (0 if it is not)."""
        group = self.scheduler.get_seq_group(request_id)
        return len(group.prompt_token_ids) if group is not None else 0

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None = None,
                    sampling_params: SamplingParams | None = None,
                    prompt_token_ids: Seq[int] | None = None, priority: int = 0) -> None:
        """Queue a request: a text prompt (needs a tokenizer) or token ids, admitted by
        ``self.admission`` (ValueError naming the field; nothing changes)."""
        prompt, ids, params = self.admission.admit(prompt, prompt_token_ids, sampling_params,
                                                   priority)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        self.scheduler.add_request(request_id, ids, params, priority=priority,
                                   eos_token_id=self.eos_token_id, prompt=prompt)

    def abort_request(self, request_id: str | Seq[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        aborted = self.scheduler.abort_seq_group(ids)
        if self._pending is not None:
            self._pending.aborted.update(g.request_id for g in aborted)

    def has_unfinished_requests(self) -> bool:
        """Requests in the scheduler, or outputs of the last step still to return."""
        return self.scheduler.has_unfinished_seqs() or self._pending is not None

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    def unfinished_request_ids(self) -> list[str]:
        """Every request still in the engine (waiting, running or swapped out)."""
        return list(self.scheduler.requests)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> cache ops -> forward and sampling -> output processor.

        A request that breaks the step (a value that fails inside the shared sampler, a
        bug triggered by its state) fails alone: the step is re-run without it and every
        other request gets exactly the tokens it would have got. The step then raises
        EngineStepError naming the failed requests, carrying everyone's outputs.

        A request's RequestOutput comes after each step it ran in, or, with output_kind
        FINAL_ONLY, only after the step that finished it (or failed it).

        With async output processing (``async_output_proc``) a step returns the previous
        step's outputs: their text and RequestOutputs are made while this step's forward
        runs (on the forward thread). Every token, stop and block decision is still made
        in the step that sampled the token, so the tokens are those of the synchronous
        engine and no token is computed in vain; a request's outputs come one step later
        (a last call with nothing scheduled returns the final ones)."""
        out = self.scheduler.schedule()
        num_aborted = self.scheduler.num_aborted
        pending, self._pending = self._pending, None
        # The previous step's outputs (async), then requests that finished unserved.
        outputs: list[RequestOutput] = []
        ignored = [request_output(g) for g in out.ignored_seq_groups]
        lane = out.lane
        failed: dict[str, Exception] = {}
        try:
            self.executor.execute_cache_ops(out)
        except DistributedError:
            raise  # fatal: the executor has shut every rank down
        except Exception as e:
            outputs += self._finish_pending(pending, failed) + ignored
            # The swap pool's contents are unknown now: every swapped group fails too.
            self._fail_step(out.request_ids()
                            + [g.request_id for g in self.scheduler.swapped], e, outputs,
                            failed)
        try:
            if pending is None or not (out.groups or lane):
                outputs += self._finish_pending(pending, failed)
                result = self._execute_isolated(out, failed)
            else:
                # The previous step's text and outputs while this step's forward runs.
                snap = self.executor.snapshot_rng(out)
                forward = self._forward_thread().submit(self.executor.execute_model, out)
                try:
                    outputs += self._finish_pending(pending, failed)
                except BaseException:
                    wait([forward])  # no request may be failed while its forward runs
                    raise
                result = self._execute_isolated(out, failed, snap, forward.result)
        except DistributedError:
            raise
        except Exception as e:
            outputs += ignored
            self._fail_step([rid for rid in out.request_ids() if rid not in failed], e,
                            outputs, failed)
        outputs += ignored
        # The requests that ran and are still in the engine (not aborted meanwhile).
        ran = [s.seq_group for s in out.groups if not s.seq_group.is_finished()]
        lane_intact = self.scheduler.num_aborted == num_aborted
        if lane is not None and not lane_intact:
            running = SequenceStatus.RUNNING
            ran = [g for g, s in zip(lane.groups, lane.seqs) if s.status is running] + ran
        deferred: list[DeferredText] | None = [] if self.async_output_proc else None
        lane_update = None
        try:
            updates, lane_update = self.output_processor.process(out, result, failed, deferred)
            self.scheduler.apply(out, updates, lane_update)
        except Exception as e:
            # Bookkeeping failed outside any one request: nothing is known.
            self._fail_step([rid for rid in out.request_ids() if rid in self._requests],
                            e, outputs, failed)
        if lane is not None and lane_intact and not failed:
            # Every lane request is still in the engine: its output is due if it streams
            # or if its token finished it.
            finishes = lane_update.finishes if lane_update is not None else {}
            due = [g for i, g in enumerate(lane.groups)
                   if g.sampling_params.output_kind is not _FINAL_ONLY or i in finishes]
            due += _due(ran)
            ran = lane.groups + ran
        else:
            if lane is not None and lane_intact:
                ran = lane.groups + ran
            due = None
        if failed:
            text_failed: dict[str, Exception] = {}
            if deferred:
                text_failed = self._text_failures(
                    self.output_processor.finish_text(deferred), ran)
                failed.update(text_failed)
            outputs.extend(request_output(g) for g in ran
                           if (g.request_id not in failed or g.request_id in text_failed)
                           and _output_due(g))
            raise self._step_error(failed, outputs)
        if due is None:
            due = _due(ran)
        if deferred is None:
            outputs += request_outputs(due)
        elif ran:
            self._pending = _Pending(ran, deferred, due)
        return outputs

    def _finish_pending(self, pending: _Pending | None,
                        failed: dict[str, Exception]) -> list[RequestOutput]:
        """The outputs of a step whose text was deferred: its text, then a RequestOutput per
        request that ran, but none for a request aborted since (its output was never
        due: a stream ends at the abort). A request whose text failed is aborted (its
        blocks are only freed: safe while a forward runs), its output carries the error,
        and it joins ``failed`` (the step then raises EngineStepError naming it)."""
        if pending is None:
            return []
        text_failed = self._text_failures(self.output_processor.finish_text(pending.deferred),
                                          pending.groups)
        failed.update(text_failed)
        aborted = pending.aborted
        if not aborted and not text_failed:
            return request_outputs(pending.due)
        return [request_output(g) for g in pending.groups
                if (g.request_id not in aborted or g.request_id in text_failed)
                and _output_due(g)]

    def _text_failures(self, text_failed: dict[str, Exception],
                       groups: list[SequenceGroup] | None = None) -> dict[str, Exception]:
        """Aborts the requests whose text failed, each with its error (``groups``: where to
        find those that already left the scheduler)."""
        for group in groups or []:
            if group.request_id in text_failed:
                group.error = (f"the engine failed while making this request's text: "
                               f"{text_failed[group.request_id]!r}")
        for group in self.scheduler.abort_seq_group(list(text_failed)):
            group.error = (f"the engine failed while making this request's text: "
                           f"{text_failed[group.request_id]!r}")
        return text_failed

    def _forward_thread(self) -> ThreadPoolExecutor:
        if self._forward_pool is None:
            self._forward_pool = ThreadPoolExecutor(
                1, thread_name_prefix="vllm-lite-forward", initializer=self._init_forward_thread)
        return self._forward_pool

    def _init_forward_thread(self) -> None:
        device = torch.device(self.config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread

    def _step_error(self, failed: dict[str, Exception],
                    outputs: list[RequestOutput]) -> EngineStepError:
        """Aborts the failed requests and adds a finished, error-carrying output for each."""
        for rid, cause in failed.items():
            # Requests that broke the forward left the scheduler already (_execute_isolated).
            group = self.scheduler.get_seq_group(rid) or self._isolated.pop(rid, None)
            if group is None:
                continue
            self.scheduler.abort_seq_group(rid)
            group.error = f"the engine failed while running this request: {cause!r}"
            outputs.append(request_output(group))
        self._isolated.clear()
        cause = next(iter(failed.values()))
        return EngineStepError(list(failed), cause, outputs)

    def _fail_step(self, request_ids: list[str], cause: Exception,
                   outputs: list[RequestOutput],
                   failed: dict[str, Exception] | None = None) -> None:
        """A failed step leaves its requests in an unknown state: abort them (their blocks
        are free at once) and tell the caller which ones; the engine serves on."""
        failed = dict(failed or {})
        for rid in request_ids:
            failed.setdefault(rid, cause)
        raise self._step_error(failed, outputs) from cause

    # Re-runs allowed while looking for the requests that broke a step: a bisection finds
    # one culprit among n requests in about 2 log2(n) runs; past this many the remaining
    # suspects all fail (a step that breaks for everybody is not worth more forwards).
    _MAX_ISOLATION_RUNS = 32

    def _execute_isolated(self, out: SchedulerOutput, failed: dict[str, Exception],
                          snap: Any = None,
                          first: Callable[[], RunnerOutput] | None = None) -> RunnerOutput:
        """The step's forward and sampling. If it raises, re-run halves of the batch
        (random states restored each time, the KV writes are the same values again) to
        find the requests that make it fail, record them in ``failed`` (request_id ->
        exception) and run the others once more: their results are exactly those of a
        step without the failed requests. ``first``: the first run's result, awaited (a
        run already started, its random states ``snap`` before it)."""
        if first is None:
            snap = self.executor.snapshot_rng(out)
        try:
            return self.executor.execute_model(out) if first is None else first()
        except DistributedError:
            raise  # not a request's fault: nothing to bisect
        except Exception as e:
            groups = out.request_ids()
            if len(groups) <= 1:
                raise
            logger.warning("step %d failed (%r); looking for the request that broke it",
                           out.step, e)
            budget = [self._MAX_ISOLATION_RUNS]
            culprits: dict[str, Exception] = {}
            self._bisect(out, groups, snap, culprits, budget, e)
            if not culprits or len(culprits) == len(groups):
                raise
        failed.update(culprits)
        for group in self.scheduler.abort_seq_group(list(culprits)):
            # Out of the scheduler now (their KV was not written by the re-run): the
            # scheduler's apply skips them; _step_error reports them.
            self._isolated[group.request_id] = group
        logger.error("step %d: request(s) %s failed alone; the others go on", out.step,
                     ", ".join(culprits))
        self.executor.restore_rng(snap)
        rest = out.only({rid for rid in groups if rid not in culprits})
        return self.executor.execute_model(rest)

    def _bisect(self, out: SchedulerOutput, groups: list[str], snap: Any,
                culprits: dict[str, Exception], budget: list[int], cause: Exception) -> None:
        """Adds to ``culprits`` the requests of ``groups`` (ids of a failing set) that fail
        alone."""
        if len(groups) == 1:
            culprits[groups[0]] = cause
            return
        half = len(groups) // 2
        for part in (groups[:half], groups[half:]):
            if budget[0] <= 0:
                for rid in part:  # out of re-runs: every remaining suspect fails
                    culprits.setdefault(rid, cause)
                continue
            budget[0] -= 1
            self.executor.restore_rng(snap)
            try:
                self.executor.execute_model(out.only(set(part)))
            except DistributedError:
                raise
            except Exception as e:  # noqa: BLE001  (narrowing down which request broke it)
                self._bisect(out, part, snap, culprits, budget, e)

"""Orderings the scheduler uses: which waiting request is admitted first, which running
one is preempted first. Keys sort ascending; smaller runs sooner."""

from __future__ import annotations

import operator
from collections.abc import Callable

from vllm_lite.sequence import SequenceGroup

SortKey = tuple[float, ...]
WaitingKey = Callable[[SequenceGroup, int], SortKey]


def _arrival(group: SequenceGroup) -> SortKey:
    return (group.arrival_time, group.arrival_index)


def _fcfs(group: SequenceGroup, max_model_len: int) -> SortKey:
    return _arrival(group)


def _priority(group: SequenceGroup, max_model_len: int) -> SortKey:
    return (group.priority, *_arrival(group))


def _shortest_first(group: SequenceGroup, max_model_len: int) -> SortKey:
    # The work a request may cost: its prompt plus everything it may generate.
    max_tokens = group.sampling_params.max_tokens
    prompt_len = len(group.prompt_token_ids)
    total = min(prompt_len + max_tokens, max_model_len) if max_tokens is not None else max_model_len
    return (total, *_arrival(group))


_WAITING_KEYS: dict[str, WaitingKey] = {
    "fcfs": _fcfs,
    "priority": _priority,
    "shortest_first": _shortest_first,
}


def waiting_key(policy: str, group: SequenceGroup, max_model_len: int, max_wait_steps: int) -> SortKey:
    """Admission order: aged requests first (in arrival order), then the policy's order.

    The aging bound is what keeps a long request under shortest_first, or a low-priority
    one under priority, from waiting for ever behind a stream of favoured arrivals.
    """
    if group.waiting_steps >= max_wait_steps:
        return (0, *_arrival(group))
    return (1, *_WAITING_KEYS[policy](group, max_model_len))


# Service order of admitted groups; the last one is the first preemption victim: the
# lowest priority (largest value), and among equals the newest. _priority's key, read
# by one C-level getter: it is computed for every running group on every step.
running_key: Callable[[SequenceGroup], SortKey] = operator.attrgetter(
    "priority", "arrival_time", "arrival_index")

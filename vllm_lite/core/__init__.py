"""Engine core: KV block management and the continuous-batching scheduler (pure Python)."""

from vllm_lite.core.block_manager import AllocStatus, BlockSpaceManager
from vllm_lite.core.scheduler import (
    ScheduledSequence,
    ScheduledSequenceGroup,
    Scheduler,
    SchedulerOutput,
)

__all__ = [
    "AllocStatus",
    "BlockSpaceManager",
    "ScheduledSequence",
    "ScheduledSequenceGroup",
    "Scheduler",
    "SchedulerOutput",
]

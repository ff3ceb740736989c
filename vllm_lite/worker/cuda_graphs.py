"""CUDA graphs for decode steps: the decoder's forward captured once per batch-size bucket
and replayed, so a decode step costs one graph launch instead of one launch per op.

- :func:`capture_sizes`: the buckets (1, 2, 4, 8, then steps of 8), from max_num_seqs;
- :class:`DecodeGraphInputs`: the static input tensors a graph reads, filled in place each
  step; a batch is padded to its bucket with rows that write no cache slot (slot -1),
  attend over one token of block 0 and are never read back;
- :class:`DecodeGraphs`: captures every bucket (one shared memory pool, largest first) and
  replays the one a step fits.

The attention inside a graph is launched with max_model_len as its length bound: the grid
covers every partition any sequence can reach and the kernels stop at each sequence's own
length (read from the device), so no launch argument depends on the step. Prefill and mixed
steps, and decode batches larger than the largest bucket, run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence as Seq

import torch
from torch import nn

from vllm_lite.layers.attention import AttentionMetadata, attention_metadata

logger = logging.getLogger(__name__)

# The largest bucket: batches above it gain little from a graph (the kernels dominate) and
# each bucket's capture costs startup time.
MAX_CAPTURE_SIZE = 256
# A padded row's length: one token, so every kernel reads a real (if unrelated) slot.
PAD_SEQ_LEN = 1
PAD_SLOT = -1
ENFORCE_EAGER_HINT = ("start the engine with --enforce-eager (EngineArgs.enforce_eager=True) "
                      "to run every step without CUDA graphs")


class GraphCaptureError(RuntimeError):
    """Capturing the decode graphs failed at startup (out of memory, an op that cannot be
    captured); the message names --enforce-eager."""


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then multiples of 8, up to the first one that
    holds min(max_num_seqs, cap) sequences."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    limit = min(max_num_seqs, cap)
    sizes: list[int] = []
    for size in (1, 2, 4):
        sizes.append(size)
        if size >= limit:
            return sizes
    size = 8
    while True:
        sizes.append(size)
        if size >= limit:
            return sizes
        size += 8


def bucket_for(num_seqs: int, sizes: Seq[int]) -> int | None:
    """The smallest captured size holding num_seqs sequences (None: run eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphInputs:
    """The static tensors the captured graphs read, for up to ``max_batch`` sequences of
    up to ``max_blocks`` KV blocks each, on ``device``."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        dev = torch.device(device)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((max_batch,), PAD_SLOT, dtype=torch.long, device=dev)
        self.seq_lens = torch.full((max_batch,), PAD_SEQ_LEN, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=dev)

    def metadata(self, batch: int, block_size: int, max_seq_len: int) -> AttentionMetadata:
        """The decode metadata of the first ``batch`` rows, bounded by max_seq_len (the
        model's, not the step's: a captured launch holds it)."""
        return AttentionMetadata(
            is_prompt=False,
            slot_mapping=self.slot_mapping[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[:batch + 1],
            block_tables=self.block_tables[:batch],
            max_seq_len=max_seq_len,
            block_size=block_size,
            max_query_len=1,
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             batch: int) -> None:
        """Writes one decode step (n = len(input_ids) <= batch sequences) into the first
        rows and pads rows n..batch: slot -1 (no cache write), length 1, block 0."""
        n = int(input_ids.shape[0])
        if n > batch or batch > self.max_batch:
            raise ValueError(f"{n} sequences do not fit a bucket of {batch} "
                             f"(at most {self.max_batch})")
        tables = meta.block_tables
        width = int(tables.shape[1])
        if width > self.max_blocks:
            raise ValueError(f"block tables of {width} blocks exceed the graphs' "
                             f"{self.max_blocks} (max_model_len)")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(tables, non_blocking=True)
        if n < batch:
            self.input_ids[n:batch].zero_()
            self.positions[n:batch].zero_()
            self.slot_mapping[n:batch].fill_(PAD_SLOT)
            self.seq_lens[n:batch].fill_(PAD_SEQ_LEN)
            self.block_tables[n:batch].zero_()


class DecodeGraphs:
    """One captured decoder forward per bucket of ``sizes``, sharing one memory pool."""

    def __init__(self, model: nn.Module, sizes: Seq[int], block_size: int,
                 max_model_len: int, device: torch.device) -> None:
        if not sizes:
            raise ValueError("no capture sizes")
        self.model = model
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        max_blocks = -(-max_model_len // block_size)
        self.inputs = DecodeGraphInputs(self.sizes[-1], max_blocks, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool_bytes = 0

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first (the smaller ones reuse its pool's memory).
        Any failure is a GraphCaptureError naming --enforce-eager."""
        if self.device.type != "cuda":
            raise GraphCaptureError(f"CUDA graphs need a CUDA device, got {self.device}")
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        try:
            for batch in reversed(self.sizes):
                meta = self.inputs.metadata(batch, self.block_size, self.max_model_len)
                ids = self.inputs.input_ids[:batch]
                pos = self.inputs.positions[:batch]
                with attention_metadata(meta):
                    # Once eagerly first: lazy initialisation (workspaces, autotuning) must
                    # not happen inside the capture.
                    self.model(ids, pos)
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self.model(ids, pos)
                self.graphs[batch] = graph
                self.outputs[batch] = out
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001  (any failure stops the start, with the way out)
            self.graphs.clear()
            self.outputs.clear()
            raise GraphCaptureError(
                f"capturing the decode CUDA graphs (batch sizes {self.sizes[0]}.."
                f"{self.sizes[-1]}) failed: {e!r}; {ENFORCE_EAGER_HINT}") from e
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("CUDA graphs: %d decode batch sizes captured (%s..%s), %.1f MiB",
                    len(self.sizes), self.sizes[0], self.sizes[-1], self.pool_bytes / 2**20)

    def bucket(self, num_seqs: int) -> int | None:
        return bucket_for(num_seqs, self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The decoder's hidden states [n, hidden] of a decode step of n sequences, by
        replaying its bucket's graph (the caller checked bucket(n) is not None)."""
        n = int(input_ids.shape[0])
        batch = self.bucket(n)
        if batch is None:
            raise ValueError(f"no graph holds {n} sequences (largest {self.sizes[-1]})")
        self.inputs.fill(input_ids, positions, meta, batch)
        self.graphs[batch].replay()
        return self.outputs[batch][:n]


def activation_reserve_bytes(model: nn.Module, max_batch: int, block_size: int,
                             device: torch.device) -> int:
    """Memory to keep for the graphs' pool, measured before the KV cache is sized: twice
    the activation peak of an eager forward of ``max_batch`` one-token sequences (the
    captured decode forward of the largest bucket holds about as much, for good)."""
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    dev = torch.device(device)
    meta = AttentionMetadata(
        is_prompt=True,
        slot_mapping=torch.full((max_batch,), PAD_SLOT, dtype=torch.long, device=dev),
        seq_lens=torch.ones(max_batch, dtype=torch.int32, device=dev),
        query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=dev),
        block_tables=torch.zeros((max_batch, 1), dtype=torch.int32, device=dev),
        max_seq_len=1, block_size=block_size, max_query_len=1)
    saved = [(a.k_cache, a.v_cache) for a in model.attention_layers()]
    for a in model.attention_layers():
        a.k_cache = a.v_cache = None
    try:
        with torch.inference_mode(), attention_metadata(meta):
            model(torch.zeros(max_batch, dtype=torch.long, device=dev),
                  torch.zeros(max_batch, dtype=torch.long, device=dev))
        torch.cuda.synchronize(dev)
    finally:
        for a, (k, v) in zip(model.attention_layers(), saved):
            a.k_cache, a.v_cache = k, v
    return 2 * max(0, torch.cuda.max_memory_allocated(device) - base)

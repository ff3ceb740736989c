"""What the driver (rank 0) tells the other tensor-parallel ranks, as flat int64 tensors.

Each message is a fixed-size header on the group's control channel (the command and a few
sizes; workers wait on it between steps without a timeout) and, when it has one, a payload
on the cpu channel: one int64 tensor holding every array of the message back to back, so
a step costs two broadcasts however many sequences it has.

``EXECUTE``: header (T tokens, S sequences, B block-table columns, L logit rows,
is_prompt, max_seq_len, max_query_len); payload input_ids [T], positions [T],
slot_mapping [T], seq_lens [S], query_start_loc [S + 1], block_tables [S * B],
logits_index [L]. The workers rebuild the AttentionMetadata, run the forward (its
all-reduces pair with the driver's) and the LM head on the same L rows (its vocabulary
gather pairs with the driver's); only the driver samples.
``CACHE_OPS``: header (swap-out, swap-in, copy pair counts); payload the pairs.
``NUM_BLOCKS``: no payload; every rank then joins a min-reduction of its block counts.
``INIT_CACHE``: header (device blocks, CPU blocks). ``SHUTDOWN``: the workers exit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from vllm_lite.core.scheduler import SchedulerOutput
from vllm_lite.distributed.group import TensorParallelGroup
from vllm_lite.errors import InternalError
from vllm_lite.layers.attention import AttentionMetadata

# Header ints: the command, the payload's length, then the command's own fields.
HEADER_LEN = 10


class Command(enum.IntEnum):
    EXECUTE = 1
    CACHE_OPS = 2
    NUM_BLOCKS = 3
    INIT_CACHE = 4
    SHUTDOWN = 5


@dataclass
class Message:
    command: Command
    fields: list[int]
    payload: torch.Tensor


def send(tp: TensorParallelGroup, command: Command, fields: list[int],
         payload: torch.Tensor | None = None, timeout_s: float | None = None) -> None:
    """Driver side: the header (waiting at most ``timeout_s`` for the ranks to take it; None:
    as long as they take), then the payload (if any) to every rank."""
    n = 0 if payload is None else int(payload.numel())
    tp.broadcast_header([int(command), n, *fields], HEADER_LEN, timeout_s)
    if n:
        tp.broadcast_cpu(payload.to(device="cpu", dtype=torch.int64).contiguous())


def receive(tp: TensorParallelGroup) -> Message:
    """Worker side: waits for the driver's next message."""
    header = tp.broadcast_header(None, HEADER_LEN)
    try:
        command = Command(header[0])
    except ValueError:
        raise InternalError(f"unknown tensor-parallel command {header[0]}") from None
    payload = torch.empty(header[1], dtype=torch.int64)
    if header[1]:
        tp.broadcast_cpu(payload)
    return Message(command, header[2:], payload)


# -- EXECUTE -----------------------------------------------------------------------------------
def send_step(tp: TensorParallelGroup, input_ids: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata, logits_index: torch.Tensor) -> None:
    parts = [input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.query_start_loc,
             meta.block_tables.reshape(-1), logits_index]
    payload = torch.cat([p.reshape(-1).to(device="cpu", dtype=torch.int64) for p in parts])
    send(tp, Command.EXECUTE,
         [int(input_ids.numel()), meta.num_seqs, int(meta.block_tables.shape[1]),
          int(logits_index.numel()), int(meta.is_prompt), meta.max_seq_len,
          meta.max_query_len], payload)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor


def unpack_step(msg: Message, block_size: int, device: torch.device) -> StepInputs:
    t, s, b, n_logits, is_prompt, max_seq_len, max_query_len = msg.fields[:7]
    sizes = [t, t, t, s, s + 1, s * b, n_logits]
    if sum(sizes) != msg.payload.numel():
        raise InternalError(f"step payload of {msg.payload.numel()} ints; expected {sum(sizes)}")
    ids, pos, slots, seq_lens, qsl, tables, index = msg.payload.split(sizes)

    def dev(x: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return x.to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        is_prompt=bool(is_prompt), slot_mapping=dev(slots),
        seq_lens=dev(seq_lens, torch.int32), query_start_loc=dev(qsl, torch.int32),
        block_tables=dev(tables.reshape(s, b), torch.int32), max_seq_len=max_seq_len,
        block_size=block_size, max_query_len=max_query_len)
    return StepInputs(dev(ids), dev(pos), meta, dev(index))


# -- CACHE_OPS ---------------------------------------------------------------------------------
def send_cache_ops(tp: TensorParallelGroup, out: SchedulerOutput) -> None:
    groups = (out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy)
    flat = [int(x) for pairs in groups for pair in pairs for x in pair]
    send(tp, Command.CACHE_OPS, [len(list(g)) for g in groups],
         torch.tensor(flat, dtype=torch.int64) if flat else None)


def unpack_cache_ops(msg: Message) -> tuple[list[tuple[int, int]], ...]:
    counts = msg.fields[:3]
    pairs = msg.payload.reshape(-1, 2).tolist()
    if len(pairs) != sum(counts):
        raise InternalError(f"cache-op payload of {len(pairs)} pairs; expected {sum(counts)}")
    out, rest = pairs[:counts[0]], pairs[counts[0]:]
    swap_in, copies = rest[:counts[1]], rest[counts[1]:]
    return ([tuple(p) for p in out], [tuple(p) for p in swap_in], [tuple(p) for p in copies])

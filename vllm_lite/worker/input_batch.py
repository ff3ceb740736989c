"""The model runner's state between steps, so a step's inputs cost the same at any context:

- :class:`BlockTableRows`: one persistent row of block ids per running sequence, written
  only where the scheduler's table changed (a block appended, a copy-on-write, a swap-in),
  told apart by the table list's identity and length (the block manager's lists only
  grow in place), gathered into the step's batch table by one indexed copy;
- :class:`StepStaging`: one host buffer (pinned on a GPU) holding every integer input of
  a step, copied to the device in one transfer; on the CPU the step's tensors are views of
  it. Two buffers alternate, so a step's inputs stay intact while the next is filled.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


class BlockTableRows:
    """Block-table rows kept across steps, keyed by sequence id."""

    def __init__(self, capacity: int = 64, max_blocks: int = 64) -> None:
        self.rows = np.zeros((capacity, max_blocks), dtype=np.int32)
        # seq_id -> [row, the table list last written (held: its identity stays unique),
        # how many of its ids the row holds]
        self._seqs: dict[int, list] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._seen: set[int] = set()

    def row_of(self, seq_id: int, table: list[int]) -> int:
        """The row holding ``table`` for ``seq_id`` (updated in place where it changed).

        The same list object as last time is taken to have changed only by growing in
        place (only its new tail is written); another list is written whole. Callers
        hand over a list changed otherwise as a new list (the block manager's tables
        are kept so; the scheduler copies the others)."""
        self._seen.add(seq_id)
        entry = self._seqs.get(seq_id)
        n = len(table)
        if entry is not None:
            row, old, n_old = entry
            if old is table:
                if n > n_old:  # grown in place: the new tail only
                    if n > self.rows.shape[1]:
                        self._widen(n)
                    self.rows[row, n_old:n] = table[n_old:]
                    entry[2] = n
                elif n < n_old:
                    self._write(row, table)
                    entry[2] = n
                return row
            if n > self.rows.shape[1]:
                self._widen(n)
            self._write(row, table)
            entry[1], entry[2] = table, n
            return row
        if n > self.rows.shape[1]:
            self._widen(n)
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._write(row, table)
        self._seqs[seq_id] = [row, table, n]
        return row

    def rows_for(self, seq_ids: list[int], tables: list[list[int]]) -> list[int]:
        """row_of for each (seq_id, table) pair, in one pass: a row whose table is the
        same list at the same length as last time costs one lookup."""
        self._seen.update(seq_ids)
        get = self._seqs.get
        out = []
        for seq_id, table in zip(seq_ids, tables):
            entry = get(seq_id)
            if entry is not None and entry[1] is table and entry[2] == len(table):
                out.append(entry[0])
            else:
                out.append(self.row_of(seq_id, table))
        return out

    def end_step(self) -> None:
        """Release the rows of sequences this step did not run (finished, preempted, or
        waiting; one that comes back is written afresh)."""
        if len(self._seen) != len(self._seqs):
            for seq_id in [s for s in self._seqs if s not in self._seen]:
                self._free.append(self._seqs.pop(seq_id)[0])
        self._seen = set()

    def gather(self, rows: Iterable[int] | np.ndarray, max_blocks: int, out: np.ndarray) -> None:
        """Writes the first ``max_blocks`` ids of each row, in order, to ``out``."""
        np.take(self.rows[:, :max_blocks], np.asarray(rows, dtype=np.intp), axis=0, out=out)

    def _write(self, row: int, table: list[int]) -> None:
        n = len(table)
        self.rows[row, :n] = table
        self.rows[row, n:] = 0

    def _widen(self, needed: int) -> None:
        width = max(needed, 2 * self.rows.shape[1])
        rows = np.zeros((self.rows.shape[0], width), dtype=np.int32)
        rows[:, :self.rows.shape[1]] = self.rows
        self.rows = rows

    def _grow(self) -> None:
        old = self.rows.shape[0]
        rows = np.zeros((2 * old, self.rows.shape[1]), dtype=np.int32)
        rows[:old] = self.rows
        self.rows = rows
        self._free.extend(range(2 * old - 1, old - 1, -1))


class StepStaging:
    """One step's integer inputs in one host buffer: ``n64`` int64 values then ``n32``
    int32 values (the int32 part reinterprets the int64 buffer's tail), one copy to the
    device."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._host: list[torch.Tensor | None] = [None, None]
        self._dev: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._n64 = self._n32 = self._total = 0

    def start(self, n64: int, n32: int) -> tuple[np.ndarray, np.ndarray]:
        """Host views (int64 [n64], int32 [n32]) of this step's buffer, to fill."""
        total = n64 + (n32 + 1) // 2
        buf = self._host[self._turn]
        if buf is None or buf.numel() < total:
            size = max(total, 2 * buf.numel() if buf is not None else 1024)
            buf = torch.empty(size, dtype=torch.int64, pin_memory=self._pin)
            self._host[self._turn] = buf
        self._n64, self._n32, self._total = n64, n32, total
        host = buf.numpy()
        return host[:n64], host[n64:total].view(np.int32)[:n32]

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The filled buffer on the device (one non-blocking copy from pinned memory; the
        host buffer itself on the CPU) as (int64 [n64], int32 [n32]) tensors."""
        turn = self._turn
        self._turn ^= 1
        host = self._host[turn]
        assert host is not None, "start() first"
        host = host[:self._total]
        if self.device.type == "cpu":
            dev = host
        else:
            buf = self._dev[turn]
            if buf is None or buf.numel() < self._total:
                buf = torch.empty(self._host[turn].numel(), dtype=torch.int64, device=self.device)
                self._dev[turn] = buf
            dev = buf[:self._total]
            dev.copy_(host, non_blocking=True)
        return dev[:self._n64], dev[self._n64:].view(torch.int32)[:self._n32]

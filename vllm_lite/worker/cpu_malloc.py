"""Memory settings for an engine on the CPU: glibc keeps freed memory for reuse, and the
big, randomly read tensors (the KV pool) ask for transparent huge pages.

A CPU step allocates and frees tensors of megabytes every time (the logits, their
log_softmax and the sampler's temporaries, 6 MiB each at 31 x 49152 float32; a prefill's
activations). glibc's defaults give such blocks back to the kernel as soon as a few are
free together (a block over the mmap threshold is unmapped when freed; a free top of the
heap over the trim threshold is trimmed), so the next step takes a page fault for every
4 KiB it touches again. Measured on the sampler at 31 x 49152: 6.0 -> 1.3 ms per greedy
step. This is what vLLM's CPU backend gets by preloading tcmalloc; here two mallopt calls
at engine start do it, in every process that runs a CPU worker:

- M_MMAP_THRESHOLD 32 MiB (glibc's largest): blocks below it come from the heap, so a
  freed one is reused; the KV pool and weights, far larger, stay mmapped.
- M_TRIM_THRESHOLD 512 MiB: up to that much free memory stays at the top of the heap
  instead of being returned and faulted in again.

A user's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (glibc's environment
settings) win: then nothing is changed. Not glibc (musl, macOS): nothing to do.

Huge pages (:func:`advise_huge_pages`): a decode step reads every sequence's KV blocks,
2 KiB tiles scattered over a pool of a GiB or more, so with 4 KiB pages nearly every tile
costs a TLB miss and a page walk before its data arrives. Linux backs memory with 2 MiB
pages when the system's transparent_hugepage setting is "always", or is "madvise" (the
default of Debian and Ubuntu) and the program asks with madvise(MADV_HUGEPAGE); the engine
asks for its CPU KV pool, allocated on a 2 MiB boundary (:func:`empty_huge_pages`) so that
its first blocks are huge-page backed too. Measured on the project's AMD EPYC VM (bf16 9/3x64, 32
sequences, 1 GiB pool, shuffled blocks, 2 threads): the paged-attention kernel took
0.31 / 0.37 / 1.61 ms instead of 0.39 / 0.45 / 1.80 at 128 / 176 / 1024 tokens. A first
touch also faults in 2 MiB at once instead of 512 faults. "never" (or not Linux): nothing
happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

import torch

logger = logging.getLogger(__name__)

# mallopt parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 512 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_applied = False

_MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE_BYTES = 2 << 20


def keep_freed_memory() -> bool:
    """Applies the two settings once per process; True when they are in effect."""
    global _applied
    if _applied:
        return True
    user = [name for name in USER_SETTINGS if name in os.environ]
    if user:
        logger.info("CPU allocator: keeping the user's %s", ", ".join(user))
        return False
    libc = _glibc()
    if libc is None:
        return False
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not ok:
        logger.warning("CPU allocator: mallopt refused the thresholds; freed memory is "
                       "returned to the kernel (slower steps)")
        return False
    _applied = True
    logger.debug("CPU allocator: freed blocks under %d MiB are reused, up to %d MiB kept",
                MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
    return True


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (mallopt's thresholds are glibc's)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def advise_huge_pages(t: torch.Tensor) -> int:
    """Asks Linux to back the whole 2 MiB pages inside CPU tensor ``t``'s memory with huge
    pages (madvise MADV_HUGEPAGE); call it before the memory is first touched (a fresh
    ``torch.empty``), as pages already faulted in stay small. Returns the bytes advised: 0
    off Linux, for a tensor that holds no whole huge page, or when the kernel refuses
    (which changes nothing but speed)."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = (start + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    length = (end - first) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if length <= 0:
        return 0
    libc = _libc()
    if libc is None or libc.madvise(first, length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
        return 0
    return length


def empty_huge_pages(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor that starts on a 2 MiB boundary, its memory
    (rounded up to whole 2 MiB pages) advised for huge pages (:func:`advise_huge_pages`),
    so every byte of it can be huge-page backed. A plain ``torch.empty`` starts wherever
    malloc puts it, and the part before its first 2 MiB boundary (up to 2 MiB) stays in
    small pages: for a KV pool, that is where the first blocks handed out live (the default
    model's 17.6 MiB layer pools had their first 0.1-2 MiB there). Costs up to 4 MiB of
    address space per call, never touched unless used. Off Linux, or with THP refused, the
    same tensor without the advice."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return _huge_page_buffer(nbytes)[0].view(dtype).view(shape)


def _huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, int]:
    """(``nbytes`` uint8 starting on a 2 MiB boundary, the bytes advised for huge pages)."""
    span = (nbytes + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    buf = torch.empty(span + HUGE_PAGE_BYTES, dtype=torch.uint8)
    offset = -buf.data_ptr() % HUGE_PAGE_BYTES
    advised = advise_huge_pages(buf[offset:offset + span])
    return buf[offset:offset + nbytes], advised


def copy_to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU ``tensors`` in one fresh buffer in huge pages
    (:func:`empty_huge_pages`), each starting on a 4 KiB boundary, in order; the tensors
    themselves where no huge page could be advised (small, not Linux, THP refused).

    For the packed projection weights of a CPU model (the worker passes it to
    LlamaForCausalLM.relocate_packed_weights): a decode step streams all of them from
    memory, and with 4 KiB pages every 64 cache lines cost a TLB miss."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return list(tensors)
    page = 4096
    spans = [(t.numel() * t.element_size() + page - 1) // page * page for t in tensors]
    if sum(spans) < HUGE_PAGE_BYTES:
        return list(tensors)
    arena, advised = _huge_page_buffer(sum(spans))
    if advised == 0:
        return list(tensors)
    offset = 0
    out = []
    for t, span in zip(tensors, spans):
        nbytes = t.numel() * t.element_size()
        view = arena[offset:offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += span
    return out


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The C library the process runs on (any libc: madvise), loaded once."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return libc

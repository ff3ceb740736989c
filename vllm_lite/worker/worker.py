"""A Worker owns one device's share of the engine: the model, its KV cache (sized here),
the model runner and the sampler's random states.

One step on a worker: the scheduler's block operations on its caches (``execute_cache_ops``)
then the forward and sampling (``execute_model``). Without tensor parallelism one worker
runs in the engine's process. With it, each rank holds one over its shard of the model and
of every KV block: rank 0's lives in the engine's process (the driver: it samples and
broadcasts each step's inputs), the others run :meth:`Worker.serve` in their own processes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from vllm_lite.core.scheduler import SchedulerOutput
from vllm_lite.distributed.group import TensorParallelGroup
from vllm_lite.layers.sampler import RngSnapshot, Sampler
from vllm_lite.worker.cache_engine import (
    CacheEngine, cache_block_bytes, num_blocks_for_cpu, profile_num_gpu_blocks)
from vllm_lite.worker.cpu_malloc import copy_to_huge_pages, keep_freed_memory
from vllm_lite.worker.cuda_graphs import (
    ENFORCE_EAGER_HINT, DecodeGraphs, GraphCaptureError, activation_reserve_bytes,
    capture_sizes)
from vllm_lite.worker import step_broadcast
from vllm_lite.worker.model_runner import ModelInput, ModelRunner, RunnerOutput
from vllm_lite.worker.step_broadcast import Command

if TYPE_CHECKING:
    from vllm_lite.config.schema import EngineConfig

logger = logging.getLogger(__name__)


def gguf_head_tensor(model: torch.nn.Module, device: Any, dtype: torch.dtype,
                     tp: TensorParallelGroup | None) -> str | None:
    """The GGUF tensor whose own blocks the LM head keeps with quantization="gguf"
    (``token_embd.weight`` for a head tied to the embedding, else ``output.weight``), or None
    where the head stays dense in ``dtype``. Kept: float32 on the CPU with one rank, where
    the CPU build runs packed quantized weights (AVX2 and wider): the head then streams a
    quarter of its float32 bytes a decode step (the embedding keeps its dequantized rows
    for the lookup). A bf16 head is already half those bytes and its kernel outran the int8
    one on bf16 activations; the generic build's int8 kernel ran a batch's head (16-32
    rows) well behind the dense GEMM; with tensor parallelism each rank holds its
    vocabulary rows of the dense head (measured: docs/results/llama_cpp.md)."""
    from vllm_lite import ops

    tied = getattr(model, "tie_word_embeddings", None)
    if (torch.device(device).type != "cpu" or tp is not None or dtype != torch.float32
            or tied is None or not ops.packed_quant_linear_kernel_selected()):
        return None
    return "token_embd.weight" if tied else "output.weight"


class Worker:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None,
                 tp: TensorParallelGroup | None = None) -> None:
        from vllm_lite.models.loader import load_model

        self.config = config
        self.tp = tp
        mc = config.model_config
        if isinstance(config.cpu_threads_bind, list):
            from vllm_lite import ops

            # Before the model loads, so every parallel region after runs on the bound threads.
            bound = ops.init_cpu_threads_env(",".join(map(str, config.cpu_threads_bind)))
            logger.info("cpu_threads_bind: %s", bound.replace("\n", ", "))
        self.device = tp.device if tp is not None else config.device
        if torch.device(self.device).type == "cpu":
            keep_freed_memory()
        torch.manual_seed(mc.seed)
        if model is None:
            model, _ = load_model(mc.model, mc.dtype, self.device, mc.max_model_len, tp=tp,
                                  hf_config=mc.hf_config)
        if mc.quantization is not None:
            from vllm_lite.layers.quantization import quantize_model

            # The head stays in the activation dtype (its logits feed the sampler; a tied
            # head is the embedding), but for a GGUF where gguf_head_tensor says.
            kept_weights = None
            skip: tuple[torch.nn.Module, ...] = (model.lm_head,)
            if mc.quantization == "gguf":
                from vllm_lite.models.gguf_quant import LM_HEAD, read_llama_projections

                head = gguf_head_tensor(model, self.device, mc.dtype, tp)
                kept_weights = read_llama_projections(mc.gguf_file, mc.hf_config, lm_head=head)
                if LM_HEAD in kept_weights:
                    skip = ()
            elif mc.quantization in ("gptq", "awq"):
                from vllm_lite.models.gptq_awq import read_checkpoint_projections

                kept_weights = read_checkpoint_projections(mc.model, mc.hf_config)
            if tp is not None and kept_weights:
                from vllm_lite.distributed.layers import shard_kept_weights

                kept_weights = shard_kept_weights(model, kept_weights)
            n = quantize_model(model, mc.quantization, skip=skip,
                               group_size=mc.quantization_group_size, kept_weights=kept_weights)
        if torch.device(self.device).type == "cpu" and hasattr(model, "relocate_packed_weights"):
            # A decode step streams every projection's weights: huge pages spare the TLB.
            model.relocate_packed_weights(copy_to_huge_pages)
        self.model = model
        self.dtype: torch.dtype = next(model.parameters()).dtype
        if tp is None or tp.rank == 0:
            # One line for what runs: dtype and quantization never told apart.
            dtype = str(self.dtype).removeprefix("torch.")
            weights = dtype
            if mc.quantization:
                kept = (f"{n - 1} projections and the LM head" if not skip
                        else f"{n} projections")
                weights = f"{kept} {mc.quantization}, the rest {dtype}"
            logger.info("model: %s on %s, %s", type(model).__name__,
                        torch.device(self.device), weights)
        self.kv_cache_dtype = config.cache_config.kv_cache_dtype
        # The cache tensors' dtype (uint8 for fp8): what a block's bytes are counted in.
        from vllm_lite import ops

        self.cache_dtype = ops.kv_cache_storage_dtype(self.kv_cache_dtype, self.dtype)
        self.block_size = config.cache_config.block_size
        self.sampler = Sampler(seed=mc.seed)
        before_forward = None
        if tp is not None and tp.is_driver:
            def before_forward(inp: ModelInput, index: torch.Tensor) -> None:
                step_broadcast.send_step(tp, inp.input_ids, inp.positions,
                                         inp.attn_metadata, index)
        self.runner = ModelRunner(model, self.block_size, self.device, self.sampler,
                                  before_forward)
        self.cache_engine: CacheEngine | None = None

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device KV blocks, CPU swap blocks) this worker can hold: the CPU pool from
        kv_cache_space, a GPU's from a profiling forward and gpu_memory_utilization."""
        config = self.config
        cc = config.cache_config
        if config.num_gpu_blocks_override is not None:
            num_gpu_blocks = config.num_gpu_blocks_override
        elif self.device.type == "cpu":
            num_gpu_blocks = num_blocks_for_cpu(self.model, self.block_size, self.cache_dtype,
                                                config.kv_cache_space)
        else:
            num_gpu_blocks = profile_num_gpu_blocks(
                self.model, self.block_size, self.cache_dtype, self.device,
                config.scheduler_config.max_num_batched_tokens,
                config.scheduler_config.max_num_seqs, cc.gpu_memory_utilization)
            if self.uses_cuda_graphs():
                # The graphs' memory pool stays allocated for good: it comes out of
                # gpu_memory_utilization's share too, before the KV cache is sized.
                reserve = activation_reserve_bytes(
                    self.model, capture_sizes(config.scheduler_config.max_num_seqs)[-1],
                    self.block_size, self.device)
                block = cache_block_bytes(self.model, self.block_size, self.cache_dtype)
                num_gpu_blocks -= -(-reserve // block)
                logger.info("CUDA graphs: %.1f MiB kept for their memory pool (%d KV "
                            "blocks fewer)", reserve / 2**20, -(-reserve // block))
        block_bytes = cache_block_bytes(self.model, self.block_size, self.cache_dtype)
        num_cpu_blocks = cc.cpu_blocks_for(block_bytes) if cc.swap_space > 0 else 0
        return num_gpu_blocks, num_cpu_blocks

    def uses_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: on a GPU, with one rank (tensor-parallel ranks
        run eagerly), for a model whose forward can be captured (``supports_cuda_graphs``,
        default True: the torch MoE block sizes its expert GEMMs on the host), unless
        enforce_eager."""
        return (torch.device(self.device).type == "cuda" and self.tp is None
                and getattr(self.model, "supports_cuda_graphs", True)
                and not self.config.model_config.enforce_eager)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_engine = CacheEngine(self.model, self.block_size, num_gpu_blocks,
                                        num_cpu_blocks, self.cache_dtype, self.device,
                                        self.kv_cache_dtype,
                                        self.config.cache_config.kv_cache_layout)
        if self.uses_cuda_graphs():
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """Captures the decode graphs over the KV cache just allocated; a failure, or a
        pool larger than gpu_memory_utilization left room for, stops the start with an
        error naming --enforce-eager (never a fallback while serving)."""
        sc = self.config.scheduler_config
        graphs = DecodeGraphs(self.model, capture_sizes(sc.max_num_seqs), self.block_size,
                              sc.max_model_len, self.device)
        graphs.capture()
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        limit = int(total * self.config.cache_config.gpu_memory_utilization)
        held = torch.cuda.memory_reserved(self.device)
        if self.config.num_gpu_blocks_override is None and held > limit:
            raise GraphCaptureError(
                f"the decode CUDA graphs' pool ({graphs.pool_bytes / 2**20:.0f} MiB) took "
                f"this process to {held / 2**30:.2f} GiB, past gpu_memory_utilization's "
                f"{limit / 2**30:.2f} GiB; lower max_num_seqs or gpu_memory_utilization, "
                f"or {ENFORCE_EAGER_HINT}")
        self.runner.graphs = graphs

    def execute_cache_ops(self, out: SchedulerOutput) -> None:
        """The step's swap-out, swap-in and copy-on-write block operations, in that order."""
        assert self.cache_engine is not None, "init_cache first"
        self.cache_engine.execute(out.blocks_to_swap_out, out.blocks_to_swap_in,
                                  out.blocks_to_copy)

    def execute_model(self, out: SchedulerOutput) -> RunnerOutput:
        """Forward, sampling and prompt logprobs of the scheduled groups. Touches only
        this step's KV slots and the sampler's random states, so it can run again."""
        return self.runner.execute_model(out)

    def snapshot_rng(self, out: SchedulerOutput) -> RngSnapshot:
        """The random states running ``out`` may advance."""
        return self.sampler.snapshot(out.seq_groups())

    def restore_rng(self, snap: RngSnapshot) -> None:
        self.sampler.restore(snap)

    # -- a tensor-parallel rank other than the driver ------------------------------------------
    def serve(self) -> None:
        """Runs the driver's messages until SHUTDOWN (returns) or a failed collective
        (DistributedError: the driver died, hung or disconnected)."""
        tp = self.tp
        assert tp is not None and not tp.is_driver, "serve() is for ranks other than 0"
        while True:
            msg = step_broadcast.receive(tp)
            if msg.command == Command.EXECUTE:
                step = step_broadcast.unpack_step(msg, self.block_size, self.device)
                self.runner.run_model(step.input_ids, step.positions, step.meta,
                                      step.logits_index)
            elif msg.command == Command.CACHE_OPS:
                assert self.cache_engine is not None, "init_cache first"
                self.cache_engine.execute(*step_broadcast.unpack_cache_ops(msg))
            elif msg.command == Command.NUM_BLOCKS:
                tp.min_cpu(list(self.determine_num_blocks()))
            elif msg.command == Command.INIT_CACHE:
                self.init_cache(msg.fields[0], msg.fields[1])
            elif msg.command == Command.SHUTDOWN:
                logger.info("tensor-parallel rank %d: shutdown", tp.rank)
                return

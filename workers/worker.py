"""Worker: one tensor-parallel rank. It holds its model shard and its shard of the KV pool and
executes the messages the EngineCore sends; it decides nothing about scheduling or caching.

This module is the rank's life: device and kernels, weights, pool, reset, shutdown, and the step
messages. Beside it: the values it exchanges with the runtime (worker_spec), the pool's size
(kv_budget), its tiers' wiring (tier_setup) and the test-only faults (fault_injection)."""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time

import torch

from tierserve.scheduler.messages import (
    FlushTiers, FromWorker, ModelRunnerOutput, SchedulerOutput, ShutdownWorker, ToWorker,
    WorkerError, req_ids_digest,
)
from tierserve.workers import kv_budget, parallel
from tierserve.workers.backends.base import Backend
from tierserve.workers.backends.cpu_features import detect_cpu_features
from tierserve.workers.backends.kernels import KernelLibrary, kernel_library
from tierserve.workers.backends.select import select_backend
from tierserve.workers.fault_injection import injected_crashes, stall_if_asked
from tierserve.workers.kv_pool import allocate_kv_cache, kv_cache_bytes_per_block
from tierserve.workers.model.loader import load_model, resolve_dtype
from tierserve.workers.lora_adapters import LoRAAdapters
from tierserve.workers.model_runner import ModelRunner
from tierserve.workers.tier_setup import attach_tiers
# The control plane's values live with the spec; runtime/ and deploy/ import them from here.
from tierserve.workers.worker_spec import ModelInfo, TierReport, WorkerSpec, resolve_device

__all__ = ["WorkerSpec", "ModelInfo", "TierReport", "Worker", "resolve_device"]

log = logging.getLogger("tierserve.worker")
# One line per part of a start (kernels, weights, KV pool), which the CLI shows on a terminal.
progress = logging.getLogger("tierserve.progress")


class Worker:
    def __init__(self, spec: WorkerSpec, rank: int = 0, dist_init_method: str | None = None,
                 local_device_index: int = 0) -> None:
        self.spec = spec
        self.rank = rank
        self.dist_init_method = dist_init_method
        # Rank 0 only: a socket already listening on the store's address (see init_distributed).
        self.dist_listen_fd: int | None = None
        self.device = torch.device(spec.device, local_device_index) if spec.device == "cuda" \
            else torch.device("cpu")
        self.dtype = resolve_dtype(spec.dtype)
        self.model = None
        self.runner: ModelRunner | None = None
        self.num_threads = 1
        self._threads_reduced = False
        # The kernel variant this rank would run (set by init_device); whether the engine
        # runs it is decided once, for all ranks, at load_model.
        self._kernels: KernelLibrary | None = None
        self.backend: Backend | None = None
        # Seconds spent in each part of the start: kernels, weights, kv_pool.
        self.startup: dict[str, float] = {}

    @contextlib.contextmanager
    def _phase(self, name: str):
        t0 = time.perf_counter()
        yield
        self.startup[name] = time.perf_counter() - t0

    # ------------------------------------------------------------------ control plane

    def init_device(self) -> None:
        _keep_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.num_threads = self.spec.cpu_threads or max(
            1, (os.cpu_count() or 1) // self.spec.tensor_parallel_size)
        torch.set_num_threads(self.num_threads)
        if self.device.type == "cpu":
            with self._phase("kernels"):
                self._start_kernels()
            if self._kernels is not None and self._kernels.available and self.rank == 0:
                progress.info("%s CPU kernels ready in %.1f s", self._kernels.isa,
                              self.startup["kernels"])
        if self.spec.tensor_parallel_size > 1:
            if self.dist_init_method is None:
                raise RuntimeError("tensor_parallel_size > 1 needs a dist_init_method")
            parallel.init_distributed(self.rank, self.spec.tensor_parallel_size,
                                      self.dist_init_method,
                                      timeout_s=self.spec.collective_timeout_s,
                                      listen_fd=self.dist_listen_fd)

    def _start_kernels(self) -> None:
        """Starts building (or loading) the best kernel variant this CPU runs under the cap,
        before the weights load, so that a first-time compile overlaps it."""
        spec = self.spec
        isa = detect_cpu_features().best_isa("amx" if spec.cpu_isa == "auto" else spec.cpu_isa)
        if isa == "torch" or spec.cpu_kernels == "off" or not spec.cache_dir:
            return
        self._kernels = kernel_library(isa)
        self._kernels.start_build(spec.cache_dir, sync=spec.cpu_kernels == "sync")
        if self._kernels.building and self.rank == 0:
            progress.info("building the %s CPU kernels in the background (once per machine, "
                          "about a minute); this engine serves on the torch backend", isa)
        if self._kernels.building and self.num_threads > 1:
            # A compiler now shares the cores. With an OpenMP thread on every core, the one it
            # preempts stalls the others at each barrier: one thread fewer until the build
            # ends (see handle).
            torch.set_num_threads(self.num_threads - 1)
            self._threads_reduced = True

    def bind_thread(self) -> None:
        """Makes the calling thread ready to run this rank's steps: torch's thread count and
        the CUDA device are per thread."""
        torch.set_num_threads(self.num_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def kernels_ready(self) -> bool:
        """Whether this rank's kernel variant is loaded now; never waits for a background
        build. The engine runs the kernels only if every rank's are ready."""
        return self._kernels is not None and self._kernels.available

    def load_model(self, use_kernels: bool = False) -> ModelInfo:
        """Loads this rank's shard; on CPU with use_kernels, the model runs this rank's kernel
        variant, else the torch backend, for the engine's whole life."""
        if use_kernels and not self.kernels_ready():
            raise RuntimeError(f"rank {self.rank}: kernels requested but not loaded")
        features = detect_cpu_features()
        self.backend = select_backend(self.device, self._kernels if use_kernels else None,
                                      quant_linear=self.spec.quantized_linears)
        if not use_kernels and self._kernels is not None and self._kernels.building:
            log.info("rank %d: the %s kernels are still building; this engine runs the torch "
                     "backend, later starts the %s one", self.rank, self._kernels.isa,
                     self._kernels.isa)
        log.info("rank %d: %s backend on %s (ISAs: %s)", self.rank, self.backend.name,
                 features.model_name, ", ".join(features.isas) or "none")
        if self.rank == 0:
            progress.info("loading the weights of %s (%s, %s backend%s)",
                          os.path.basename(os.path.normpath(self.spec.model)), self.spec.dtype,
                          self.backend.name,
                          f", quantized to {self.spec.quantization}" if self.spec.quantization
                          else "")
        with self._phase("weights"), self._load_threads():
            config, self.model = load_model(self.spec.model, self.dtype, self.device,
                                            self.backend, self.spec.quantization)
        if self.rank == 0:
            progress.info("weights loaded in %.1f s", self.startup["weights"])
        block_bytes = kv_cache_bytes_per_block(config, self.spec.tensor_parallel_size,
                                               self.spec.block_size, self.dtype)
        return ModelInfo(config.vocab_size, config.max_position_embeddings,
                         tuple(config.eos_token_ids), self.backend.describe(), block_bytes,
                         self.model.weight_bytes(), self.model.decode_weight_bytes())

    @contextlib.contextmanager
    def _load_threads(self):
        """A core less for torch while the weights load: the engine process loads its
        tokenizer meanwhile, and loading runs many short torch ops, each of which waits at a
        barrier for its slowest thread (a thread that shares its core stalls them all)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads - 1))
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def determine_num_blocks(self) -> int:
        """How many blocks this rank can hold; the runtime takes the minimum over ranks."""
        return kv_budget.determine_num_blocks(self.spec, self.model.config, self.device,
                                              self.dtype, self._make_runner)

    def initialize_cache(self, num_blocks: int, known: bool = False) -> TierReport:
        """The KV pool and tiers. known: a rank replacing a lost one, whose engine already
        knows the copy bandwidth: it is not measured again."""
        with self._phase("kv_pool"):
            self.runner = self._make_runner(num_blocks)
            report = attach_tiers(self.runner, self.spec, self.rank, self.dtype, known)
        log.info("rank %d: KV pool of %d blocks x %d tokens", self.rank, num_blocks,
                 self.spec.block_size)
        if self.rank == 0:
            per_block = kv_cache_bytes_per_block(self.model.config,
                                                 self.spec.tensor_parallel_size,
                                                 self.spec.block_size, self.dtype)
            progress.info("KV pool of %d blocks x %d tokens (%.2f GiB per rank) in %.1f s",
                          num_blocks, self.spec.block_size, num_blocks * per_block / 2**30,
                          self.startup["kv_pool"])
        return report

    def reset(self, num_blocks: int) -> TierReport:
        """A fresh runner (input batch, KV pool) and tiers, as a new rank would start them, for
        an engine whose step failed here; the weights stay loaded."""
        if self.runner is not None and self.runner.tiers is not None:
            self.runner.tiers.close()
        self.runner = None  # the old pool goes before the new one is allocated
        return self.initialize_cache(num_blocks, known=True)

    def _make_runner(self, num_blocks: int) -> ModelRunner:
        cfg = self.model.config
        kv = allocate_kv_cache(cfg.num_hidden_layers, num_blocks, self.spec.block_size,
                               self.model.kv_heads_per_rank, cfg.head_dim, self.dtype,
                               self.device)
        return ModelRunner(self.model, kv, self.spec.block_size, self.device,
                           is_driver=self.rank == 0, seed=self.spec.seed,
                           max_num_seqs=self.spec.max_num_seqs,
                           max_model_len=self.spec.max_model_len,
                           append_sampled=self.spec.async_scheduling,
                           tokenizer_file=self.spec.tokenizer_file,
                           decode_graphs=self.device.type == "cuda" and not self.spec.enforce_eager
                           and self.spec.tensor_parallel_size == 1,
                           loras=LoRAAdapters(self.model, self.spec.max_loaded_loras,
                                              self.spec.max_lora_rank, self.device)
                           if self.spec.max_loaded_loras else None)

    def _inject_crash(self, msg: SchedulerOutput) -> None:
        for reason in injected_crashes(self.spec, self.rank, msg):
            self.crash(reason)

    def crash(self, reason: str) -> None:
        """A fault injected for tests: raised here (in-process, a failed step); a rank in a
        process of its own replaces this to exit at once."""
        raise RuntimeError(reason)

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.tiers.close()
        self.runner = None
        self.model = None
        parallel.destroy_distributed()

    # ------------------------------------------------------------------ data plane

    def handle(self, msg: ToWorker) -> FromWorker | None:
        """Executes one message; returns the reply for the driver rank (None elsewhere)."""
        if isinstance(msg, SchedulerOutput):
            stall_if_asked(self.spec, self.rank, msg.step_id)
            if self._threads_reduced and not self._kernels.building:
                torch.set_num_threads(self.num_threads)  # on this thread: OpenMP's is per thread
                self._threads_reduced = False
            try:
                self._inject_crash(msg)
                result = self.runner.execute(msg)
            except Exception as e:  # reported as data: the engine fails the step's requests
                log.exception("rank %d: step %d failed", self.rank, msg.step_id)
                return WorkerError(msg.step_id, self.rank, f"{type(e).__name__}: {e}")
            if self.rank != 0:
                return None
            result.req_ids_digest = req_ids_digest(msg.scheduled_req_ids())
            return result
        if isinstance(msg, FlushTiers):
            written = self.runner.tiers.flush(msg) if self.runner is not None else 0
            return ModelRunnerOutput(msg.step_id, flushed_blocks=written) \
                if self.rank == 0 else None
        if isinstance(msg, ShutdownWorker):
            self.shutdown()
            return None
        raise RuntimeError(f"unexpected message {type(msg).__name__}")


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _keep_freed_memory() -> None:
    """Keeps freed heap memory in the process. By default glibc hands large freed blocks back to
    the OS, and every step's temporaries (several MB in a prefill) page-fault in again."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # the largest glibc accepts
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass

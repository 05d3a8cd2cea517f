"""Tensor parallelism: how the ranks start and what ranks > 0 do.

One process per rank, joined by MPI (Open MPI): never a transport of fantai's own. On GPUs
(device cuda) each rank takes the GPU of its index among the ranks on its host and the
all-reduces run over NCCL, bootstrapped over MPI, which still starts the ranks and carries each
step's batch. Rank 0 is the
process the user started (LLM, AsyncEngine, `fantai serve`): it owns the scheduler, the sampler
and the HTTP server and sends each step's batch to the others, which run the same forward on
their share and join its all-reduces.

- Started plainly (`fantai serve M --tensor-parallel-size 2`, `LLM(..., tensor_parallel_size=2)`):
  this process becomes an MPI singleton and spawns N - 1 ranks on this host with
  MPI_Comm_spawn, running `python -m fantai.tp_launch SPEC`. Spawning (rather than re-executing
  under mpirun) keeps rank 0 the very process the caller holds: an LLM inside pytest or a
  notebook works, and the caller's stdin, signals and exit status stay its own.
- Started by `mpirun -np N [--host a,b] fantai serve M --tensor-parallel-size N`: every rank runs
  the same command; ranks > 0 turn into workers here and never return.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from typing import Any

from fantai import _C

logger = logging.getLogger("fantai")

# Seconds a collective may wait for the slowest rank before the group is declared dead.
TIMEOUT_ENV = "FANTAI_TP_TIMEOUT_S"
# What a rank > 0 needs to load exactly what rank 0 loads.
_LOAD_FIELDS = ("model", "dtype", "device", "quantization", "dequantize", "matmul_precision",
                "tensor_parallel_size", "cpu_bind")


def _timeout() -> float:
    return float(os.environ.get(TIMEOUT_ENV, "5"))


def _under_mpirun() -> bool:
    # A singleton (this process after an earlier spawn) has a world of one: not mpirun's.
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1


def _threads(options: Any, ranks_here: int) -> int | None:
    """Each rank takes its share of this host's cores unless told otherwise (2 cores, TP = 2: one
    thread each); oversubscribed cores would make every all-reduce wait for a descheduled rank."""
    if options.threads:
        return options.threads
    return max(1, _C.default_threads() // max(1, ranks_here))


def _local_rank(rank: int) -> int:
    """This rank's index among the ranks on its host: spawned ranks all run on rank 0's."""
    return int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)) if _under_mpirun() else rank


def bind_threads(model: Any, spec: str, local_rank: int = 0) -> list[int]:
    """Pins the model's CPU threads (--cpu-bind) and returns each thread's CPU; ranks sharing a
    host take disjoint slices of its cores, rank r from place r x threads on."""
    if spec == "none" or model.backend != "cpu":
        return []
    return list(model.bind_threads(spec, local_rank * model.num_threads))


def start_ranks(options: Any) -> int | None:
    """Connects this process as rank 0 (starting the other ranks if nobody did); returns the
    threads this rank should use. A rank > 0 under mpirun never returns from here."""
    n = options.tensor_parallel_size
    if n <= 1:
        _C.tp_reset()  # an earlier group's communicator must not reach this model's backend
        return options.threads
    reason = _C.mpi_unavailable_reason()
    if reason:
        raise RuntimeError(f"tensor_parallel_size={n} needs MPI, and {reason} "
                           "(apt-get install libopenmpi-dev openmpi-bin, then rebuild fantai)")
    if options.device != "cpu":
        _check_gpu_ranks(options.device, n)
    if _under_mpirun():
        here = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
        if _C.tp_world_rank() > 0:
            _worker({f: getattr(options, f) for f in _LOAD_FIELDS} | {"threads": _threads(options, here)})
        _C.tp_connect(n, [], _timeout())
        _finalize_at_exit()
        return _threads(options, here)
    threads = _threads(options, n)
    spec = {f: getattr(options, f) for f in _LOAD_FIELDS} | {"threads": threads}
    from fantai.model_files import resolve_model

    spec["model"] = resolve_model(options.model)  # the workers must not resolve it differently
    logger.info("starting %d tensor-parallel ranks (%s threads each)", n, threads)
    _C.tp_connect(n, [sys.executable, "-m", "fantai.tp_launch", json.dumps(spec)], _timeout())
    _finalize_at_exit()
    return threads


def _check_gpu_ranks(device: str, n: int) -> None:
    """GPU ranks: one GPU each (the rank's index on its host), joined by NCCL while MPI still
    starts the ranks and carries the step's host data. Refused here, before any rank starts, when
    this build has no NCCL, libnccl does not open, or this process sees no GPU: the same errors
    every rank would raise."""
    why = _C.nccl_unavailable_reason()
    if why:
        # The reason says its remedy: a rebuild (no NCCL at build time) or FANTAI_NCCL_LIBRARY.
        raise RuntimeError(f"tensor_parallel_size={n} on device {device!r} needs NCCL, and {why}")
    if "cuda" not in _C.available_backends():
        raise ValueError(f"tensor_parallel_size={n} on device {device!r}: backend 'cuda' is unavailable "
                         "(no CUDA device is visible to this process)")
    if device != "cuda":
        raise ValueError(f"tensor_parallel_size={n} gives each rank the GPU of its index among the ranks "
                         f"on its host: ask for device 'cuda', not {device!r} (CUDA_VISIBLE_DEVICES "
                         "picks the GPUs)")


_finalize_registered = False


def finalize() -> bool:
    """A clean stop of this process's tensor-parallel groups: rank 0 stops the ranks' step loops
    (when an engine has not), then MPI is finalized on every rank, so a job under mpirun ends with
    status 0. Skipped (False) when a group failed or never ran: that path leaves with an error
    status of its own. Finalize waits at most the collective timeout for the other ranks."""
    return bool(_C.tp_finalize(_timeout()))


def _finalize_at_exit() -> None:
    global _finalize_registered
    if not _finalize_registered:
        _finalize_registered = True
        atexit.register(finalize)


def _worker(spec: dict[str, Any]) -> None:
    """A rank > 0: load this rank's share, then run steps until rank 0 stops; exits the process."""
    from fantai.loader import load_model

    code = 0
    try:
        rank = _C.tp_join(_timeout())
        loaded = load_model(spec["model"], spec["dtype"], spec["threads"], spec["device"],
                            quantization=spec["quantization"], dequantize=spec["dequantize"])
        loaded.model.set_matmul_precision(spec["matmul_precision"])
        cpus = bind_threads(loaded.model, spec.get("cpu_bind", "none"), _local_rank(rank))
        if cpus:  # this process's main thread runs its steps and starts no threads of its own
            os.sched_setaffinity(0, {cpus[0]})
        logger.info("tensor-parallel rank %d loaded in %.2f s", rank, loaded.load_seconds)
        _C.tp_worker_loop(loaded.model)
        # Rank 0 stopped the loop: a clean stop finalizes MPI (mpirun then exits 0).
        finalize()
    except BaseException as e:  # rank 0 reports the failure to the user; this one says why here
        print(f"fantai tensor-parallel worker: {e}", file=sys.stderr, flush=True)
        code = 1
    # After a failure MPI_Finalize would wait on ranks that may be gone: leave without it.
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))

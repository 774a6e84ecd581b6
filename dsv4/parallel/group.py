"""The tensor-parallel process group of a ``torchrun`` launch.

torchrun starts one process per device and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; ``start_group`` reads them (the command line calls it; the model never reads the
environment), joins the group with a timeout and returns the ``TensorSplit`` every sharded
module is built with. Backend: gloo on a CPU, nccl on CUDA (on ROCm torch's "nccl" backend is
RCCL). The timeout bounds every collective, so a rank whose peer died raises instead of waiting
for ever; on gloo a dead peer's closed connection raises at once.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .split import SINGLE, TensorSplit

DEFAULT_TIMEOUT_S = 60.0


def launch_env(env) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) of a torchrun launch, or None outside one."""
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise ValueError(f"RANK={env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r}, "
                         f"LOCAL_RANK={env.get('LOCAL_RANK')!r} must be integers (set by "
                         "torchrun)") from None
    return rank, world, local


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def start_group(tp: int, env, device: torch.device,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorSplit:
    """Join the launch's process group for ``--tp tp`` and return this rank's split. tp == 1
    outside torchrun (or with WORLD_SIZE=1) is the one-device run: no group. Raises ValueError
    when tp and the launch disagree."""
    launch = launch_env(env)
    world = 1 if launch is None else launch[1]
    if tp != world:
        how = ("outside torchrun (one process)" if launch is None
               else f"torchrun started {world} processes (WORLD_SIZE={world})")
        raise ValueError(f"--tp {tp} needs one process per rank: launch with torchrun "
                         f"--nproc-per-node {tp} -m dsv4 generate --tp {tp} ...; {how}")
    if world == 1:
        return SINGLE
    rank, world, local = launch
    if device.type == "cuda":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return TensorSplit(rank, world, dist.group.WORLD)


def end_group(split: TensorSplit) -> None:
    if split.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is how a collective reports a peer that stopped (gloo's closed connection or
    timeout, NCCL's watchdog)."""
    return isinstance(e, dist.DistBackendError) or (
        isinstance(e, RuntimeError) and any(s in str(e) for s in (
            "Connection closed by peer", "Connection reset by peer", "Timed out",
            "timed out", "Broken pipe", "NCCL")))

"""One rank of an FSDP1 verify job (``verify --fsdp1``), run under torchrun as ``__main__`` with JOB.json.

As ``worker.py`` but the plan runs as FSDP1 ``FullyShardedDataParallel`` with the plan's ``auto_wrap_policy``
(``apply/fsdp1.py``): K SGD steps beside an unsharded reference on the same data, the all-gathers and
reduce-scatters counted per step (FSDP1 calls them through the ``torch.distributed`` module too), the parameters
compared under ``summon_full_params``, and the module names FSDP1 wrapped reported for the launcher to compare
with the plan's groups. ``rank.run_rank`` starts and ends the rank and reports a failure.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel

from fsdp_planner.apply.fsdp1 import clean_name, fsdp1_kwargs, wrapped_units
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.patching import patched
from fsdp_planner.runtime.rank import run_rank
from fsdp_planner.runtime.worker import (
    MOMENTUM,
    CollectiveCounter,
    build_job,
    fingerprints,
    params_changed,
    parity,
    train_steps,
)


@contextmanager
def counting_list_all_gather(counter: CollectiveCounter) -> Iterator[None]:
    """FSDP1 all-gathers a CPU flat parameter with ``dist.all_gather`` into a list of chunks (GPU: the
    ``all_gather_into_tensor`` family ``CollectiveCounter`` wraps): count those too, at the unsharded size."""
    original = dist.all_gather

    def wrapper(tensor_list: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        counter.counts[CollectiveKind.ALL_GATHER.value] += 1
        counter.nbytes[CollectiveKind.ALL_GATHER.value] += sum(t.numel() * t.element_size() for t in tensor_list)
        return original(tensor_list, *args, **kwargs)

    with patched(dist, "all_gather", wrapper):
        yield


def _train(job: dict, model: torch.nn.Module, reference: torch.nn.Module, device: torch.device, rank: int,
           world: int) -> dict[str, Any]:
    """K steps of the FSDP1 model beside the reference, as the FSDP2 job runs them (``worker.train_steps``), then
    parity on the gathered params (rank 0's: it trained the reference; every rank gathers); what rank 0 reports."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=job["lr"], momentum=MOMENTUM)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=job["lr"],
                              momentum=MOMENTUM)
    before = fingerprints(reference) if rank == 0 else []
    result = train_steps(job, model, reference, opt, ref_opt, device, rank, world, counting_list_all_gather)
    ref_params = dict(reference.named_parameters())
    with FullyShardedDataParallel.summon_full_params(model):
        checked = parity((clean_name(name), p, ref_params[clean_name(name)]) for name, p in model.named_parameters()
                         ) if rank == 0 else {}
    return {**result, **checked, **({"params_changed": params_changed(before, reference)} if rank == 0 else {})}


def _run(job: dict, device: torch.device, rank: int, world: int) -> None:
    """The job on this rank as FSDP1 units; rank 0 writes the result."""
    model, reference, plan = build_job(job, device)
    # device_id: FSDP1 on CPU needs it said explicitly (it otherwise looks for a CUDA device)
    model = FullyShardedDataParallel(model, device_id=device, **fsdp1_kwargs(plan, model))
    units = wrapped_units(model)
    result = _train(job, model, reference, device, rank, world)
    if rank == 0:
        Path(job["result"]).write_text(json.dumps({**result, "units": units, "backend": dist.get_backend(),
                                                   "world": world}))
    dist.barrier()


if __name__ == "__main__":
    run_rank(sys.argv[1], _run)

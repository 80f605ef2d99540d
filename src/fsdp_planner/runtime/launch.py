"""torchrun, plus a record of how each rank ended: ``python -m fsdp_planner.runtime.launch EXITS.json ARGS...``.

ARGS are torchrun's own. When the job fails, torchrun knows each rank's exit status (a rank killed by SIGKILL has
no other trace: it wrote nothing) but only prints it in a summary meant for people; this writes it as JSON
(``{"RANK": EXITCODE}``, a negative code being the signal) so ``verify`` can name the rank that died and why.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

PARENT_ENV = "FSDP_PLANNER_PARENT"  # the pid of the command that started the job (runtime/verify.py)


def follow_parent() -> None:
    """End with the command that started the job, even when it is killed by SIGKILL and cannot stop the job
    itself: Linux sends this process SIGTERM then (``PR_SET_PDEATHSIG``), and torchrun ends its ranks on SIGTERM.
    Where prctl does not exist the command's own handlers are all there is."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = os.environ.get(PARENT_ENV)
    if parent and os.getppid() != int(parent):  # it died before prctl: nobody waits for this job
        sys.exit(1)


def main(argv: list[str]) -> int:
    follow_parent()
    exits_path, torchrun_args = Path(argv[0]), argv[1:]
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as e:
        exits_path.write_text(json.dumps({str(rank): f.exitcode for rank, f in e.failures.items()}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

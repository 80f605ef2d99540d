"""torchrun, plus a record of how each rank ended: ``python -m fsdp_planner.runtime.launch EXITS.json ARGS...``.

ARGS are torchrun's own. When the job fails, torchrun knows each rank's exit status (a rank killed by SIGKILL has
no other trace: it wrote nothing) but only prints it in a summary meant for people; this writes it as JSON
(``{"RANK": EXITCODE}``, a negative code being the signal) so ``verify`` can name the rank that died and why.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from fsdp_planner.signals import follow_parent

PARENT_ENV = "FSDP_PLANNER_PARENT"  # the pid of the command that started the job (runtime/verify.py)
LAUNCHER_ENV = "FSDP_PLANNER_LAUNCHER"  # this launcher's pid, which its ranks follow (rank.follow_launcher)


def follow_command() -> None:
    """End with the command that started the job, even when it is killed by SIGKILL and cannot stop the job
    itself: this process then gets SIGTERM (``signals.follow_parent``), on which torchrun ends its ranks."""
    parent = os.environ.get(PARENT_ENV)
    if parent:
        follow_parent(int(parent), signal.SIGTERM)


def main(argv: list[str]) -> int:
    follow_command()
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # torchrun passes its environment on to the ranks
    exits_path, torchrun_args = Path(argv[0]), argv[1:]
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as e:
        exits_path.write_text(json.dumps({str(rank): f.exitcode for rank, f in e.failures.items()}))
        return 1
    except SignalException as e:  # torchrun stopped its ranks on a signal sent to it: die of it, not a traceback
        return die_of(e.sigval)
    return 0


def die_of(signum: int) -> int:
    """End this process by ``signum``, which the command reads as the launcher killed from outside
    (``failures.launcher_killed``); the status a shell would give, should the signal not end it."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

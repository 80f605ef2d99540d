"""torchrun, plus a record of how each rank ended: ``python -m fsdp_planner.runtime.launch EXITS.json ARGS...``.

ARGS are torchrun's own. When the job fails, torchrun knows each rank's exit status (a rank killed by SIGKILL has
no other trace: it wrote nothing) but only prints it in a summary meant for people; this writes it as JSON
(``{"RANK": EXITCODE}``, a negative code being the signal) so ``verify`` can name the rank that died and why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    exits_path, torchrun_args = Path(argv[0]), argv[1:]
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as e:
        exits_path.write_text(json.dumps({str(rank): f.exitcode for rank, f in e.failures.items()}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

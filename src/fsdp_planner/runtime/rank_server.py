"""Imported by the launcher's rank server (``launch.RankStart.FORKSERVER``: multiprocessing's forkserver preloads
it first): the server ends, by SIGKILL, when the launcher that started it dies, and the ranks forked from it follow
the server (``rank.run_forked``). Without this the server would outlive a launcher killed by SIGKILL: it stays up
while any process it forked holds its "alive" pipe, and so do the ranks, which would run on unsupervised.

Only in a direct child of a launcher (``LAUNCHER_ENV`` is its parent's pid): imported anywhere else it does
nothing."""

from __future__ import annotations

import os
import signal

from fsdp_planner.runtime.launch import LAUNCHER_ENV
from fsdp_planner.signals import follow_parent

if os.environ.get(LAUNCHER_ENV) == str(os.getppid()):
    follow_parent(os.getppid(), signal.SIGKILL)

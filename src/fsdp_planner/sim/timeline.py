"""The step as the engines record it: what ran on which stream and when, and the times an engine hands back.

Both engines (``streams.py`` on GPUs, ``host_engine.py`` on CPU ranks) write the same ``TimelineEvent``s into a
``Timeline`` and end with ``StepTimes``; ``simulate.py`` turns those into the ``StepReport``. Pictures draw the
events (``report/step_view.py``); everything else asks for no timeline and gets an empty one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from fsdp_planner.fsdp2.collectives import CollectiveKind

AG, RS, AR = CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_REDUCE


class Stream(Enum):
    COMPUTE = "compute"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


class Work(Enum):
    """What the compute stream does during one of its timeline events."""

    OPS = "ops"  # a run of the trace's ops
    RECOMPUTE = "recompute"  # a checkpointed forward run again
    COPY_OUT = "copy-out"  # FSDP2 copying an all-gather's output into the unsharded params
    HOST = "host"  # idle: the host has not launched the next op yet (FSDP2's hooks, launches)
    OPTIMIZER = "optimizer"  # the optimizer step after backward (on the host under CPU offload: the GPU waits)


@dataclass(frozen=True)
class TimelineEvent:
    stream: Stream
    name: str
    start: float
    end: float
    group: int = -1
    op: int = -1  # compute: the first trace event of this run of ops (pictures map event positions to times)
    work: Work = Work.OPS  # compute only


class Timeline:
    """The events of one simulated step, or nothing at all when no picture asked for them (a planner simulates
    thousands of plans and reads only their times)."""

    def __init__(self, recording: bool) -> None:
        self.recording = recording
        self.events: list[TimelineEvent] = []

    def add(self, stream: Stream, name: str, start: float, end: float, group: int = -1, op: int = -1,
            work: Work = Work.OPS) -> None:
        if self.recording:
            self.events.append(TimelineEvent(stream, name, start, end, group, op, work))


@dataclass(frozen=True)
class StepTimes:
    """What an engine measured of one step: the report's times, before the schedule's counts and the memory peak
    are added (``simulate.report``)."""

    step: float
    recompute: float  # checkpointed forwards run again
    exposed: float  # compute waiting for collectives (may come out slightly negative; the report clips it)
    busy: dict[CollectiveKind, float]  # seconds each communication stream is busy
    host_time: float  # the host's work: launches and FSDP2's hooks
    host_wait: float  # compute idle because the host had not launched the next op
    copy_time: float  # FSDP2's copy-outs (and on CPU ranks copy-ins) on the compute stream
    events: list[TimelineEvent] = field(default_factory=list)
    compute: float | None = None  # the engine's compute, recomputation included; None: the trace's ops + recompute

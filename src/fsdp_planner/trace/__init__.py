"""Step 1 of the pipeline: one training step of the model, traced on meta/fake tensors."""

from fsdp_planner.trace.events import Event, EventKind
from fsdp_planner.trace.index import TraceIndex
from fsdp_planner.trace.infos import ModuleInfo, ParamInfo
from fsdp_planner.trace.recorder import default_loss, record, run_model
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT
from fsdp_planner.trace.walk import model_fingerprint

__all__ = ["ROOT", "Event", "EventKind", "ModuleInfo", "ParamInfo", "Trace", "TraceIndex", "default_loss",
           "model_fingerprint", "record", "run_model"]

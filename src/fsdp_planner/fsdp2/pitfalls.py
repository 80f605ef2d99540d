"""FSDP pitfalls in a model and a plan, as findings with a severity and the exact fix (``fsdp-planner check``).

Errors are what makes a run fail or train wrong: a 0-dim param (no ``fully_shard`` accepts one), a param read
while its group is sharded, a non-forward method of a sharded module left unregistered, tied params across
groups, a module reused inside a list group (pytorch#183702), a group of several trainable dtypes, a container
listed as a group, an int ``reshard_after_forward`` that does not divide the shard size, an FSDP1 unit mixing dtypes
or requires_grad.
Warnings are what makes it slow or wasteful: params never used in the step, params the root keeps gathered all
step, a list group whose modules run apart (held through the groups between), 16-bit params whose grads are
reduce-scattered in fp32 only to be cast back, fp64 params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_count, fmt_modules
from fsdp_planner.fsdp2.claim import (
    SCALAR_FIX,
    SCALAR_PROBLEM,
    check_plan_matches,
    claiming_group,
    hooked_by,
    scalar_params,
    short_list,
)
from fsdp_planner.fsdp2.dtypes import fp32_modules_computed_low, group_dtypes
from fsdp_planner.fsdp2.input_casts import unhooked_casts
from fsdp_planner.fsdp2.plan import Plan, check_plan_layout, check_reshard_sizes
from fsdp_planner.fsdp2.precision import Precision
from fsdp_planner.fsdp2.replay import build_schedule
from fsdp_planner.fsdp2.tensor_parallel import local_param, param_style
from fsdp_planner.fsdp2.validity import compiled_groups_refusal, sharded_reads
from fsdp_planner.trace.events import EventKind
from fsdp_planner.trace.infos import ParamInfo
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import ROOT, is_within, parent_of


class Severity(Enum):
    ERROR = "error"  # the run fails or trains wrong
    WARNING = "warning"  # the run is slow or wasteful
    INFO = "info"  # nothing wrong: a question about the plan answered with numbers (check --cluster)


class Code(Enum):
    SHARDED_READ = "sharded-read"
    FORWARD_METHOD = "forward-method"
    TIED_ACROSS_GROUPS = "tied-across-groups"
    LIST_GROUP_REUSE = "list-group-reuse"
    LIST_GROUP_AFTER_FORWARD = "list-group-after-forward"  # a list group's module called after the model's forward
    LIST_GROUP_UNUSED = "list-group-unused"  # a list group's module the step never calls
    LIST_GROUP_APART = "list-group-apart"  # a list group whose modules run apart: held through the groups between
    MIXED_DTYPE_GROUP = "mixed-dtype-group"
    MIXED_DTYPE_MODULE = "mixed-dtype-module"
    CONTAINER_GROUP = "container-group"
    COMPILED_GROUP = "compiled-group"  # FSDP2's hooks (a group's, experts' own calls) inside a module compiled whole
    RESHARD_AFTER_FORWARD = "reshard-after-forward"
    FSDP1_MIXED_UNIT = "fsdp1-mixed-unit"
    UNUSED_PARAMS = "unused-params"
    DATA_DEPENDENT_STEP = "data-dependent-step"  # the forward reads tensor values on the host: ranks may diverge
    ROUTING_SKIPS = "routing-skips"  # params whose gradient depends on the routing (an expert skipped without tokens)
    ROOT_PARAMS = "root-params"
    UPCAST_REDUCE = "upcast-reduce"
    FP64_PARAMS = "fp64-params"
    REDUCE_DTYPE_COST = "reduce-dtype-cost"  # info: the step with grads reduced in bf16 vs fp32
    HSDP_PAYS = "hsdp"  # info: the plan on the best HSDP layout vs pure FSDP
    RESHARD_TO_NODE = "reshard-to-node"  # info: int reshard_after_forward (the node) vs True
    FORWARD_PREFETCH = "forward-prefetch"  # info: explicit forward prefetch vs implicit, where the host waits
    COMPILE_PAYS = "compile"  # info: the step with the repeated blocks torch.compile'd vs eager (or the reverse)
    COMPILE_LOSS_PAYS = "compile-loss"  # info: the step with the loss torch.compile'd vs eager (or the reverse)
    LOSS_CHUNKS_PAY = "loss-chunks"  # info: the step with the output layer and loss in chunks vs whole (or reverse)
    FLOAT8_PAYS = "float8"  # info: the step with torchao's float8 training (tensorwise, float8 all-gather) vs without
    RECORDED_OUTPUTS = "recorded-outputs"
    ALIASED_INPUTS = "aliased-inputs"  # a listed module given one tensor twice, which FSDP2 hands it as two
    CHECKPOINTED_RUNNING_STATS = "checkpointed-running-stats"
    SCALAR_PARAMS = "scalar-params"
    PRECISION = "precision"  # the step fails in the precision's compute dtype (found by tracing, not here)
    DOES_NOT_RUN = "does-not-run"  # the plan cannot run on the cluster for a reason no other finding names
    OVER_BUDGET = "over-budget"  # the plan's simulated reserved peak is over the memory budget (check --cluster)


@dataclass(frozen=True)
class Finding:
    severity: Severity
    code: Code
    message: str
    fix: str
    module: str = ""  # the module to change ("" is the root)

    def to_dict(self) -> dict[str, str]:
        return {"severity": self.severity.value, "code": self.code.value, "message": self.message, "fix": self.fix,
                "module": self.module}


def has_errors(findings: Sequence[Finding]) -> bool:
    return any(f.severity is Severity.ERROR for f in findings)


def _name(fqn: str) -> str:
    """The module as Python code reaches it from the user's ``model``, code that runs: ``model.layers[0].attn`` (a
    ModuleList's child is indexed), ``model.get_submodule("...")`` for a name no attribute can spell."""
    if fqn == ROOT:
        return "model"
    parts = fqn.split(".")
    if not all(p.isidentifier() or p.isdigit() for p in parts):
        return f"model.get_submodule({fqn!r})"
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts)


def _path(fqn: str) -> str:
    """The module as prose names it: its real path (``named_modules``), so an HF model's ``model.norm`` does not
    read as ``model.model.norm``."""
    return "the root module" if fqn == ROOT else fqn


# -- the model, whatever the plan ----------------------------------------------------------------------------
def model_findings(trace: Trace, precision: Precision | None = None) -> list[Finding]:
    """Findings about the model itself: dtypes a module mixes, params the step never uses, dtypes FSDP2 upcasts."""
    out: list[Finding] = []
    by_name = {p.fqn: p for p in trace.params}
    for fqn, info in trace.modules.items():
        dtypes = list(dict.fromkeys(by_name[p].dtype for p in info.params if by_name[p].requires_grad))
        if len(dtypes) > 1:
            out.append(Finding(Severity.ERROR, Code.MIXED_DTYPE_MODULE,
                               f"{_path(fqn)} registers trainable params of several dtypes ({', '.join(dtypes)}); "
                               f"FSDP2 manages a module's own params in one group and asserts one original dtype "
                               f"per group at its first forward, whatever MixedPrecisionPolicy says",
                               "store them in one dtype (MixedPrecisionPolicy casts for compute) or freeze one", fqn))
    for owner, ps in _by_owner([by_name[p] for p in scalar_params(trace)]).items():
        out.append(Finding(Severity.ERROR, Code.SCALAR_PARAMS, f"{SCALAR_PROBLEM} {short_list(p.fqn for p in ps)}",
                           SCALAR_FIX, owner))
    uses = trace.index.param_uses
    unused = [p for i, p in enumerate(trace.params) if p.requires_grad and not uses[i]]
    branch = " (or a branch of a data-dependent if the trace did not take: see data-dependent-step)" \
        if trace.host_reads else ""
    for owner, ps in _by_owner(unused).items():
        out.append(Finding(Severity.WARNING, Code.UNUSED_PARAMS,
                           f"{short_list(p.fqn for p in ps)} ({fmt_bytes(sum(p.nbytes for p in ps))}) never read in "
                           f"the step{branch}: FSDP2 still all-gathers them with their group and keeps their optimizer "
                           "state", "remove them, freeze them (requires_grad_(False)), or check why the step skips "
                           "them", owner))
    if trace.host_reads:
        where = ", ".join(_path(m) for m in trace.host_reads[:3]) + \
            (f" and {len(trace.host_reads) - 3} more" if len(trace.host_reads) > 3 else "")
        out.append(Finding(Severity.WARNING, Code.DATA_DEPENDENT_STEP,
                           f"the forward of {where} reads tensor values on the host (.item(), bool(), int(): an if "
                           "or a loop count on the data): the trace took one path (a mask's every element true, a "
                           "float 0.0), and a rank whose data takes another calls other modules and issues other "
                           "collectives than its peers, which fails or hangs FSDP2",
                           "make the step's modules and loop counts the same on every rank (torch.where instead of "
                           "an if, a fixed count)", trace.host_reads[0]))
    if precision is not None:
        out += _dtype_warnings(trace, precision)
    return out


def routing_skip_findings(skipped: Sequence[str]) -> list[Finding]:
    """An error for params that get no gradient where the router gives their expert no token (``skipped``,
    ``service.tracing.routing_skips``): ranks then run other collectives than their peers."""
    if not skipped:
        return []
    # the modules skipped: each param's module's parent (an expert's Linears' expert), as the user's loop names them
    owners = list(dict.fromkeys(".".join(p.split(".")[:-2]) or ROOT for p in skipped))
    shown = ", ".join(_path(o) for o in owners[:3]) + (f" and {len(owners) - 3} more" if len(owners) > 3 else "")
    return [Finding(Severity.ERROR, Code.ROUTING_SKIPS,
                    f"the forward skips a module the router gave no token: {shown} got no gradient in a step "
                    "that routed no token to them (the trace's balanced routing gives every expert some). FSDP2 "
                    "all-gathers a group in its module's forward and reduce-scatters only the params that got a "
                    "gradient, so a rank whose batch skips an expert runs other collectives than its peers: NCCL "
                    "hangs, gloo pairs them wrong and trains wrong values",
                    "call every expert each step, on its slice of tokens even when that is empty (an expert run on "
                    "0 rows gives zero gradients, as torchtitan's grouped experts do), instead of skipping it "
                    "(`if idx.numel() == 0: continue`)", owners[0])]


def _by_owner(params: Sequence) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in params:
        out.setdefault(p.owners[0], []).append(p)
    return out


def _dtype_warnings(trace: Trace, precision: Precision) -> list[Finding]:
    out = []
    trainable = [p for p in trace.params if p.requires_grad]
    small = [p for p in trainable if p.itemsize < precision.reduce_bytes and p.dtype in ("bfloat16", "float16")]
    if small and not precision.autocast:
        nbytes = sum(p.nbytes for p in small)
        out.append(Finding(Severity.WARNING, Code.UPCAST_REDUCE,
                           f"{len(small)} trainable params ({fmt_bytes(nbytes)}) are stored in {small[0].dtype}: "
                           f"under '{precision.name}' (reduce in {8 * precision.reduce_bytes}-bit) FSDP2 "
                           f"reduce-scatters their grads in fp32, twice the bytes, and casts them back to "
                           f"{small[0].dtype}; the optimizer updates 16-bit weights (no fp32 master copy)",
                           "build the model in fp32 and let MixedPrecisionPolicy(param_dtype=torch.bfloat16) cast "
                           "for compute, or set reduce_dtype to the params' dtype", small[0].owners[0]))
    wide = [p for p in trainable if p.dtype == "float64"]
    if wide:
        out.append(Finding(Severity.WARNING, Code.FP64_PARAMS,
                           f"{short_list(p.fqn for p in wide)} are float64: every all-gather, reduce-scatter and "
                           f"optimizer state of them is twice fp32's bytes",
                           "store them in fp32 (model.float())", wide[0].owners[0]))
    return out


# -- a plan ----------------------------------------------------------------------------------------------------
def plan_findings(trace: Trace, plan: Plan, world_size: int | None = None, fsdp1: bool = False) -> list[Finding]:
    """Findings about ``plan`` on the traced model. A plan made for another model is a PlannerError, and so is a TP
    degree that does not divide a param its layout shards (``local_param``: ``check`` refuses the degree first)."""
    out = _structure_findings(trace, plan, world_size)
    if out:  # the replay needs a plan FSDP2 can apply: check that it is this model's, then stop
        if plan.fingerprint != trace.fingerprint:
            check_plan_matches(plan, trace)
        return out
    check_plan_matches(plan, trace)
    out += _method_findings(trace, plan) + _idle_method_findings(plan)
    out += _sharded_read_findings(trace, plan, world_size)
    out += _reuse_findings(trace, plan)
    out += _apart_findings(trace, plan)
    out += _root_findings(trace, plan)
    out += _recorded_outputs_findings(trace, plan)
    out += _running_stats_findings(trace, plan)
    out += _aliased_inputs_findings(trace, plan)
    if fsdp1:
        out += _fsdp1_findings(trace, plan)
    return out


def _structure_findings(trace: Trace, plan: Plan, world_size: int | None) -> list[Finding]:
    out = []
    modules = trace.modules
    for i, g in enumerate(plan.groups):
        for m in g.modules:
            if m in modules and modules[m].cls in ("ModuleList", "ModuleDict") and not modules[m].shardable:
                out.append(Finding(Severity.ERROR, Code.CONTAINER_GROUP,
                                   f"group {i} ({fmt_modules(g.modules)}) lists {_path(m)}, a {modules[m].cls} "
                                   "without forward: fully_shard "
                                   f"refuses it", "list its children in the group instead", m))
    if (refused := compiled_groups_refusal(plan, {*trace.compiled, *plan.compiled})) is not None:
        problem, fix, module = refused
        out.append(Finding(Severity.ERROR, Code.COMPILED_GROUP, problem, fix, module))
    if all(m in modules for g in plan.groups for m in g.modules):
        group_of = {m: i for i, g in enumerate(plan.groups) for m in g.modules if m != ROOT}
        for p in (trace.params[i] for i in trace.index.tied_params):
            groups = {claiming_group(o, group_of, trace.index.parents) for o in p.owners}
            if len(groups) > 1:
                names, paths = ", ".join(_name(o) for o in p.owners), ", ".join(_path(o) for o in p.owners)
                out.append(Finding(Severity.ERROR, Code.TIED_ACROSS_GROUPS,
                                   f"param '{p.fqn}' is shared by {paths}, which are in different groups: FSDP2 2.13 "
                                   f"raises ValueError (\"shared with a parameter already managed by another FSDP "
                                   f"group\")", f"shard them in one call: fully_shard([{names}])", p.owners[0]))
    if {p for g in plan.groups for p in g.params} == {p.fqn for p in trace.params}:
        for i, dtypes in enumerate(group_dtypes(plan, trace)):
            if len(dtypes) > 1:
                g = plan.groups[i]
                out.append(Finding(Severity.ERROR, Code.MIXED_DTYPE_GROUP,
                                   f"group {i} ({fmt_modules(g.modules)}) manages trainable params of several dtypes "
                                   f"({', '.join(dtypes)}): FSDP2 asserts \"FSDP expects uniform original parameter "
                                   f"dtype\" at its first forward (MixedPrecisionPolicy does not change it)",
                                   "put each dtype's modules in a group of their own (every fsdp-planner policy "
                                   "splits them)", g.modules[0]))
        out += _precision_findings(trace, plan)
    if world_size is not None:
        out += _world_findings(plan, world_size)
    return out


def _precision_findings(trace: Trace, plan: Plan) -> list[Finding]:
    """What the step needs of the groups to run in the compute dtype: its modules traced in fp32 (BatchNorm) in fp32
    groups of their own, and each module that gets float32 activations hooked, for FSDP2 to cast them."""
    out = [Finding(Severity.ERROR, Code.PRECISION,
                   f"group {i} ({fmt_modules(plan.groups[i].modules)}) holds params of {fmt_modules(held)}, which "
                   "fail in the compute dtype (floating buffers FSDP2 does not cast) and run only in fp32: the "
                   "group's MixedPrecisionPolicy computes them in the compute dtype",
                   "give them groups of their own with \"param_dtype\": \"fp32\" (every fsdp-planner policy does)",
                   held[0]) for i, held in fp32_modules_computed_low(plan, trace)]
    out += [Finding(Severity.ERROR, Code.PRECISION,
                    f"{_path(m)} gets float32 activations and no group hooks it: FSDP2 casts a module's inputs to "
                    "the compute dtype only at the pre-forward of a module a fully_shard call hooks",
                    f"give it a group (fully_shard({_name(m)}), one without params of its own is fine)", m)
            for m in unhooked_casts(trace, hooked_by(plan, trace))]
    return out


def _world_findings(plan: Plan, world_size: int) -> list[Finding]:
    """What stops the plan on ``world_size`` ranks: a layout of other ranks, else a reshard size they refuse (the
    sizes of a layout the plan does not have are not asked)."""
    try:
        check_plan_layout(plan, world_size)
    except PlannerError as e:
        return [Finding(Severity.ERROR, Code.DOES_NOT_RUN, str(e),
                        f"make the plan again for {world_size} ranks, or run it on the ranks it was made for")]
    try:
        check_reshard_sizes(plan, world_size)
    except PlannerError as e:
        return [Finding(Severity.ERROR, Code.RESHARD_AFTER_FORWARD, str(e),
                        "use true, false or a divisor of the shard size")]
    return []


def _method_calls_by_event(trace: Trace) -> dict[int, tuple[str, str]]:
    """Event index -> (module, method) for the ops of each traced non-forward method call, forward and backward."""
    out: dict[int, tuple[str, str]] = {}
    start: dict[tuple[str, int], int] = {}
    for i, e in enumerate(trace.events):
        key = (e.module, e.call)
        if key in trace.method_calls:  # its forward, and its backward (between its pre- and post-backward)
            if e.kind in (EventKind.FWD_PRE, EventKind.BWD_PRE):
                start[key] = i
            elif e.kind in (EventKind.FWD_POST, EventKind.BWD_POST) and key in start:
                for j in range(start.pop(key), i):
                    out.setdefault(j, (e.module, trace.method_calls[key]))
    return out


def _method_findings(trace: Trace, plan: Plan) -> list[Finding]:
    listed = {m for g in plan.groups for m in g.modules}
    registered = set(plan.forward_methods)
    out = []
    for m, name in trace.forward_methods:
        call = f"{_name(m)}.{name}()"
        if m in listed and (m, name) not in registered:
            out.append(Finding(Severity.ERROR, Code.FORWARD_METHOD,
                               f"the step calls {call}, which runs {_path(m)}'s params outside its forward: FSDP2 "
                               f"leaves them sharded there (\"mixed torch.Tensor and DTensor\")",
                               f"register_fsdp_forward_method({_name(m)}, \"{name}\") after fully_shard, or add "
                               f"{{\"module\": \"{m}\", \"method\": \"{name}\"}} to the plan's forward_methods "
                               f"(apply_plan registers them)", m))
        else:
            how = "the plan registers it, so apply_plan wraps it with FSDP2's hooks" if m in listed else \
                "this plan does not shard it on its own, so its params are gathered around the call"
            out.append(Finding(Severity.WARNING, Code.FORWARD_METHOD,
                               f"the step calls {call}, which runs {_path(m)}'s params outside its forward; {how}",
                               f"a training script that calls fully_shard({_name(m)}) itself must also call "
                               f"register_fsdp_forward_method({_name(m)}, \"{name}\")", m))
    return out


def _idle_method_findings(plan: Plan) -> list[Finding]:
    """A method the plan registers on a module no group lists: FSDP2's register_fsdp_forward_method does nothing
    on a module fully_shard was not called on, so the entry only looks as if it mattered."""
    listed = {m for g in plan.groups for m in g.modules}
    return [Finding(Severity.WARNING, Code.FORWARD_METHOD,
                    f"the plan registers {_name(m)}.{name}() but no group lists {_path(m)}: FSDP2 does nothing with "
                    f"a method of a module fully_shard was not called on",
                    f"remove {{\"module\": \"{m}\", \"method\": \"{name}\"}} from the plan's forward_methods, or "
                    f"list {_path(m)} as a group's module", m)
            for m, name in plan.forward_methods if m not in listed]


def _sharded_read_findings(trace: Trace, plan: Plan, world_size: int | None) -> list[Finding]:
    index = trace.index.param_index
    group_params = [[index[p] for p in g.params] for g in plan.groups]
    schedule = build_schedule(trace, plan, world_size, group_params)
    in_method = _method_calls_by_event(trace)
    registered = set(plan.forward_methods)
    listed = {m for g in plan.groups for m in g.modules}
    seen: set[tuple[str, int]] = set()
    out = []
    for r in sharded_reads(trace, plan, schedule, group_params, limit=len(trace.events)):
        method = in_method.get(r.event)
        if method is not None and method[0] in listed and method not in registered:
            continue  # reported as an unregistered forward method
        if (r.module, r.group) in seen:
            continue
        seen.add((r.module, r.group))
        g = plan.groups[r.group]
        caller = f"{_name(method[0])}.{method[1]}()" if method else f"{_path(r.module)}'s forward"
        out.append(Finding(Severity.ERROR, Code.SHARDED_READ,
                           f"{caller} reads '{r.param}' in {'backward' if r.backward else 'forward'} while its group "
                           f"{r.group} ({fmt_modules(g.modules)}) is sharded: FSDP2 unshards a group only in the "
                           f"hooks of the modules it lists (\"mixed torch.Tensor and DTensor\")",
                           _sharded_read_fix(r.module, g.modules, method), r.module))
    return out


def _sharded_read_fix(module: str, group_modules: Sequence[str], method: tuple[str, str] | None) -> str:
    if method is not None:
        return (f"shard {_path(method[0])} as a group of its own (or with its caller) and register_fsdp_forward_method"
                f"({_name(method[0])}, \"{method[1]}\")")
    owner = next((g for g in group_modules if is_within(module, g)), None)
    if owner is not None:  # a submodule of a group's module called from outside that module's forward
        return (f"call {_path(module)} through {_path(owner)}'s forward, or shard it as a group of its own "
                f"(fully_shard({_name(module)}) before fully_shard({_name(owner)}))")
    return (f"shard {_path(module)} and {fmt_modules(group_modules)} in one call (fully_shard([...])), or leave those "
            f"params to the root")


def _called_after_forward(trace: Trace) -> set[str]:
    """The modules called outside every other module's call: by the loss, after the model's forward returned."""
    out, depth = set(), 0
    for e in trace.events:
        if e.backward:
            break
        if e.kind is EventKind.FWD_PRE:
            if depth == 0 and e.module != ROOT:
                out.add(e.module)
            depth += 1
        elif e.kind is EventKind.FWD_POST:
            depth -= 1
    return out


def _reuse_findings(trace: Trace, plan: Plan) -> list[Finding]:
    out = []
    late = _called_after_forward(trace)
    subtree = trace.index.subtree_params
    for i, g in enumerate(plan.inner_groups):
        if len(g.modules) < 2:
            continue
        for m in (m for m in g.modules if m in late):  # (a new user's [head, aux_head]: 7 all-gathers measured, 6
            # predicted, the peak 8.7% low)
            out.append(Finding(Severity.WARNING, Code.LIST_GROUP_AFTER_FORWARD,
                               f"{_path(m)} is called after the model's forward (by the loss) inside list group {i} "
                               f"({fmt_modules(g.modules)}): FSDP2 runs the group's forward hooks again at the "
                               "loss's call (a list group's hooks follow each module's forward), which the "
                               "prediction does not replay (an all-gather more a step on a new user's model)",
                               f"shard {_path(m)} in a group of its own (fully_shard({_name(m)}))", m))
        # (a group of unused modules alone never starts its forward; one tied to a used module cannot be apart)
        used = any(not trace.modules[x].unused for x in g.modules)
        for m in (m for m in g.modules if used and trace.modules[m].unused
                  and not any(trace.param(p).is_shared for p in subtree[m])):
            # (its params may be read all the same, by a module they are passed to: then they need a group that is
            # gathered when they are read, not one of their own)
            read = any(trace.index.param_uses[trace.index.param_index[p]] for p in subtree[m])
            out.append(Finding(Severity.WARNING, Code.LIST_GROUP_UNUSED,
                               f"{_path(m)} is never called in the step, inside list group {i} "
                               f"({fmt_modules(g.modules)}): the root's post-forward completes the group's forward "
                               "and hooks its pre-backward on each of the root's outputs, and an output whose grad "
                               "arrives after the group's post-backward gathers it again, which the prediction "
                               "does not replay (an all-gather more a step on a new user's model)",
                               f"leave {_path(m)}'s params to the root's group (other modules read them)" if read else
                               f"shard {_path(m)} in a group of its own (fully_shard({_name(m)})), never gathered",
                               m))
        for m in g.modules:
            calls = trace.forward_calls(m)
            if calls > 1:
                # a warning: the upstream bug does not hit every model (the fixture 'twice' trains with it)
                out.append(Finding(Severity.WARNING, Code.LIST_GROUP_REUSE,
                                   f"{_path(m)} runs {calls} times per step inside list group {i} "
                                   f"({fmt_modules(g.modules)}): a module of a list group reused later in the step "
                                   f"can fail in backward (pytorch#183702; not every model, so verify the plan)",
                                   f"shard {_path(m)} in a group of its own (fully_shard({_name(m)}))", m))
    return out


APART_SHARE = 0.05  # a list group held through others is said from this share of the model's params: below it,
# what it holds is small beside a block (the fp32 group of a ResNet's BatchNorms spans the step with 0.2%)


def _apart_findings(trace: Trace, plan: Plan) -> list[Finding]:
    """A list group whose modules run apart in forward (the first and the last block listed together, the unit
    size-based wrapping makes of a CNN's first conv and last linear): FSDP2 gathers it at the first one's
    pre-forward and reshards it after the last one's post-forward, so its params stay unsharded while the groups
    between run. Not where a tied param makes the modules one group; groups inside or around its modules are not
    counted as between (``_nested``)."""
    index, uses, events = trace.index.param_index, trace.index.param_uses, trace.events
    owner = {index[p]: j for j, g in enumerate(plan.inner_groups) for p in g.params if p in index}
    total = sum(p.numel for p in trace.params) or 1
    out = []
    for i, g in enumerate(plan.inner_groups):
        ps = [trace.param(p) for p in g.params if p in index]
        if len(g.modules) < 2 or any(p.is_shared for p in ps) or sum(p.numel for p in ps) < APART_SHARE * total:
            continue
        reads = sorted(e for p in ps for e in uses[index[p.fqn]] if not events[e].backward)
        between = _groups_between(trace, plan, i, reads, owner)
        if not between:
            continue
        nbytes = sum(p.numel * (trace.compute_itemsize or p.itemsize) for p in ps)
        first, last = (next((m for m in g.modules if is_within(events[e].module, m)), events[e].module)
                       for e in (reads[0], reads[-1]))
        later = [m for m in g.modules if m != first]
        out.append(Finding(Severity.WARNING, Code.LIST_GROUP_APART,
                           f"list group {i} ({fmt_modules(g.modules)}) is gathered at {_path(first)}'s forward and "
                           f"resharded after {_path(last)}'s: its {fmt_bytes(nbytes)} stay unsharded while "
                           f"{fmt_count(len(between), 'other group')} {'runs' if len(between) == 1 else 'run'} "
                           "between them "
                           f"({fmt_modules([plan.inner_groups[j].modules[0] for j in between])})",
                           "list together only modules that run one after another: give "
                           f"{fmt_modules(later)} {'a group of its own' if len(later) == 1 else 'groups of their own'}"
                           f" (fully_shard({_name(later[0])}))", g.modules[0]))
    return out


def _nested(theirs: Sequence[str], mine: Sequence[str]) -> bool:
    """Whether a group of ``theirs`` lies inside a group of ``mine`` (gathered within its calls) or around it (held
    around them whatever they list): either way not a group that runs between ``mine``'s modules."""
    return all(any(is_within(m, x) for x in mine) for m in theirs) or \
        all(any(is_within(x, m) for m in theirs) for x in mine)


def _groups_between(trace: Trace, plan: Plan, i: int, reads: list[int], owner: dict[int, int]) -> list[int]:
    """The inner groups other than ``i`` whose params forward reads between ``reads``' first and last events, in
    order; groups inside or around group ``i``'s modules left out (``_nested``)."""
    if not reads:
        return []
    mine = plan.inner_groups[i].modules
    out: dict[int, None] = {}
    for e in range(reads[0] + 1, reads[-1]):
        if trace.events[e].backward:
            continue
        for q in trace.events[e].params:
            j = owner.get(q)
            if j is not None and j != i and j not in out and not _nested(plan.inner_groups[j].modules, mine):
                out[j] = None
    return list(out)


def _recorded_outputs_findings(trace: Trace, plan: Plan) -> list[Finding]:
    """A sharded transformers sub-model that records outputs. transformers finds which outputs a model records
    (``_can_record_outputs``) by ``str(model.__class__)`` (``utils/output_capturing.py``), and ``fully_shard``
    swaps the class for ``FSDP<class>``: the lookup finds nothing, so its hidden states and attentions come back
    None even when asked for. A caller that reads them (LLaVA reads its vision tower's hidden states) fails with
    "'NoneType' object is not subscriptable". The root is left out: a causal LM's root passes the request on to
    its inner model, which records them."""
    out = []
    for g in plan.inner_groups:
        for m in g.modules:
            info = trace.modules.get(m)
            if info is None or m == ROOT or not info.records_outputs:
                continue
            out.append(Finding(
                Severity.WARNING, Code.RECORDED_OUTPUTS,
                f"{_path(m)} ({info.cls}) is sharded on its own: transformers looks up the outputs it records by "
                f"its class name, which fully_shard changes to FSDP{info.cls}, so its hidden states and attentions "
                "come back None; a caller that reads them fails (\"'NoneType' object is not subscriptable\")",
                f"shard its children (e.g. its layers) and leave {_name(m)} to an outer group; or, after "
                "fully_shard, register the new class: transformers.utils.output_capturing._CAN_RECORD_REGISTRY"
                f"[{_name(m)}] = {_name(m)}._can_record_outputs", m))
    return out


def _running_stats_findings(trace: Trace, plan: Plan) -> list[Finding]:
    """Checkpointed modules holding a norm that updates running statistics (BatchNorm in training): their
    recomputation in backward runs that forward again, so each step updates them twice (torch's checkpoint
    replays the forward as it ran, buffers' in-place updates included). One finding for all of them."""
    norms = [n for n, info in trace.modules.items() if info.running_stats]
    held = [m for m in (*plan.activation_checkpointing, *plan.selective_checkpointing)
            if any(is_within(n, m) for n in norms)]
    if not held:
        return []
    return [Finding(Severity.WARNING, Code.CHECKPOINTED_RUNNING_STATS,
                    f"{fmt_count(len(held), 'checkpointed module')} ({fmt_modules([_path(m) for m in held])}) hold "
                    "BatchNorm-style norms, whose running statistics the recomputation in backward updates a second "
                    "time each step (momentum applied twice: the statistics eval uses drift toward recent batches)",
                    "checkpoint modules without them, or put those norms in eval mode, or accept the double update",
                    held[0])]


def _aliased_inputs_findings(trace: Trace, plan: Plan) -> list[Finding]:
    """Modules a group lists (FSDP2 hooks them) whose call was given one tensor in two inputs or more: FSDP2's
    pre-forward passes a sharded module's grad-requiring inputs through an autograd function of its own, which
    returns each as a tensor of its own, so the module sees distinct tensors where its caller passed one, and may
    run otherwise than traced (nn.MultiheadAttention's ``query is key`` path: three projections, not one packed; a
    trial's ViT with each attention its own group measured 7.7% over the predicted peak). One finding for all."""
    listed = [m for g in plan.groups for m in g.modules if m != ROOT and trace.modules[m].aliased_inputs]
    if not listed:
        return []
    verb = "is" if len(listed) == 1 else "are"
    return [Finding(Severity.WARNING, Code.ALIASED_INPUTS,
                    f"{fmt_count(len(listed), 'listed nn.MultiheadAttention')} "
                    f"({fmt_modules([_path(m) for m in listed])}) {verb} given one tensor as query, key and value "
                    "(self-attention), which FSDP2's hooks on a module it shards hand over as distinct tensors: it "
                    "then projects them apart, not packed, and the step (its memory most) differs from the one "
                    "traced", "shard them with their parent (list the module that calls them instead)", listed[0])]


def _root_findings(trace: Trace, plan: Plan) -> list[Finding]:
    root = plan.root
    if not root.params:
        return []
    index, uses = trace.index.param_index, trace.index.param_uses
    # params the step never reads have their own finding (unused-params): remove them, not group them
    ps = [trace.params[index[p]] for p in root.params if uses[index[p]]]
    if not ps:
        return []
    itemsize = trace.compute_itemsize
    tp = plan.tensor_parallel if plan.tp_degree > 1 else None
    styles = tp.styles(trace.modules) if tp is not None else {}
    # what each rank holds: its TP shard of a sharded param (a new user read the whole model's bytes under TP 2)
    local = [local_param(p, param_style(p, styles), tp.degree) if tp is not None else p for p in ps]
    nbytes = sum(p.numel * (itemsize or p.itemsize) for p in local)
    owners = list(dict.fromkeys(o for p in ps for o in p.owners[:1]))
    return [Finding(Severity.WARNING, Code.ROOT_PARAMS,
                    f"the root group manages {fmt_count(len(ps), 'param')} ({fmt_bytes(nbytes)} unsharded"
                    f"{' on each TP rank' if tp is not None else ''}) of "
                    f"{fmt_modules([_path(o) for o in owners])}: FSDP2 all-gathers them at the root's pre-forward and, "
                    f"the root not resharding after forward, keeps them on every rank until the end of backward",
                    _root_fix(trace, plan, ps, ROOT in owners), owners[0])]


def _root_fix(trace: Trace, plan: Plan, ps: list[ParamInfo], on_root: bool) -> str:
    """How to take ``ps`` off the root group: groups of the modules holding them (a tied param's modules in one),
    and what cannot move (``on_root``: params registered on the root module itself)."""
    # a param read outside its module's calls (a parent's method reading head.proj.weight) is sharded-read unless
    # the group is a module whose calls hold every read: the lowest one holding the owner and its readers
    holding = {p.fqn: _holding(trace, p) for p in ps if p.owners[0] != ROOT}
    movable = [m for m in dict.fromkeys(holding.values()) if m != ROOT]
    # inside a repeated block, the block (around the groups below it): a LoRA model's module policy left 27 norms
    # and frozen projections of 4 blocks on the root, and the fix named each of them. Not a block whose group
    # would claim a root param read outside its calls (then sharded there: a review's finding)
    whole = [b for b in trace.index.block_instances
             if all(is_within(holding.get(p.fqn, ROOT), b) for p in ps if is_within(p.owners[0], b))]
    movable = list(dict.fromkeys(next((b for b in whole if is_within(m, b)), m) for m in movable))
    own_groups = "a group of its own" if len(movable) == 1 else "groups of their own"
    fix = f"give {fmt_modules(movable)} {own_groups} (fully_shard({_name(movable[0])}), ...)" if movable else ""
    for p in ps:
        if len(p.owners) > 1 and ROOT not in p.owners:  # a tied param: every module holding it in one group
            fix += f"; {p.fqn} is tied: fully_shard([{', '.join(_name(o) for o in p.owners)}])"
    if on_root:
        fix += ("; " if fix else "") + "params registered on the root module itself can only be managed by the " \
                                       "root: move them into a submodule to shard them"
    elif not movable:  # (a ParameterList the root's forward indexes: only the root's group is gathered there)
        fix = ("the root module's forward reads them, where only the root's group is gathered: read them inside a "
               "submodule's forward (one that owns them) to shard them")
    if plan.policy.startswith("auto(") and movable:  # auto tries them in groups kept gathered (prefer_empty_root)
        fix += ("; this plan is auto's, which keeps params on the root only where its search found them grouped "
                "slower, larger or unable to run")
    return fix


def _holding(trace: Trace, p: ParamInfo) -> str:
    """The lowest module whose subtree holds ``p``'s owner and every module whose forward ops read ``p`` (backward
    reads it where forward left it gathered)."""
    held = p.owners[0]
    for i in trace.index.param_uses[trace.index.param_index[p.fqn]]:
        if trace.events[i].backward:
            continue
        reader = trace.events[i].module
        while not is_within(reader, held):
            held = parent_of(held) if held != ROOT else ROOT
    return held


def _fsdp1_findings(trace: Trace, plan: Plan) -> list[Finding]:
    index = trace.index.param_index
    out = []
    for i, g in enumerate(plan.groups):
        ps = [trace.params[index[p]] for p in g.params]
        dtypes = sorted({p.dtype for p in ps})
        grads = {p.requires_grad for p in ps}
        where = f"FSDP1 unit {i} ({fmt_modules(g.modules)})"
        if len(dtypes) > 1:
            out.append(Finding(Severity.ERROR, Code.FSDP1_MIXED_UNIT,
                               f"{where} flattens params of several dtypes ({', '.join(dtypes)}) into one flat "
                               f"parameter, which FSDP1 refuses", "wrap each dtype's modules as units of their own",
                               g.modules[0]))
        if len(grads) > 1:
            out.append(Finding(Severity.ERROR, Code.FSDP1_MIXED_UNIT,
                               f"{where} mixes frozen and trainable params in one flat parameter, which FSDP1 refuses "
                               f"unless use_orig_params=True",
                               "pass use_orig_params=True, or wrap the frozen modules as units of their own",
                               g.modules[0]))
    return out

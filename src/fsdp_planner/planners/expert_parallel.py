"""Where a plan's expert parallelism comes from: the model's grouped experts modules (each param stacked on a
leading expert dim, as ``models/moe.py``'s ``GroupedExperts`` and transformers' experts layers hold them), the EP
degrees that divide both their expert count and the data-parallel shard ranks (x TP with tensor parallelism: EP's
ranks span the TP ranks, torchtitan's expert TP of 1), and a plan with EP applied to a plan without it (the
experts in their own groups: ``fsdp2/expert_groups.py``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from fsdp_planner.choices import ExpertPlacement, ShardPlacement
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_time
from fsdp_planner.fsdp2.checkpointing import modified_topk
from fsdp_planner.fsdp2.expert_groups import param_group_hosts, with_expert_groups
from fsdp_planner.fsdp2.expert_parallel import ExpertParallel
from fsdp_planner.fsdp2.plan import Mesh, Plan, divisors
from fsdp_planner.fsdp2.validity import modules_inside, own_calls_in_compiled_block
from fsdp_planner.hardware.cluster import Cluster
from fsdp_planner.models import ModelSpec, hf
from fsdp_planner.models.hf_experts import COMPILED_EP, NO_EP_TP, OTHER_EXPERTS, UNPRICED_EP
from fsdp_planner.planners.auto import AutoPolicy, AutoResult, ScreenedLayout, faster
from fsdp_planner.planners.auto.evaluator import Candidate
from fsdp_planner.planners.blocks import block_instances
from fsdp_planner.planners.tensor_parallel import TP_DEGREES, Layout, check_layout, is_titan_moe, tp_layout
from fsdp_planner.sim.expert_parallel import ep_params, ep_view
from fsdp_planner.sim.options import SimOptions, plan_options
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.sim.sizing import shard_dims
from fsdp_planner.sim.tensor_parallel import tp_params, tp_view
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import is_within, parent_of

EXPERT_CLASSES = ("GroupedExperts",)  # the built-in's; transformers' experts layers end in "Experts" too


def ep_refusal(model: ModelSpec, trace: Trace, tp_degree: int) -> str | None:
    """Why apply, export and verify do not run expert parallelism on the model's experts at TP ``tp_degree``
    (simulated only), None where they do: transformers' (``hf:`` models) with TP (``NO_EP_TP``) or inside compiled
    blocks (``COMPILED_EP``), experts layers
    other than its standard ones (``OTHER_EXPERTS``), or other experts whose rows are sized from data
    (``DATA_SIZED_EXPERTS``)."""
    if (said := token_list_experts(trace)) is not None:  # (any model's: EP cannot be applied to them at all)
        return said
    if not hf.is_hf(model.name):
        return DATA_SIZED_EXPERTS if data_sized_experts(trace) else None
    if tp_degree > 1:
        return NO_EP_TP
    if compiled_experts(trace) is not None:
        return COMPILED_EP
    classes = tuple(sorted({trace.modules[m].cls for m in expert_modules(trace)}))
    source = model.name.removeprefix(hf.PREFIX)
    return None if hf.standard_experts(source, model.hf_config, classes) else OTHER_EXPERTS


def ep_note(plan: Plan, trace: Trace, model: ModelSpec) -> str | None:
    """What a plan with EP leaves out: where apply does not run it, why (``ep_refusal``); where it runs
    transformers' experts, that its dispatch syncs with the host each layer (``UNPRICED_EP``). None for any other
    plan."""
    if plan.expert_parallel is None:
        return None
    return ep_refusal(model, trace, plan.tp_degree) or (UNPRICED_EP if hf.is_hf(model.name) else None)


# EP's dispatch (``apply/expert_parallel.py``) sends equal splits of each rank's (experts, rows, dim)
DATA_SIZED_EXPERTS = ("the expert parallelism of this plan is simulated with the same rows for each rank's experts, "
                      "but the layer around them sizes them from data (the data-dependent ops noted), so on real "
                      "ranks EP's all-to-all would get buffers of different sizes (gloo aborts, NCCL hangs): give "
                      "the experts a fixed capacity (rows = tokens x top_k / experts x a capacity factor) to run it")


def data_sized_experts(trace: Trace) -> bool:
    """Whether the layer around the experts sized their rows from data (a count read with ``.item()``, a
    ``nonzero`` selection): the balanced-routing stand-in made them equal on every rank; real routing does not."""
    layers = {parent_of(m) for m in expert_modules(trace)}
    return any(is_within(m, layer) for m in trace.stood_in for layer in layers)


# an experts module that picks its own tokens (the routing's data-dependent ops run in its forward), or multiplies the
# layer's token rows split by offsets (a 2-D ``torch._grouped_mm``), takes the layer's token list, not the
# (experts, rows, dim) block EP's dispatch sends it (``apply/expert_parallel.py``)
SELF_ROUTED_EXPERTS = ("expert parallelism sends each rank's experts a block of (experts, rows, dim) routed rows, and "
                       "this model's experts modules select their own tokens (data-dependent ops in their forward, "
                       "noted): EP cannot run them, nor be simulated as it would run; plan it without --ep")
OFFSET_ROWS_EXPERTS = ("expert parallelism here sends each rank's experts a block of (experts, rows, dim) routed rows "
                       "(models/moe.py's GroupedExperts), and this model's experts modules take the layer's token rows "
                       "split by offsets (a torch._grouped_mm of 2-D rows), which that dispatch cannot send and whose "
                       "token-count dispatch is not modelled: plan it without --ep, or give the experts (experts, "
                       "rows, dim) inputs")


def token_list_experts(trace: Trace) -> str | None:
    """Why EP cannot run the model's experts modules, which take the layer's token list (``SELF_ROUTED_EXPERTS``,
    ``OFFSET_ROWS_EXPERTS``, or a first input that is no (experts, rows, dim) block: ``flat_input_experts``); None
    where they take EP's block."""
    experts = expert_modules(trace)
    if any(is_within(m, e) for m in trace.stood_in for e in experts):
        return SELF_ROUTED_EXPERTS
    if any(is_within(m, e) for m in trace.offset_rows for e in experts):
        return OFFSET_ROWS_EXPERTS
    return flat_input_experts(trace, experts)


def flat_input_experts(trace: Trace, experts: list[str]) -> str | None:
    """Why EP's dispatch cannot send the model's experts their input: an experts module (not transformers', whose
    layers run transformers' own EP on (tokens, dim) rows) whose first input was not 3-D (a trial's experts took
    (tokens, dim) rows and indexed their stacked weights by expert ids: planned, chosen by auto and exported with
    EP, refused by every rank)."""
    for e in experts:
        info = trace.modules[e]
        if not info.from_transformers and info.input_dims not in (-1, 3):
            return (f"expert parallelism sends each rank's experts a block of (experts, rows, dim) routed rows "
                    f"(models/moe.py's GroupedExperts), and {info.cls} ('{e}') takes a {info.input_dims}-D input, "
                    "which that dispatch cannot send: plan it without --ep, or give the experts (experts, rows, "
                    "dim) inputs")
    return None


def check_ep_applies(trace: Trace) -> None:
    """Refuse ``--ep`` (or a plan file's EP) on experts that take the layer's token list (``token_list_experts``)."""
    if (said := token_list_experts(trace)) is not None:
        raise PlannerError(said)


def check_dispatch_runs(plan: Plan, trace: Trace, model: ModelSpec) -> None:
    """Refuse, before real ranks start, EP of experts whose rows the model sizes from data (transformers' experts
    take their own dispatch, which sends the counts routing gives), and EP of experts that select their own tokens."""
    if plan.expert_parallel is not None:
        check_ep_applies(trace)
    if plan.expert_parallel is not None and not hf.is_hf(model.name) and data_sized_experts(trace):
        raise PlannerError(DATA_SIZED_EXPERTS)


def runs_ep(model: ModelSpec, trace: Trace, tp_degree: int) -> bool:
    """Whether apply, export and verify run expert parallelism on the model's experts (``ep_refusal``)."""
    return ep_refusal(model, trace, tp_degree) is None


def compiled_experts(trace: Trace) -> tuple[str, str] | None:
    """The first expert module inside a block ``--compile`` compiles whole, and that block (None: none is). EP runs
    there with the experts sharded in their blocks' calls only (a per-param mesh: no hooks of their own, EP's
    all-to-alls traced into the block's graph, as torchtitan's ``apply_compile`` compiles its MoE blocks whole with
    EP); in calls of their own FSDP2's hooks would run inside the graph (``own_calls_in_compiled_block``)."""
    return next(modules_inside(expert_modules(trace), trace.compiled), None) if trace.compiled else None


def expert_modules(trace: Trace) -> list[str]:
    """Modules that hold grouped experts: a class named ``...Experts`` whose own params share one leading dim (the
    experts) above 1, stacked weights at least 3-D and any biases 2-D (gpt-oss's experts have both)."""
    out = []
    for name, info in trace.modules.items():
        params = [trace.param(p) for p in info.params]
        lead = {p.shape[0] for p in params if len(p.shape) >= 2}
        if params and info.cls.endswith("Experts") and len(lead) == 1 and lead.pop() > 1 \
                and all(len(p.shape) >= 2 for p in params) and any(len(p.shape) >= 3 for p in params):
            out.append(name)
    return out


def no_experts(trace: Trace) -> str:
    """Why ``--ep`` finds nothing to split: no ``...Experts`` class, or one whose weights are not stacked on an
    expert dim in the module itself (DBRX's keep them flattened, 2-D, in a child)."""
    other = sorted({info.cls for info in trace.modules.values() if info.cls.endswith("Experts")})
    if not other:
        return ("expert parallelism needs grouped experts modules (params stacked on an expert dim, a class named "
                "...Experts); this model has none")
    holds = "does not hold its" if len(other) == 1 else "do not hold their"
    return (f"expert parallelism needs grouped experts modules, and {', '.join(other)} {holds} experts' weights "
            "as its own params stacked on a leading dim of several experts (3-D, e.g. [experts, out, in]), which is "
            "what EP splits: plan this model without --ep")


def expert_count(trace: Trace, experts: list[str]) -> int:
    """The number of experts each expert module holds (their common leading dim)."""
    counts = {trace.param(p).shape[0] for m in experts for p in trace.modules[m].params}
    if len(counts) != 1:
        raise PlannerError(f"the expert modules hold different expert counts {sorted(counts)}: name one kind of "
                           "expert module for expert parallelism")
    return counts.pop()


def ep_degrees(trace: Trace, shard: int) -> list[int]:
    """EP degrees a model allows on ``shard`` data-parallel shard ranks: divisors of the expert count that divide
    the shard ranks (EP's ranks come out of dp_shard); [1] for a model without grouped experts."""
    experts = expert_modules(trace)
    if not experts:
        return [1]
    n = expert_count(trace, experts)
    return [d for d in divisors(n) if shard % d == 0]


# How the planner's EP plans shard the experts: in their block's fully_shard call on a per-param mesh, as
# torchtitan's apply_fsdp does since pytorch/torchtitan#2281 (March 2026). A plan file saying per_param_mesh false
# (or written before it was recorded) keeps the expert modules' own calls, as torchtitan did before.
PER_PARAM_MESH = True
BOTH_PLACEMENTS = (PER_PARAM_MESH, not PER_PARAM_MESH)  # what an EP screen tries unless told: torchtitan's first


def screen_placement(policy: AutoPolicy) -> ShardPlacement | None:
    """The shard dims auto's EP screens give a plan: torchtitan's rule for experts (``ShardPlacement.AUTO``: dim 1
    where dim 0 would pad) where auto chooses the placement, as a classic policy's EP plan has it
    (``service/planning.expert_placement``); else the plan's own. The search chose its dims without EP, where E
    experts divide the shard ranks that E / EP need not (DeepSeek-V3 on 512 H100s, EP 32: 8 experts over 16 ranks
    padded on dim 0, 55 blocks checkpointed to fit at 8.51 s on HSDP 2x256; on dim 1 48, 8.40 s on 1x512). The
    user's ``--shard-placement`` decides where given (``auto``: this rule; ``dim0``: the plan's own dims)."""
    if policy.keeps_placement:
        return ShardPlacement.AUTO if policy.options.shard_placement is ShardPlacement.AUTO else None
    return ShardPlacement.AUTO


def per_param_meshes(placement: ExpertPlacement | None, trace: Trace) -> tuple[bool, ...]:
    """The ``per_param_mesh`` values an EP screen tries: the user's ``placement`` (``--ep-placement``), else both;
    experts inside compiled blocks in their blocks' calls only (``compiled_experts``)."""
    compiled = compiled_experts(trace)
    if compiled is not None and placement is ExpertPlacement.OWN:
        raise PlannerError(own_calls_in_compiled_block(*compiled))
    if compiled is not None:
        return (True,)
    if placement is None:
        return BOTH_PLACEMENTS
    return (placement is ExpertPlacement.BLOCKS,)


def with_expert_parallel(plan: Plan, trace: Trace, degree: int, skew: float = 1.0, shard: int = 0,
                         placement: ShardPlacement | None = None, per_param_mesh: bool = PER_PARAM_MESH) -> Plan:
    """``plan`` with EP of ``degree`` over the model's expert modules, each its own group (sharded in its block's
    call where ``per_param_mesh``); degree 1: no EP.
    A plan with shard dims gets them again at the experts' own shard ranks (``shard``: the data-parallel shard
    ranks; the placement rule of ``ShardPlacement.AUTO``), and so does one without where ``placement`` is AUTO
    (without EP every param may divide on dim 0, E / EP experts need not)."""
    if degree == 1:
        return plan.replace(expert_parallel=None)
    experts = expert_modules(trace)
    if not experts:
        raise PlannerError(no_experts(trace))
    if (compiled := compiled_experts(trace)) is not None and not per_param_mesh:
        raise PlannerError(own_calls_in_compiled_block(*compiled))
    check_ep_applies(trace)
    tp = plan.tp_degree
    if tp > 1 and degree % tp:
        raise PlannerError(f"expert parallelism of degree {degree} with TP {tp}: EP's ranks span the TP ranks "
                           f"(torchtitan's expert TP of 1), so the EP degree must be a multiple of {tp}")
    if shard and shard % (degree // tp):
        fits = [str(d) for d in ep_degrees(trace, shard * tp) if d % tp == 0 and shard % (d // tp) == 0 and d > 1]
        ranks = f"{shard * tp} data-parallel shard x TP ranks" if tp > 1 else f"{shard} data-parallel shard ranks"
        raise PlannerError(f"expert parallelism of degree {degree} does not divide the {ranks} (EP's ranks come out "
                           "of dp_shard" + (" x tp" if tp > 1 else "") + "): " +
                           (f"choose one of {', '.join(fits)}" if fits else "no EP degree above 1 divides them"))
    out = with_expert_groups(plan.replace(expert_parallel=ExpertParallel(degree, tuple(experts), skew,
                                                                         per_param_mesh)), trace)
    auto_dims = bool(plan.shard_dims) or placement is ShardPlacement.AUTO  # (dim 0 may divide without EP only)
    if auto_dims and shard:
        # of the tensors FSDP2 shards: under TP, one TP rank's local ones (a TP view's params already are)
        local = tp_params(trace, plan.tensor_parallel) if tp > 1 and not trace.tensor_parallel else trace
        out = out.replace(shard_dims=shard_dims(ep_params(local, out), shard, ShardPlacement.AUTO))
    return out


@dataclass(frozen=True)
class EPOption:
    """One EP layout of a plan, simulated: its degree, whether the expert groups stay unsharded after forward
    (their backward all-gathers saved for E / EP experts' memory), the plan and its step."""

    degree: int
    keep_experts: bool
    plan: Plan
    step: StepReport
    in_full: bool = False  # its op-level checkpointed blocks checkpointed in full instead (``_in_full``)
    titan_groups: bool = False  # torchtitan's grouping, not auto's (``_block_options``)

    def describe(self, where: bool = True, flat: int = 0) -> str:
        """"EP 8 (experts kept after forward) on 4x16"; ``where``: with its mesh where it is HSDP (and, given the
        world size ``flat``, where it is pure FSDP: beside HSDP options)."""
        mesh = self.plan.mesh or (Mesh.flat(flat) if flat else None)
        where = f" on {mesh.describe()}" if where and mesh is not None and (mesh.replicate > 1 or flat) else ""
        own = self.plan.expert_parallel is not None and not self.plan.expert_parallel.per_param_mesh
        kept = ["experts' own calls"] * own + \
            [("kept" if own else "experts' blocks kept") + " after forward"] * self.keep_experts
        said = ", ".join(["torchtitan's groups"] * self.titan_groups + kept +
                         ["op-level blocks in full"] * self.in_full)
        return (f"EP {self.degree}" + (f" ({said})" if said else "") if self.degree > 1 else "no EP") + where


def ep_options(trace: Trace, plan: Plan, cluster: Cluster, options: SimOptions, skew: float = 1.0,
               degrees: tuple[int, ...] = (), views: dict[tuple, Trace] | None = None,
               without: bool = True, placement: ShardPlacement | None = None,
               per_param: tuple[bool, ...] = BOTH_PLACEMENTS) -> list[EPOption]:
    """``plan`` (without EP; ``without``: simulated so too, first) under ``degrees`` (default every EP degree the
    model and its shard ranks allow), the experts in their blocks' calls (torchtitan's) or in calls of their own
    (which can keep them unsharded after forward apart from their blocks), resharded after forward or kept: each
    simulated. The EP screen a search runs after choosing its groups; deterministic, 4 simulations a degree.
    ``views``: the EP views built so far, by EP signature (one per degree, whatever the mesh: a view is one EP
    rank's step). A plan with TP is screened on one TP rank's view (``trace`` and ``cluster`` that view's).
    ``placement``: AUTO shards the experts by auto's rule on their EP view (``with_expert_parallel``);
    ``per_param``: the experts' placements tried (``per_param_meshes``)."""
    shard = plan.shard_size(cluster.world_size * (plan.tp_degree if trace.tensor_parallel else 1))
    out = [EPOption(1, False, plan, simulate(trace, plan, cluster, options, timeline=False))] if without else []
    views = {} if views is None else views
    for degree in degrees or ep_degrees(trace, shard)[1:]:
        for mesh in per_param:
            ep_plan = with_expert_parallel(plan, trace, degree, min(skew, degree), shard, placement, mesh)
            if ep_plan.expert_parallel.per_param_mesh != mesh:  # an int reshard keeps the own calls: the blocks'
                # placement asked for is tried with those calls resharded after forward (a trial's torchtitan job
                # lost auto's flat layout to EP so, and auto came out 10% slower than the job's one-key edit)
                ep_plan = with_expert_parallel(_ints_resharded(plan), trace, degree, min(skew, degree), shard,
                                               placement, mesh)
                if ep_plan.expert_parallel.per_param_mesh != mesh:
                    continue
            key = ep_plan.expert_parallel.signature()
            if key not in views:
                views[key] = ep_view(trace, ep_plan).trace
            for keep in (False, True):
                p = ep_plan if not keep else _experts_kept(ep_plan, trace)
                out.append(EPOption(degree, keep, p, simulate(views[key], p, cluster, options, timeline=False)))
    return out


def _ints_resharded(plan: Plan) -> Plan:
    """``plan`` with each group resharding to an int after forward resharded whole instead (FSDP2 reshards no
    DTensor param of a per-param mesh to an int)."""
    return plan.replace(groups=[replace(g, reshard_after_forward=True) if not isinstance(g.reshard_after_forward, bool)
                                else g for g in plan.groups])


def _fastest(option: EPOption) -> tuple:
    """The order EP options are chosen in: the fastest step, then the fewer EP ranks, resharding, and torchtitan's
    layout (the experts in their blocks' calls) on a tie."""
    ep = option.plan.expert_parallel
    return option.step.step_time, option.degree, option.keep_experts, not (ep is None or ep.per_param_mesh)


def _experts_kept(plan: Plan, trace: Trace) -> Plan:
    """``plan`` with its expert groups kept unsharded after forward; on a per-param mesh their blocks too (one
    fully_shard call reshards both alike, ``param_group_hosts``)."""
    kept = {i for i, g in enumerate(plan.groups) if g.modules[0] in plan.expert_parallel.modules}
    kept.update(param_group_hosts(plan, trace).values())
    return plan.replace(groups=[replace(g, reshard_after_forward=False) if i in kept else g
                                for i, g in enumerate(plan.groups)])


def hsdp_ep_options(result: AutoResult, trace: Trace, cluster: Cluster, options: SimOptions,
                    views: dict[tuple, Trace], degrees: tuple[int, ...] = (),
                    per_param: tuple[bool, ...] = BOTH_PLACEMENTS,
                    placement: ShardPlacement | None = None) -> list[EPOption]:
    """EP (``degrees``; none given: each its dp_shard allows) on auto's other data-parallel layouts
    (``result.meshes``: each one's best plan, without TP; pure FSDP among them where auto chose HSDP), EP's ranks out
    of their dp_shard and the experts replicated over dp_replicate as torchtitan lays them out: EP shrinks the
    experts' shards, which can bring a layout over the budget without EP within it, and a wider dp_shard takes
    more EP (OLMoE on 64 H100s: auto chose 2x32 without EP and screened EP there alone; 1x64 with EP 8 is 7%
    faster)."""
    out: list[EPOption] = []
    chosen = result.plan.mesh or Mesh.flat(cluster.world_size)
    for cand in result.meshes.values():
        mesh = cand.plan.mesh or Mesh.flat(cluster.world_size)
        if cand.runs and cand.plan.tp_degree == 1 and mesh != chosen and \
                (mesh.replicate > 1 or chosen.replicate > 1) and all(mesh.shard % d == 0 for d in degrees):
            plan = cand.plan.running(result.run)
            plan = plan.replace(groups=[replace(g, forward_prefetch=(), backward_prefetch=()) for g in plan.groups])
            out.extend(ep_options(trace, plan, cluster, plan_options(plan, options), degrees=degrees, views=views,
                                  without=False, placement=placement, per_param=per_param))
    return out


def best_ep_option(found: list[EPOption], budget: float) -> EPOption | None:
    """The fastest of ``found`` whose reserved memory fits ``budget`` bytes (None: none fits)."""
    fitting = [o for o in found if o.step.reserved_memory <= budget]
    return min(fitting, key=_fastest) if fitting else None


def with_auto_ep(result: AutoResult, trace: Trace, cluster: Cluster, options: SimOptions, degrees: tuple[int, ...],
                 note: Callable[[str], None] | None = None, per_param: tuple[bool, ...] = BOTH_PLACEMENTS,
                 placement: ShardPlacement | None = None) -> AutoResult:
    """Auto's ``result`` under expert parallelism: its plan's groups under each of ``degrees`` (the user's; none
    given: no EP and every degree the model and its shard ranks allow, each screened and ``note``d), on its layout
    and auto's other HSDP ones, the expert groups resharded after forward or kept, the fastest that fits (else the
    one holding least, over the budget); ``per_param``: the experts' placements tried (``per_param_meshes``);
    ``placement``: their shard dims (``screen_placement``)."""
    tp = result.plan.tensor_parallel
    if tp is not None and tp.degree > 1:  # screened on one TP rank's view, EP's ranks spanning TP's
        if not degrees:
            raise PlannerError("auto screens expert parallelism with TP only at the degree given: add --ep")
        view = tp_view(trace, tp, cluster, options.float8 or result.plan.float8)
        trace, cluster = view.trace, view.cluster
    views: dict[tuple, Trace] = {}
    found = _ep_candidates(result, trace, cluster, options, degrees, views, per_param, placement)
    if not result.fixed_checkpointing:
        found += _in_full(found, views, cluster, options, result.memory.fits) + \
            _op_level_everywhere(found, trace, views, cluster, options, result.memory.fits)
        if not result.fits or (degrees and not any(result.memory.fits(o.step.reserved_memory) for o in found)) \
                or _faster_over_budget(found, result):
            # (the EP asked for: auto's groups fit without it and not under it, where the expert's grouping may, as
            # a job's own can; auto's own screen: an EP option faster than its plan that does not fit, checkpointed
            # as the step without EP was (Qwen3-30B-A3B on 16 H100s, batch 1 x 4096: EP 8 675 ms in 77.1 GiB
            # against 828 ms without EP; torchtitan's grouping with the blocks it needs in full, 652 ms, fits)
            found += _block_options(result, trace, cluster, options, found, views, per_param, placement)
    fitting = [o for o in found if result.memory.fits(o.step.reserved_memory)]
    best = min(fitting, key=_fastest) if fitting else \
        min(found, key=lambda o: o.step.reserved_memory)
    if fitting and best.degree > 1 and not result.fixed_checkpointing:
        relaxed = _relaxed_checkpointing(best, views[best.plan.expert_parallel.signature()], cluster,
                                         plan_options(best.plan, options), result.memory.fits)
        found = [relaxed if o is best else o for o in found]  # (its line says what is chosen)
        best = relaxed
    if note is not None and len(found) > 1:
        note(_screen_line(found, result, cluster, options))
    # a TP view's lines without EP go: under EP torchtitan's MoE layout splits the experts' tokens over TP
    # (``token_split``), which runs only with EP (its experts tensor-parallel, ``expert_tensor``, are another layout)
    meshes = {**(result.meshes if tp is None or tp.degree == 1 else {}), **_lines(found, result, cluster)}
    if best.degree == 1:
        return replace(result, meshes=meshes) if best.plan is result.plan else \
            replace(result, plan=best.plan, report=best.step, meshes=meshes)
    label = f"{_on_mesh(result.plan.policy, best.plan.mesh, cluster)}, {best.describe(where=False)}"
    if not best.plan.activation_offloading:  # (the expert's grouping in place of auto's last resort: none offloaded)
        label = label.replace(", ac offload", "", 1)
    return replace(result, plan=best.plan.replace(policy=label), run=best.plan.run, report=best.step,
                   fits=bool(fitting), meshes=meshes, ep_given=bool(degrees))


def _ep_candidates(result: AutoResult, trace: Trace, cluster: Cluster, options: SimOptions, degrees: tuple[int, ...],
                   views: dict[tuple, Trace], per_param: tuple[bool, ...],
                   placement: ShardPlacement | None) -> list[EPOption]:
    """``with_auto_ep``'s options: auto's plan under ``degrees`` (none: without EP too, as searched) on its layout,
    then on auto's other layouts (``hsdp_ep_options``); the user's EP that the chosen layout's dp_shard does not take
    runs on the others that do (refused where none does)."""
    written = result.written_plan  # explicit prefetch lists name groups by position, which the experts' own
    # groups move: FSDP2's implicit prefetching instead
    written = written.replace(groups=[replace(g, forward_prefetch=(), backward_prefetch=()) for g in written.groups])
    refused = None
    try:
        found = ep_options(trace, written, cluster, plan_options(written, options), degrees=degrees, views=views,
                           placement=placement, per_param=per_param)
    except PlannerError as e:  # the user's EP does not divide the chosen layout's dp_shard: another layout's may
        if not degrees:
            raise
        found, refused = [], e
    if degrees:
        found = found[1:]  # the user's EP, not the plan without it
    else:
        found[0] = replace(found[0], plan=result.plan, step=result.report)  # no EP: auto's own plan, as searched
    found += hsdp_ep_options(result, trace, cluster, options, views, degrees, per_param, placement)
    if not found and refused is not None:
        raise refused
    return found


def _in_full(found: list[EPOption], views: dict[tuple, Trace], cluster: Cluster, options: SimOptions,
             fits: Callable[[float], bool]) -> list[EPOption]:
    """The EP options over the budget that checkpoint blocks op-level, those blocks checkpointed in full instead:
    the search chose op-level for a step without EP, and torchtitan's op-level list keeps what EP's all-to-alls
    receive (``fsdp2/selective.py``), an MoE layer's routed tokens twice over, which full checkpointing does not
    (Qwen3-30B-A3B, EP 8 on 16 H100s: over the budget op-level, within it in full). The relaxation then
    checkpoints fewer of them where that fits."""
    out = []
    for o in _over_op_level(found, fits):
        plan = o.plan
        full = plan.replace(activation_checkpointing=(*plan.activation_checkpointing, *plan.selective_checkpointing),
                            selective_checkpointing={})
        out.append(_option(o, full, views, cluster, options, in_full=True))
    return out


def _op_level_everywhere(found: list[EPOption], trace: Trace, views: dict[tuple, Trace], cluster: Cluster,
                         options: SimOptions, fits: Callable[[float], bool]) -> list[EPOption]:
    """The EP options over the budget that checkpoint some blocks op-level, every block checkpointed so: the search
    left the last blocks uncheckpointed for a step without EP, whose all-to-alls' received tokens EP adds, where the
    expert's configuration checkpoints every block op-level and fits (torchtitan's DeepSeek-V3 16B job on 8 H100s,
    EP 8: auto's groups with its last block left out 70.3 GiB, over the budget; every block op-level 69.7 GiB and
    faster than the same blocks in full). The relaxation then checkpoints fewer where that fits."""
    out = []
    blocks = block_instances(trace)
    for o in _over_op_level(found, fits):
        plan = o.plan
        policy = next(iter(plan.selective_checkpointing.values()))
        held = (*plan.activation_checkpointing, *plan.selective_checkpointing)
        more = {b: policy for b in blocks if not any(is_within(b, m) or is_within(m, b) for m in held)
                and modified_topk(trace, b, policy) is None}
        if more:
            every = plan.replace(selective_checkpointing={**plan.selective_checkpointing, **more})
            out.append(_option(o, every, views, cluster, options))
    return out


WORTH_CHECKPOINTING = 0.01  # an EP option over the budget this much faster than auto's plan is screened again with
# the checkpointing it needs (below it, a tie the extra simulations would not change)


def _faster_over_budget(found: list[EPOption], result: AutoResult) -> bool:
    """Whether an EP option of ``found`` is over the budget and faster than ``result``'s plan by more than
    ``WORTH_CHECKPOINTING``, none fitting: more checkpointing may bring it within."""
    ep = [o for o in found if o.degree > 1]
    return not any(result.memory.fits(o.step.reserved_memory) for o in ep) and \
        any(o.step.step_time < result.report.step_time * (1 - WORTH_CHECKPOINTING) for o in ep)


def _over_op_level(found: list[EPOption], fits: Callable[[float], bool]) -> list[EPOption]:
    """The EP options of ``found`` that checkpoint some modules op-level and are over the budget."""
    return [o for o in found if o.degree > 1 and o.plan.selective_checkpointing and not fits(o.step.reserved_memory)]


def _option(like: EPOption, plan: Plan, views: dict[tuple, Trace], cluster: Cluster, options: SimOptions,
            in_full: bool = False) -> EPOption:
    """``like``'s EP option with ``plan`` (its EP layout, other checkpointing), simulated on its EP view."""
    view = views[plan.expert_parallel.signature()]
    return replace(like, plan=plan, step=simulate(view, plan, cluster, plan_options(plan, options), timeline=False),
                   in_full=in_full or like.in_full)


BLOCK_OPTIONS = 3  # the layouts of torchtitan's grouping whose checkpointing is fitted (``_block_options``),
# beside each layout's and placement's fastest


def _block_options(result: AutoResult, trace: Trace, cluster: Cluster, options: SimOptions, found: list[EPOption],
                   views: dict[tuple, Trace], per_param: tuple[bool, ...] = BOTH_PLACEMENTS,
                   placement: ShardPlacement | None = None) -> list[EPOption]:
    """Where nothing fit without EP (or, with the EP asked for, nothing under it), torchtitan's grouping (the titan
    baseline: a group per block) under each EP
    degree screened, in each of ``per_param``'s placements, on the degree's best layout and on pure FSDP, every block
    checkpointed in full; the ``BLOCK_OPTIONS`` fastest of those, and each layout's and placement's fastest, then
    with the fewest leading blocks checkpointed in full that let them fit (``placement``: the shard dims). Auto's
    own groups were chosen for a step EP did not shrink, and can be slower under EP than the expert's
    (Qwen3.5-397B-A17B on 256 H100s, EP 64: auto's groups 5.86 s a step on HSDP 2x128, titan's with every block
    checkpointed 5.56 s on 1x256); nor need torchtitan's grouping run best at the degree or placement auto's groups
    do (DeepSeek-V3 on 256 H100s: auto's groups best at EP 256 in the experts' own calls, 9.09 s; torchtitan's in
    their blocks' calls with every block checkpointed 9.02 s at EP 64, 8.65 s at EP 32)."""
    titan = next((c for name, c in result.baselines.items() if name.startswith("titan")), None)
    screened = [o for o in found if o.degree > 1 and o.plan.tp_degree == 1]
    if titan is None or not screened or trace.tensor_parallel or titan.plan.tp_degree > 1:  # (TP's EP: its own)
        return []
    blocks = block_instances(trace)
    base = titan.plan.running(result.run)  # (the memory options the search ran with: shard dims, offload)
    # (the expert's checkpointing, in full: none of auto's activation offloading, on the blocks that checkpoints, a
    # plan FSDP2 cannot run: the review)
    base = base.replace(activation_checkpointing=(), selective_checkpointing={}, activation_offloading=(),
                        groups=[replace(g, forward_prefetch=(), backward_prefetch=()) for g in base.groups])
    flat = Mesh.flat(cluster.world_size)
    searched = {c.plan.mesh or flat for c in result.meshes.values()}  # (a --mesh given: that one alone)
    own = [g.modules for g in base.groups] != [g.modules for g in result.plan.groups]  # (said where they differ)
    best: dict[int, EPOption] = {}
    for o in sorted(screened, key=lambda o: _rank(o, result)):
        best.setdefault(o.degree, o)
    in_full = []
    for like in best.values():
        for mesh in dict.fromkeys(m for m in (like.plan.mesh or flat, flat) if m in searched):
            for per_param_mesh in per_param:
                plan = base.replace(mesh=None if mesh == flat else mesh)
                try:
                    ep_plan = with_expert_parallel(plan, trace, like.degree, like.plan.expert_parallel.skew,
                                                   plan.shard_size(cluster.world_size), placement, per_param_mesh)
                except PlannerError:  # (a degree the layout's shard ranks do not take)
                    continue
                key = ep_plan.expert_parallel.signature()
                if key not in views:
                    views[key] = ep_view(trace, ep_plan).trace
                full = ep_plan.replace(activation_checkpointing=tuple(blocks))
                in_full.append(EPOption(like.degree, False, full, simulate(views[key], full, cluster,
                                                                           plan_options(full, options),
                                                                           timeline=False), titan_groups=own))
    ranked = sorted(in_full, key=lambda o: _rank(o, result))
    firsts: dict[tuple, EPOption] = {}  # each layout's and placement's fastest too: a wider shard holds less, so
    for o in ranked:  # it may fit with fewer blocks checkpointed (DeepSeek-V3 on 512 H100s, EP 32: in full 2x256
        # ran faster than 1x512, which fit with 48 blocks where 2x256 needed 55, 8.40 against 8.51 s)
        firsts.setdefault((o.plan.mesh, o.plan.expert_parallel.per_param_mesh), o)
    fitted = []
    for o in {id(o): o for o in [*ranked[:BLOCK_OPTIONS], *firsts.values()]}.values():
        none = _option(o, o.plan.replace(activation_checkpointing=()), views, cluster, options)
        fitted.append(_checkpointed_to_fit(none, views[o.plan.expert_parallel.signature()], blocks, cluster,
                                           options, result.memory.fits))
    return in_full + fitted


def _screen_line(found: list[EPOption], result: AutoResult, cluster: Cluster, options: SimOptions) -> str:
    """The EP screen's note: each option's step (and memory where it does not fit), pure FSDP's named beside
    HSDP's."""
    tp = result.plan.tensor_parallel
    hsdp = any(o.plan.mesh is not None and o.plan.mesh.replicate > 1 for o in found)
    flat = cluster.world_size if hsdp and (tp is None or tp.degree == 1) else 0
    split = f", {options.micro_batches} micro-batches" if options.micro_batches > 1 else ""
    where = "its groups and the experts in their blocks' calls where not said otherwise"
    return f"auto's EP screen ({where}{split}): " + ", ".join(
        f"{o.describe(flat=flat)} {fmt_time(o.step.step_time)}" + (
            "" if result.memory.fits(o.step.reserved_memory)
            else f" ({fmt_bytes(o.step.reserved_memory)}, does not fit)") for o in _shown(found, result))


def _on_mesh(policy: str, mesh: Mesh | None, cluster: Cluster) -> str:
    """Auto's label (``auto(h100:64, 70.8 GiB, hsdp 2x32)``) naming ``mesh``, the layout its EP option runs on."""
    mesh = mesh or Mesh.flat(cluster.world_size)
    hsdp = f", hsdp {mesh.describe()}" if mesh.replicate > 1 else ""
    if re.search(r", hsdp \d+x\d+", policy):
        return re.sub(r", hsdp \d+x\d+", hsdp, policy, count=1)
    return policy[:-1] + hsdp + ")" if policy.startswith("auto(") and policy.endswith(")") else policy


def _relaxed_checkpointing(best: EPOption, view: Trace, cluster: Cluster, options: SimOptions,
                           fits: Callable[[float], bool]) -> EPOption:
    """``best`` (an EP option that fits) checkpointing fewer modules, where that fits and is faster: the search chose
    its checkpointing for the step without EP, whose experts' shards EP shrinks, so it can checkpoint more than it
    needs (Qwen3-30B-A3B on 32 H100s, EP 8: 12 blocks op-level, 680 ms in 57.2 GiB, where none fit in 65.1 GiB at
    653 ms). A binary search for the fewest of its checkpointed modules, in its order, that fit (fewer mostly save
    more; a checkpointed block's held input can make one more hold more, so the search may stop short of the
    fewest), the fastest of those it simulated that fits kept."""
    plan = best.plan
    kept = [*((m, None) for m in plan.activation_checkpointing), *plan.selective_checkpointing.items()]
    if not kept:
        return best

    def first(n: int) -> EPOption:
        full = tuple(m for m, p in kept[:n] if p is None)
        sac = {m: p for m, p in kept[:n] if p is not None}
        p = plan.replace(activation_checkpointing=full, selective_checkpointing=sac)
        return replace(best, plan=p, step=simulate(view, p, cluster, options, timeline=False))

    lo, hi, fitting = 0, len(kept), [best]  # ``hi`` modules fit
    while lo < hi:
        mid = (lo + hi) // 2
        option = first(mid)
        if fits(option.step.reserved_memory):
            hi = mid
            fitting.append(option)
        else:
            lo = mid + 1
    return min(fitting, key=lambda o: o.step.step_time)


def with_own_ep(result: AutoResult, policy: AutoPolicy, trace: Trace, model: str, cluster: Cluster,
                options: SimOptions, note: Callable[[str], None] | None = None) -> AutoResult:
    """Auto's own EP screen (no ``--ep``) for a model with grouped experts, ``result`` being ``policy``'s search:
    on its plan without TP (``with_auto_ep``); where the search took TP (the experts tensor-parallel, torchtitan's
    MoE layout without EP), on the best plan of the same search without TP too, and the faster within the budget
    kept (else the one holding least): EP without TP is not given up for TP's experts without a look."""
    if result.plan.tp_degree == 1:
        return with_auto_ep(result, trace, cluster, options, (), note, per_param_meshes(policy.ep_placement, trace),
                            screen_placement(policy))
    if len(policy.tensor_parallel) <= 1 or policy.mesh is not None:  # a TP layout or mesh the user fixed: as asked
        return result
    flat_policy = replace(policy, tensor_parallel=())
    # choosing among TP layouts, the search searched the one without TP in full: that search not run twice (its
    # plans and seconds are counted in ``result``'s already)
    done = result.searched_without_tp(flat_policy, trace)
    searched = replace(done, evaluated=0, seconds=0.0) if done is not None else flat_policy.search(trace, model)
    flat = with_auto_ep(searched, trace, cluster, options, (), note, per_param_meshes(policy.ep_placement, trace),
                        screen_placement(policy))
    return faster(result, flat)


def _lines(found: list[EPOption], result: AutoResult, cluster: Cluster) -> dict[str, Candidate]:
    """The EP layouts of the screen as the search's lines name them ("2x32, EP 8"; on a TP view "1x32 x TP 2,
    EP 8"), each its best option: the fastest that fits, else the one holding least."""
    tp = result.plan.tensor_parallel
    out: dict[str, Candidate] = {}
    for o in sorted(found, key=lambda o: _rank(o, result)):
        if o.degree > 1:
            mesh = (o.plan.mesh or Mesh.flat(cluster.world_size)).describe()
            name = mesh + (f" x TP {tp.degree}" if tp is not None and tp.degree > 1 else "") + f", EP {o.degree}"
            out.setdefault(name, Candidate(o.plan, o.step, "EP screen"))
    return out


def _rank(o: EPOption, result: AutoResult) -> tuple[bool, float]:
    fits = result.memory.fits(o.step.reserved_memory)
    return not fits, o.step.step_time if fits else o.step.reserved_memory


def _shown(found: list[EPOption], result: AutoResult) -> list[EPOption]:
    """The screen's options as noted: on auto's own layout the best of each EP degree (of its placements and
    resharding), on each other HSDP layout its best (four options a degree, every one on a line, made the note
    1,000 characters long on mixtral-8x7b)."""
    best: dict[object, list[EPOption]] = {}
    for o in found:
        best.setdefault((o.degree, None) if o.plan.mesh == result.plan.mesh else o.plan.mesh, []).append(o)
    out = []
    for opts in best.values():
        fitting = [o for o in opts if result.memory.fits(o.step.reserved_memory)]
        out.append(min(fitting, key=_fastest) if fitting else min(opts, key=lambda o: o.step.reserved_memory))
    return out


def ep_tp_degrees(trace: Trace, model: ModelSpec, cluster: Cluster, tp: int | None, ep: int | None,
                  loss_parallel: bool | None = None) -> dict[int, tuple[int, ...]]:
    """The TP x EP layouts auto screens for a model with torchtitan's MoE layout (``is_titan_moe``): each TP degree
    above 1 (``tp``: the user's; else each of ``TP_DEGREES`` whose layout passes ``check_layout`` on ``cluster``)
    with the EP degrees ``--tp N --ep M`` takes (multiples of it that divide the experts, their EP / TP ranks the
    data-parallel ones: ``ep``, the user's, alone; a degree auto takes itself checked against the heads,
    ``Layout.checked``). {} for another model, or where none is left."""
    if not is_titan_moe(trace):
        return {}
    n = expert_count(trace, expert_modules(trace))
    out = {}
    for d in (tp,) if tp is not None else TP_DEGREES[1:]:
        shard = cluster.world_size // d if cluster.world_size % d == 0 else 0
        degrees = tuple(e for e in ((ep,) if ep is not None else divisors(n))
                        if e % d == 0 and n % e == 0 and shard and shard % (e // d) == 0)
        layout = _fitting_layout(trace, model, cluster, d, degrees[0], loss_parallel) if d > 1 and degrees else None
        if layout is not None and (tp is not None or layout.checked):
            out[d] = degrees
    return out


def _fitting_layout(trace: Trace, model: ModelSpec, cluster: Cluster, degree: int, ep: int,
                    loss_parallel: bool | None) -> Layout | None:
    """torchtitan's MoE layout of ``degree``, where it divides what it shards (``check_layout``)."""
    try:
        layout = tp_layout(trace, degree, model, loss_parallel, ep=ep)
        check_layout(trace, layout, cluster, model.workload().get("seq_len"))
    except PlannerError:
        return None
    return layout


@dataclass(frozen=True)
class EPTPScreen:
    """A TP layout's best classic plan (its screening, ``ScreenedLayout``) under each of its EP degrees: the best
    option of each degree, the fastest that fits first (else the one holding least)."""

    layout: ScreenedLayout
    options: tuple[EPOption, ...]

    def lines(self) -> dict[str, Candidate]:
        """The screen's layouts as the search's lines name them ("1x32 x TP 2, EP 8"), each its best option."""
        return {self.name(o.plan): Candidate(o.plan, o.step, "EP x TP screen") for o in self.options}

    def name(self, plan: Plan) -> str:
        """The line of ``plan``'s layout (its data-parallel mesh on this TP layout, and its EP)."""
        policy = self.layout.policy
        return f"{policy.layout_name(plan.mesh or Mesh.flat(policy.cluster.world_size))}, EP {plan.ep_degree}"

    def faster(self, searched: AutoResult, label: str) -> AutoResult:
        """``searched`` (this layout's full search, under EP), or this screen's best option where it is faster
        within the budget: the search chooses groups and checkpointing without EP, whose smaller experts can
        leave a classic grouping with fewer blocks checkpointed ahead. ``label``: the search's plan's policy."""
        best, fits = self.options[0], searched.memory.fits
        if not fits(best.step.reserved_memory) or (searched.fits and
                                                   searched.report.step_time <= best.step.step_time):
            return searched
        assert self.layout.best is not None
        checkpointed = len(best.plan.activation_checkpointing)
        origin = self.layout.best.plan.policy + (f" + checkpoint {checkpointed} blocks" if checkpointed else "")
        plan = best.plan.replace(policy=f"{label}, {best.describe()}, {origin} grouping (EP x TP screen)",
                                 model=searched.plan.model, fingerprint=searched.plan.fingerprint,
                                 numel=searched.plan.numel)  # (the whole model's, not the TP view's)
        return replace(searched, plan=plan, run=best.plan.run, report=best.step, fits=True)

    def key(self) -> tuple[bool, float]:
        """Rank: a layout with an option within the budget first, then the fastest."""
        best = self.options[0]
        assert self.layout.ev is not None
        fits = self.layout.ev.memory.fits(best.step.reserved_memory)
        return not fits, best.step.step_time if fits else best.step.reserved_memory


def screen_ep_tp(layout: ScreenedLayout, degrees: tuple[int, ...], options: SimOptions) -> EPTPScreen | None:
    """``layout``'s best classic grouping under each EP degree of ``degrees`` (on its TP view, the expert groups
    resharded after forward or kept), each with the fewest leading blocks checkpointed in full that let it fit
    under EP (its screening chose them without: EP's smaller experts need fewer); the best option of each degree.
    None where no classic plan runs on the layout."""
    if layout.best is None or layout.ev is None:
        return None
    plan = layout.best.plan
    plan = plan.replace(groups=[replace(g, forward_prefetch=(), backward_prefetch=()) for g in plan.groups])
    if layout.policy.checkpointing is None:
        plan = plan.replace(activation_checkpointing=())
    # dim-1 sharding (auto's way out) where dim 0 would pad: E / EP experts stacked on dim 0 can be fewer than the
    # shard ranks
    placement = screen_placement(layout.policy)
    if placement is not None:
        plan = plan.replace(shard_dims=shard_dims(layout.trace, layout.ev.ctx.shard, placement))
    views: dict[tuple, Trace] = {}
    cluster, fits = layout.policy.cluster, layout.ev.memory.fits
    found = ep_options(layout.trace, plan, cluster, plan_options(plan, options), degrees=degrees, views=views,
                       without=False, placement=placement,
                       per_param=per_param_meshes(layout.policy.ep_placement, layout.trace))
    blocks = block_instances(layout.trace) if layout.policy.checkpointing is None else []
    found = [_checkpointed_to_fit(o, views[o.plan.expert_parallel.signature()], blocks, cluster, options, fits)
             for o in found]
    best: dict[int, EPOption] = {}
    for o in sorted(found, key=lambda o: (not fits(o.step.reserved_memory), o.step.step_time
                                          if fits(o.step.reserved_memory) else o.step.reserved_memory)):
        best.setdefault(o.degree, o)
    return EPTPScreen(layout, tuple(best.values()))


def _checkpointed_to_fit(option: EPOption, view: Trace, blocks: list[str], cluster: Cluster, options: SimOptions,
                         fits: Callable[[int], bool]) -> EPOption:
    """``option`` with the fewest leading ``blocks`` checkpointed in full that let it fit (a bisection: more blocks
    checkpointed hold less), all of them where none does; ``view``: its EP view."""
    if fits(option.step.reserved_memory) or not blocks:
        return option
    lo, hi, out = 1, len(blocks), None
    while lo <= hi:
        mid = (lo + hi) // 2
        plan = option.plan.replace(activation_checkpointing=tuple(blocks[:mid]))
        step = simulate(view, plan, cluster, plan_options(plan, options), timeline=False)
        if fits(step.reserved_memory):
            out, hi = replace(option, plan=plan, step=step), mid - 1
        else:
            lo = mid + 1
    if out is None:  # (the bisection's last step was every block: simulated again, a plan's cost is small)
        plan = option.plan.replace(activation_checkpointing=tuple(blocks))
        out = replace(option, plan=plan, step=simulate(view, plan, cluster, plan_options(plan, options),
                                                       timeline=False))
    return out

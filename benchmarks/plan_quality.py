"""Plan quality: auto against the classic policies and the expert's best hand configurations on public
architectures, 8 to 4096 H100s, within the GPU's memory, all judged by the same simulator.

Run: python benchmarks/plan_quality.py   (writes benchmarks/plan_quality.md and plan_quality.json)
     python benchmarks/plan_quality.py --two-d   (only the 2-D rows, FSDP2 with TP: their section of the .md and
     plan_quality_2d.json)

One row per (model, cluster), with the budget every real job has: the memory of one GPU (80e9 bytes on an H100) less
the default headroom (5%, ``sim/budget.py``), auto's default. Baselines over it are marked: they are not runnable
jobs. The columns: the four classic policies with their defaults (pure FSDP over every GPU); torchtitan's actual
defaults, its grouping with op-level selective checkpointing of every block (``--ac op``, torchtitan's ``mode =
"selective"``, ``selective_ac_option = "op"``); torchtitan's grouping and module wrapping with every block
checkpointed in full (``--ac full``); torchtitan's grouping with the fewest leading blocks checkpointed in full that
let it fit (what an expert writes by hand, found by binary search); torchtitan's grouping on HSDP (``dp_replicate x
dp_shard``, shard over one node of 8 GPUs or over eight nodes) without checkpointing, with op-level and with full;
and the best hand configuration of a grid (``HAND_POLICIES`` x ``--ac`` none/full/op/selective x every whole-node
layout; the order policy at ``ORDER_TARGETS``, also with every group kept unsharded after forward; torchtitan's
grouping with the fewest leading blocks in full and the rest op-level), named.

torchtitan's reshard policy: its ``apply_fsdp`` (torchtitan/models/llama3/infra/parallelize.py, commit 018740b7)
with ``reshard_after_forward_policy = "default"`` and no pipeline reshards every block after forward
(``reshard_after_forward = not pp_enabled``), keeps ``[norm, output]`` unsharded after forward (``policy ==
"always"`` only) and leaves the root at ``fully_shard``'s default; older releases instead kept the last block
unsharded (``int(layer_id) < len(model.layers) - 1``). The titan policy plans the current one.

Auto chooses its layout and checkpointing too. A row's verdict compares auto with the best baseline that fits.

Two kinds of rows give the expert more to choose from, as auto has. Gradient accumulation (``MICRO_ROWS``: Llama 3
8B at a per-GPU batch of 4 and 8): auto with ``--micro-batches auto`` (``planners/auto/split.py``), each expert
column at its fastest split of the batch into 1, 2, 4 or 8 micro-batches that fits, each split traced at its
micro-batch. FSDP2's memory options, on the rows where no baseline fits without them (Llama 3 405B on 512,
Mixtral 8x7B): each expert column at its fastest of none, dim-1 sharding (``--shard-placement auto``), CPU offload
(``--offload``) and both that fits, the hand grid over all of them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from fsdp_planner.choices import DEFAULT_SAC_POLICY, ShardPlacement
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import fmt_bytes, fmt_time
from fsdp_planner.fsdp2.checkpointing import ACMode
from fsdp_planner.fsdp2.plan import Mesh, Plan
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.models import ModelSpec, load_model
from fsdp_planner.planners import CLASSIC_POLICIES, AutoResult, PolicyName, PolicyRequest, make_policy
from fsdp_planner.planners.auto import Target, candidate_meshes
from fsdp_planner.planners.auto.evaluator import GROUP_SLACK
from fsdp_planner.planners.auto.split import candidate_splits, choose_split
from fsdp_planner.planners.blocks import block_instances
from fsdp_planner.planners.expert_parallel import ep_degrees, ep_options
from fsdp_planner.planners.tensor_parallel import titan_llama_layout, titan_moe_layout
from fsdp_planner.service.planning import search
from fsdp_planner.sim.context import SimContext
from fsdp_planner.sim.options import SimOptions, plan_options
from fsdp_planner.sim.simulate import StepReport, simulate
from fsdp_planner.sim.sizing import shard_dims
from fsdp_planner.sim.tensor_parallel import tp_view
from fsdp_planner.trace import Trace, record

POLICY_NAMES = [p.value for p in CLASSIC_POLICIES]
WITH_AC = {"titan+op": (PolicyName.TITAN, ACMode.OP),  # torchtitan's defaults
           "titan+ac": (PolicyName.TITAN, ACMode.FULL), "module+ac": (PolicyName.MODULE, ACMode.FULL)}
FEWEST = "titan+k full"  # torchtitan's grouping, the fewest leading blocks in full that fit
HSDP_SHARDS = (8, 64)  # torchtitan's grouping with dp_shard one node, or eight nodes, and dp_replicate the rest
HSDP = {f"titan{ac}/hsdp{s}": (s, mode) for s in HSDP_SHARDS
        for ac, mode in (("", None), ("+op", ACMode.OP), ("+ac", ACMode.FULL))}
BEST_HAND = "best hand config"
COLUMNS = [*POLICY_NAMES, *WITH_AC, FEWEST, *HSDP, BEST_HAND]
HAND_POLICIES = [PolicyName.MODULE, PolicyName.SIZE, PolicyName.TITAN, PolicyName.ORDER]
HAND_AC = [None, ACMode.FULL, ACMode.OP, ACMode.SELECTIVE]
ORDER_TARGETS = [2**28, 2**29, 2**30, 2**31]  # the order policy's --target-bytes the hand grid tries
AHEAD = 0.10  # a row where auto is at least this much faster than the best baseline that fits is named
TIE = 0.005  # within this, auto only ties

# Each model on the H100 counts it is trained on with FSDP (issue 9: 8B on 8-512, 70B on 64-2048, 405B on 512+;
# small models on up to a few hundred GPUs; 8B at 4096 as the scale case HSDP exists for); the seed's CNN everywhere,
# as the latency-bound extreme.
MODELS = {
    "seed-net": ("the seed's CNN", [8, 64, 512, 4096]),
    "llama3-8b": ("Llama 3 8B", [8, 64, 512, 4096]),
    "llama3-70b": ("Llama 3 70B", [64, 512, 2048]),
    "llama3-405b": ("Llama 3 405B", [512, 2048, 4096]),
    "llama32-3b": ("Llama 3.2 3B, tied embeddings", [8, 64, 512]),
    "t5-3b": ("T5 v1.1 XL, encoder-decoder", [8, 64, 512]),
    "vit-h14": ("ViT-H/14", [8, 64, 512]),
    "mixtral-8x7b": ("Mixtral 8x7B, mixture of experts", [64, 512]),
}
# Gradient accumulation rows: model -> (per-GPU batches, GPUs); the sequence is the model's default (8192).
MICRO_ROWS = {"llama3-8b": ((4, 8), (8, 64))}
# The expert's columns on those rows and on the memory-option rows, each at its best split or memory option.
EXPERT_COLUMNS = [*WITH_AC, FEWEST, BEST_HAND]
# FSDP2's memory options in auto's order (``AutoPolicy._ways_out``): dim-1 sharding, offload, both.
MEMORY_WAYS = [(False, ShardPlacement.AUTO), (True, ShardPlacement.DIM0), (True, ShardPlacement.AUTO)]


def summary(r: StepReport) -> dict:
    return {"step_time": r.step_time, "exposed_comm": r.exposed_comm, "peak_memory": r.peak_memory,
            "reserved_memory": r.reserved_memory,
            "collectives": r.all_gathers + r.reduce_scatters, "lower_bound": r.lower_bound}


class Simulator:
    """Simulates plans on one model and cluster, one context per layout."""

    def __init__(self, tr: Trace, model: str, cluster: Cluster, options: SimOptions | None = None) -> None:
        self.tr, self.model, self.cluster = tr, model, cluster
        self.options = options or SimOptions()
        self.contexts: dict[Mesh, SimContext] = {}

    def run(self, plan: Plan) -> dict:
        mesh = plan.layout(self.cluster.world_size)
        if mesh not in self.contexts:
            self.contexts[mesh] = SimContext(self.tr, self.cluster, self.options, mesh=mesh)
        ctx = self.contexts[mesh]
        return {**summary(simulate(self.tr, plan, context=ctx, timeline=False)), "plan": plan.policy}

    def request(self, request: PolicyRequest) -> dict | None:
        """The policy's plan simulated; None when it cannot plan the model."""
        try:
            return self.run(make_policy(request).plan(self.tr, self.model))
        except PlannerError:
            return None


def baselines(tr: Trace, model: str, cluster: Cluster, budget: int) -> dict[str, dict]:
    """Every baseline column this cluster has, simulated like auto's plan (a policy that cannot plan the model,
    or an HSDP layout whose shard group is not smaller than the cluster, is left out)."""
    requests = {name: PolicyRequest(PolicyName(name)) for name in POLICY_NAMES}
    requests |= {name: PolicyRequest(p, checkpointing=mode) for name, (p, mode) in WITH_AC.items()}
    requests |= {name: PolicyRequest(PolicyName.TITAN, checkpointing=mode, mesh=Mesh(cluster.world_size // s, s))
                 for name, (s, mode) in HSDP.items() if s < cluster.world_size}
    sim = Simulator(tr, model, cluster)
    out = {name: r for name, request in requests.items() if (r := sim.request(request)) is not None}
    if (fewest := fewest_full(sim, budget)) is not None:
        out[FEWEST] = fewest
    if (hand := best_hand(sim, budget)) is not None:
        out[BEST_HAND] = hand
    return out


def titan_blocks(sim: Simulator) -> tuple[Plan, list[str]] | None:
    """torchtitan's plan and the model's block instances, the start of the hand grid's checkpointing columns;
    None when titan cannot plan the model or it has no blocks."""
    try:
        plan = make_policy(PolicyRequest(PolicyName.TITAN)).plan(sim.tr, sim.model)
    except PlannerError:
        return None
    blocks = block_instances(sim.tr)
    return (plan, list(blocks)) if blocks else None


def fewest_full(sim: Simulator, budget: int) -> dict | None:
    """torchtitan's grouping with the fewest leading blocks checkpointed in full that fit (binary search; all of
    them when none fits); None when the model has no blocks."""
    titan = titan_blocks(sim)
    if titan is None:
        return None
    plan, blocks = titan

    def with_k(k: int) -> dict:
        return {**sim.run(plan.replace(activation_checkpointing=blocks[:k])), "plan": f"titan + {k} full"}

    lo, hi = 0, len(blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        if with_k(mid)["reserved_memory"] <= budget:
            hi = mid
        else:
            lo = mid + 1
    return with_k(lo)


def best_hand(sim: Simulator, budget: int) -> dict | None:
    """The fastest configuration that fits of ``HAND_POLICIES`` x ``HAND_AC`` x every whole-node layout, the order
    policy's ``ORDER_TARGETS`` with its default reshard or every group kept unsharded after forward on every layout,
    and torchtitan's grouping with the fewest leading blocks in full and every other op-level that fit (the
    smallest peak when none fits), labelled with what it is."""
    meshes = candidate_meshes(sim.cluster, Target.FSDP2)
    tried = []
    for p in HAND_POLICIES:
        for ac in HAND_AC:
            for mesh in meshes:
                r = sim.request(PolicyRequest(p, checkpointing=ac, mesh=mesh if mesh.replicate > 1 else None))
                if r is not None:
                    label = f"{p.value} --ac {ac.value if ac else 'none'} {mesh.describe()}"
                    tried.append({**r, "plan": label})
    tried += order_kept(sim, meshes)
    if (mixed := full_then_op(sim, budget)) is not None:
        tried.append(mixed)
    return fastest(tried, budget)


def order_kept(sim: Simulator, meshes: list[Mesh]) -> list[dict]:
    """The order policy at each of ``ORDER_TARGETS`` on each layout, as it plans (the last group kept unsharded
    after forward) and with every group kept (a plan file's ``reshard_after_forward``: no all-gather in backward)."""
    out = []
    for target in ORDER_TARGETS:
        for mesh in meshes:
            try:
                plan = make_policy(PolicyRequest(PolicyName.ORDER, target_bytes=target,
                                                 mesh=mesh if mesh.replicate > 1 else None)).plan(sim.tr, sim.model)
            except PlannerError:
                continue
            kept = plan.replace(groups=[replace(g, reshard_after_forward=False) for g in plan.groups])
            for p, how in ((plan, ""), (kept, ", every group kept")):
                out.append({**sim.run(p), "plan": f"order {fmt_bytes(target)}{how} {mesh.describe()}"})
    return out


def full_then_op(sim: Simulator, budget: int) -> dict | None:
    """torchtitan's grouping with the fewest leading blocks in full that fit with every other block op-level
    (binary search); None when the model has no blocks or even all in full do not fit."""
    titan = titan_blocks(sim)
    if titan is None:
        return None
    plan, blocks = titan

    def with_k(k: int) -> dict:
        p = plan.replace(activation_checkpointing=blocks[:k], selective_checkpointing=dict.fromkeys(
            blocks[k:], DEFAULT_SAC_POLICY))
        return {**sim.run(p), "plan": f"titan + {k} full + the rest op"}

    lo, hi = 0, len(blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        if with_k(mid)["reserved_memory"] <= budget:
            hi = mid
        else:
            lo = mid + 1
    found = with_k(lo)
    return found if found["reserved_memory"] <= budget else None


def fastest(tried: list[dict], budget: int) -> dict | None:
    """The fastest that fits (the smallest reserved memory when none does)."""
    return min(tried, key=lambda r: (r["reserved_memory"] > budget, r["step_time"] if r["reserved_memory"] <= budget
                                     else r["reserved_memory"]), default=None)


def expert_baselines(variants: list[tuple[str, Simulator]], budget: int) -> dict[str, dict]:
    """``EXPERT_COLUMNS``, each at its fastest variant (a split into micro-batches, a memory option) that fits;
    each result's plan names the variant."""
    def tagged(r: dict | None, variant: str) -> list[dict]:
        return [] if r is None else [{**r, "plan": f"{r['plan']}, {variant}" if variant else r["plan"]}]

    out = {}
    for name, (p, mode) in WITH_AC.items():
        tried = [t for v, sim in variants for t in tagged(sim.request(PolicyRequest(p, checkpointing=mode)), v)]
        if (best := fastest(tried, budget)) is not None:
            out[name] = best
    for name, pick in ((FEWEST, fewest_full), (BEST_HAND, best_hand)):
        tried = [t for v, sim in variants for t in tagged(pick(sim, budget), v)]
        if (best := fastest(tried, budget)) is not None:
            out[name] = best
    return out


def memory_variants(tr: Trace, model: str, cluster: Cluster) -> list[tuple[str, Simulator]]:
    """The expert's memory options: none, and each of ``MEMORY_WAYS`` (dim-1 sharding where the model has params
    it applies to)."""
    dim1 = bool(shard_dims(tr, cluster.world_size, ShardPlacement.AUTO))
    names = {(False, ShardPlacement.AUTO): "shard dim 1", (True, ShardPlacement.DIM0): "offload",
             (True, ShardPlacement.AUTO): "offload + shard dim 1"}
    return [("", Simulator(tr, model, cluster))] + [
        (names[(o, p)], Simulator(tr, model, cluster, SimOptions().with_memory_options(o, p)))
        for o, p in MEMORY_WAYS if dim1 or p is ShardPlacement.DIM0]


def judge(r: dict, result: AutoResult, extra: dict[str, dict]) -> dict:
    """``r`` with its verdict: the best baseline that fits (its columns and ``extra``'s, named with a '*') and
    whether auto is at least as fast."""
    candidates = {**{n: p for n, p in r["policies"].items() if n != "auto"}, **{f"{n}*": p for n, p in extra.items()}}
    fitting = {n: p for n, p in candidates.items() if p["reserved_memory"] <= result.budget}
    best = min(fitting, key=lambda n: (fitting[n]["step_time"], fitting[n]["reserved_memory"]), default=None)
    auto = r["policies"]["auto"]
    ok = result.fits and (best is None or (auto["step_time"] <= fitting[best]["step_time"] * (1 + 1e-9)
                                           and auto["reserved_memory"] <= max(fitting[best]["reserved_memory"],
                                                                              result.budget)))
    return {**r, "expert": extra, "best_other": best, "best_step": fitting[best]["step_time"] if best else None,
            "best_plan": fitting[best]["plan"] if best else None,
            "gain": 1 - auto["step_time"] / fitting[best]["step_time"] if best else None, "auto_ok": ok}


def throughput(tr: Trace, tokens: int, report: StepReport, gpu_peak: float) -> dict:
    """Tokens/s per GPU (each rank runs the example batch) and MFU (model FLOPs, recomputation not counted)."""
    return {"tokens_per_s_per_gpu": tokens / report.step_time if tokens else None,
            "mfu": (tr.fwd_flops + tr.bwd_flops) / report.step_time / gpu_peak}


def auto_search(tr: Trace, spec: ModelSpec, cluster: Cluster, options: SimOptions | None = None) -> AutoResult:
    """Auto as the CLI plans (``service/planning.search``): its TP screen (each degree traced at its batch) and,
    for a MoE model planned without TP, its EP screen, as ``fsdp-planner plan MODEL --policy auto`` gives."""
    return search(tr, PolicyRequest(PolicyName.AUTO), cluster, options or SimOptions(), spec,
                  tracer=lambda s, _: planning_trace(s)[0])


def layout_text(result: AutoResult) -> str:
    """Auto's layout: its data-parallel mesh (replicate x shard), with TP and EP where it chose them."""
    plan = result.plan
    ep = plan.expert_parallel.degree if plan.expert_parallel is not None else 1
    return result.report.mesh + (f" x TP {plan.tp_degree}" if plan.tp_degree > 1 else "") + \
        (f", EP {ep}" if ep > 1 else "")


def row(model: str, cluster: Cluster, tr: Trace, tokens: int, result: AutoResult) -> dict:
    policies = baselines(tr, model, cluster, result.budget)
    policies["auto"] = {**auto_summary(result), **throughput(tr, tokens, result.report, cluster.gpu.peak_bf16_flops)}
    r = {"model": model, "cluster": cluster.name, "budget": result.budget,
         "budget_source": result.budget_source, "min_peak": result.min_peak, "fits": result.fits,
         "lower_bound": result.report.lower_bound, "policies": policies}
    r = judge(r, result, {})
    if r["best_other"] is None:  # nothing fits without FSDP2's memory options: the expert gets them too
        r = judge(r, result, expert_baselines(memory_variants(tr, model, cluster), result.budget))
    return r


def auto_summary(result: AutoResult) -> dict:
    plan = result.plan
    return {**summary(result.report), "plan": plan.policy, "mesh": result.report.mesh, "layout": layout_text(result),
            "tp": plan.tp_degree, "ep": plan.expert_parallel.degree if plan.expert_parallel is not None else 1,
            "groups": len(plan.inner_groups), "seconds": result.seconds,
            "checkpointed": len(plan.activation_checkpointing), "op_checkpointed": len(plan.selective_checkpointing)}


def micro_row(model: str, batch: int, cluster: str) -> dict:
    """A gradient accumulation row: auto choosing the split of the per-GPU ``batch`` (``--micro-batches auto``),
    the expert columns each at its fastest split that fits."""
    c = parse_cluster(cluster)
    traces = {n: planning_trace(ModelSpec(model, batch_size=batch // n))[0] for n in candidate_splits(batch)}
    options = {n: SimOptions(micro_batches=n) for n in traces}
    best, _ = choose_split(batch, lambda n: auto_search(traces[n], ModelSpec(model, batch_size=batch // n), c,
                                                        options[n]))
    result = best.result
    variants = [(f"{n} micro-batch{'es' * (n > 1)}", Simulator(traces[n], model, c, options[n])) for n in traces]
    policies = {"auto": {**auto_summary(result), "micro_batches": best.micro_batches}}
    r = {"model": model, "batch": batch, "cluster": cluster, "budget": result.budget,
         "budget_source": result.budget_source, "min_peak": result.min_peak, "fits": result.fits,
         "lower_bound": result.report.lower_bound, "policies": policies}
    return judge(r, result, expert_baselines(variants, result.budget))


def cell(p: dict, budget: float) -> str:
    over = " **over budget**" if p["reserved_memory"] > budget else ""
    return (f"{fmt_time(p['step_time'])} / {fmt_time(p['exposed_comm'])} / {fmt_bytes(p['reserved_memory'])} / "
            f"{p['collectives']}{over}")


def baseline_name(r: dict, name: str) -> str:
    """A baseline's column, with what it was where the column does not say (the hand config, k; an expert
    column's split or memory option, marked '*')."""
    if name.endswith("*"):
        return f"{name} ({r['best_plan']})"
    return f"{name} ({r['policies'][name]['plan']})" if name in (BEST_HAND, FEWEST) or name.startswith(BEST_EP) \
        else name


def row_name(r: dict) -> str:
    return f"{r['model']}, batch {r['batch']}" if "batch" in r else r["model"]


def verdict(r: dict) -> str:
    if not r["fits"]:
        return f"no plan fits; needs {fmt_bytes(r['min_peak'])}"
    if r["best_other"] is None:
        return "auto (no baseline fits)"
    gain, other = r["gain"], baseline_name(r, r["best_other"])
    if abs(gain) <= TIE:
        return f"tie with {other} ({gain:+.2%})"
    return f"auto, {gain:.1%} faster than {other}" if gain > 0 else f"auto {-gain:.1%} SLOWER than {other}"


def ac_text(auto: dict) -> str:
    full, op = auto["checkpointed"], auto.get("op_checkpointed", 0)
    return " + ".join([f"{full} full"] * bool(full) + [f"{op} op"] * bool(op)) or "-"


def summary_line(rows: list[dict]) -> str:
    """How many rows auto fits and beats the best fitting baseline; the rows >= ``AHEAD`` ahead, the ties, any
    loss."""
    def names(pick) -> str:
        return ", ".join(f"{row_name(r)} x{r['cluster'].split(':')[1]}" for r in rows if pick(r)) or "none"

    fits = [r for r in rows if r["fits"]]
    judged = [r for r in fits if r["gain"] is not None]
    return (f"**Auto fits on {len(fits)} of {len(rows)} rows (the others: no plan fits the GPU) and is at least as "
            f"fast as the best baseline that fits on {sum(r['auto_ok'] for r in rows)}. Ahead by {AHEAD:.0%} or more: "
            f"{names(lambda r: r in judged and r['gain'] >= AHEAD)}. Only a tie (within {TIE:.1%}): "
            f"{names(lambda r: r in judged and abs(r['gain']) <= TIE)}. Behind by more than {TIE:.1%}: "
            f"{names(lambda r: r in judged and r['gain'] < -TIE)}. No baseline fits: "
            f"{names(lambda r: r in fits and r['gain'] is None)}.**")


def behind_note(rows: list[dict]) -> str:
    """The rows where a baseline that fits is faster than auto, by how much, and the preference that can cause it."""
    behind = [r for r in rows if r["fits"] and r["gain"] is not None and r["gain"] < 0]
    if not behind:
        return ""
    names = ", ".join(f"{row_name(r)} x{r['cluster'].split(':')[1]} ({-r['gain']:.2%})" for r in behind)
    return (f"Auto behind a baseline: {names}. Among the plans within {GROUP_SLACK:.1%} of the fastest it simulated, "
            "auto keeps the one with the fewest groups (`Refiner.prefer_fewer_groups`: fewer collectives and hooks "
            "for a difference within the simulator's error), so it can trail a hand plan with many more groups by "
            "less than that; on the llama32-3b rows of the run of 2026-11-29 its search had simulated a plan at "
            "least as fast as the hand config (a DP grouping with every group kept unsharded after forward, 35-57 "
            "groups) and chose 6 groups instead.")


def expert_table(title: str, rows: list[dict], text: str) -> list[str]:
    """A section: per row, the expert columns (each with the split or memory option it took) and auto."""
    out = ["", f"## {title}", "", text, "",
           "| model | GPUs | " + " | ".join(EXPERT_COLUMNS) + " | auto | auto plan | verdict |",
           "|---|---|" + "---|" * (len(EXPERT_COLUMNS) + 3)]
    for r in rows:
        cells = [f"{cell(r['expert'][n], r['budget'])} ({r['expert'][n]['plan']})" if n in r["expert"] else "n/a"
                 for n in EXPERT_COLUMNS]
        auto = r["policies"]["auto"]
        split = f", {auto['micro_batches']} micro-batches" if "micro_batches" in auto else ""
        out.append(f"| {row_name(r)} | {r['cluster'].split(':')[1]} | " + " | ".join(cells)
                   + f" | {cell(auto, r['budget'])} | {auto['plan']}{split}, {ac_text(auto)} | {verdict(r)} |")
    return out


def planning_trace(model: str | ModelSpec) -> tuple[Trace, int]:
    """The model traced as the CLI plans it (bf16 compute), and the tokens of its batch (0: not a token model)."""
    lm = load_model(model)
    tr = record(lm.model, lm.example_inputs, lm.loss_fn, compute_dtype=SimOptions().precision.trace_dtype)
    first = lm.example_inputs[0] if isinstance(lm.example_inputs, tuple) else lm.example_inputs
    if isinstance(first, dict):  # a transformers model's keyword inputs
        first = first.get("input_ids")
    tokens = first.numel() if isinstance(first, torch.Tensor) and not first.is_floating_point() else 0
    return tr, tokens


def main() -> None:
    started = time.perf_counter()
    rows = []
    for model, (_, gpus) in MODELS.items():
        tr, tokens = planning_trace(model)
        for spec in [f"h100:{n}" for n in gpus]:
            cluster = parse_cluster(spec)
            rows.append(row(model, cluster, tr, tokens, auto_search(tr, ModelSpec(model), cluster)))
            print(f"{model} {spec}: {verdict(rows[-1])} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    micro = []
    for model, (batches, gpus) in MICRO_ROWS.items():
        for batch in batches:
            for n in gpus:
                micro.append(micro_row(model, batch, f"h100:{n}"))
                print(f"{model} batch {batch} h100:{n}: {verdict(micro[-1])} ({time.perf_counter() - started:.0f} s)",
                      file=sys.stderr)
    elapsed = time.perf_counter() - started
    load = os.getloadavg()[0]  # the time above is this machine's under that load
    out = Path(__file__).parent
    (out / "plan_quality.json").write_text(
        json.dumps({"rows": rows, "micro_batch_rows": micro, "seconds": elapsed}, indent=1) + "\n")
    lines = [
        "# Plan quality: auto vs the classic policies and the expert's best hand configurations",
        "",
        f"Measured by `python benchmarks/plan_quality.py` ({elapsed:.0f} s on {platform.machine()}, Python "
        f"{platform.python_version()}, load average {load:.1f} on {os.cpu_count()} cores at its end); every number "
        "is the step simulator's (bf16 mixed precision, AdamW, "
        "the cluster's compute roofline, activations at their traced dtypes), for the built-in models' example batches "
        "(one sequence of 8192 tokens per GPU for the Llamas).",
        "",
        "Cells: step time / exposed communication / memory reserved per rank (the allocated peak plus the caching "
        "allocator's separate all-gather stream pool, sim/memory.py) / collectives per step. Budget: the memory "
        "of one H100 (80e9 bytes) less the default 5% headroom for the memory model's error (sim/budget.py); "
        "**over budget** marks a plan that does not fit, i.e. is not a job anyone "
        "can run. The classic policies run with their defaults (module and titan: the repeated block class; size: "
        "FSDP1's 1e8 threshold; order: one block per group), pure FSDP over every GPU. titan+op is torchtitan's "
        "defaults: its grouping and reshard policy (every block resharded after forward, [norm, output] kept, the "
        "root at its default) with op-level selective checkpointing of every block; titan+ac and module+ac "
        "checkpoint every block in full; 'titan+k full' checkpoints the fewest leading blocks in full that let "
        "titan's grouping fit (k in the summary); titan[+op|+ac]/hsdpS is torchtitan's grouping on HSDP with shard "
        "groups of S GPUs (8: one node; 64: eight nodes) replicated across the rest (n/a where S is the whole "
        "cluster); 'best hand config' is the fastest that fits of module/size/titan/order x --ac "
        "none/full/op/selective x every whole-node layout, the order policy's groups of 256 MiB to 2 GiB on every "
        "layout as it plans them or with every group kept unsharded after forward, and titan's grouping with the "
        "fewest leading blocks in full and the rest op-level that fit (named in the summary). Auto is what "
        "`fsdp-planner plan MODEL --policy auto --cluster h100:N` gives (`service/planning.search`): it chooses "
        "the TP degree (1, 2, 4, 8 where the model's layout allows, each traced at its batch: the same global "
        "batch; the built-in Llamas), for a MoE model without TP its EP degree (the EP screen), the data-parallel "
        "layout ('auto layout': replicate x shard, x TP d, EP e) and, when nothing fits without, per leading block "
        "none, op-level or full checkpointing ('auto AC'); the columns before it are pure FSDP (the expert's TP "
        "configurations: the 2-D section below). Tokens/s/GPU and MFU are auto's (model FLOPs over the bf16 dense "
        "peak; recomputation is "
        "not model FLOPs).",
        "",
        summary_line(rows + micro),
        "",
        *([behind_note(rows + micro), ""] if behind_note(rows + micro) else []),
        "| model | GPUs | lower bound | " + " | ".join([*COLUMNS, "auto"])
        + " | auto layout | auto AC | tokens/s/GPU | MFU | winner |",
        "|---|---|---|" + "---|" * (len(COLUMNS) + 1) + "---|---|---|---|---|",
    ]
    for r in rows:
        cells = [cell(r["policies"][n], r["budget"]) if n in r["policies"] else "n/a" for n in [*COLUMNS, "auto"]]
        auto = r["policies"]["auto"]
        tps = f"{auto['tokens_per_s_per_gpu']:,.0f}" if auto["tokens_per_s_per_gpu"] and r["fits"] else "-"
        mfu = f"{auto['mfu']:.0%}" if r["fits"] else "-"
        lines.append(f"| {r['model']} | {r['cluster'].split(':')[1]} | {fmt_time(r['lower_bound'])} | "
                     + " | ".join(cells) + f" | {auto['layout']} | {ac_text(auto)} | {tps} | {mfu} "
                     f"| {verdict(r)} |")
    lines += expert_table(
        "Gradient accumulation: Llama 3 8B at a per-GPU batch of 4 and 8", micro,
        "Sequences of 8192 tokens. Auto runs with `--micro-batches auto` (the split of the batch whose auto plan is "
        "fastest within the budget, `planners/auto/split.py`); each expert column at its fastest split into 1, 2, 4 "
        "(and 8) micro-batches that fits, each split traced at its micro-batch (`set_requires_gradient_sync(False)` "
        "on all but the last, `reshard_after_backward` left True). Cells as above, for the whole step.")
    lines += expert_table(
        "FSDP2's memory options for the expert: the rows where no baseline fits without them", [
            r for r in rows if r["expert"]],
        "On these rows no column of the table above fits. Each expert column here is at its fastest of: nothing "
        "more, dim-1 sharding (`--shard-placement auto`: `Shard(1)` where dim 0 would be padded), CPU offload "
        "(`--offload`, `CPUOffloadPolicy`) and both, that fits; the hand grid over all of them. Marked '*' in the "
        "verdicts.")
    lines += ["", "## Summary (the table the README shows)", "",
              "| model | GPUs | best baseline that fits (step time) | auto: step / reserved / layout / "
              "checkpointed / groups | verdict |", "|---|---|---|---|---|"]
    for r in rows + micro:
        auto, best = r["policies"]["auto"], r["best_other"]
        base = f"{baseline_name(r, best)} {fmt_time(r['best_step'])}" if best else "none"
        mine = (f"**{fmt_time(auto['step_time'])}** / {fmt_bytes(auto['reserved_memory'])} / {auto['layout']} / "
                f"{ac_text(auto)} / {auto['groups']}" if r["fits"] else "-")
        lines.append(f"| {row_name(r)} | {r['cluster'].split(':')[1]} | {base} | {mine} | {verdict(r)} |")
    (out / "plan_quality.md").write_text("\n".join(lines) + "\n" + two_d_section(out / "plan_quality.md"))
    print("\n".join(lines))


# -- 2-D rows: FSDP2 with tensor parallelism ------------------------------------------------------------------------
# The jobs people run with TP: (model, GPUs). Every layout trains the same step as the rows above, one sequence of
# 8192 tokens per GPU: TP d runs d sequences per data-parallel rank (torchtitan's 70B job: local batch 8, TP 8).
TWO_D_ROWS = (("llama3-70b", 64), ("llama3-70b", 256), ("llama3-405b", 512))
EXPERT_TP = 8  # torchtitan's TP degree for its 70B and 405B jobs: one node, FSDP across the nodes
EXPERT_2D = {"titan TP8+ac": ACMode.FULL, "titan TP8+op": ACMode.OP}  # its 70B/405B jobs: full AC
TWO_D_START = "<!-- 2-D rows: python benchmarks/plan_quality.py --two-d -->"


def two_d_section(md: Path) -> str:
    """The 2-D rows' section of ``md`` as last written (``--two-d``), kept when the rows above are regenerated."""
    text = md.read_text() if md.exists() else ""
    return text[text.index(TWO_D_START):] if TWO_D_START in text else ""


def two_d_row(model: str, gpus: int) -> dict:
    """Auto choosing its TP degree (``service/planning.search``, each degree traced at its batch) against
    torchtitan's 2-D configuration: its grouping with TP 8 inside each node (``titan_llama_layout``: SP, loss
    parallel), FSDP over the nodes, every block checkpointed in full (its jobs) or op-level."""
    cluster, spec = parse_cluster(f"h100:{gpus}"), ModelSpec(model)
    tr, tokens = planning_trace(spec)
    result = auto_search(tr, spec, cluster)
    wide, _ = planning_trace(ModelSpec(model, batch_size=EXPERT_TP))
    policies = {}
    for name, mode in EXPERT_2D.items():
        plan = make_policy(PolicyRequest(PolicyName.TITAN, checkpointing=mode)).plan(wide, model)
        plan = plan.replace(tensor_parallel=titan_llama_layout(EXPERT_TP))
        policies[name] = {**summary(simulate(wide, plan, cluster, timeline=False)), "plan": plan.policy}
    policies["auto"] = {**auto_summary(result), **throughput(tr, tokens, result.report, cluster.gpu.peak_bf16_flops)}
    r = {"model": model, "cluster": f"h100:{gpus}", "budget": result.budget, "budget_source": result.budget_source,
         "min_peak": result.min_peak, "fits": result.fits, "lower_bound": result.report.lower_bound,
         "policies": policies}
    return judge(r, result, {})


# MoE rows: (model, GPUs), one sequence of 4096 tokens per GPU (the model's default), TP d at d per data-parallel
# rank. The expert's configurations follow torchtitan's MoE jobs: its deepseek_v3_671b.toml (commit 8e2cd19) and
# llama4_17bx16e.toml (commit 6964eb7, "a preset for 64 H100 GPUs") run TP 8 with full checkpointing, their
# experts tensor-parallel (expert_parallel_degree 1: titan TP 8+ac); the EP x TP rows keep EP = a multiple of TP
# (EP's ranks span TP's, --tp N --ep M); EP 8 alone is its EP recipe without TP. Experts sharded on dim 1 where
# dim 0 would pad, as torchtitan's FSDP placement for experts.
MOE_ROWS = (("mixtral-8x7b", 64), ("mixtral-8x7b", 512), ("hf:deepseek-v3", 256), ("hf:deepseek-v3", 512))
EXPERT_MOE = {"titan TP 8+ac": (8, 1), "titan EP 8+ac": (1, 8), "titan TP 2 x EP 8+ac": (2, 8),
              "titan TP 8 x EP 8+ac": (8, 8)}
MOE_FEWEST = ("titan TP 8+ac", "titan EP 8+ac", "titan TP 2 x EP 8+ac")  # also with the fewest leading blocks in
# full that fit
BEST_EP = "titan EP best"  # torchtitan's grouping without TP at the EP degree it runs fastest at (``moe_best_ep``)


def moe_expert(model: str, cluster: Cluster, tp: int, ep: int, blocks: int | None = None) -> dict:
    """torchtitan's grouping under TP ``tp`` (its MoE layout; 1: none) and EP ``ep`` (1: the experts
    tensor-parallel), every block checkpointed in full (``blocks``: the first that many only), the experts
    resharded after forward, simulated on one TP rank's view at ``tp`` sequences per data-parallel rank
    (``ep_options``, as auto's EP screen simulates; without EP ``simulate``)."""
    trace, on, layout = moe_view(model, cluster, tp, ep > 1)
    mode = ACMode.FULL if blocks is None else None
    plan = make_policy(PolicyRequest(PolicyName.TITAN, checkpointing=mode)).plan(trace, model)
    if blocks is not None:
        plan = plan.replace(activation_checkpointing=tuple(block_instances(trace)[:blocks]))
    plan = plan.replace(tensor_parallel=layout, groups=[replace(g, forward_prefetch=(), backward_prefetch=())
                                                        for g in plan.groups])
    plan = plan.replace(shard_dims=shard_dims(trace, cluster.world_size // tp, ShardPlacement.AUTO))
    ac = "" if blocks is None else f", {blocks} blocks in full" if blocks else ", no AC"
    if ep == 1:
        wide = planning_trace(ModelSpec(model, batch_size=tp))[0]
        return {**summary(simulate(wide, plan, cluster, SimOptions(), timeline=False)), "plan": plan.policy + ac}
    option = ep_options(trace, plan, on, plan_options(plan, SimOptions()), degrees=(ep,), without=False,
                        placement=ShardPlacement.AUTO)[0]
    return {**summary(option.step), "plan": option.plan.policy + ac}


MOE_VIEWS: dict[tuple, tuple] = {}


def moe_view(model: str, cluster: Cluster, tp: int, expert_parallel: bool = True) -> tuple:
    """The model traced at ``tp`` sequences per data-parallel rank, on one TP rank's view (trace, cluster,
    layout: torchtitan's MoE layout with EP, or with the experts tensor-parallel), made once."""
    key = (model, cluster.name, tp, expert_parallel)
    if key not in MOE_VIEWS:
        wide, _ = planning_trace(ModelSpec(model, batch_size=tp))
        if tp == 1:
            MOE_VIEWS[key] = (wide, cluster, None)
        else:
            layout = titan_moe_layout(tp, expert_parallel=expert_parallel)
            view = tp_view(wide, layout, cluster)
            MOE_VIEWS[key] = (view.trace, view.cluster, layout)
    return MOE_VIEWS[key]


def moe_fewest(model: str, cluster: Cluster, tp: int, ep: int, budget: int) -> dict:
    """``moe_expert`` with the fewest leading blocks checkpointed in full that fit ``budget`` (all: its full-AC
    column), as a user tunes torchtitan's full AC down to what fits."""
    trace = moe_view(model, cluster, tp, ep > 1)[0]
    lo, hi, out = 0, len(block_instances(trace)), None
    while lo <= hi:
        mid = (lo + hi) // 2
        r = moe_expert(model, cluster, tp, ep, mid)
        if r["reserved_memory"] <= budget:
            out, hi = r, mid - 1
        else:
            lo = mid + 1
    return out or moe_expert(model, cluster, tp, ep)


def moe_best_ep(model: str, cluster: Cluster, budget: int) -> dict[str, dict]:
    """torchtitan's grouping without TP under each EP degree the experts and the shard ranks allow, every block
    checkpointed in full, the fastest that fits (else the one holding least), and that degree with the fewest leading
    blocks in full that fit: the hand sweep of ``expert_parallel_degree`` a user runs (EP 8 is one point of it)."""
    trace = moe_view(model, cluster, 1)[0]
    found = {ep: moe_expert(model, cluster, 1, ep) for ep in ep_degrees(trace, cluster.world_size)[1:]}
    ep = min(found, key=lambda d: (found[d]["reserved_memory"] > budget, found[d]["step_time"]
                                   if found[d]["reserved_memory"] <= budget else found[d]["reserved_memory"]))
    fewest = moe_fewest(model, cluster, 1, ep, budget)
    return {f"{BEST_EP}+ac": {**found[ep], "plan": f"EP {ep}, {found[ep]['plan']}"},
            f"{BEST_EP}+k full": {**fewest, "plan": f"EP {ep}, {fewest['plan']}"}}


def moe_row(model: str, gpus: int) -> dict:
    """Auto choosing EP x TP itself (``service/planning.search``) against torchtitan's MoE configurations."""
    cluster, spec = parse_cluster(f"h100:{gpus}"), ModelSpec(model)
    tr, tokens = planning_trace(spec)
    result = auto_search(tr, spec, cluster)
    policies, refused = {}, {}
    for name, (tp, ep) in EXPERT_MOE.items():  # (a column the model cannot run: n/a, its reason kept)
        try:
            policies[name] = moe_expert(model, cluster, tp, ep)
            if name in MOE_FEWEST:
                policies[name.replace("+ac", "+k full")] = moe_fewest(model, cluster, tp, ep, result.budget)
        except PlannerError as e:
            refused[name] = str(e)
    try:
        policies.update(moe_best_ep(model, cluster, result.budget))
    except (PlannerError, ValueError) as e:  # (no EP degree the experts and the GPUs allow: n/a)
        refused[BEST_EP] = str(e)
    policies["auto"] = {**auto_summary(result), **throughput(tr, tokens, result.report, cluster.gpu.peak_bf16_flops)}
    r = {"model": model, "cluster": f"h100:{gpus}", "budget": result.budget, "budget_source": result.budget_source,
         "min_peak": result.min_peak, "fits": result.fits, "lower_bound": result.report.lower_bound,
         "policies": policies, "refused": refused}
    return judge(r, result, {})


# torchtitan's 405B job as it ships (torchtitan/models/llama3/config_registry.py, the last llama3_405b.toml): TP 8
# with async TP, torch.compile of the blocks, float8 (tensorwise), full checkpointing, local batch 8 (one sequence
# of 8192 tokens per GPU), here on 512 H100s; auto given the same compile, float8 and async TP choices (numerics and
# compile time are the user's), as the CLI plans: both through the CLI's JSON, as a user runs them.
SHIPPED = ("llama3-405b", 512)
SHIPPED_FLAGS = ("--compile", "--float8", "tensorwise", "--async-tp")


def cli_json(args: list[str]) -> dict:
    """``fsdp-planner ARGS --json``'s document (in this process)."""
    from fsdp_planner.cli import main as cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = cli_main([*args, "--json"])
    if rc != 0:
        raise SystemExit(f"fsdp-planner {' '.join(args)} exited {rc}")
    return json.loads(out.getvalue())


def shipped_row(model: str, gpus: int) -> dict:
    """torchtitan's shipped configuration (SHIPPED_FLAGS, TP 8, full AC) beside auto with the same flags."""
    cluster = f"h100:{gpus}"
    titan = cli_json(["simulate", model, "--policy", "titan", "--ac", "full", "--tp", str(EXPERT_TP), "--batch",
                      str(EXPERT_TP), "--cluster", cluster, *SHIPPED_FLAGS])
    doc = cli_json(["plan", model, "--policy", "auto", "--cluster", cluster, *SHIPPED_FLAGS])
    auto = doc["plans"][0]
    tp = (auto["plan"].get("tensor_parallel") or {}).get("degree", 1)
    return {"model": model, "cluster": cluster, "budget": doc["auto"]["budget"],
            "titan": {k: titan[k] for k in ("step_time", "exposed_comm", "reserved_memory")},
            "auto": {**{k: auto["simulation"][k] for k in ("step_time", "exposed_comm", "reserved_memory")},
                     "mesh": auto["simulation"]["mesh"], "tp": tp}}


def shipped_lines(r: dict) -> list[str]:
    t, a = r["titan"], r["auto"]
    gain = 1 - a["step_time"] / t["step_time"]
    return [
        "### torchtitan's 405B job as it ships", "",
        f"torchtitan's llama3 405B configuration (config_registry.py; its last TOML the same): TP 8 with async TP, "
        f"torch.compile of the blocks, float8 (tensorwise, float8 all-gather), every block checkpointed in full, "
        f"local batch 8, here on {r['cluster'].split(':')[1]} H100s; auto given the same choices "
        f"(`fsdp-planner plan {r['model']} --policy auto --cluster {r['cluster']} {' '.join(SHIPPED_FLAGS)}`). "
        "Step / exposed communication / reserved per rank.", "",
        "| model | GPUs | torchtitan as shipped (TP 8) | auto, same flags | auto layout | winner |",
        "|---|---|---|---|---|---|",
        f"| {r['model']} | {r['cluster'].split(':')[1]} | {fmt_time(t['step_time'])} / {fmt_time(t['exposed_comm'])} / "
        f"{fmt_bytes(t['reserved_memory'])} | {fmt_time(a['step_time'])} / {fmt_time(a['exposed_comm'])} / "
        f"{fmt_bytes(a['reserved_memory'])} | {a['mesh']} x TP {a['tp']} | "
        + (f"auto, {gain:.1%} faster" if gain > 0 else f"torchtitan, {-gain:.1%} faster") + " |", ""]


def two_d_table(rows: list[dict], columns: list[str]) -> list[str]:
    """A 2-D table: per row the expert's configurations, auto, its layout and checkpointing, throughput, winner."""
    lines = ["| model | GPUs | " + " | ".join([*columns, "auto"]) + " | auto layout | auto AC | tokens/s/GPU | MFU "
             "| winner |", "|---|---|" + "---|" * (len(columns) + 1) + "---|---|---|---|---|"]
    for r in rows:
        auto = r["policies"]["auto"]
        cells = [cell(r["policies"][n], r["budget"]) if n in r["policies"] else "n/a" for n in [*columns, "auto"]]
        tps = f"{auto['tokens_per_s_per_gpu']:,.0f}" if auto["tokens_per_s_per_gpu"] and r["fits"] else "-"
        mfu = f"{auto['mfu']:.0%}" if r["fits"] else "-"
        lines.append(f"| {r['model']} | {r['cluster'].split(':')[1]} | " + " | ".join(cells)
                     + f" | {auto['layout']} | {ac_text(auto)} | {tps} | {mfu} | {verdict(r)} |")
    return lines


def two_d_main() -> None:
    started = time.perf_counter()
    rows, moe = [], []
    for model, gpus in TWO_D_ROWS:
        rows.append(two_d_row(model, gpus))
        print(f"{model} h100:{gpus}: {verdict(rows[-1])} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    for model, gpus in MOE_ROWS:
        moe.append(moe_row(model, gpus))
        print(f"{model} h100:{gpus}: {verdict(moe[-1])} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    shipped = shipped_row(*SHIPPED)
    print(f"{SHIPPED[0]} h100:{SHIPPED[1]} as shipped: {shipped} ({time.perf_counter() - started:.0f} s)",
          file=sys.stderr)
    elapsed = time.perf_counter() - started
    out = Path(__file__).parent
    (out / "plan_quality_2d.json").write_text(json.dumps({"rows": rows, "moe_rows": moe, "shipped": shipped,
                                                          "seconds": elapsed}, indent=1) + "\n")
    lines = [
        TWO_D_START, "", "## 2-D layouts: FSDP2 with tensor parallelism", "",
        f"Measured by `python benchmarks/plan_quality.py --two-d` ({elapsed:.0f} s on {platform.machine()}, load "
        f"average {os.getloadavg()[0]:.1f}), the same simulator, budget and step as the rows above: one sequence of "
        "8192 tokens per GPU, so a layout with TP d runs d sequences per data-parallel rank (the same global batch; "
        "torchtitan's 70B job runs local batch 8 with TP 8). The expert's 2-D configuration is torchtitan's: TP 8 "
        "inside each node with sequence parallelism and loss parallel (its Llama layout), FSDP over the nodes with "
        "its grouping, every block checkpointed in full (titan TP8+ac, its 70B and 405B jobs) or op-level (titan "
        "TP8+op), eager (no compile, no float8, no async TP). Auto chooses the TP degree among 1, 2, 4, 8 (each "
        "screened by its best classic plan, the best searched in full), the data-parallel layout and the "
        "checkpointing. Cells as above.",
        "", *two_d_table(rows, list(EXPERT_2D)), "",
        "### MoE: FSDP2 with EP and TP", "",
        "One sequence of 4096 tokens per GPU (the model's default); TP d runs d per data-parallel rank. The "
        "expert's configurations follow torchtitan's MoE jobs (deepseek_v3_671b.toml at commit 8e2cd19 and "
        "llama4_17bx16e.toml at commit 6964eb7: TP 8, full checkpointing, expert_parallel_degree 1, the experts "
        "tensor-parallel: titan TP 8+ac, each rank holding 1/8 of every expert's hidden units). The EP x TP "
        "columns keep EP 8 with TP (EP's ranks span TP's, each TP rank dispatching 1/TP of the routed tokens); "
        "titan EP 8+ac is its EP recipe without TP; titan EP best its EP degree swept as a user tunes it (each "
        "degree the experts and the GPUs allow, every block in full, the fastest that fits: its degree in the "
        "json's plan). Each: torchtitan's grouping, every block checkpointed in full "
        "(+ac) or the fewest leading blocks in full that fit (+k full, as a user tunes it), experts resharded "
        "after forward and sharded on dim 1 where dim 0 would pad (torchtitan's expert placement). Auto chooses EP"
        " x TP itself (each TP degree x the EP degrees it allows, screened by its best classic grouping under EP, "
        "the best searched in full, beside its search without TP and its EP screen). Where auto's plan keeps "
        "the experts' groups unsharded after forward (their backward all-gathers saved), no column here does: part "
        "of its lead there is that choice, open to a hand config too. DeepSeek-V3 (671B, transformers' "
        "modules, `hf:deepseek-v3`): the TP columns are n/a, torchtitan's MoE TP layout naming its own modules and "
        "EP x TP over transformers' experts being refused; torchtitan's own 671B job adds pipeline parallelism, "
        "which fsdp-planner does not model, so its EP column is that job's recipe without PP.", "",
        *two_d_table(moe, [*EXPERT_MOE, *(n.replace("+ac", "+k full") for n in MOE_FEWEST), f"{BEST_EP}+ac",
                           f"{BEST_EP}+k full"]), "",
        *shipped_lines(shipped),
        summary_line([*rows, *moe]),
    ]
    md = out / "plan_quality.md"
    text = md.read_text()
    kept = text[:text.index(TWO_D_START)] if TWO_D_START in text else text + "\n"
    md.write_text(kept + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    two_d_main() if "--two-d" in sys.argv[1:] else main()

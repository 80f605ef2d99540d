"""What float8 training (a plan's ``float8``: torchao's ``Float8Linear``, ``fsdp2/float8.py``) changes in a step.

- Matmuls: the three of each converted Linear call (forward; input grad and weight grad in backward) run at the
  GPU's dense float8 peak (``GPU.peak_fp8_flops``) with the matmul efficiency of the cluster's roofline times
  ``FLOAT8_PEAK_SHARE`` (a GEMM sweep's float8 rate over its bf16 one); their
  operands are cast first, memory-bound work timed at HBM bandwidth before the matmul it feeds (``Float8Step``).
- The casts, as torchao 0.18 runs them (``hp_tensor_to_float8_dynamic``): eager, the amax is ``abs`` then ``max``
  and the cast upcasts to fp32, scales, clamps and converts (``_ToFloat8ConstrFunc``, ``to_fp8_saturated``): 2h +
  h + (h + 4 unless already fp32) + 8 + 8 + 5 bytes an element for an h-byte input, in 6 or 7 kernels. Inside a
  torch.compile'd block inductor fuses them into a reduction reading the input and one kernel reading it and writing
  float8: 2h + 1 bytes, 2 kernels. Forward casts the input (and the weight, unless FSDP2 all-gathered it in
  float8); backward casts the output grad for each of its two matmuls (one cast compiled: the same scale and data,
  tensorwise) and recasts the saved input (torchao saves the bf16 input and weight, not their float8 casts, so what
  a call saves for backward is unchanged), and the weight again unless it was gathered in float8.
- Memory: while a cast runs it holds, eager, its fp32 scaled copy and that copy clamped beside the float8 result
  (9 bytes an element), fused only the result; the Linear's autograd function holds each float8 copy until its
  matmul ran (backward: both output-grad copies until the weight grad's matmul, beside the input recast). The most
  held at once around each converted matmul is a level on the activations (``cast_peak``, ``sim/memory.py``):
  under full checkpointing the step's peak is there, in a block's backward (-22.6% on toy-llama at batch 16
  without it); without checkpointing it is the end of forward, where no cast runs.
- Under torchao's float8 TP styles (``Float8.tp_float8_all_gather``, ``Trace.float8_tp``) the casts move out of
  the Linear into the styles' hooks: a region's input cast on its sequence shard before the all-gather, a rowwise
  output grad before its backward all-gather; the Linear saves and uses the float8 copies (``_styled_casts``).
- Under tensor parallelism a cast's amax of a TP-sharded DTensor is a ``Partial(max)`` DTensor, made whole by an
  all-reduce of one fp64 scalar over the TP group (``amax_to_scale`` upcasts it first) on the compute stream before
  the cast (``TP_AMAX_BYTES``; measured on the fake process group, issued by DTensor's redistribution): a rowwise
  Linear's input is sharded on its last dim (cast in forward and again for the weight grad in backward), a colwise
  one's output grad is (cast for each backward matmul); a weight not gathered in float8 is a TP shard in forward
  and backward. Replicated inputs and output grads need none. Rowwise (axiswise) scales all-reduce a vector of
  fp64 amaxes, one a row or column, where the scaled axis is the sharded one (``_tp_amaxes``).
- FSDP2's float8 all-gather: one byte an element for the converted weights (``gathered``), the rest as before;
  the unsharded weights it leaves are float8 too (the memory model's unsharded params). With precomputed scales
  one all-reduce a step of one fp32 amax per converted weight, issued once for each mesh dim the weights are sharded
  over (DTensor's redistribution of a ``Partial(max)`` on FSDP's shard dim and TP's dim runs one all-reduce per dim);
  without, each all-gather all-reduces one amax per converted weight it holds (``scale_all_reduces``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fsdp_planner.choices import Float8Recipe
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.float8 import Float8
from fsdp_planner.fsdp2.replay import Collective
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel, TPStyle
from fsdp_planner.hardware.cluster import GPU
from fsdp_planner.trace.events import EventKind
from fsdp_planner.trace.records import Trace
from fsdp_planner.trace.tree import is_within

FP32_BYTES = 4
# bytes an element a cast holds at its peak: eager, the fp32 upcast times the scale and its clamp beside the
# float8 result (``_ToFloat8ConstrFunc``: ``tensor.to(float32) * scale`` held while ``to_fp8_saturated`` clamps and
# converts; measured on fake ranks); fused by inductor, the float8 result alone
EAGER_CAST_BYTES = 2 * FP32_BYTES + 1
FUSED_CAST_BYTES = 1
TP_AMAX_BYTES = 8  # the amax all-reduced as fp64 (torchao's amax_to_scale: ``amax.to(torch.float64)``)
_COLWISE = (TPStyle.COLWISE, TPStyle.SEQUENCE_COLWISE, TPStyle.COLWISE_GATHER)  # output grad sharded on its last dim
_ROWWISE = (TPStyle.ROWWISE, TPStyle.ROWWISE_SEQUENCE, TPStyle.ROWWISE_SPLIT)  # input sharded on its last dim


@dataclass(frozen=True)
class Float8Step:
    """Per converted matmul (event index) the bytes and kernels of the casts before it; the params FSDP2
    all-gathers in float8; the converted weights (param indices), in trace order."""

    matmuls: np.ndarray  # event indices
    cast_nbytes: np.ndarray  # bytes the casts before each move, in the compute dtype
    cast_kernels: np.ndarray  # kernels they launch
    gathered: frozenset[int]
    weights: tuple[int, ...]
    precompute_scale: bool
    tp_all_reduces: np.ndarray  # per matmul: the amax all-reduces over the TP group before it (module docstring)
    cast_peaks: np.ndarray  # per matmul: the most bytes its casts hold at once beside the memory model's terms
    tp_amax_nbytes: np.ndarray  # per matmul: those all-reduces' bytes (a scalar each tensorwise, vectors rowwise)
    tp_degree: int = 1

    def tp_amax_seconds(self, seconds: Callable[[float], float]) -> np.ndarray:
        """Per matmul, its amax all-reduces' seconds given one all-reduce's (``seconds`` of its bytes): each of a
        matmul's all-reduces takes its mean bytes (exact where a collective's time is linear in its bytes)."""
        return np.array([n * seconds(b / n) if n else 0.0 for n, b in
                         zip(self.tp_all_reduces.tolist(), self.tp_amax_nbytes.tolist(), strict=True)])

    def levels(self, n: int) -> np.ndarray:
        """The casts' bytes as a level at each of ``n`` event positions (``sim/memory.py``'s activations'
        indexing): at each converted matmul, nothing carried over to the next event."""
        out = np.zeros(n)
        np.maximum.at(out, self.matmuls, self.cast_peaks)
        return out


def cast_bytes(itemsize: int, compiled: bool) -> tuple[int, int]:
    """Bytes an element and kernels of one float8 cast of an ``itemsize``-byte tensor (module docstring)."""
    if compiled:
        return 2 * itemsize + 1, 2
    upcast = 0 if itemsize == FP32_BYTES else itemsize + FP32_BYTES
    return 3 * itemsize + upcast + 2 * FP32_BYTES * 2 + FP32_BYTES + 1, 6 + (upcast > 0)


def converted_linears(trace: Trace, f8: Float8) -> dict[str, int]:
    """The Linears torchtitan's filter converts, by name, each with its weight's param index."""
    index = trace.index.param_index
    out = {}
    for name, m in trace.modules.items():
        weight = f"{name}.weight" if name else "weight"
        if m.torch_class == "Linear" and weight in index:
            param = trace.params[index[weight]]
            # tied: any other name of the weight, as apply counts them (a module registered twice is swapped once)
            if f8.converts(name, param.shape, plain=m.plain_torch_class, tied=bool(param.aliases)):
                out[name] = index[weight]
    return out


def check_float8_scales(trace: Trace, tp: TensorParallel | None, f8: Float8 | None) -> None:
    """Refuse float8's precomputed scales under TP when a converted Linear is left whole over TP: torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` stacks every converted weight's amax in one DTensor op, and that
    weight lives on the data-parallel mesh alone, the others on the 2-D mesh (measured on the fake process group:
    "All operands in aten.stack.default must have the same mesh")."""
    if f8 is None or not f8.precompute_scale or tp is None or tp.degree == 1:
        return
    styled = tp.styles(trace.modules)
    whole = [name for name in converted_linears(trace, f8) if name not in styled]
    if whole:
        them = "it" if len(whole) == 1 else "them"
        raise PlannerError(f"float8's precomputed scales need every converted Linear under TP, and TP leaves "
                           f"{', '.join(whole[:5])}{' ...' if len(whole) > 5 else ''} whole (torchao's precompute "
                           f"stacks their scales over two meshes): add {them} to the plan's float8.filter_fqns "
                           f"(kept in bf16; on the command line --float8-skip {','.join(whole[:5])}), or turn the "
                           "precomputed scales off (the plan's float8.precompute_scale false; on the command line "
                           "--float8 tensorwise --no-float8-all-gather)")


def converted_matmuls(trace: Trace, weights: dict[int, str]) -> list[tuple[int, int, bool]]:
    """(event, weight, alone) of each matmul of a converted Linear, in step order: its forward and input-grad
    matmuls read the weight (``Event.params``); its weight-grad matmul reads none and runs in the Linear's own
    backward (a converted Linear is a module call: torchao swaps modules), just before the input-grad one
    (``mm``'s backward, a Linear without bias) or just after it (``addmm``'s, with a bias). ``alone``: a weight-grad
    matmul with no input-grad one beside it (the Linear's input needs no grad, so aten skips it), whose input grad
    torchao's autograd function makes all the same, casts and amaxes included."""
    names = {name: w for w, name in weights.items()}
    matmuls = [i for i, e in enumerate(trace.events) if e.kind is EventKind.OP and e.kernel > 0]
    read = {i: next((p for p in trace.events[i].params if p in weights), None) for i in matmuls}
    out: list[tuple[int, int, bool]] = []
    for k, i in enumerate(matmuls):
        e = trace.events[i]
        if read[i] is not None:
            out.append((i, read[i], False))
        elif e.backward and not e.params and e.module in names:
            weight = names[e.module]
            beside = matmuls[max(0, k - 1):k + 2]
            out.append((i, weight, not any(read[j] == weight and trace.events[j].backward for j in beside)))
    return out


def float8_step(trace: Trace, f8: Float8, itemsize: int) -> Float8Step:
    """The step's float8 work (module docstring); ``itemsize``: the compute dtype's bytes."""
    if trace.float8_tp and itemsize != 2:  # (the TP view halved their bytes: ``tensor_parallel.FLOAT8_SHARE``)
        raise PlannerError("float8 TP all-gathers are modelled with a 16-bit compute dtype, as torchtitan's float8 "
                           "jobs run: use --precision bf16-mixed, or plan TP's all-gathers in bf16")
    linears = converted_linears(trace, f8)
    weights = {w: name for name, w in linears.items()}
    compiled = tuple(trace.compiled)
    gathered = f8.fsdp_float8_all_gather
    styles = TensorParallel.from_signature(trace.tensor_parallel).styles(trace.modules) if trace.tensor_parallel else {}
    casting = _region_casters(trace, styles)
    shared = _shared_input_casts(trace, linears, compiled)
    matmuls, nbytes, kernels, amaxes, amax_nbytes, peaks = [], [], [], [], [], []
    for i, w, alone in converted_matmuls(trace, weights):
        e = trace.events[i]
        out_features, in_features = trace.params[w].shape
        rows = e.flops // (2 * in_features * out_features)
        fused = any(is_within(weights[w], m) for m in compiled)
        per, launches = cast_bytes(itemsize, fused)
        weight = 0 if gathered else in_features * out_features
        weight_grad = e.backward and w not in e.params  # (it reads no param: ``converted_matmuls``)
        dims, held = (rows, in_features, out_features), FUSED_CAST_BYTES if fused else EAGER_CAST_BYTES
        if weights[w] in trace.float8_tp:  # torchao's float8 TP styles cast around the Linear
            elements, casts, amax, peak = _styled_casts(styles[weights[w]], casting.get(weights[w]), dims,
                                                        weight > 0, e.backward, weight_grad, held, trace.tp_degree)
            amax_bytes = TP_AMAX_BYTES * amax
        else:
            grads = 1 if fused and f8.recipe is Float8Recipe.TENSORWISE else 2  # output grad casts in backward
            cast_in = weights[w] not in shared  # its input's cast and recast (unless an earlier sibling's serve)
            if not e.backward:
                elements, casts = cast_in * rows * in_features + weight, cast_in + (weight > 0)
            else:  # the backward's casts shared between its two matmuls (module docstring)
                elements = (grads * rows * out_features + cast_in * rows * in_features + weight) / 2
                casts = (grads + cast_in + (weight > 0)) / 2
            amax, amax_bytes = _tp_amaxes(styles.get(weights[w]), e.backward, weight_grad, gathered, f8.recipe, dims)
            made = itemsize * in_features * out_features \
                if e.backward and not weight_grad and trace.params[w].requires_grad else 0
            peak = cast_peak(dims, weight > 0, e.backward, weight_grad, grads, held, cast_in, made)
        if alone:  # the input grad torchao makes beside it: its half of the backward's casts, its amaxes
            elements, casts = 2 * elements, 2 * casts
            if weights[w] in trace.float8_tp:
                more = _styled_casts(styles[weights[w]], casting.get(weights[w]), dims, weight > 0, True, False,
                                     held, trace.tp_degree)[2]
                more_bytes = TP_AMAX_BYTES * more
            else:
                more, more_bytes = _tp_amaxes(styles.get(weights[w]), True, False, gathered, f8.recipe, dims)
            amax, amax_bytes = amax + more, amax_bytes + more_bytes
        matmuls.append(i)
        nbytes.append(elements * per)
        kernels.append(casts * launches)
        amaxes.append(amax)
        amax_nbytes.append(amax_bytes)
        peaks.append(peak)
    return Float8Step(np.array(matmuls, dtype=np.intp), np.array(nbytes, dtype=np.float64),
                      np.array(kernels, dtype=np.float64),
                      frozenset(linears.values()) if gathered else frozenset(), tuple(sorted(linears.values())),
                      f8.precompute_scale, np.array(amaxes, dtype=np.int64), np.array(peaks, dtype=np.float64),
                      np.array(amax_nbytes, dtype=np.int64), trace.tp_degree)


def cast_peak(dims: tuple[int, int, int], weight: bool, backward: bool, weight_grad: bool, grads: int,
              per: int, input_cast: bool = True, made: int = 0) -> int:
    """The most bytes the casts around one matmul of a converted Linear hold at once, beside what the memory model
    counts there (the saved activations, the gradients alive, the unsharded params): ``per`` bytes an element
    while a cast runs (``EAGER_CAST_BYTES``), then one (its float8 copy) while the Linear's autograd function
    holds it. ``dims``: its (rows, in, out); ``weight``: its weight is cast too (not all-gathered in float8).
    Forward casts the input, then the weight beside the input's copy. Backward (torchao's order) casts the output
    grad for the input grad's matmul, then the weight; then, with the input grad made, the output grad again for
    the weight grad's matmul (``grads`` == 2) and the saved input beside every copy: the two before the input grad
    are put at the weight grad's event, which the trace has first (``converted_matmuls``), the rest at the input
    grad's, whose gradients the model counts there. ``input_cast`` False: an earlier sibling's casts of the same
    input serve (``_shared_input_casts``), the float8 copy alone held. ``made``: the weight grad's bytes, which the
    memory model counts at the input grad's event and which the casts there precede (torchao makes the weight grad
    last: measured on fake ranks, a converted output head's peak was over-predicted by its weight grad)."""
    rows, in_features, out_features = dims
    w = in_features * out_features if weight else 0
    x = per * rows * in_features if input_cast else rows * in_features
    if not backward:
        return max(x, rows * in_features + per * w)
    if weight_grad:
        return max(per * rows * out_features, rows * out_features + per * w)
    again = rows * out_features + w + per * rows * out_features if grads == 2 else 0
    return max(0, max(again, grads * rows * out_features + w + x) - made)


def _shared_input_casts(trace: Trace, linears: dict[str, int], compiled: tuple[str, ...]) -> frozenset[str]:
    """The converted Linears of compiled blocks whose input casts an earlier sibling's serve: torch.compile's joint
    graph runs common-subexpression elimination before partitioning (``torch._functorch.config.cse``), so the
    same cast of the same tensor in one block (wq, wk and wv of one input; w1 and w3) runs once in forward, and
    its recast for the weight grads once in backward (AOT graphs of three float8 Linears on one input: one input
    cast in forward, one recast in backward; ``tests/test_float8.py``). The same tensor is told by what the trace
    has: a Linear whose input an earlier call took (``Event.inputs_nbytes`` 0), read with the same rows and
    in-features as a converted sibling's in the same parent call. Eager torchao casts each Linear's input
    itself."""
    out: set[str] = set()
    seen: set[tuple] = set()
    stack: list[tuple[str, int]] = []  # the open calls (module, call)
    reused: dict[str, tuple[str, int]] = {}  # converted Linear -> its parent call, when its input was taken before
    for e in trace.events:
        if e.backward:
            break
        if e.kind is EventKind.FWD_PRE:
            if e.module in linears and not e.inputs_nbytes and stack and \
                    any(is_within(e.module, m) for m in compiled):
                reused[e.module] = stack[-1]
            stack.append((e.module, e.call))
        elif e.kind is EventKind.FWD_POST and stack:
            stack.pop()
        elif e.is_op and e.flops and e.module in reused and linears[e.module] in e.params:
            in_features = trace.params[linears[e.module]].shape[1]
            key = (*reused.pop(e.module), in_features, e.flops // trace.params[linears[e.module]].numel)
            if key in seen:
                out.add(e.module)
            seen.add(key)
    return frozenset(out)


def _region_casters(trace: Trace, styles: dict[str, TPStyle]) -> dict[str, bool]:
    """Under torchao's float8 TP styles, each colwise Linear whose input its region casts to float8 on the sequence
    shard before the all-gather (``PrepareFloat8ModuleInput``) -> whether it is the region's first (its cast is
    charged there, once a call); a colwise Linear outside such a region is absent (it casts its replicated
    input itself)."""
    out: dict[str, bool] = {}
    for region in sorted(m for m in trace.float8_tp if styles.get(m) is TPStyle.GATHER_INPUT):
        readers = sorted((m for m in trace.float8_tp if styles.get(m) is TPStyle.COLWISE and is_within(m, region)
                          and m != region), key=lambda m: trace.modules[m].first_use)
        out.update({m: k == 0 for k, m in enumerate(readers)})
    return out


def _styled_casts(style: TPStyle, region: bool | None, dims: tuple[int, int, int], weight: bool, backward: bool,
                  weight_grad: bool, per: int, t: int) -> tuple[float, float, int, int]:
    """(elements cast, casts, amax all-reduces over TP, most bytes held at once) around one matmul of a converted
    Linear in torchao's float8 TP styles (``fsdp2/float8.py``). A colwise Linear's input comes cast: by its region
    on the sequence shard (``region``: True for the region's first reader, which is charged that cast and its
    amax all-reduce), or by its own style where its input is replicated (no all-reduce); its output grad is cast
    once in backward, on its last-dim shard (an all-reduce), for both matmuls. A rowwise Linear's style casts its
    last-dim-sharded input (an all-reduce) and, in backward, its output grad before the all-gather: on the
    sequence shard (an all-reduce) where the output was reduce-scattered, else whole and replicated. The Linear
    then saves and uses those float8 copies: no recast in backward. ``per``: bytes an element while a cast
    runs; the weight is cast as without the styles unless FSDP2 gathered it in float8. Backward's casts are
    shared between its two matmuls, as ``float8_step`` counts them."""
    rows, in_features, out_features = dims
    w = in_features * out_features if weight else 0
    colwise = style is TPStyle.COLWISE
    if not backward:
        x = (rows * in_features // t if region else 0) if colwise and region is not None else rows * in_features
        amax = (bool(region) if colwise else 1) + weight
        return x + w, (x > 0) + weight, amax, max(per * x, x + per * w if w else 0)
    sharded = style is TPStyle.ROWWISE_SEQUENCE
    g = rows * out_features // t if sharded else rows * out_features
    amax = (colwise or sharded) if weight_grad else weight
    peak = max(per * g, rows * out_features) if weight_grad else rows * out_features + per * w
    return (g + w) / 2, (1 + weight) / 2, int(amax), peak


def _tp_amaxes(style: TPStyle | None, backward: bool, weight_grad: bool, gathered: bool, recipe: Float8Recipe,
               dims: tuple[int, int, int]) -> tuple[int, int]:
    """(count, bytes) of the amax all-reduces over the TP group before one matmul of a converted Linear in
    ``style`` (module docstring); ``dims``: its local (rows, in, out). Tensorwise, one fp64 scalar each: forward,
    the sharded input (rowwise) and weight (unless gathered in float8); in backward, the weight grad's matmul
    recasts the input (rowwise) and casts the output grad (colwise), the input grad's casts the output grad
    (colwise) and recasts the weight (unless gathered in float8). Rowwise (axiswise scales), a vector of fp64
    amaxes wherever the scaled axis is the TP-sharded one: a rowwise Linear's forward scales its input and weight
    along their in-features (its rows' and its out-features' amaxes), a colwise one's input-grad matmul scales the
    output grad along the out-features and the weight along them (its rows' and its in-features' amaxes); the
    weight grad's matmul scales both operands along the rows, whole on every rank (toy-llama TP 2, rowwise, on the
    fake process group: 2 a Linear, 56 of its 68 all-reduces a step, 43,008 of their 45,696 bytes)."""
    if style is None:
        return 0, 0
    if recipe is Float8Recipe.ROWWISE:
        rows, in_features, out_features = dims
        if not backward and style in _ROWWISE:
            return 2, TP_AMAX_BYTES * (rows + out_features)
        if backward and not weight_grad and style in _COLWISE:
            return 2, TP_AMAX_BYTES * (rows + in_features)
        return 0, 0
    weight = 0 if gathered else 1
    if not backward:
        count = (style in _ROWWISE) + weight
    elif weight_grad:
        count = (style in _ROWWISE) + (style in _COLWISE)
    else:
        count = (style in _COLWISE) + weight
    return count, TP_AMAX_BYTES * count


# A float8 matmul reaches a smaller share of its data-sheet peak than a bf16 one: the same GEMM sweep on one H100
# SXM found 1,402.6 of 1,979 TFLOP/s in float8_e4m3fn (70.9%) against 794.5 of 989 in bf16 (80.3%) (Stas Bekman's
# Maximum Achievable Matmul FLOPS, ml-engineering compute/accelerator/README.md, torch 2.7.0+cu126); GH200's:
# 77.6% against 83.6%. The roofline's bf16 matmul factors (``Compute``) apply to the float8 peak times this ratio
# (``sim/compute.op_times``; ``--mfu`` runs every op at its one fraction of the data-sheet peak, float8's too).
FLOAT8_PEAK_SHARE = 0.709 / 0.803


def fp8_peak(gpu: GPU) -> float:
    """The GPU's dense float8 peak; a GPU without float8 tensor cores is refused."""
    if gpu.peak_fp8_flops <= 0:
        raise PlannerError(f"the {gpu.name} has no float8 tensor cores (its cluster gives no peak_fp8_flops): float8 "
                           "training needs an H100, H200, B200 or a cluster file with gpu.peak_fp8_flops")
    return gpu.peak_fp8_flops


def scale_all_reduces(step: Float8Step, all_gathers: list[Collective], group_params: list[tuple[int, ...]],
                      amax_bytes: int) -> tuple[int, int]:
    """The amax all-reduces of a step and their bytes: one of every converted weight's amax with precomputed
    scales (one per mesh dim the weights are sharded over), else one per converted weight of each all-gather
    (torchao's ``fsdp_pre_all_gather``)."""
    if not step.gathered:
        return 0, 0
    if step.precompute_scale:  # once for FSDP's shard dim, once more for TP's
        dims = 1 + (step.tp_degree > 1)
        return dims, dims * amax_bytes * len(step.weights)
    held = [sum(p in step.gathered for p in params) for params in group_params]
    count = sum(held[c.group] for c in all_gathers)
    return count, amax_bytes * count

"""The part of ``export --format torchtitan`` that plugs a plan into torchtitan as it is today (b5bcd76, 2026):
``parallelize_fn`` with the keywords torchtitan's ``Trainer`` calls a ``ModelSpec.parallelize_fn`` with, and the
plan's module names looked up as torchtitan's own ``Decoder`` names them.

Why: a plan is made on fsdp-planner's built-in Llama (``output``, ``attention.wq``) or on a transformers model
(``model.layers.0.self_attn``); torchtitan builds the same model as a ``Decoder`` with ``lm_head`` and
``attention.qkv_linear.wqkv``. The export names the modules as the plan does and resolves them against the model it
is given, part by part, through one fixed table (``TORCHTITAN_NAMES``, written here, never from a plan). TP on a
torchtitan model is the model's own (``model.parallelize(parallel_dims)``, the layout its config declares, which the
planner's built-in Llama layout follows); on any other model, the plan's TP_LAYOUT.
"""

from __future__ import annotations

from fsdp_planner.configs.torchtitan_registry import PLAN_NAME

# each part of a plan's module name -> how torchtitan's Decoder names it (tried in turn where the model has no
# module of the plan's name): torchtitan's state_dict adapters' hf -> torchtitan key maps (llama3, qwen3,
# deepseek_v3, gpt_oss) and its Llama3 model (lm_head, fused or apart qkv_linear)
TORCHTITAN_NAMES = {
    "output": ["lm_head"], "embed_tokens": ["tok_embeddings"], "self_attn": ["attention"],
    "mlp": ["feed_forward", "moe"], "input_layernorm": ["attention_norm"], "post_attention_layernorm": ["ffn_norm"],
    "wq": ["qkv_linear.wq", "qkv_linear.wqkv"], "wk": ["qkv_linear.wk", "qkv_linear.wqkv"],
    "wv": ["qkv_linear.wv", "qkv_linear.wqkv"], "q_proj": ["qkv_linear.wq", "qkv_linear.wqkv", "wq"],
    "k_proj": ["qkv_linear.wk", "qkv_linear.wqkv"], "v_proj": ["qkv_linear.wv", "qkv_linear.wqkv"],
    "o_proj": ["wo"], "gate_proj": ["w1"], "up_proj": ["w3"], "down_proj": ["w2"],
    "experts": ["routed_experts"], "gate": ["router.gate"], "router": ["router.gate"],
}

MODULES_LINE = "    modules = dict(model.named_modules())\n"
TITAN_MODULES_LINE = "    modules = TorchtitanModules(model.named_modules())  # the plan's names, or torchtitan's\n"
MISSING_LINE = "    missing = sorted(n for n in named if n not in modules)\n"
TITAN_MISSING_LINE = MISSING_LINE + "    modules.check_groups(GROUPS, CHECKPOINTED + COMPILED)  # before any change\n"
TARGETS_LINE = "    targets = [[modules[n] for n in names] for names, _ in GROUPS]\n"
TITAN_TARGETS_LINE = ("    targets = [modules.targets(names) for names, _ in GROUPS]  # (q, k, v: one; transformers' "
                      "backbone: three)\n")
SHARD_DIMS_LINE = ("    dims = {id(p): SHARD_DIMS[n] for n, p in model.named_parameters(remove_duplicate=False) "
                   "if n in SHARD_DIMS}\n")
TITAN_SHARD_DIMS_LINE = "    dims = TorchtitanModules(model.named_modules()).shard_dims(SHARD_DIMS)\n"
TP_LINE = "    tensor_parallel(model, tp_mesh)\n"
MODEL_TP_LINE = "        model.parallelize(parallel_dims)\n"
# float8 before the model's own TP: torchao's swap of a Linear TP has parallelized drops TP's hooks, and its forward
# then mixes a Tensor with DTensors (a trial's 70B TP 8 float8 export); ``convert_float8`` skips a converted model
FLOAT8_MODEL_TP_LINE = "        convert_float8(model)  # before the model's TP, whose hooks torchao's swap drops\n" + \
    MODEL_TP_LINE
TITAN_TP_LINE = """    if not tp_sharded(model):  # torchtitan's own model lays out its TP itself (parallelize_fn)
        tensor_parallel(model, tp_mesh)
"""
DIMS_CONSTANT = """TORCHTITAN_DIMS: dict[str, int] = {dims}  # the ParallelDims degrees the plan was made for
"""
# the plan itself, as the JSON ``plan --out`` writes: data, never run; ``plan --from-torchtitan FILE.py:
# fsdp_planner_job`` reads it back where the job keeps this file's parallelize_fn, so the job's figures are the
# plan's groups (its keys alone would say torchtitan's own grouping)
PLAN_CONSTANT = PLAN_NAME + """: str = {plan}  # the plan (JSON) this file applies: data for fsdp-planner's reader
"""

TAIL = '''

TORCHTITAN_NAMES: dict[str, list[str]] = {names}


class TorchtitanModules(dict):
    """A model's modules by name; a name the model does not have is looked up as torchtitan's Decoder names it:
    each part of the plan's name as it is or as TORCHTITAN_NAMES says, the first the model has (transformers'
    leading ``model.`` dropped, torchtitan's Decoder holding its layers itself)."""

    def __missing__(self, name: str) -> nn.Module:
        parts = self.parts(name)
        if not parts:
            raise KeyError(name)
        return self[parts[0]]  # (a backbone's: its group's first module, which FSDP2's prefetch lists take)

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or (isinstance(name, str) and bool(self.parts(name)))

    def parts(self, name: str) -> list[str]:
        """The model's modules a plan's name stands for: itself, or as torchtitan names it; transformers' backbone
        ``model`` is the Decoder's embedding, layers and norm (the Decoder holds them itself, beside lm_head)."""
        if dict.__contains__(self, name):
            return [name]
        if name == "model":
            return [p for p in ("tok_embeddings", "layers", "norm") if dict.__contains__(self, p)]
        found = self.torchtitan_name(name)
        return [found] if found is not None else []

    def torchtitan_name(self, name: str) -> str | None:
        parts = name.split(".")
        if parts[0] == "model" and not dict.__contains__(self, "model"):
            parts = parts[1:]
        found = [""]
        for part in parts:
            found = [f"{prefix}.{alt}" if prefix else alt for prefix in found
                     for alt in (part, *TORCHTITAN_NAMES.get(part, ())) if dict.__contains__(self, f"{prefix}.{alt}"
                                                                                           if prefix else alt)]
            if not found:
                return None
        return found[0] if parts and found[0] != name else None

    def targets(self, names: list[str]) -> list[nn.Module]:
        """The modules one ``fully_shard`` call takes for a group's names, each once."""
        return list({id(self[p]): self[p] for n in names for p in self.parts(n)}.values())

    def check_groups(self, groups: list[tuple[list[str], bool | int]], whole: list[str]) -> None:
        """Refuse, before any change, two groups holding one module of this model (torchtitan fuses q, k and v
        into ``qkv_linear.wqkv``: a plan sharding them apart cannot be applied to it), and checkpointing or
        compiling transformers' backbone, which torchtitan's Decoder has no module for (``whole``)."""
        owner: dict[int, str] = {}
        for names, _ in groups:
            for name in (n for n in names if n in self):
                for module in self.targets([name]):
                    first = owner.setdefault(id(module), name)
                    if first not in names:
                        raise ValueError(f"the plan shards {first!r} and {name!r} in different groups, and this "
                                         "model holds them in one module: make the plan with them in one group (or "
                                         "with their block)")
        if any(len(self.parts(n)) > 1 for n in whole):
            raise ValueError("the plan checkpoints or compiles transformers' backbone 'model', which torchtitan's "
                             "model has no module for: make the plan checkpointing its layers")

    def shard_dims(self, dims: dict[str, int]) -> dict[int, int]:
        """SHARD_DIMS by param identity, its names (the plan's) looked up as the modules' are."""
        out = {}
        for name, dim in dims.items():
            owner, _, leaf = name.rpartition(".")
            param = getattr(self[owner], leaf, None) if owner in self else None
            if not isinstance(param, nn.Parameter):
                raise ValueError(f"SHARD_DIMS names {name!r}, a param this model does not have")
            out[id(param)] = dim
        return out


def tp_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s params are laid out over a ``tp`` mesh dim already (torchtitan's model.parallelize)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) for p in model.parameters())


def parallelize_fn(model: nn.Module, *, parallel_dims: Any, **job: Any) -> nn.Module:
    """torchtitan's ``ModelSpec.parallelize_fn`` (the keywords its Trainer passes: parallel_dims, training,
    parallelism, compile_config, ac_config, dump_folder): the plan in place of torchtitan's parallelize, its groups,
    checkpointing, compile and precision as the plan says (the job's own settings of them are not read here).
    ``fsdp_planner_job()`` sets it on the model's spec. On a model that declares its own TP layout (torchtitan's
    Decoder: ``model.parallelize(parallel_dims)``), TP is that layout; FSDP2 shards over DTensor meshes, torchtitan's
    ``spmd_backend = "partial_dtensor"``."""
    backend = getattr(job.get("parallelism"), "spmd_backend", "partial_dtensor")
    if backend != "partial_dtensor":
        raise ValueError(f"this plan's parallelize_fn shards with FSDP2 over DTensor meshes: set "
                         f"parallelism.spmd_backend = 'partial_dtensor' (the job has {backend!r}; "
                         "fsdp_planner_job() sets it)")
    have = {k: getattr(parallel_dims, k, 1) for k in TORCHTITAN_DIMS}
    if have != TORCHTITAN_DIMS:
        raise ValueError(f"this plan was made for {TORCHTITAN_DIMS} and the job has {have}: make the plan again for "
                         "the job's degrees, or run the job with the plan's")
    if parallel_dims.ep > 1 and callable(getattr(model, "parallelize", None)):
        raise ValueError("expert parallelism on torchtitan's own MoE model is torchtitan's (its routed experts are "
                         "laid out otherwise than the plan's): run the job with torchtitan's parallelize and "
                         "expert_parallel_degree, or export a plan without --ep")
    if parallel_dims.tp > 1 and callable(getattr(model, "parallelize", None)):
        model.parallelize(parallel_dims)
    names = [n for n, on in (("dp_replicate", parallel_dims.dp_replicate > 1), ("fsdp", True),
                             ("tp", parallel_dims.tp > 1)) if on]
    world_mesh = parallel_dims.get_mesh(names if len(names) > 1 else names[0])
    return parallelize(model, world_mesh)
'''


def torchtitan_dims(replicate: int, tp: int, ep: int, ranks: int) -> dict[str, int]:
    """The ``ParallelDims`` degrees a plan fixes: dp_shard where the plan's world is known (``ranks``; else any,
    as the job's -1 says); pipeline and context parallelism are not planned."""
    shard = {"dp_shard": ranks // (replicate * tp)} if ranks else {}
    return {"dp_replicate": replicate, **shard, "tp": tp, "ep": ep, "pp": 1, "cp": 1}

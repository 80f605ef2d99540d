"""``--from-torchtitan`` and ``--from-accelerate``: each key the readers take, the one-line notes for what is left
out, the one-line errors for what cannot be read, and the commands run from the files."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from fsdp_planner.choices import ACMode, PolicyName
from fsdp_planner.cli import build_parser, main
from fsdp_planner.cli.requests import configured
from fsdp_planner.configs.job_config import ACCELERATE, NO_WRAP_NUMEL, TORCHTITAN, read_config
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.plan import Mesh

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def titan(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def accel(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\n" + text)
    return path


# -- torchtitan keys -------------------------------------------------------------------------------------------------
def test_torchtitan_keys(tmp_path):
    cfg = read_config(TORCHTITAN, str(titan(tmp_path, """
[model]
name = "llama3"
flavor = "70B"
[training]
local_batch_size = 2
seq_len = 4096
global_batch_size = 64
mixed_precision_param = "bfloat16"
mixed_precision_reduce = "bfloat16"
enable_cpu_offload = true
[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = 8
fsdp_reshard_after_forward = "never"
[activation_checkpoint]
mode = "full"
""")))
    assert (cfg.model, cfg.batch, cfg.seq, cfg.global_batch) == ("llama3-70b", 2, 4096, 64)
    assert (cfg.precision, cfg.reduce_dtype, cfg.offload) == ("bf16-mixed", "bf16", True)
    assert (cfg.replicate, cfg.shard, cfg.reshard, cfg.ac, cfg.policy) == (2, 8, "never", ACMode.FULL, PolicyName.TITAN)
    assert cfg.notes == []


@pytest.mark.parametrize(("section", "ac"), [
    ('mode = "none"', ACMode.NONE), ('mode = "selective"\nselective_ac_option = "op"', ACMode.OP),
    ('mode = "selective"\nselective_ac_option = "2"', ACMode.SELECTIVE), ("", ACMode.OP),  # torchtitan's default
])
def test_torchtitan_activation_checkpoint(tmp_path, section, ac):
    cfg = read_config(TORCHTITAN, str(titan(tmp_path, f"[activation_checkpoint]\n{section}\n")))
    assert cfg.ac is ac
    assert [n for n in cfg.notes if "selective_ac_option is not given" in n] == ([] if section else [cfg.notes[0]])


def test_torchtitan_older_keys_and_defaults(tmp_path):
    job = titan(tmp_path, '[training]\nbatch_size = 3\nmixed_precision_param = "float32"\n')
    cfg = read_config(TORCHTITAN, str(job))
    assert (cfg.batch, cfg.precision, cfg.reduce_dtype, cfg.shard, cfg.replicate, cfg.reshard) == \
        (3, "fp32", None, None, 1, "default")  # dp_shard -1: every GPU --cluster has


@pytest.mark.parametrize(("text", "note"), [
    ('[model]\nconverters = ["float8"]\n[float8]\nfilter_fqns = ["output", "w2"]\n', "float8.filter_fqns = ["),
    ('[model]\nconverters = ["float8"]\n[float8]\nenable_fsdp_float8_all_gather = true\n',
     "float8.precompute_float8_dynamic_scale_for_fsdp off is read as on"),
    ("[mx]\nx = 1\n", "[mx] (MX formats) is left out"),
    ("[mystery]\nx = 1\n", "[mystery] is not read"),
    ("[parallelism]\nshard_degree = 8\n", "parallelism.shard_degree is not read"),
])
def test_torchtitan_left_out_is_one_line(tmp_path, text, note):
    notes = read_config(TORCHTITAN, str(titan(tmp_path, text + '[activation_checkpoint]\nmode = "none"\n'))).notes
    assert len(notes) == 1 and notes[0].startswith(note) and "\n" not in notes[0]


@pytest.mark.parametrize(("text", "float8"), [
    ('[model]\nconverters = ["float8"]\n', ("tensorwise", False)),  # torchtitan's default: bf16 all-gather
    ('[float8]\nenable_float8_linear = true\nenable_fsdp_float8_all_gather = true\n'
     'precompute_float8_dynamic_scale_for_fsdp = true\n', ("tensorwise", True)),  # the Dec 2024 form
    ('[model]\nconverters = ["quantize.linear.float8"]\n[quantize.linear.float8]\nrecipe_name = "rowwise"\n',
     ("rowwise", False)),
    ("[float8]\nenable_fsdp_float8_all_gather = true\n", (None, False)),  # settings without the converter: off
])
def test_torchtitan_float8_is_read_in_each_of_its_forms(tmp_path, text, float8):
    cfg = read_config(TORCHTITAN, str(titan(tmp_path, text + '[activation_checkpoint]\nmode = "none"\n')))
    assert (cfg.float8, cfg.float8_all_gather) == float8 and not cfg.notes


@pytest.mark.parametrize(("text", "key"), [("[compile]\nenable = true\n", "compile.enable"),
                                         ("[training]\ncompile = true\n", "training.compile")])
def test_torchtitan_compile_is_read_not_left_out(tmp_path, text, key):
    cfg = read_config(TORCHTITAN, str(titan(tmp_path, text + '[activation_checkpoint]\nmode = "none"\n')))
    assert cfg.compile and cfg.keys[key] is True and not cfg.notes


def test_torchtitan_compile_of_the_loss_alone_leaves_the_blocks_eager(tmp_path):
    """torchtitan's deepseek_v3_671b compiles its loss only (``components=["loss"]``): it was simulated with
    every block compiled (and minutes of partitioning); ``components`` left out holds both (the default). A compiled
    loss is --compile-loss (trace/compiled_loss.py); it was left eager, its fp32 copies of the logits counted."""
    def read(components: str):
        return read_config(TORCHTITAN, str(titan(tmp_path, f'[compile]\nenable = true\n{components}'
                                                           '[activation_checkpoint]\nmode = "none"\n')))

    loss = read('components = ["loss"]\n')
    assert (loss.compile, loss.compile_loss) == (False, True)
    assert loss.notes == ['compile.components = ["loss"] compiles no part of the model: its blocks are simulated eager']
    for components in ('components = ["model", "loss"]\n', ""):
        both = read(components)
        assert (both.compile, both.compile_loss) == (True, True) and not both.notes
    model = read('components = ["model"]\n')
    assert (model.compile, model.compile_loss) == (True, False) and not model.notes


@pytest.mark.parametrize(("text", "all_gather"), [
    ("mixed_precision: fp8\n", True),  # no fp8_config: Accelerate takes torchao's where installed, all-gather on
    ("mixed_precision: fp8\nfp8_config:\n  backend: 'NO'\n", True),  # (FP8BackendType's value for none named)
    ("mixed_precision: fp8\nfp8_config:\n  backend: AO\n  enable_fsdp_float8_all_gather: false\n", False),
])
def test_accelerate_fp8_with_torchao_is_float8_tensorwise(tmp_path, text, all_gather):
    """mixed_precision: fp8 with torchao's backend (AO; Accelerate 1.16's AORecipeKwargs) is --float8 tensorwise,
    its FSDP2 all-gather as fp8_config says (default on): a trial's job was simulated in bf16, said only."""
    cfg = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n" + text)))
    assert (cfg.float8, cfg.float8_all_gather) == ("tensorwise", all_gather)
    assert any("mixed_precision = fp8 with torchao's backend (AO" in n for n in cfg.notes), cfg.notes
    fsdp1 = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 1\n" + text)))
    assert not fsdp1.float8 and any("under FSDP1 (fsdp_version 1) is not modelled" in n for n in fsdp1.notes)
    bf16 = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\nmixed_precision: bf16\n"
                                                       "fp8_config:\n  backend: AO\n")))
    assert not bf16.float8 and any("fp8_config is not read: mixed_precision = bf16" in n for n in bf16.notes)
    extra = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\nmixed_precision: fp8\n"
                                                        "fp8_config:\n  backend: AO\n  margin: 0\n")))
    assert "fp8_config.margin is not read: torchao's backend does not take it" in extra.notes


@pytest.mark.parametrize(("text", "error"), [
    ("[training]\nseq_len = 0\n", "training.seq_len = 0 is not a whole number"),
    ('[activation_checkpoint]\nmode = "FULL"\n', 'mode = "FULL" is not one of none, full, selective, in lowercase'),
    # (read as "never" and "bfloat16" before, where torchtitan refuses the job: a new user's trial)
    ('[parallelism]\nfsdp_reshard_after_forward = "Never"\n',
     'forward = "Never" is not one of default, always, never, in lowercase'),
    ('[parallelism]\npipeline_parallel_degree = -1\n', "pipeline_parallel_degree = -1, which torchtitan refuses"),
    ('[training]\nmixed_precision_param = "BFloat16"\n',
     'param = "BFloat16" is not one of bfloat16, float32, in lowercase'),
    ('[training]\nlocal_batch_size = "two"\n', 'training.local_batch_size = "two" is not a whole number'),
    ('[parallelism]\nfsdp_reshard_after_forward = "sometimes"\n', "is not one of default, always, never"),
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "3"\n', "'op' or 2"),
    ('[training]\nmixed_precision_param = "float16"\n', "is not one of bfloat16, float32"),
    ('[activation_checkpoint]\nmode = "memory_budget"\n', "memory_budget is torch.compile's checkpointing"),
    ("[training\n", "is not valid TOML"),
    ("training = 3\n", "[training] = 3 is not a table"),
    # a typo of a key it has: never silent, and not simulated as the job with its default either (it was a note)
    # a key a letter or a suffix from one (a transposition, "_degree" left out: a new user's findings)
    ("[compile]\nenabel = true\n", "compile.enabel is not a key of [compile] (did you mean enable?)"),
    ("[parallelism]\ndata_parallel_shard = 8\n", "parallelism.data_parallel_shard is not a key of [parallelism] "
     "(did you mean data_parallel_shard_degree?)"),
    ("[training]\nlocal_batch_sise = 4\n", "training.local_batch_sise is not a key of [training] (did you mean "
                                            "local_batch_size?)"),
])
def test_torchtitan_errors_are_one_line(tmp_path, text, error):
    with pytest.raises(PlannerError, match=re.escape(error)) as e:
        read_config(TORCHTITAN, str(titan(tmp_path, text)))
    assert "\n" not in str(e.value)


# -- Accelerate keys -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fsdp", "policy", "classes", "numel"), [
    ("fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: A,B",
     PolicyName.MODULE, ("A", "B"), None),
    ("fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 1000", PolicyName.SIZE, (), 1000),
    ("fsdp_auto_wrap_policy: SIZE_BASED_WRAP", PolicyName.SIZE, (), 100_000_000),
    ("fsdp_auto_wrap_policy: NO_WRAP", PolicyName.SIZE, (), NO_WRAP_NUMEL),
])
def test_accelerate_wrap_policies(tmp_path, fsdp, policy, classes, numel):
    cfg = read_config(ACCELERATE, str(accel(tmp_path, f"fsdp_config:\n  {fsdp}\n")))
    assert (cfg.policy, cfg.module_classes, cfg.min_numel) == (policy, classes, numel)


def test_accelerate_keys(tmp_path):
    cfg = read_config(ACCELERATE, str(accel(tmp_path, """fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: false
  fsdp_activation_checkpointing: true
  fsdp_offload_params: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
mixed_precision: 'no'
num_machines: 2
num_processes: 16
""")))
    assert (cfg.reshard, cfg.ac, cfg.offload, cfg.precision, cfg.world, cfg.nodes) == \
        ("never", ACMode.FULL, True, "fp32", 16, 2)
    assert cfg.notes == []


def test_accelerate_hsdp_from_its_parallelism_config(tmp_path):
    path = accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\nnum_processes: 16\n"
                           "parallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
                           "  parallelism_config_dp_shard_size: 8\n")  # Accelerate's sizes make num_processes
    cfg = read_config(ACCELERATE, str(path))
    assert (cfg.replicate, cfg.world, cfg.notes) == (2, 16, [])
    a = args_of("simulate", "toy-llama", "--from-accelerate", cfg.path)
    assert (a.cluster, a.mesh) == ("h100:16", "2x8")


def test_accelerate_s_context_and_sequence_parallel_options(tmp_path):
    """accelerate 1.16 launches with cp_backend, cp_comm_strategy, sp_size, sp_backend, ... beside the sizes: the
    options are read past (cp_backend was refused as a misspelled cp_size), sp_size counts in the ranks
    (Accelerate's total_size) and, above 1, is refused as another job, as cp_size is."""
    base = "fsdp_config:\n  fsdp_version: 2\nnum_processes: 8\nparallelism_config:\n"
    options = "  parallelism_config_cp_backend: torch\n  parallelism_config_sp_backend: deepspeed\n"
    cfg = read_config(ACCELERATE, str(accel(tmp_path, base + "  parallelism_config_dp_shard_size: 8\n" + options)))
    assert (cfg.world, cfg.notes) == (8, [])
    with pytest.raises(PlannerError, match="parallelism_config_sp_size = 2: fsdp-planner does not model sequence "
                                           "parallelism"):
        read_config(ACCELERATE, str(accel(tmp_path, base + "  parallelism_config_dp_shard_size: 4\n"
                                                           "  parallelism_config_sp_size: 2\n" + options)))
    with pytest.raises(PlannerError, match=r"dp_shard_size 4 x tp_size 1 x cp_size 1 x sp_size 1 make 4 ranks"):
        read_config(ACCELERATE, str(accel(tmp_path, base + "  parallelism_config_dp_shard_size: 4\n")))


@pytest.mark.parametrize(("strategy", "reshard", "replicate"), [
    # (FULL_SHARD: every unit but the root freed after forward, FSDP1's root keeping its params: the policy's rule)
    ("FULL_SHARD", "default", 1), ("SHARD_GRAD_OP", "never", 1), ("HYBRID_SHARD", "default", 2),
    ("_HYBRID_SHARD_ZERO2", "never", 2),
    (1, "default", 1), (2, "never", 1), ("4", "default", 2),  # Accelerate takes FSDP1's ShardingStrategy numbers
])
def test_accelerate_v1_sharding_strategies(tmp_path, strategy, reshard, replicate):
    cfg = read_config(ACCELERATE, str(accel(tmp_path, f"fsdp_config:\n  fsdp_sharding_strategy: {strategy}\n"
                                                      "num_machines: 2\nnum_processes: 16\n")))
    assert (cfg.reshard, cfg.replicate) == (reshard, replicate)
    assert any("fsdp_version = 1" in n for n in cfg.notes)


@pytest.mark.parametrize(("text", "note"), [
    ("mixed_precision: fp16\n", "mixed_precision = fp16 is simulated as bf16-mixed"),
    # Transformer Engine's float8 is not torchao's: bf16-mixed, said
    ("mixed_precision: fp8\nfp8_config:\n  backend: TE\n", "mixed_precision = fp8 under fp8_config.backend = TE"),
    ("dynamo_config:\n  dynamo_backend: INDUCTOR\n", 'dynamo_config.dynamo_backend = "INDUCTOR" is left out'),
    ("  fsdp_mystery: 1\n", "fsdp_config.fsdp_mystery is not read"),
    ("mystery: 1\n", "mystery is not read"),
    ("dynamo_backend: INDUCTOR\n", 'dynamo_backend = "INDUCTOR" is left out'),  # older files: at the top level
    # ParallelismConfig's argument name where the file's key is prefixed: said, or TP would vanish silently
    ("parallelism_config:\n  tp_size: 2\n", "parallelism_config.tp_size is not read: Accelerate's config file "
                                             "spells it parallelism_config_tp_size"),
    ("parallelism_config:\n  mystery: 2\n", "parallelism_config.mystery is not read"),
])
def test_accelerate_left_out_is_one_line(tmp_path, text, note):
    """(fsdp_version 2: version 1's own note aside)"""
    notes = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n" + text))).notes
    assert len(notes) == 1 and notes[0].startswith(note) and "\n" not in notes[0], notes


@pytest.mark.parametrize(("text", "error"), [
    ("fsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n", "NO_SHARD is DDP"),
    ("fsdp_config:\n  fsdp_activation_checkpointing: maybe\n", 'fsdp_activation_checkpointing = "maybe" is not true'),
    ("fsdp_config:\n  fsdp_sharding_strategy: 9\n", "fsdp_sharding_strategy = 9 is not one of FULL_SHARD"),  # not
    # fsdp_reshard_after_forward, the key it once named
    ("fsdp_config:\n  fsdp_auto_wrap_policy: LAYER_WRAP\n", "is not one of transformer_based_wrap"),
    ("num_processes: 12\nnum_machines: 5\n", "num_processes 12 is not a multiple of num_machines 5"),
    ("fsdp_config: [1\n", "is not valid YAML at line"),
    ("fsdp_config: !!python/object/apply:os.system ['true']\n", "is not valid YAML"),  # safe_load: never run
    # a key a letter from one that changes the job: the setting would stay at its default (it was a note)
    ("fsdp_config:\n  fsdp_reshard_after_forwrd: false\n", "fsdp_config.fsdp_reshard_after_forwrd is not a key of "
                                                          "fsdp_config (did you mean fsdp_reshard_after_forward?)"),
    ("parallelism_config:\n  parallelism_config_tp_sise: 2\n", "(did you mean parallelism_config_tp_size?)"),
    # (with sizes whose product then falls short of num_processes: said as that before, a new user's trial)
    ("num_processes: 8\nparallelism_config:\n  parallelism_config_dp_shard_size: 4\n  parallelism_config_tp_sise: 2\n",
     "(did you mean parallelism_config_tp_size?)"),
    ("num_processes: 8\nparallelism_config:\n  parallelism_config_dp_shard_size: 4\n  tp_size: 2\n",
     "make their product 8 (tp_size not read: the sizes' keys are parallelism_config_<dim>_size)"),
])
def test_accelerate_errors_are_one_line(tmp_path, text, error):
    with pytest.raises(PlannerError, match=re.escape(error)) as e:
        read_config(ACCELERATE, str(accel(tmp_path, text)))
    assert "\n" not in str(e.value)


def test_accelerate_refuses_another_distributed_type(tmp_path):
    path = tmp_path / "ddp.yaml"
    path.write_text("distributed_type: MULTI_GPU\n")
    with pytest.raises(PlannerError, match='distributed_type = "MULTI_GPU" is not FSDP'):
        read_config(ACCELERATE, str(path))
    # a YAML with neither key is another tool's file: it was simulated as a default FSDP job (a new user's finding)
    path.write_text("a: &a [1, 2]\nb: *a\n")
    with pytest.raises(PlannerError, match="has neither distributed_type: FSDP nor an fsdp_config section"):
        read_config(ACCELERATE, str(path))
    path.write_text("fsdp_config:\n  fsdp_version: 2\n")  # the FSDP section alone is read
    assert read_config(ACCELERATE, str(path)).keys["fsdp_config.fsdp_version"] == 2


def test_accelerate_fsdp1_prefetch_keys_are_said(tmp_path):
    """FSDP1's prefetch switches change the overlap; FSDP2 has none: each is one note, not dropped silently."""
    cfg = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_backward_prefetch: BACKWARD_POST\n"
                                                      "  fsdp_forward_prefetch: true\n")))
    said = [n for n in cfg.notes if "is FSDP1's" in n]
    assert [n.split(" = ")[0] for n in said] == ["fsdp_config.fsdp_backward_prefetch",
                                                 "fsdp_config.fsdp_forward_prefetch"], cfg.notes
    two = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n"
                                                      "  fsdp_backward_prefetch: BACKWARD_PRE\n")))
    assert not two.notes  # Accelerate's FSDP2 plugin ignores it: nothing to say


# -- the command line's options from a config ------------------------------------------------------------------------
def args_of(*argv: str):  # type: ignore[no-untyped-def]
    args, _ = configured(build_parser().parse_args(list(argv)))
    return args


def test_a_torchtitan_job_shards_its_experts_as_torchtitan_does(tmp_path):
    """torchtitan shards experts on dim 1 where FSDP x EP ranks outnumber them (distributed/fsdp.py): a job read
    with dim 0 padded every expert to the shard size (qwen3 30B-A3B on 256 H100s: 221 GiB all-gathered a step
    where torchtitan's placement gathers 113 GiB; a new user's finding)."""
    job = titan(tmp_path, '[activation_checkpoint]\nmode = "none"\n')
    assert args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "a100").shard_placement == \
        "auto"
    with pytest.raises(PlannerError, match="--shard-placement \"dim0\" contradicts torchtitan's expert shard"):
        args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "a100", "--shard-placement",
                "dim0")


def test_torchtitan_compile_as_the_compile_option(tmp_path):
    job = titan(tmp_path, '[compile]\nenable = true\n[activation_checkpoint]\nmode = "none"\n')
    assert args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "a100").compile is True
    plain = titan(tmp_path, '[activation_checkpoint]\nmode = "none"\n')
    assert args_of("simulate", "toy-llama", "--from-torchtitan", str(plain), "--cluster", "a100").compile is False


def test_torchtitan_job_as_options(tmp_path):
    job = titan(tmp_path, "[training]\nlocal_batch_size = 2\nseq_len = 64\nglobal_batch_size = 64\n"
                          "[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 8\n"
                          "[activation_checkpoint]\nmode = \"full\"\n")
    a = args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "a100")
    assert (a.cluster, a.mesh, a.batch, a.micro_batches, a.seq, a.ac, a.policy) == \
        ("a100:16", "2x8", 4, "2", 64, "full", "titan")  # 64 = 2 x 16 GPUs x 2 micro-batches


def test_torchtitan_gradient_accumulation_reduce_scatters_in_every_micro_batch(tmp_path, capsys):
    """torchtitan's train_step never disables gradient sync: its micro-batches run as --gradient-sync every, each
    reduce-scattering (x N the one-pass step's), fewer bytes than --micro-batches' default (no unsharded grads kept)."""
    job = titan(tmp_path, "[training]\nlocal_batch_size = 1\nseq_len = 32\nglobal_batch_size = 16\n"
                          "[parallelism]\ndata_parallel_shard_degree = 8\n")
    a = args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "h100")
    assert (a.micro_batches, a.gradient_sync, a.batch) == ("2", "every", 2)
    assert "set_requires_gradient_sync" not in capsys.readouterr().err  # QA's interim note is gone
    with pytest.raises(PlannerError, match=re.escape("--gradient-sync \"last\" contradicts training.global_batch")):
        args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "h100", "--gradient-sync", "last")
    base = ["simulate", "toy-llama", "--cluster", "h100:8", "--json"]
    assert main([*base, "--from-torchtitan", str(job)]) == 0
    titan_step = json.loads(capsys.readouterr().out)
    assert main([*base, "--policy", "titan", "--batch", "2", "--micro-batches", "2"]) == 0
    last = json.loads(capsys.readouterr().out)
    assert titan_step["gradient_sync"] == "every" and last["gradient_sync"] == "last"
    assert titan_step["reduce_scatters"] == 2 * last["reduce_scatters"]
    assert titan_step["peak_memory"] < last["peak_memory"]


def test_accelerate_job_as_options(tmp_path):
    cfg = accel(tmp_path, "fsdp_config:\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 5000\n"
                          "  fsdp_offload_params: true\nmixed_precision: bf16\nnum_machines: 2\nnum_processes: 16\n")
    a = args_of("simulate", "toy-llama", "--from-accelerate", str(cfg))
    assert (a.cluster, a.policy, a.min_nonwrapped_numel, a.offload, a.precision) == \
        ("h100:2x8", "size", "5000", True, "bf16-mixed")


@pytest.mark.parametrize(("argv", "error"), [
    (["--batch", "4"], "--batch 4 contradicts training.local_batch_size in torchtitan config"),
    (["--cluster", "h100:16"], "--cluster \"h100:16\" has 16 GPUs but the torchtitan job runs on 8"),
    (["--policy", "order"], "--policy order contradicts the torchtitan job"),  # once "contradicts (the grouping)"
    # a setting the config leaves at its default is the job's too (these were taken silently)
    (["--tp", "2"], "--tp 2 contradicts parallelism.tensor_parallel_degree in torchtitan config"),
    (["--mesh", "2x4"], "--mesh \"2x4\" contradicts parallelism.data_parallel_replicate_degree = 1"),
    (["--compile"], "--compile true contradicts compile.enable in torchtitan config"),
    (["--reduce-dtype", "bf16"], "--reduce-dtype \"bf16\" contradicts training.mixed_precision_reduce"),
    (["--float8", "tensorwise"], "whose model has no float8 converter"),
    (["--ac", "full"], "--ac \"full\" contradicts activation_checkpoint.mode in torchtitan config"),
])
def test_a_contradicting_option_is_one_error(tmp_path, argv, error):
    job = titan(tmp_path, "[training]\nlocal_batch_size = 2\n[parallelism]\ndata_parallel_shard_degree = 8\n"
                          "[activation_checkpoint]\nmode = \"none\"\n")
    with pytest.raises(PlannerError, match=re.escape(error)):
        args_of("simulate", "toy-llama", "--from-torchtitan", str(job), *argv)


def test_a_contradicting_workload_says_the_jobs_own_flag(tmp_path):
    job = titan(tmp_path, "[training]\nlocal_batch_size = 2\nseq_len = 64\n")
    for flag, key in (("--batch", "training.local_batch_size"), ("--seq", "training.seq_len")):
        with pytest.raises(PlannerError, match=re.escape(f"drop one of them, or set the job's own: -- --{key} 4")):
            args_of("simulate", "toy-llama", "--from-torchtitan", str(job), flag, "4")
    a = args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--", "--training.local_batch_size", "4",
                "--training.seq_len", "4")
    assert (a.batch, a.seq) == (4, 4)


def test_a_flag_turns_a_toml_job_s_checkpointing_off(tmp_path):
    """``-- --activation_checkpoint.mode none`` (any spelling of none) sets no checkpointing, as ``mode = "none"`` in
    the file does; it was refused as "null is not one of none, full, selective" (a trial)."""
    job = titan(tmp_path, "[training]\nlocal_batch_size = 2\n[activation_checkpoint]\nmode = \"full\"\n")
    for value in ("none", "None", "null"):
        cfg = read_config(TORCHTITAN, str(job), [f"--activation_checkpoint.mode={value}"])
        assert cfg.keys["activation_checkpoint.mode"] == "none"
    assert read_config(TORCHTITAN, str(job)).keys["activation_checkpoint.mode"] == "full"


def test_a_key_in_another_table_is_said_with_the_table_that_has_it(tmp_path):
    """``enable_cpu_offload`` under [parallelism] was "not read: fsdp-planner does not know it" while [training]'s
    is read (a trial's job was simulated without the offload it meant): the note names the table that has it."""
    job = titan(tmp_path, "[training]\nlocal_batch_size = 2\n[parallelism]\nenable_cpu_offload = true\n")
    cfg = read_config(TORCHTITAN, str(job))
    assert "parallelism.enable_cpu_offload is not read: [parallelism] has no such key, training.enable_cpu_offload " \
        "is one" in " ".join(cfg.notes), cfg.notes


@pytest.mark.parametrize("degree", [-2, 0])
def test_a_shard_degree_out_of_range_says_its_minus_one_too(tmp_path, degree):
    """torchtitan's data_parallel_shard_degree takes -1 (the rest of the GPUs), which the refusal of -2 left out."""
    job = titan(tmp_path, f"[parallelism]\ndata_parallel_shard_degree = {degree}\n")
    with pytest.raises(PlannerError, match=rf"data_parallel_shard_degree = {degree} is not a whole number from 1 to "
                                           r"1,000,000,000, or -1 \(the GPUs the other degrees leave\)$"):
        read_config(TORCHTITAN, str(job))


def test_an_option_that_agrees_with_a_default_setting_is_taken(tmp_path):
    """The same values as the job's defaults pass, and leave auto free where the command is plan's."""
    job = titan(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 8\n")
    a = args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--tp", "1", "--mesh", "1x8")
    assert (a.tp, a.mesh) == (1, "1x8")
    assert args_of("plan", "toy-llama", "--from-torchtitan", str(job)).tp is None


def test_a_job_on_part_of_a_node_more_names_its_nodes(tmp_path):
    """TP 3 x dp_shard 4 is 12 GPUs, not whole 8-GPU nodes: the job's own keys named (not a cluster the user never
    typed), and a cluster that holds it suggested, each TP group inside a node (dp_shard 7 x TP 2: 7 nodes of 2, not
    2 of 7); given so, it plans."""
    for shard, tp, suggested in ((4, 3, "h100:2x6"), (7, 2, "h100:7x2")):
        job = titan(tmp_path, f"[parallelism]\ndata_parallel_shard_degree = {shard}\ntensor_parallel_degree = {tp}\n")
        with pytest.raises(PlannerError, match=re.escape(
                f"the torchtitan job's {shard * tp} GPUs (data_parallel_replicate_degree 1 x "
                f"data_parallel_shard_degree {shard} x tensor_parallel_degree {tp}) are not a whole number of 8-GPU "
                f"nodes: give the nodes it runs on, e.g. --cluster {suggested}")):
            args_of("simulate", "toy-llama", "--from-torchtitan", str(job))
        assert args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", suggested).cluster == \
            suggested


def test_the_model_comes_from_the_torchtitan_job(tmp_path, capsys):
    job = titan(tmp_path, '[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 8\n')
    assert args_of("simulate", "--from-torchtitan", str(job)).model == "llama3-8b"
    with pytest.raises(PlannerError, match="MODEL 'toy-llama' is not the torchtitan job's model"):
        args_of("simulate", "toy-llama", "--from-torchtitan", str(job))
    unknown = titan(tmp_path, '[model]\nname = "deepseek_v3"\nflavor = "99B"\n')
    with pytest.raises(PlannerError, match=r"model \"deepseek_v3\" flavor \"99B\" is not one fsdp-planner builds "
                                           r"\(known: llama3 debugmodel/1B/3B/8B/70B/405B, deepseek_v3 "
                                           r"671B/debugmodel/16B/236B, qwen3 0.6B/1.7B/4B/8B/14B/32B/30B-A3B/"
                                           r"235B-A22B/debugmodel/debugmodel_non_fused_qkv/debugmodel_moe, gpt_oss "
                                           r"debugmodel/20b/120b, kimi_k2_7 moonlight-16B-A3B\)"):
        args_of("simulate", "--from-torchtitan", str(unknown), "--cluster", "h100:8")
    capsys.readouterr()
    args_of("simulate", "toy-llama", "--from-torchtitan", str(unknown), "--cluster", "h100:8")
    assert 'MODEL "toy-llama" stands for the torchtitan job\'s model' in capsys.readouterr().err
    v3 = titan(tmp_path, '[model]\nname = "deepseek_v3"\nflavor = "671B"\n')  # its shipped transformers config
    assert args_of("simulate", "--from-torchtitan", str(v3), "--cluster", "h100:8").model == "hf:deepseek-v3"
    assert 'model "deepseek_v3" flavor "671B" is simulated as hf:deepseek-v3' in capsys.readouterr().err


@pytest.mark.parametrize(("flavor", "model"), [("debugmodel_moe", "hf:titan-qwen3-debugmodel-moe"),
                                                ("debugmodel_non_fused_qkv", "hf:titan-qwen3-debugmodel")])
def test_torchtitan_s_debug_flavours_are_its_shipped_configs(tmp_path, flavor, model):
    job = titan(tmp_path, f'[model]\nname = "qwen3"\nflavor = "{flavor}"\n')
    assert args_of("simulate", "--from-torchtitan", str(job), "--cluster", "h100:8").model == model


def test_torchtitan_s_gpt_oss_is_planned_with_fused_attention(tmp_path, capsys):
    """transformers runs gpt-oss's attention eagerly (its sinks have no SDPA path), saving seq x seq scores that
    torchtitan's flex or varlen attention never makes; a user's --attention is kept."""
    job = titan(tmp_path, '[model]\nname = "gpt_oss"\nflavor = "20b"\n')
    args = args_of("simulate", "--from-torchtitan", str(job), "--cluster", "h100:8")
    assert (args.model, args.attention) == ("hf:gpt-oss-20b", "flash")
    assert "attention planned as --attention flash: torchtitan runs hf:gpt-oss-20b's" in capsys.readouterr().err
    mine = args_of("simulate", "--from-torchtitan", str(job), "--cluster", "h100:8", "--attention", "eager")
    assert mine.attention == "eager"
    assert "attention planned as" not in capsys.readouterr().err


def test_missing_model_and_cluster_are_argument_errors(capsys, tmp_path):
    assert main(["simulate", "toy-llama"]) == 2
    assert "the following arguments are required: --cluster" in capsys.readouterr().err
    assert main(["simulate", "--from-accelerate", str(accel(tmp_path, ""))]) == 2
    assert "the following arguments are required: model" in capsys.readouterr().err
    assert main(["simulate", "toy-llama", "--from-accelerate", str(tmp_path / "none.yaml")]) == 2
    assert "accelerate config" in capsys.readouterr().err


@pytest.mark.integration  # (about 2 s: three toy-llama runs)
def test_simulate_and_plan_from_a_config_run_the_job_its_options_run(tmp_path, capsys):
    """The config's job and the options it stands for give one simulation, and plan --from-... starts from it."""
    job = titan(tmp_path, "[training]\nlocal_batch_size = 2\nseq_len = 32\n"
                          '[parallelism]\ndata_parallel_shard_degree = 4\n[activation_checkpoint]\nmode = "full"\n')
    assert main(["simulate", "toy-llama", "--from-torchtitan", str(job), "--json", "--quiet"]) == 0
    from_config = json.loads(capsys.readouterr().out)
    # torchtitan's optimizer, and its checkpoint wrapper's early_stop=False
    assert main(["simulate", "toy-llama", "--policy", "titan", "--ac", "full", "--batch", "2", "--seq", "32",
                 "--cluster", "h100:4", "--optimizer", "adamw-fused", "--no-early-stop", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == from_config
    assert main(["simulate", "toy-llama", "--policy", "titan", "--ac", "full", "--batch", "2", "--seq", "32",
                 "--cluster", "h100:4", "--optimizer", "adamw-fused", "--json"]) == 0
    stopping = json.loads(capsys.readouterr().out)
    assert stopping["recompute_time"] < from_config["recompute_time"]
    assert (from_config["checkpoint_early_stop"], stopping["checkpoint_early_stop"]) == (False, True)
    job_stopping = tmp_path / "stopping.toml"  # a TOML of torchtitan before #1580, or one that says so
    job_stopping.write_text(job.read_text() + "early_stop = true\n")
    assert main(["simulate", "toy-llama", "--from-torchtitan", str(job_stopping), "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out) == stopping
    out = tmp_path / "auto.json"
    assert main(["plan", "toy-llama", "--from-torchtitan", str(job), "--json", "--quiet", "--out", str(out)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"] == json.loads(out.read_text())  # as written: its precision, workload, optimizer (a trial)
    assert {**plan["config_step"], "micro_batches": 1, "gradient_sync": "last", "checkpoint_early_stop": False,
            "loss_chunks": plan["loss_chunks"]} == from_config
    assert (plan["micro_batches"], plan["gradient_sync"]) == (1, "last")
    assert plan["fits"] and plan["auto_step"]["step_time"] <= plan["config_step"]["step_time"]
    assert plan["changes"][-1] == {"key": "(the grouping)", "config": plan["changes"][-1]["config"],
                                   "auto": f"{len(plan['plan']['groups'])} groups", "expressible": False}


@pytest.mark.parametrize("rule", ["always", "never"])
def test_reshard_after_forward_rules(rule):
    from fsdp_planner.fsdp2.plan import Group, Plan
    from fsdp_planner.service.planning import with_reshard

    plan = Plan(fingerprint="", numel=2, groups=[Group(modules=["a"], params=["a.w"], reshard_after_forward=False),
                        Group(modules=["b"], params=["b.w"], reshard_after_forward=True),
                        Group(modules=[""], params=[], reshard_after_forward=True)])
    out = with_reshard(plan, rule)
    assert [g.reshard_after_forward for g in out.groups] == [rule == "always"] * 3
    assert [g.reshard_after_forward for g in plan.groups] == [False, True, True]  # a copy
    assert with_reshard(plan, "default") is plan  # "default": the policy's own


@pytest.mark.integration  # (about 6 s: the Llama 3 8B job traced, searched and its config edits simulated)
def test_the_example_configs_plan(capsys, tmp_path):
    titan_job, accelerate = str(EXAMPLES / "llama3_8b.toml"), str(EXAMPLES / "accelerate_fsdp.yaml")
    assert main(["plan", "--from-torchtitan", titan_job, "--cluster", "h100", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "llama3-8b" and plan["cluster"] == "h100:8"
    assert plan["fits"] and plan["auto_step"]["step_time"] < plan["config_step"]["step_time"]
    assert all(set(c) == {"key", "config", "auto", "expressible"} for c in plan["changes"])
    edit = plan["best_edit"]
    assert edit is None or (edit["step"]["budget"]["fits"]
                            and edit["step"]["step_time"] < plan["config_step"]["step_time"])
    out = tmp_path / "plan.json"
    # (the YAML's block class, TransformerBlock, is toy-llama's too: the same file, a model that plans in a second)
    assert main(["plan", "toy-llama", "--from-accelerate", accelerate, "--cluster", "h100", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fsdp_config.fsdp_auto_wrap_policy" in text and "export plan.json --format accelerate" in text
    assert json.loads(out.read_text())["precision"] == "bf16-mixed"


def test_no_gpu_count_plans_for_the_preset_node(tmp_path, capsys):
    a = args_of("simulate", "toy-llama", "--from-accelerate", str(accel(tmp_path, "mixed_precision: bf16\n")),
                "--cluster", "a100")
    assert a.cluster == "a100:8"
    assert "gives no GPU count (no num_processes): planning for 8 GPUs" in capsys.readouterr().err
    # two machines: a node of the preset on each, as the note says (it said one node and planned h100:2x4)
    a = args_of("simulate", "toy-llama", "--from-accelerate", str(accel(tmp_path, "num_machines: 2\n")))
    assert a.cluster == "h100:2x8"
    assert "planning for 16 GPUs, 2 machines (num_machines) of h100's 8" in capsys.readouterr().err


def test_plan_from_a_config_refuses_what_it_does_not_take(tmp_path, capsys):
    job = str(titan(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 2\n"))
    for extra in (["--policy", "titan"], ["--explain"]):
        assert main(["plan", "toy-llama", "--from-torchtitan", job, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1


def test_a_job_without_a_model_needs_model(tmp_path, capsys):
    job = str(titan(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 2\n"))
    with pytest.raises(PlannerError, match=r"names no model \(\[model\] name and flavor\): give MODEL"):
        args_of("simulate", "--from-torchtitan", job)
    assert args_of("simulate", "toy-llama", "--from-torchtitan", job).model == "toy-llama"
    assert "stands for" not in capsys.readouterr().err


@pytest.mark.parametrize(("kind", "text", "error"), [
    (ACCELERATE, "", "is empty: expected an Accelerate config YAML"),
    (ACCELERATE, "- a\n- b\n", "holds a list, not a table of settings"),
    (ACCELERATE, "just words\n", "holds a single value, not a table of settings"),
])
def test_a_config_that_is_not_a_table_is_one_line(tmp_path, kind, text, error):
    """An empty file or a list is named as such (not as Python's NoneType or list)."""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(PlannerError, match=re.escape(error)):
        read_config(kind, str(path))


def test_every_key_of_the_example_torchtitan_job_is_known():
    """The documented example (torchtitan's own keys) gets no 'is not read' note."""
    assert not [n for n in read_config(TORCHTITAN, str(EXAMPLES / "llama3_8b.toml")).notes if "is not read" in n]



def test_auto_beside_a_config_traces_its_tp_layouts_at_their_batch(tmp_path):
    """plan --from-X: auto's TP d layouts run d sequences per data-parallel rank, traced at that batch (they were
    simulated on the config's one-sequence trace: hf/torchtitan llama3-8b on h100:8 showed TP 8 at 198 ms against
    the config's 1.34 s)."""
    from fsdp_planner.cli.requests import keywords
    from fsdp_planner.service.configured import compare_config
    from fsdp_planner.service.planning import SILENT
    from fsdp_planner.service.tracing import trace_spec
    from fsdp_planner.sim.simulate import simulate

    job = titan(tmp_path, '[training]\nlocal_batch_size = 1\nseq_len = 64\n[activation_checkpoint]\nmode = "none"\n')
    args, cfg = configured(build_parser().parse_args(["plan", "toy-llama", "--from-torchtitan", str(job),
                                                      "--cluster", "h100:8"]))
    asked: list[int] = []

    def tracer(spec, options):  # type: ignore[no-untyped-def]
        asked.append(spec.batch_size or 1)
        return trace_spec(spec, options.precision)

    outcome = compare_config(keywords(args), cfg, tracer, SILENT)
    assert max(asked) > 1  # the TP layouts' batches
    plan, report = outcome.auto.search.plan, outcome.auto.report
    d = plan.tp_degree
    again = simulate(trace_spec(dataclasses.replace(outcome.auto.job.model, batch_size=d), outcome.auto.job.options
                                .precision), plan, outcome.auto.job.cluster, outcome.auto.job.options, timeline=False)
    assert report.step_time == pytest.approx(again.step_time)


@pytest.mark.parametrize(("text", "optimizer", "note"), [
    ("", "adamw-fused", None),  # torchtitan's default implementation since early 2025
    ('[optimizer]\nname = "AdamW"\nimplementation = "foreach"\n', "adamw", None),
    ('[optimizer]\nname = "Adam"\nfused = true\n', "adam-fused", None),  # the key implementation replaced
    ("[optimizer]\nfused = false\n", "adamw", None),
    ('[optimizer]\nimplementation = "fused_opt_states_bf16"\n', "adamw-fused-bf16-states", None),
    ('[optimizer]\nname = "Muon"\n', "adamw-fused", "\"Muon\" is simulated as AdamW"),
    ("[optimizer]\nearly_step_in_backward = true\n", "adamw-fused", "early_step_in_backward = true is left out"),
])
def test_torchtitan_optimizer_and_its_implementation(tmp_path, text, optimizer, note):
    job = titan(tmp_path, text)
    cfg = read_config(TORCHTITAN, str(job))
    assert cfg.optimizer == optimizer
    said = [n for n in cfg.notes if "optimizer" in n]
    assert (not said) if note is None else (len(said) == 1 and note in said[0])
    assert args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "h100").optimizer == optimizer
    with pytest.raises(PlannerError, match=r'^--optimizer "sgd" contradicts the optimizer in torchtitan config .* \('
                                           + re.escape(f'"{optimizer}")')):
        args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "h100", "--optimizer", "sgd")
    # the default named on the command line is the user's word too: against a fused job, one error, not the job's
    # optimizer silently; the job's own said again is fine
    other = "adamw-fused" if optimizer == "adamw" else "adamw"
    with pytest.raises(PlannerError, match=f'^--optimizer "{other}" contradicts the optimizer'):
        args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "h100", "--optimizer", other)
    assert args_of("simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "h100", "--optimizer",
                   optimizer).optimizer == optimizer
    with pytest.raises(PlannerError, match=r"optimizer\.implementation"):
        read_config(TORCHTITAN, str(titan(tmp_path, '[optimizer]\nimplementation = "turbo"\n')))


def test_older_tomls_parallel_degrees_under_training_are_read(tmp_path):
    """torchtitan's 2024 TOMLs set the degrees under [training]: read as [parallelism]'s, each in a note (they were
    taken as known keys and dropped: the job planned without its TP), and one set in both places to different
    values is an error."""
    job = titan(tmp_path, "[training]\ndata_parallel_degree = 4\ntensor_parallel_degree = 2\n")
    args, cfg = configured(build_parser().parse_args(["simulate", "toy-llama", "--from-torchtitan", str(job)]))
    assert (args.tp, args.cluster) == (2, "h100:8")
    assert any("training.tensor_parallel_degree is read as parallelism.tensor_parallel_degree" in n
               for n in cfg.notes)
    both = titan(tmp_path, "[training]\ntensor_parallel_degree = 2\n[parallelism]\ntensor_parallel_degree = 4\n")
    with pytest.raises(PlannerError, match=re.escape("tensor_parallel_degree = 2 and parallelism.tensor")):
        args_of("simulate", "toy-llama", "--from-torchtitan", str(both))
    pp = titan(tmp_path, "[training]\npipeline_parallel_degree = 2\n")
    with pytest.raises(PlannerError, match="pipeline parallelism"):
        args_of("simulate", "toy-llama", "--from-torchtitan", str(pp))


def test_an_accelerate_job_s_machines_are_its_nodes(tmp_path):
    """num_machines is the job's node count: a cluster of another layout is an error (it was planned as one node),
    and machines of more processes than a node's GPUs are planned as whole nodes, with a note."""
    two = accel(tmp_path, "num_machines: 2\nnum_processes: 8\n")
    with pytest.raises(PlannerError, match=r"has 1 node\(s\) but the accelerate job runs on 2 \(num_machines\)"):
        args_of("simulate", "toy-llama", "--from-accelerate", str(two), "--cluster", "h100:8")
    # the GPU to give alone is the user's (it said h100 whatever the cluster: a new user's finding)
    with pytest.raises(PlannerError, match=r"give the GPU alone \(--cluster a100\) or agree"):
        args_of("simulate", "toy-llama", "--from-accelerate", str(two), "--cluster", "a100:16")
    assert args_of("simulate", "toy-llama", "--from-accelerate", str(two), "--cluster", "h100").cluster == "h100:2x4"
    wide = accel(tmp_path, "num_machines: 2\nnum_processes: 32\n")
    assert args_of("simulate", "toy-llama", "--from-accelerate", str(wide)).cluster == "h100:32"
    one = accel(tmp_path, "num_machines: 1\nnum_processes: 16\n")  # (was h100:16 without the note)
    assert args_of("simulate", "toy-llama", "--from-accelerate", str(one)).cluster == "h100:16"
    # 12 on one machine: no cluster of whole nodes agrees, and the layout it suggested (h100:2x6) was refused as
    # not one machine (a new user's finding): the key to change is named instead
    odd = accel(tmp_path, "num_machines: 1\nnum_processes: 12\n")
    with pytest.raises(PlannerError, match=r"runs 12 processes on its one machine .*: set num_machines"):
        args_of("simulate", "toy-llama", "--from-accelerate", str(odd), "--cluster", "h100")


def test_hybrid_shard_and_a_replicate_size_that_disagree_are_one_error(tmp_path):
    """HYBRID_SHARD replicates across the machines; a parallelism_config replicate size of another value was
    overwritten by it without a word."""
    both = accel(tmp_path, "fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\nnum_machines: 2\nnum_processes: 16\n"
                           "parallelism_config:\n  parallelism_config_dp_replicate_size: 4\n"
                           "  parallelism_config_dp_shard_size: 4\n")
    with pytest.raises(PlannerError, match=r"replicates across the 2 machines and parallelism_config\."):
        args_of("simulate", "toy-llama", "--from-accelerate", str(both))
    agree = accel(tmp_path, "fsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\nnum_machines: 2\n"
                            "num_processes: 16\nparallelism_config:\n  parallelism_config_dp_replicate_size: 2\n"
                            "  parallelism_config_dp_shard_size: 8\n")
    assert args_of("simulate", "toy-llama", "--from-accelerate", str(agree)).mesh == "2x8"


def test_a_job_too_large_is_said_by_its_keys(tmp_path):
    job = titan(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 100000000\n")
    with pytest.raises(PlannerError, match=r"^the torchtitan job runs on 100,000,000 GPUs \(data_parallel_replicate"):
        args_of("simulate", "toy-llama", "--from-torchtitan", str(job))


def test_a_config_s_tp_degree_the_model_refuses_is_said_by_its_key(tmp_path, capsys):
    """The degree is the config's: its refusal names the key, not a --tp the user never typed."""
    job = titan(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = 3\n")
    assert main(["simulate", "toy-llama", "--from-torchtitan", str(job), "--cluster", "h100"]) != 0
    err = capsys.readouterr().err
    assert "parallelism.tensor_parallel_degree = 3 must divide the model's" in err and "--tp" not in err


@pytest.mark.integration  # llama3-8b traced and auto's search: ~10 s
def test_simulate_of_a_config_over_the_budget_concludes_what_auto_s_fit_note_says(tmp_path, capsys):
    """The fit: note (auto's own plan fits) stood alone above a job 34 GiB over the budget, reading as if the
    job fit: a note now says which is which."""
    path = accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\nnum_processes: 8\nmixed_precision: bf16\n")
    assert main(["simulate", "llama3-8b", "--from-accelerate", str(path), "--cluster", "h100"]) == 0
    captured = capsys.readouterr()
    assert "over the 70.8 GiB budget" in captured.out
    assert "the configuration as given is over the budget (below), and auto's own plan of the same job fits" \
        in captured.err


def test_a_toml_s_float8_under_tp_gathers_in_float8_and_a_registry_s_in_bf16() -> None:
    """torchtitan applied torchao's float8 TP styles with tensorwise float8 under TP until April 2026: a TOML (that
    time's form) with both reads as --float8-tp-all-gather, with a note; its registry job of today does not."""
    titan = Path(__file__).parent / "fixtures" / "torchtitan"
    toml = read_config(TORCHTITAN, str(titan / "llama3_405b.toml"))
    assert (toml.float8, toml.tp, toml.float8_tp_all_gather) == ("tensorwise", 8, True)
    assert any("torchao's float8 TP styles" in n for n in toml.notes)
    registry = read_config(TORCHTITAN, f"{titan / 'llama3' / 'config_registry.py'}:llama3_405b")
    assert (registry.float8, registry.tp, registry.float8_tp_all_gather) == ("rowwise", 8, False)


def test_a_toml_s_float8_tp_all_gathers_turn_off_on_the_command_line(tmp_path, capsys) -> None:
    """The TOML's float8 TP styles are a reading of its time, not a key: --no-float8-tp-all-gather gathers TP's
    activations in bf16 (twice the bytes), and without float8 it is refused as a float8 setting."""
    toml = tmp_path / "tp_float8.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\nconverters = ["float8"]\n[float8]\n'
                    'enable_fsdp_float8_all_gather = true\nprecompute_float8_dynamic_scale_for_fsdp = true\n'
                    '[training]\nlocal_batch_size = 2\nseq_len = 256\n[parallelism]\n'
                    'data_parallel_shard_degree = 4\ntensor_parallel_degree = 2\n')
    job = ["simulate", "--from-torchtitan", str(toml), "--cluster", "h100:8", "--json"]
    gathered = []
    for extra in ([], ["--no-float8-tp-all-gather"]):
        assert main([*job, *extra]) == 0
        gathered.append(json.loads(capsys.readouterr().out)["tp_all_gather_bytes"])
    assert gathered[1] > gathered[0] > 0
    assert main(["simulate", "toy-llama", "--policy", "titan", "--cluster", "h100:8",
                 "--no-float8-tp-all-gather"]) == 2
    assert "--no-float8-tp-all-gather is a setting of float8 training" in capsys.readouterr().err


def test_a_toml_s_rowwise_float8_simulates(tmp_path) -> None:
    """A rowwise float8 TOML (its all-gather key off, as rowwise must) reads as --float8 rowwise: the key was
    given as --no-float8-all-gather, which rowwise refuses on the command line."""
    toml = tmp_path / "rowwise.toml"
    toml.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\nconverters = ["float8"]\n[float8]\n'
                    'recipe_name = "rowwise"\n[training]\nlocal_batch_size = 2\nseq_len = 256\n[parallelism]\n'
                    'data_parallel_shard_degree = 4\n')
    assert main(["simulate", "--from-torchtitan", str(toml), "--cluster", "h100"]) == 0


def test_a_class_the_config_names_that_the_model_lacks_names_the_key(tmp_path, capsys):
    """fsdp_transformer_layer_cls_to_wrap of another model's class: the error names the key and the file (it read
    as if the user had typed --module-classes: a new user's finding), in simulate and in plan alike."""
    path = accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                           "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n")
    for command in ("simulate", "plan"):
        assert main([command, "toy-llama", "--from-accelerate", str(path), "--cluster", "h100", "--quiet"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: accelerate config '{path}': fsdp_config.fsdp_transformer_layer_cls_to_wrap: module class "
            "LlamaDecoderLayer not found in the model; classes with params: Attention, Embedding, FeedForward, "
            "Linear, ModuleList, RMSNorm, TransformerBlock")


@pytest.mark.integration  # llama32-1b traced at TP 2, auto's search and the config's edits: ~9 s
def test_auto_is_no_slower_than_the_config_edited_to_never_reshard(tmp_path, capsys):
    """torchtitan's grouping with fsdp_reshard_after_forward = "never" and no checkpointing was faster than auto's
    plan (121 ms a step, -11.1% against -10.8%): auto preferred fewer groups within 0.5%, with only the classic
    policies as set by default for its bar. The classic groupings kept gathered join that bar."""
    job = titan(tmp_path, '[model]\nname = "llama3"\nflavor = "1B"\n[training]\nlocal_batch_size = 1\n'
                          'seq_len = 8192\n[parallelism]\ndata_parallel_shard_degree = -1\ntensor_parallel_degree = 2\n'
                          '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n')
    assert main(["plan", "--from-torchtitan", str(job), "--cluster", "h100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    edit = doc["best_edit"]
    assert [c["key"] for c in edit["changes"]] == ["activation_checkpoint.mode",
                                                  "parallelism.fsdp_reshard_after_forward"]
    assert doc["auto_step"]["step_time"] <= edit["step"]["step_time"] * (1 + 1e-12)


def test_accelerate_transformer_wrap_without_classes_wraps_only_transformers_models(tmp_path, capsys):
    """Accelerate's TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap wraps the model's
    _no_split_modules: a model of one's own has none, so Accelerate shards the root alone, where it was simulated
    as the module policy on its blocks without a word (a new user's finding); transformers' models keep theirs."""
    yaml = accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                           "num_processes: 8\n")
    args = args_of("simulate", "toy-llama", "--from-accelerate", str(yaml))
    assert (args.policy, args.min_nonwrapped_numel) == ("size", str(10**15))
    assert "without fsdp_config.fsdp_transformer_layer_cls_to_wrap wraps the model's _no_split_modules" in \
        capsys.readouterr().err
    # (a transformers model: its _no_split_modules, with the embedding and the tail carved as Accelerate's FSDP2 does)
    assert args_of("simulate", "hf:gpt2", "--from-accelerate", str(yaml)).policy == "titan"


def test_accelerate_fsdp2_carves_the_embedding_and_the_tail_of_a_transformers_model(tmp_path, capsys):
    """Accelerate 1.16's fsdp2_prepare_model shards the input embedding alone and [final norm, lm_head] as a group
    kept unsharded after forward: simulated with them in the root (the module policy), the embedding and head
    were gathered all step (a new user's trial, checked against Accelerate's own FSDP2 on CPU)."""
    yaml = accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                           "  fsdp_transformer_layer_cls_to_wrap: Qwen3DecoderLayer\nnum_processes: 8\n")
    assert main(["simulate", "hf:qwen3-8b", "--from-accelerate", str(yaml), "--cluster", "h100", "--json"]) == 0
    assert "Accelerate's FSDP2 shards a transformers model's input embedding alone" in capsys.readouterr().err
    assert main(["plan", "hf:qwen3-8b", "--policy", "titan", "--module-classes", "Qwen3DecoderLayer", "--cluster",
                 "h100:8", "--json", "--out", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    groups = [g["modules"] for g in json.loads((tmp_path / "p.json").read_text())["groups"]]
    assert groups[0] == ["model.embed_tokens"] and groups[-2] == ["model.norm", "lm_head"]
    v1 = accel(tmp_path, "fsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\nnum_processes: 8\n")
    assert args_of("simulate", "hf:qwen3-8b", "--from-accelerate", str(v1)).policy == "module"  # (FSDP1's)


def test_a_toml_job_without_its_batch_or_length_runs_torchtitan_s_defaults(tmp_path, capsys):
    """torchtitan's TOML JobConfig ran local_batch_size 8 and seq_len 2048 where a job left them out (before its
    registry form, 9810191); it was simulated at the model's own default (the 8B's 1 x 8,192)."""
    job = titan(tmp_path, "[model]\nname = \"llama3\"\nflavor = \"8B\"\n[training]\nseq_len = 4096\n")
    a = args_of("simulate", "--from-torchtitan", str(job), "--cluster", "h100")
    assert (a.batch, a.seq) == (8, 4096)
    assert "gives no training.local_batch_size: torchtitan runs its default, 8, simulated here" in \
        capsys.readouterr().err
    a = args_of("simulate", "--from-torchtitan", str(job), "--cluster", "h100", "--batch", "2")
    assert (a.batch, a.seq) == (2, 4096)


def test_the_best_edit_of_a_job_over_the_budget_is_the_fastest_that_fits_and_may_turn_offload_off():
    """Where the config's job is over the budget, any edit that fits beats it (the search asked for one faster than
    the job too, and found none: gpt-oss 20B at 71.3 GiB, where reshard always alone fits at 70.2 GiB, 10 ms
    slower); and CPU offload is a key auto changes, so the edits try auto's setting of it too (an Accelerate job
    with offload: off alone was 3x faster)."""
    from fsdp_planner.planners.config_edit import Setting, best_edit
    from fsdp_planner.sim.simulate import StepReport

    def report(step: float, reserved: int) -> StepReport:
        return StepReport(step_time=step, compute_time=0.0, exposed_comm=0.0, lower_bound=0.0, peak_memory=reserved,
                          reserved_memory=reserved, memory_at_peak={}, all_gathers=0, reduce_scatters=0,
                          all_gather_bytes=0, reduce_scatter_bytes=0, comm_time={})

    flat = Mesh(1, 8)
    old = Setting(ACMode.NONE, "default", flat, True)
    steps = {(ACMode.NONE, "always", True): report(3.73, 70), (ACMode.NONE, "default", False): report(1.0, 60),
             (ACMode.NONE, "always", False): report(1.2, 60)}

    def step(s: Setting) -> StepReport | None:
        return steps.get((s.ac, s.reshard, s.offload))

    fits = lambda reserved: reserved <= 70  # noqa: E731
    over = report(3.72, 71)
    found = best_edit([ACMode.NONE], ["always"], old, old, step, fits, over)  # auto keeps offload: on
    assert found is not None and found[0] == Setting(ACMode.NONE, "always", flat, True)
    found = best_edit([ACMode.NONE], ["always"], old, Setting(ACMode.NONE, "default", flat, False), step, fits, over)
    assert found is not None and (found[0].offload, found[1].step_time) == (False, 1.0)
    assert best_edit([ACMode.NONE], ["always"], old, old, step, fits, report(3.0, 60)) is None  # none beats 3.0 s


@pytest.mark.integration
def test_the_best_edit_of_a_moe_job_tries_auto_s_expert_parallel_degree(capsys):
    """torchtitan's gpt-oss 20B job on 8 H100s runs no EP, and auto's plan EP 8: the best edit of the job's keys
    alone tries that degree too (parallelism.expert_parallel_degree is a key), and takes it (measured here: the job
    1.05 s, its best edit without EP 1.00 s, with EP 8 0.90 s, auto 0.89 s)."""
    spec = str(Path(__file__).parent / "fixtures/torchtitan/gpt_oss/config_registry.py:gpt_oss_20b")
    assert main(["plan", "--from-torchtitan", spec, "--cluster", "h100", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    edit = {c["key"]: (c["config"], c["auto"]) for c in doc["best_edit"]["changes"]}
    assert edit["parallelism.expert_parallel_degree"] == ("1", "8")
    assert doc["best_edit"]["step"]["step_time"] < doc["config_step"]["step_time"]


def test_accelerate_regional_compilation_is_read_as_compile(tmp_path):
    """``dynamo_use_regional_compilation: true`` with INDUCTOR compiles each repeated block (accelerate's
    compile_regions), what --compile models: it was "left out: eager" beside a header saying blocks compiled (the
    user had added --compile); a whole-model compile stays left out, said so."""
    regional = "dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_use_regional_compilation: true\n"
    cfg = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n" + regional)))
    assert cfg.compile and not cfg.notes
    assert cfg.keys["dynamo_config.dynamo_use_regional_compilation"] is True
    whole = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\ndynamo_config:\n"
                                                        "  dynamo_backend: INDUCTOR\n")))
    assert not whole.compile and "not of the whole model" in whole.notes[0]


def test_torchtitan_s_early_stop_and_force_recompute_keys(tmp_path):
    """A TOML's activation_checkpoint.early_stop is read (absent: false, torchtitan's default since #1580; an
    explicit --early-stop against it names that default); a force-recompute list other than torchtitan's default is
    said not to be read, not taken silently."""
    base = "[parallelism]\ndata_parallel_shard_degree = 8\n[activation_checkpoint]\nmode = \"selective\"\n" \
           "selective_ac_option = \"op\"\n"
    assert read_config(TORCHTITAN, str(titan(tmp_path, base))).early_stop is False
    with pytest.raises(PlannerError, match=re.escape("--early-stop true contradicts activation_checkpoint.early_stop "
                                                     "(not given: false, torchtitan's default since #1580)")):
        args_of("simulate", "toy-llama", "--from-torchtitan", str(titan(tmp_path, base)), "--early-stop")
    stopping = read_config(TORCHTITAN, str(titan(tmp_path, base + "early_stop = true\n")))
    assert stopping.early_stop is True and not stopping.notes
    forced = read_config(TORCHTITAN, str(titan(tmp_path, base + "per_op_sac_force_recompute_mm_shapes_by_fqns = []\n")))
    assert any("per_op_sac_force_recompute_mm_shapes_by_fqns = [] is not read" in n for n in forced.notes)


def test_auto_stops_early_beside_a_torchtitan_job_unless_told_not_to(tmp_path, capsys):
    """torchtitan's wrapper re-runs checkpointed blocks whole, and the job and its edits are simulated so; auto's
    plan is applied by the export's parallelize_fn, which checkpoints as the plan says, so auto may stop early. A
    --no-early-stop on the command line (for TORCHTITAN_FLAGS on another job, which run the wrapper) was silently
    dropped: auto keeps it."""
    job = titan(tmp_path, "[training]\nlocal_batch_size = 2\nseq_len = 32\n"
                          '[parallelism]\ndata_parallel_shard_degree = 4\n[activation_checkpoint]\nmode = "full"\n')
    plans = {}
    for flags in ((), ("--no-early-stop",)):
        assert main(["plan", "toy-llama", "--from-torchtitan", str(job), "--json", "--quiet",
                     "--memory-budget", "2MiB", *flags]) in (0, 1)
        doc = json.loads(capsys.readouterr().out)
        assert doc["plan"]["activation_checkpointing"] or doc["plan"].get("selective_checkpointing")
        plans[flags] = doc
    assert plans[()]["plan"].get("checkpoint_early_stop", True) is True
    assert plans[("--no-early-stop",)]["plan"]["checkpoint_early_stop"] is False
    assert plans[()]["config_step"] == plans[("--no-early-stop",)]["config_step"]  # (the job's own: the wrapper's)


@pytest.mark.parametrize("components", ['["lossy"]', '"model,lossy"', "true"])
def test_torchtitan_compile_components_are_its_names(tmp_path, components):
    """A misspelled component compiled nothing, said as a note; a bare --compile.components flag (true) compiled
    the model alone (a new user's findings): one error naming the value and torchtitan's names."""
    with pytest.raises(PlannerError, match=r"compile\.components = .* is not a list of torchtitan's components "
                                           r"\(\"model\" and \"loss\"\)"):
        read_config(TORCHTITAN, str(titan(tmp_path, f'[compile]\nenable = true\ncomponents = {components}\n'
                                                    '[activation_checkpoint]\nmode = "none"\n')))


@pytest.mark.parametrize(("mp", "reduce"), [("bf16", "bf16"), ("fp16", "bf16"), ("no", None)])
def test_accelerate_reduces_in_the_param_dtype(tmp_path, mp, reduce):
    """Accelerate's FSDP plugin builds MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) from
    mixed_precision: bf16 (a new user's trial: simulated with fp32 reduce-scatters, twice the bytes)."""
    cfg = read_config(ACCELERATE, str(accel(tmp_path, f"mixed_precision: '{mp}'\nfsdp_config:\n  fsdp_version: 2\n")))
    assert cfg.reduce_dtype == reduce
    with pytest.raises(PlannerError, match="mixed_precision is false: YAML reads a bare no so; write 'no' in quotes"):
        read_config(ACCELERATE, str(accel(tmp_path, "mixed_precision: no\n")))


def test_accelerate_fsdp2_does_not_read_fsdp1_s_sharding_strategy(tmp_path):
    """FSDP2 (fsdp_version 2) reads fsdp_reshard_after_forward alone: FSDP1's SHARD_GRAD_OP or HYBRID_SHARD beside
    it changed the simulated job (no reshard; HSDP across machines) where Accelerate runs FSDP2's default."""
    for strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD"):
        cfg = read_config(ACCELERATE, str(accel(tmp_path, "num_machines: 2\nnum_processes: 16\nfsdp_config:\n  "
                                                          f"fsdp_version: 2\n  fsdp_sharding_strategy: {strategy}\n")))
        assert (cfg.reshard, cfg.replicate) == ("default", 1)
        assert any("is FSDP1's, which Accelerate's FSDP2" in n for n in cfg.notes)
    cfg = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n  fsdp_sharding_strategy: "
                                                      "SHARD_GRAD_OP\n  fsdp_reshard_after_forward: false\n")))
    assert cfg.reshard == "never"


@pytest.mark.parametrize(("text", "meant"), [("mixed_precison: bf16\n", "mixed_precision"),
                                             ("num_proceses: 16\n", "num_processes"),
                                             ("fsdp_confg:\n  fsdp_version: 2\n", "fsdp_config")])
def test_accelerate_misspelled_top_level_key_is_an_error(tmp_path, text, meant):
    """A top-level key a letter off was a note, and the job simulated at the setting's default (fp32 for bf16, 8
    GPUs for 16, FSDP1 with no wrap for the whole fsdp_config: a new user's trial); only fsdp_config's keys were
    checked so."""
    with pytest.raises(PlannerError, match=rf"is not a key of the config \(did you mean {meant}\?\)"):
        read_config(ACCELERATE, str(accel(tmp_path, text)))


def test_accelerate_keys_that_are_no_strings_are_said_as_written(tmp_path):
    """YAML reads ``5:``, ``true:`` and ``~:`` as a number, a bool and null: under fsdp_config such a key was an
    internal error (TypeError in the misspelling check), at the top level a note naming "ru" for true, "" for 5
    (the quotes stripped off a string's JSON, here off none); a long key lost its closing parenthesis."""
    cfg = read_config(ACCELERATE, str(accel(tmp_path, "true: x\n~: y\n5: z\n1.5: w\nfsdp_config:\n  fsdp_version: "
                                                      "2\n  7: x\n  false: y\n" + "  " + "k" * 213 + ": 1\n")))
    said = [n.split(" is not read")[0] for n in cfg.notes if " is not read" in n]
    assert said[:4] == ["true", "null", "5", "1.5"]
    assert said[4:6] == ["fsdp_config.7", "fsdp_config.false"]
    assert said[6].startswith("fsdp_config.kkk") and said[6].endswith("(213 characters)")


def test_accelerate_fsdp2_size_based_wrap_says_its_rule(tmp_path):
    """Accelerate's FSDP2 wraps by a module's whole size, containers included (a ModuleList of blocks makes
    fully_shard raise); simulated with FSDP1's rule, without a word before (a new user's trial)."""
    cfg = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n  fsdp_auto_wrap_policy: "
                                                      "SIZE_BASED_WRAP\n  fsdp_min_num_params: 100000000\n")))
    assert any("SIZE_BASED_WRAP shards every module whose params exceed" in n for n in cfg.notes)
    cfg = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n")))  # (NO_WRAP)
    assert not any("SIZE_BASED_WRAP" in n for n in cfg.notes)


@pytest.mark.parametrize(("option", "says"), [
    (["--ac", "op"], r'--ac "op" contradicts fsdp_config.fsdp_activation_checkpointing \(not given: false'),
    (["--offload"], r"--offload true contradicts fsdp_config.fsdp_offload_params \(not given: false\)"),
    (["--reduce-dtype", "fp32"], r'--reduce-dtype "fp32" contradicts mixed_precision in accelerate config'),
])
def test_an_option_against_a_key_the_accelerate_config_leaves_out_is_an_error(tmp_path, capsys, option, says):
    """A config without checkpointing or offload runs neither: --ac op or --offload beside it simulated another job
    (op-level checkpointing, which Accelerate cannot run) with exit 0, where the same option against the key
    written out was an error (a new user's trial)."""
    yaml = accel(tmp_path, "mixed_precision: bf16\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n")
    assert main(["simulate", "toy-llama", "--from-accelerate", str(yaml), "--cluster", "h100", *option]) == 2
    assert re.search(says, capsys.readouterr().err)


@pytest.mark.integration  # (a plan of the built-in 8B beside its config: ~20 s)
def test_an_fsdp1_accelerate_config_s_edit_names_its_sharding_strategy(tmp_path, capsys):
    """Accelerate's FSDP1 plugin reads fsdp_sharding_strategy first: the advised edit named FSDP2's
    fsdp_reshard_after_forward = false, which that job would not read (a new user's trial)."""
    yaml = accel(tmp_path, "mixed_precision: bf16\nnum_processes: 8\nfsdp_config:\n  fsdp_auto_wrap_policy: "
                           "TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: TransformerBlock\n  "
                           "fsdp_sharding_strategy: FULL_SHARD\n  fsdp_activation_checkpointing: true\n")
    assert main(["plan", "llama3-8b", "--from-accelerate", str(yaml), "--cluster", "h100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    keys = [c["key"] for c in (doc["best_edit"] or {}).get("changes", [])] + [c["key"] for c in doc["changes"]]
    assert "fsdp_config.fsdp_sharding_strategy" in keys and "fsdp_config.fsdp_reshard_after_forward" not in keys
    assert {"key": "fsdp_config.fsdp_sharding_strategy", "config": "FULL_SHARD", "auto": "SHARD_GRAD_OP"} in \
        [{k: c[k] for k in ("key", "config", "auto")} for c in doc["best_edit"]["changes"]]


def test_accelerate_quoted_fsdp_version_and_a_section_that_is_no_mapping(tmp_path):
    """Accelerate reads fsdp_version through the environment (int("2")): a quoted "2" is FSDP2, where it was
    refused as not 1 or 2; a section that is no mapping is said in YAML's words, not as a TOML table."""
    cfg = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: '2'\n")))
    assert cfg.keys["fsdp_config.fsdp_version"] == 2 and not cfg.fsdp1
    with pytest.raises(PlannerError, match=r"fsdp_config = .* is not a mapping of keys"):
        read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config: 3\n")))


def test_accelerate_reshard_keys_as_accelerate_1_16_runs_them(tmp_path):
    """FSDP1: the launcher passes fsdp_sharding_strategy (default FULL_SHARD), which wins over
    fsdp_reshard_after_forward (accelerate config writes FSDP1's choice there): read as FULL_SHARD, with a note
    (it was read as SHARD_GRAD_OP, 95 GiB over the budget where the job runs FULL_SHARD: the review). FSDP2's true is
    the policy's own rule (the carved tail and the root stay gathered), not every group resharded."""
    v1 = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_reshard_after_forward: SHARD_GRAD_OP\n")))
    assert v1.reshard == "default" and any("is not what FSDP1 runs" in n for n in v1.notes)
    for value, rule in (("true", "default"), ("false", "never")):
        v2 = read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n  "
                                                          f"fsdp_reshard_after_forward: {value}\n")))
        assert v2.reshard == rule
    with pytest.raises(PlannerError, match="fsdp_reshard_after_forward"):
        read_config(ACCELERATE, str(accel(tmp_path, "fsdp_config:\n  fsdp_version: 2\n  "
                                                    "fsdp_reshard_after_forward: SHARD_GRAD_OP\n")))


@pytest.mark.integration  # (a plan of the built-in 8B on 16 GPUs beside its config: ~25 s)
def test_an_fsdp1_hybrid_config_s_edit_says_its_mesh_by_strategy(tmp_path, capsys):
    """FSDP1's HSDP is HYBRID_SHARD across the machines: an edit to one 16-rank FSDP group named
    _HYBRID_SHARD_ZERO2 beside parallelism_config keys, which FSDP1 does not read (the config's replicate chose the
    strategy's text, not the edit's mesh)."""
    yaml = accel(tmp_path, "mixed_precision: bf16\nnum_machines: 2\nnum_processes: 16\nfsdp_config:\n  "
                           "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: "
                           "TransformerBlock\n  fsdp_sharding_strategy: HYBRID_SHARD\n")
    assert main(["plan", "llama3-8b", "--from-accelerate", str(yaml), "--cluster", "h100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    edit = {c["key"]: c["auto"] for c in doc["best_edit"]["changes"]}
    assert not any(k.startswith("parallelism_config") for k in edit)
    assert edit.get("fsdp_config.fsdp_sharding_strategy") in ("SHARD_GRAD_OP", "FULL_SHARD", "_HYBRID_SHARD_ZERO2")
    mesh = doc["best_edit"]["step"]["mesh"]
    assert ("HYBRID" in edit["fsdp_config.fsdp_sharding_strategy"]) == (mesh == "2x8"), (edit, mesh)


@pytest.mark.integration  # auto's search of llama3-8b on 8 H100s beside the configured job: ~20 s
def test_a_job_offloading_where_auto_needs_no_offload_says_so(tmp_path, capsys):
    """``simulate --from-accelerate`` of a job with fsdp_offload_params where auto's plan fits without CPU offload
    printed a "fit:" note beside the job's step and no conclusion (a trial read it as a stray): it says the job
    need not offload and that ``plan`` writes the plan that does not."""
    cfg = tmp_path / "offload.yaml"
    cfg.write_text((EXAMPLES / "accelerate_fsdp.yaml").read_text().replace("fsdp_offload_params: false",
                                                                           "fsdp_offload_params: true"))
    assert main(["simulate", "llama3-8b", "--from-accelerate", str(cfg), "--cluster", "h100"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "fit: the job on h100:8 as auto plans it: auto's plan fits" in err
    assert "the configuration offloads to the CPU, and auto's own plan of the same job fits without CPU offload" in err

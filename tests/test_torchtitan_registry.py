"""``--from-torchtitan FILE.py:FUNCTION``: torchtitan's current config_registry jobs (a fetched copy of its llama3
registry under tests/fixtures/torchtitan) read without running them, into the same job as the equivalent TOML;
torchtitan's dotted flags after ``--``; non-literal values; and ``export --format torchtitan`` read back."""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from fsdp_planner.apply.export import export_plan
from fsdp_planner.apply.torchtitan_job import unexpressed
from fsdp_planner.choices import ACMode, ExportFormat, SacPolicy
from fsdp_planner.cli import build_parser, main
from fsdp_planner.cli.requests import configured
from fsdp_planner.configs.job_config import TORCHTITAN, JobConfig, read_config
from fsdp_planner.configs.torchtitan_registry import Call, Override, is_registry_spec, parse_flags
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.float8 import Float8
from fsdp_planner.fsdp2.plan import Group, Mesh, Plan, Workload
from fsdp_planner.fsdp2.tensor_parallel import TensorParallel
from fsdp_planner.sim.options import PRECISIONS

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "torchtitan"
REGISTRY = FIXTURES / "llama3" / "config_registry.py"
DEBUG_JOBS = [f for f in (n.name for n in ast.parse(REGISTRY.read_text()).body if isinstance(n, ast.FunctionDef))
              if "debugmodel" in f]


def job(function: str) -> str:
    return f"{REGISTRY}:{function}"


def options(spec: str, *extra: str, flags: tuple[str, ...] = ()) -> tuple[dict[str, object], JobConfig]:
    """The command line's options for ``simulate --from-torchtitan spec``, and the job read; without the spec."""
    args = build_parser().parse_args(["simulate", *extra, "--from-torchtitan", spec, "--cluster", "h100",
                                      *(["--", *flags] if flags else [])])
    merged, cfg = configured(args)
    assert cfg is not None
    shown = {k: getattr(merged, k) for k in vars(args) if k not in ("from_torchtitan", "torchtitan_flags")}
    # (a registry job's CUDA graphs keep the sharded grads all step; the TOMLs' jobs had none)
    assert shown.pop("zero_grad") == ("zeros" if cfg.cuda_graphs else "none")
    return shown, cfg


CHUNKED = "loss = ChunkedLossWrapper"  # the note of torchtitan's chunked loss (its llama3 jobs of 2026)


def unchunked(notes: list[str]) -> list[str]:
    """``notes`` without the chunked loss's: torchtitan's registry jobs chunk the loss, which their TOMLs (of 2025)
    had no key for."""
    return [n for n in notes if not n.startswith(CHUNKED)]


def same_job(a: JobConfig, b: JobConfig) -> None:
    mine = {k: v for k, v in vars(a).items() if k != "path"}
    theirs = {k: v for k, v in vars(b).items() if k != "path"}
    mine["notes"], theirs["notes"] = unchunked(mine["notes"]), unchunked(theirs["notes"])
    del mine["loss_chunks"], theirs["loss_chunks"]  # (the registry's jobs chunk their loss, as the note dropped says)
    # (the registry's jobs replay their step as a CUDA graph, TrainingConfig's default; the TOMLs' had none)
    assert mine.pop("cuda_graphs") and theirs.pop("cuda_graphs") == (not b.path.endswith(".toml"))
    assert mine == theirs


@pytest.mark.parametrize("function", ["llama3_8b", "llama3_70b", "llama3_405b"])
def test_the_shipped_jobs_are_their_tomls(function):
    """Model, tokens as sequences, parallelism, checkpointing, compile and float8: the same options and notes, but
    for the 405B job's float8, which torchtitan ran tensorwise with its TP activations all-gathered in float8 in the
    TOMLs' time (torchao's float8 TP styles) and runs rowwise, TP's all-gathers in bf16, in the registry's (its
    converter's default recipe since April 2026)."""
    registry, toml = options(job(function)), options(str(FIXTURES / f"{function}.toml"))
    f8 = function == "llama3_405b"
    # (None: not given, off)
    assert (registry[0].pop("float8_tp_all_gather"), toml[0].pop("float8_tp_all_gather")) == (None, f8 or None)
    if f8:
        assert [(j.pop("float8"), j.pop("float8_all_gather")) for j, _ in (registry, toml)] == \
            [("rowwise", None), ("tensorwise", False)]
        assert toml[1].float8_tp_all_gather and not registry[1].float8_tp_all_gather
        assert "torchao's float8 TP styles" in toml[1].notes.pop()
        toml[1].float8_tp_all_gather = False
        for j in (registry[1], toml[1]):
            j.float8, j.float8_all_gather = None, False
            for key in [k for k in j.keys if "float8" in k]:
                del j.keys[key]
    # the registry's jobs chunk their loss (ChunkedLossWrapper), which the TOMLs (of 2025) had no key for
    assert (registry[0].pop("loss_chunks"), toml[0].pop("loss_chunks")) == (8, None)
    assert registry[0] == toml[0]
    same_job(registry[1], toml[1])
    assert registry[0]["model"] == function.replace("_", "-")


def test_the_shipped_jobs_as_expected():
    """The numbers the registry holds, so the TOMLs above cannot both be wrong the same way."""
    jobs = {f: read_config(TORCHTITAN, job(f)) for f in ("llama3_8b", "llama3_70b", "llama3_405b")}
    assert [(c.model, c.batch, c.seq, c.ac.value) for c in jobs.values()] == [
        ("llama3-8b", 1, 8192, "op"), ("llama3-70b", 8, 8192, "full"), ("llama3-405b", 2, 8192, "full")]
    assert [(c.tp, c.async_tp) for c in jobs.values()] == [(1, False), (8, False), (8, True)]  # TP kept
    assert not jobs["llama3_405b"].notes  # float8 (its lm_head filter is the output head) and compile both read;
    # each job's chunked loss read (simulated in its chunks: no note)
    assert [c.loss_chunks for c in jobs.values()] == [8, 8, 8]
    assert [(c.float8, c.float8_all_gather) for c in jobs.values()] == [(None, False), (None, False),
                                                                        ("rowwise", False)]
    assert jobs["llama3_405b"].compile and not jobs["llama3_8b"].compile


@pytest.mark.parametrize("function", DEBUG_JOBS)
def test_the_debug_jobs_read(function):
    """Each debug job (built on llama3_debugmodel and its attribute edits) reads; with MODEL it is the debug TOML's
    job, its converters and model_registry options each a note."""
    registry, toml = options(job(function)), options(str(FIXTURES / "llama3_debugmodel.toml"))
    # its converter read: --float8, its default recipe; emulated, the job without float8 (no float8 matmul runs)
    float8 = "rowwise" if "float8" in function and "emulate" not in function else None
    chunked = read_config(TORCHTITAN, job(function)).loss_chunks  # (the TOML of 2025 has no chunked loss)
    assert (registry[0].pop("loss_chunks"), toml[0].pop("loss_chunks")) == (chunked, None)
    assert registry[0] == {**toml[0], **({"float8": float8} if float8 else {})}
    assert (registry[1].model_label, registry[1].batch, registry[1].seq) == ('"llama3" flavor "debugmodel"', 8, 2048)
    assert all(n.count("\n") == 0 for n in registry[1].notes)
    assert len(DEBUG_JOBS) >= 8


def test_a_debug_job_is_torchtitans_debugmodel(capsys):
    """torchtitan's quick start trains llama3's "debugmodel" flavour: the built-in llama3-debugmodel, its numbers
    (models/llama3/__init__.py's _debugmodel: dim 256, 6 layers, 16 heads, vocab 2,048, FFN 768), and the model a
    debug job without MODEL simulates (it asked for MODEL)."""
    from fsdp_planner.models import load_model

    assert options(job("llama3_debugmodel"))[0]["model"] == "llama3-debugmodel"
    model = load_model("llama3-debugmodel").model
    dim, layers, vocab, ffn = 256, 6, 2048, 768
    assert sum(p.numel() for p in model.parameters()) == 2 * vocab * dim + dim + layers * (
        4 * dim * dim + 3 * dim * ffn + 2 * dim)
    with pytest.raises(PlannerError, match="MODEL 'toy-llama' is not the torchtitan job's model"):
        options(job("llama3_debugmodel"), "toy-llama")


FLAGS = ("--parallelism.data_parallel_shard_degree", "16", "--parallelism.fsdp_reshard_after_forward=never",
         "activation_checkpoint:selective", "--training.enable-cpu-offload")


def test_a_job_with_overrides_is_its_toml_with_the_same_edits(tmp_path):
    """torchtitan's flags on a registry job, and on the TOML (its keys), give the same job as a TOML that says so."""
    text = (FIXTURES / "llama3_70b.toml").read_text().replace("local_batch_size = 8", "local_batch_size = 1")
    text = text.replace('mode = "full"', 'mode = "selective"\nselective_ac_option = "op"')
    edited = tmp_path / "edited.toml"
    edited.write_text(text.replace("tensor_parallel_degree = 8", "tensor_parallel_degree = 8\n"
                                   "data_parallel_shard_degree = 16\nfsdp_reshard_after_forward = \"never\"")
                      .replace("steps = 1000", "steps = 1000\nenable_cpu_offload = true"))
    registry = options(job("llama3_70b"), flags=(*FLAGS, "--training.num_tokens_per_microbatch_per_dp_rank", "8192"))
    toml = options(str(FIXTURES / "llama3_70b.toml"), flags=(*FLAGS, "--training.local_batch_size", "1"))
    written = options(str(edited))
    # (the registry's job computes its loss in 8 chunks, which its TOMLs of 2025 cannot say)
    assert [o[0].pop("loss_chunks") for o in (registry, toml, written)] == [8, None, None]
    assert registry[0] == toml[0] == written[0]
    same_job(registry[1], written[1])
    assert (registry[1].shard, registry[1].reshard, registry[1].offload, registry[1].batch) == (16, "never", True, 1)
    assert registry[0]["cluster"] == "h100:128" and registry[0]["tp"] == 8  # dp_shard 16 x TP 8


def test_flags_as_torchtitan_spells_them():
    assert parse_flags(["--a.b", "1", "--a.c=x", "--a.d", "--a.no-e", "--a.f", "-1", "2.5", "--a.g", "None"]) == (
        Override("a.b", 1), Override("a.c", "x"), Override("a.d", True), Override("a.e", False),
        Override("a.f", [-1, 2.5]), Override("a.g", None))
    assert parse_flags(["--a.b", "99999999999999999999"]) == (Override("a.b", 99999999999999999999),)  # not 1e+20
    assert parse_flags(["activation-checkpoint:none", "activation_checkpoint:full"]) == (
        Override("activation_checkpoint", None), Override("activation_checkpoint", Call("FullAC.Config")))
    for bad, says in ((["--steps", "3"], "is not --section.key VALUE"), (["--module", "llama3"], "MODULE:FUNCTION"),
                      (["8"], "is not --section.key VALUE"),
                      (["--activation-checkpoint:full"], "subcommand without the dashes, activation-checkpoint:full"),
                      # a value's list took a misspelled subcommand as its second value (a trial)
                      (["--a.b", "8192", "activation-checkpoint:bogus"], 'subcommand "activation-checkpoint:bogus" '
                                                                           "is none of torchtitan's")):
        with pytest.raises(PlannerError, match=says):
            parse_flags(bad)


def test_flags_on_the_command_line(capsys):
    """With --from-torchtitan every word after ``--`` is torchtitan's (``--json`` there is named); without it the
    ``--`` is argparse's, before positionals."""
    assert main(["simulate", "--from-torchtitan", job("llama3_8b"), "--", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and '"--json" is not --section.key VALUE' in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "toy-llama", "--cluster", "h100", "--", "--training.steps", "3"])
    assert "give --from-torchtitan too" in capsys.readouterr().err
    args = build_parser().parse_args(["simulate", "--cluster", "h100", "--", "-model.py"])
    assert (args.model, args.torchtitan_flags) == ("-model.py", ())
    # a number left off a flag read as true, and the error said "= true" of a flag the user gave no value (a trial)
    for spec in (job("llama3_8b"), str(FIXTURES / "llama3_8b.toml")):
        assert main(["simulate", "--from-torchtitan", spec, "--cluster", "h100", "--",
                     "--parallelism.tensor_parallel_degree"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "(--parallelism.tensor_parallel_degree was given no value, and a flag " \
            "without one sets true: give --parallelism.tensor_parallel_degree VALUE)" in err
    # a bare flag an error asks to be true ("async TP needs compile.enable = true ...") gets no such hint (a review)
    assert main(["simulate", "--from-torchtitan", str(FIXTURES / "llama3_8b.toml"), "--cluster", "h100", "--",
                 "--compile.enable", "--compile.components", "loss", "--parallelism.tensor_parallel_degree", "2",
                 "--parallelism.enable_async_tensor_parallel"]) == 2
    err = capsys.readouterr().err
    assert "compile.enable = true" in err and "given no value" not in err


@pytest.mark.parametrize(("flags", "says"), [
    (["--activation_checkpoint.mode", "full"], "give activation-checkpoint:full"),
    (["--training.local_batch_size", "2"], "this registry job counts tokens"),
])
def test_a_toml_key_given_to_a_registry_job_is_an_error_not_dropped(flags, says):
    """The TOML form's keys would be read past (the class, the token counts decide): one line naming the key the
    registry job takes."""
    with pytest.raises(PlannerError, match=says) as e:
        read_config(TORCHTITAN, job("llama3_8b"), flags)
    assert "\n" not in str(e.value)


def test_a_job_function_that_raises_is_said_to_raise(tmp_path):
    """A job whose function raises before it returns was said to return nothing (a trial looked for a missing
    return): the raise is named, with its line."""
    path = tmp_path / "jobs.py"
    path.write_text("from torchtitan.trainer import Trainer\n\n\ndef job() -> Trainer.Config:\n"
                    "    raise ValueError('not on this cluster')\n")
    with pytest.raises(PlannerError, match=r"line 5 of job raises \(raise ValueError\('not on this cluster'\)\) "
                                           r"before it returns a job") as e:
        read_config(TORCHTITAN, f"{path}:job")
    assert "\n" not in str(e.value)


def test_a_checkpointing_class_given_a_mode_in_the_jobs_code_is_told_so(tmp_path):
    """``SelectiveAC.Config(mode="op")`` in the job was refused as a --activation_checkpoint.mode flag the user never
    gave (a new user's trial): the class is named, and the mode it takes."""
    path = tmp_path / "jobs.py"
    path.write_text('from torchtitan.distributed.activation_checkpoint import SelectiveAC\n'
                    'from torchtitan.models.llama3 import model_registry\n'
                    'from torchtitan.trainer import Trainer\n\n\n'
                    'def job() -> Trainer.Config:\n'
                    '    return Trainer.Config(model_spec=model_registry("8B"), '
                    'activation_checkpoint=SelectiveAC.Config(mode="op"))\n')
    with pytest.raises(PlannerError, match=r"SelectiveAC\.Config has no field mode \(the TOML form's "
                                           r"activation_checkpoint\.mode\): the class is the mode") as e:
        read_config(TORCHTITAN, f"{path}:job")
    assert "--activation_checkpoint" not in str(e.value)


REGISTRY_HEAD = """from torchtitan.config import TrainingConfig
from torchtitan.trainer import Trainer
raise SystemExit("this file is read, never run")


def steps() -> int:
    return 5


def job() -> Trainer.Config:
    model_spec = model_registry("8B")
    return Trainer.Config(
        model_spec=model_spec,
"""


@pytest.mark.parametrize(("body", "says"), [
    ("training=TrainingConfig(max_context_length=steps() * 1024),",
     "training.max_context_length = steps() * 1024 is not a literal"),
    ("parallelism=ParallelismConfig(data_parallel_shard_degree=len([1])),",
     "parallelism.data_parallel_shard_degree = len(...) is not a literal"),
    ("training=TrainingConfig(num_tokens_per_microbatch_per_dp_rank=3000, max_context_length=2048),",
     "num_tokens_per_microbatch_per_dp_rank = 3,000 is not a multiple of training.max_context_length"),
    ("activation_checkpoint=MyAC.Config(),", "activation_checkpoint = MyAC.Config(...) is not SelectiveAC"),
    ("training=TrainingConfig(max_context_length=6000),",
     "training.num_tokens_per_microbatch_per_dp_rank = 16,384 (TrainingConfig's default) is not a multiple"),
    # the registry's own key and the bound (it named the TOML's training.seq_len, and no bound: a new user's trial)
    ("training=TrainingConfig(max_context_length=10**15),",
     "training.max_context_length = 1000000000000000 is not a whole number from 1 to 10,000,000"),
    ("training=TrainingConfig(max_context_length=-8192),",
     "training.max_context_length = -8192 is not a whole number from 1 to 10,000,000"),
])
def test_a_value_it_cannot_read_is_one_line_naming_the_key(tmp_path, body, says):
    _refused(tmp_path, REGISTRY_HEAD + f"        {body}\n    )\n", r"^torchtitan job '.*:job': .*" + re.escape(says))


def _refused(tmp_path: Path, source: str, pattern: str) -> None:
    """Reading the job ``source`` defines is one line matching ``pattern``."""
    path = tmp_path / "config_registry.py"
    path.write_text(source)
    with pytest.raises(PlannerError, match=pattern) as e:
        read_config(TORCHTITAN, f"{path}:job")
    assert "\n" not in str(e.value)


def test_a_value_it_ignores_is_a_note_and_a_flag_gives_what_the_file_does_not(tmp_path):
    path = tmp_path / "config_registry.py"
    path.write_text(REGISTRY_HEAD + "        training=TrainingConfig(steps=steps(), max_context_length=steps()),\n"
                                    "        optimizer=build_optimizer(),\n    )\n")
    cfg = read_config(TORCHTITAN, f"{path}:job", ["--training.max_context_length", "4096"])
    assert cfg.notes == ["training.steps = steps(...) is not read (not a literal; it does not change a step here)",
                         "optimizer = build_optimizer(...) is not read: simulated as torchtitan's default, fused "
                         "AdamW", "training.num_tokens_per_microbatch_per_dp_rank is not given: TrainingConfig's "
                         "default, 16,384, as torchtitan runs it"]
    assert (cfg.seq, cfg.batch, cfg.model_label) == (4096, 4, 'null flavor "8B"')  # 16384 default tokens


@pytest.mark.parametrize(("spec", "says"), [
    ("{dir}/config_registry.py:nope", "has no function nope (its functions: job, steps)"),
    ("{dir}/missing.py:job", "does not exist"),
    ("no_such_module_here.models:job", "is not found here (is torchtitan installed?)"),
])
def test_a_job_it_cannot_find_is_one_line(tmp_path, spec, says):
    (tmp_path / "config_registry.py").write_text(REGISTRY_HEAD + "    )\n")
    with pytest.raises(PlannerError, match=re.escape(says)):
        read_config(TORCHTITAN, spec.format(dir=tmp_path))


def test_module_function_finds_the_file_without_importing(tmp_path, monkeypatch):
    """MODULE:FUNCTION locates the package from its top-level entry on sys.path; no __init__ runs."""
    package = tmp_path / "mytitan" / "models" / "llama3"
    package.mkdir(parents=True)
    for d in (package, package.parent, package.parent.parent):
        (d / "__init__.py").write_text("raise RuntimeError('imported')\n")
    shutil.copy(REGISTRY, package / "config_registry.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("mytitan.models.llama3:llama3_8b", "mytitan.models.llama3.config_registry:llama3_8b"):
        assert is_registry_spec(spec)
        same_job(read_config(TORCHTITAN, spec), read_config(TORCHTITAN, job("llama3_8b")))
    assert "mytitan" not in sys.modules


def test_a_file_over_the_size_limit_is_refused(tmp_path):
    big = tmp_path / "config_registry.py"
    big.write_text(REGISTRY.read_text() + "#" * (300 << 10))  # a config file, read to 256 KiB
    with pytest.raises(PlannerError, match=r"is \d+ KiB: at most 256 KiB is read"):
        read_config(TORCHTITAN, f"{big}:llama3_8b")


def test_toml_paths_are_not_registry_specs():
    assert not is_registry_spec("job.toml") and not is_registry_spec("dir/job.toml")
    assert is_registry_spec("a/b.py:f") and is_registry_spec("torchtitan.models.llama3:llama3_8b")


# -- export --format torchtitan: the same form, read back ------------------------------------------------------------
def exported(tmp_path: Path, plan: Plan) -> tuple[Path, list[str]]:
    path = tmp_path / "titan_plan.py"
    path.write_text(export_plan(plan, ExportFormat.TORCHTITAN, PRECISIONS["bf16-mixed"]))
    tree = ast.parse(path.read_text())
    flags = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.AnnAssign)
                 and getattr(n.target, "id", "") == "TORCHTITAN_FLAGS")
    return path, flags



@pytest.mark.parametrize(("workload", "tp", "read"), [(Workload(2, 8192, 1, 8), 1, (2, 8192, None)),
                                                     (Workload(8, 4096, 4, 64), 8, (2, 4096, 64))])
def test_the_torchtitan_export_runs_the_plans_workload(tmp_path, workload, tp, read):
    """The job sets torchtitan's token counts for the plan's workload (a data-parallel rank's micro-batch, the
    sequence; with micro-batches the step's tokens over the data-parallel ranks) and reads back as that step:
    batch per micro-batch, seq and the step's sequences (4 micro-batches of 2 on 64 / TP 8 data-parallel ranks)."""
    from fsdp_planner.fsdp2.tensor_parallel import tensor_parallel_from_dict

    groups = [Group(modules=["layers.0"], params=["layers.0.w"]), Group(modules=[""], params=[])]
    tensor_parallel = tensor_parallel_from_dict({"degree": tp, "layout": {"layers.*.attention.wq": "colwise"}}) \
        if tp > 1 else None
    plan = Plan(fingerprint="", numel=2, model="llama3-70b", groups=groups, workload=workload,
                tensor_parallel=tensor_parallel)
    path, flags = exported(tmp_path, plan)
    source = path.read_text()
    assert f"config.training.num_tokens_per_microbatch_per_dp_rank = {read[0] * read[1]}\n" in source
    step = workload.batch * workload.seq * (workload.ranks // tp) if workload.micro_batches > 1 else -1
    assert f"config.training.num_tokens_per_train_step = {step}\n" in source  # (a base job's own count replaced)
    cfg = read_config(TORCHTITAN, f"{path}:fsdp_planner_job")
    assert (cfg.batch, cfg.seq, cfg.global_batch, cfg.tp, cfg.shard) == (*read, tp, workload.ranks // tp)
    assert read_config(TORCHTITAN, job("llama3_70b"), flags).global_batch == read[2]  # the flags say the same

@pytest.mark.parametrize("chunks", [0, 4])
def test_the_torchtitan_export_s_flags_carry_the_loss_s_chunks(tmp_path, chunks):
    """fsdp_planner_job() sets the plan's loss, and TORCHTITAN_FLAGS its chunks (--loss.num_chunks) on a job whose
    loss is chunked, read back as the same chunks; a whole loss has no flag, and the export says so (a new user's
    trial: the flags kept the job's own 8 chunks)."""
    plan = Plan(fingerprint="", numel=2, model="llama3-debugmodel", loss_chunks=chunks,
                workload=Workload(2, 2048, 1, 8),
                groups=[Group(modules=["layers.0"], params=["layers.0.w"]), Group(modules=[""], params=[])])
    path, flags = exported(tmp_path, plan)
    assert read_config(TORCHTITAN, f"{path}:fsdp_planner_job").loss_chunks == (chunks or None)
    assert read_config(TORCHTITAN, job("llama3_debugmodel"), flags).loss_chunks == (chunks or 8)
    # the checkpointing's subcommand last: tyro takes the job's options before a subcommand only (a new user's
    # check with tyro 1.0: "Unrecognized options: --loss.num_chunks, 4" where they followed it)
    assert flags[-1].startswith("activation-checkpoint:") and sum(f.startswith("activation-checkpoint:")
                                                                  for f in flags) == 1
    said = unexpressed(plan, PRECISIONS["bf16-mixed"], None)
    # the backend the job sets over torchtitan's default is said (a new user's trial: it was not)
    assert any(n.startswith('the job sets parallelism.spmd_backend = "partial_dtensor"') for n in said), said
    assert any(n.startswith("TORCHTITAN_FLAGS set --loss.num_chunks 4" if chunks else
                            "TORCHTITAN_FLAGS keep the job's own loss") for n in said), said


@pytest.mark.parametrize(("mesh", "reshard", "offload", "checkpointed", "reduce", "compiled"), [
    (Mesh(2, 4), [False, False], True, ["layers.0"], "", []),
    (None, [True, True], False, [], "bf16", ["layers.0", "layers.1"]),
    (Mesh(1, 8), [True, False], False, ["layers.0", "layers.1"], "", ["layers.0", "layers.1"]),
])
def test_the_torchtitan_export_reads_back_as_the_plans_job(tmp_path, mesh, reshard, offload, checkpointed, reduce,
                                                           compiled):
    """The exported fsdp_planner_job() reads as the plan's job; its flags on the shipped 8B job give the same."""
    groups = [Group(modules=[f"layers.{i}"], params=[f"layers.{i}.w"], reshard_after_forward=r)
              for i, r in enumerate(reshard)]
    plan = Plan(fingerprint="", numel=2, model="llama3-8b", mesh=mesh, offload=offload, reduce_dtype=reduce,
                activation_checkpointing=checkpointed, groups=[*groups, Group(modules=[""], params=[])],
                compiled=compiled, workload=Workload(2, 4096), optimizer="adamw")
    path, flags = exported(tmp_path, plan)
    cfg = read_config(TORCHTITAN, f"{path}:fsdp_planner_job")
    rule = "always" if all(reshard) else "never" if not any(reshard) else "default"
    assert (cfg.model, cfg.replicate, cfg.shard, cfg.reshard, cfg.offload) == (
        "llama3-8b", mesh.replicate if mesh else 1, mesh.shard if mesh else None, rule, offload)
    # (a bf16 reduce has no field: torchtitan's mixed_precision_reduce is float32 only, the export says so)
    assert (cfg.ac, cfg.precision, cfg.reduce_dtype, cfg.compile) == (
        ACMode.FULL if checkpointed else ACMode.NONE, "bf16-mixed", None, bool(compiled))
    # the job builds on torchtitan's own 8B job, which is not read, and sets the plan's groups as its model's
    # parallelize_fn, whose plan the file holds as data: the job's grouping
    assert cfg.notes == [BASE_NOTE, EXPORT_NOTE] and (cfg.batch, cfg.seq, cfg.optimizer) == (2, 4096, "adamw")
    assert Plan.from_json(cfg.plan).groups == plan.groups
    on_8b = read_config(TORCHTITAN, job("llama3_8b"), flags)
    keys = ("model", "replicate", "shard", "reshard", "offload", "ac", "precision", "reduce_dtype", "compile", "batch",
            "seq", "optimizer", "cuda_graphs")
    assert {k: getattr(on_8b, k) for k in keys} == {k: getattr(cfg, k) for k in keys}
    # the planned step is eager: torchtitan's CUDA graphs would keep the sharded grads all step (set_to_none=False)
    assert not cfg.cuda_graphs and read_config(TORCHTITAN, job("llama3_8b")).cuda_graphs


BASE_NOTE = ("fsdp_planner_job builds on llama3_8b(), not read (it is not in the file): the job is what "
             "fsdp_planner_job sets: its optimizer's param groups are simulated as AdamW")


@pytest.mark.parametrize(("optimizer", "implementation"), [("adamw", "foreach"), ("adamw-fused", "fused"),
                                                           ("adamw-fused-bf16-states", "fused_opt_states_bf16"),
                                                           ("", None), ("sgd", None)])
def test_the_torchtitan_export_runs_the_plans_optimizer(tmp_path, optimizer, implementation):
    """A plan records the optimizer it was simulated with; its torchtitan job sets torchtitan's implementation of
    it (a plan made with the default foreach AdamW was exported to a job of torchtitan's default fused one, 406
    against 416 ms read back on Llama 3 8B, without a word), and reads back as it; one torchtitan does not run, or
    none recorded, is said."""
    plan = Plan(fingerprint="", numel=2, model="llama3-8b", groups=[Group(modules=[""], params=[])],
                workload=Workload(1, 8192), optimizer=optimizer)
    path, flags = exported(tmp_path, plan)
    source = path.read_text()
    assert ("config.optimizer.implementation = " in source) == (implementation is not None)
    flag = "--optimizer.implementation"
    assert (flag, implementation) == tuple(flags[flags.index(flag):][:2]) if implementation else flag not in flags
    said = unexpressed(plan, PRECISIONS["bf16-mixed"], None)
    assert any("optimizer" in n or "AdamW" in n for n in said) == (implementation is None)
    if implementation:
        assert read_config(TORCHTITAN, f"{path}:fsdp_planner_job").optimizer == optimizer
        assert read_config(TORCHTITAN, job("llama3_8b"), flags).optimizer == optimizer  # the flags say the same


def test_a_job_on_an_unread_base_must_set_what_the_step_reads(tmp_path):
    """A job built on a function the file imports (torchtitan's own, not read) is read only where it sets what the
    simulation reads; a plan without a workload exports a job that keeps its base's token counts, which the reader
    names (and takes from flags)."""
    plan = Plan(fingerprint="", numel=2, model="llama3-8b", groups=[Group(modules=[""], params=[])],
                optimizer="adamw")
    path, _ = exported(tmp_path, plan)
    spec = f"{path}:fsdp_planner_job"
    with pytest.raises(PlannerError, match=r"fsdp_planner_job builds on llama3_8b\(\), which is not in the file .*"
                                           r"leaves training.num_tokens_per_microbatch_per_dp_rank, "
                                           r"training.max_context_length, training.num_tokens_per_train_step as "
                                           r"llama3_8b\(\) has them"):
        read_config(TORCHTITAN, spec)
    tokens = ["--training.num_tokens_per_microbatch_per_dp_rank", "8192", "--training.max_context_length", "4096",
              "--training.num_tokens_per_train_step", "-1"]
    assert (read_config(TORCHTITAN, spec, tokens).batch, read_config(TORCHTITAN, spec, tokens).seq) == (2, 4096)
    # a job that leaves the loss as its unread base has it is simulated with a whole loss, said so (torchtitan's
    # registry jobs chunk theirs: a new user's derived job lost its base's 8 chunks without a word)
    lossless = tmp_path / "lossless.py"
    lossless.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                                if not line.lstrip().startswith("config.loss")))
    said = read_config(TORCHTITAN, f"{lossless}:fsdp_planner_job", tokens).notes[0]
    assert said.endswith("its loss is simulated whole, not in chunks: set config.loss = ChunkedLossWrapper.Config(...) "
                         "where llama3_8b() chunks it"), said
    assert "its loss" not in read_config(TORCHTITAN, spec, tokens).notes[0]
    bare = tmp_path / "bare.py"
    bare.write_text("from torchtitan.models.llama3.config_registry import llama3_8b\n\n\ndef job():\n"
                    "    config = llama3_8b()\n    config.training.steps = 5\n    return config\n")
    with pytest.raises(PlannerError, match=r"leaves model_spec, activation_checkpoint, training.num_tokens_per_micro"
                                           r"batch_per_dp_rank, training.max_context_length and 13 more as "
                                           r"llama3_8b\(\) has them: set them "
                                           r"in job \(or give the flag\), or read llama3_8b's own file "
                                           r"\(--from-torchtitan torchtitan.models.llama3.config_registry:"
                                           r"llama3_8b\)$"):
        read_config(TORCHTITAN, f"{bare}:job")
    # a converter of another job (graph_trainer's jobs): its own file is no job; the job it converts is (a trial)
    converted = tmp_path / "converted.py"
    converted.write_text("from torchtitan.models.llama3.config_registry import llama3_8b\n"
                         "from torchtitan.experiments.graph_trainer.configs import to_graph_trainer_config\n\n\n"
                         "def job():\n    config = to_graph_trainer_config(llama3_8b(), model_registry)\n"
                         "    return config\n")
    with pytest.raises(PlannerError, match=r"set them in job \(or give the flag\), or plan the job it converts "
                                           r"\(--from-torchtitan torchtitan.models.llama3.config_registry:llama3_8b\); "
                                           r"what to_graph_trainer_config\(\) changes of that job is not modelled$"):
        read_config(TORCHTITAN, f"{converted}:job")
    # another trainer's config (transformers_modeling_backend's, the RL controller's): named short, and why
    other = tmp_path / "other.py"
    other.write_text(f"def job():\n    return TransformersBackendConfig(hf_model={'x' * 900!r})\n")
    with pytest.raises(PlannerError, match=r"job returns TransformersBackendConfig\(\.\.\.\), not Trainer\.Config"
                                           r"\(\.\.\.\) or another job of the file: fsdp-planner reads the jobs of "
                                           r"torchtitan's Trainer"):
        read_config(TORCHTITAN, f"{other}:job")



EXPORT_NOTE = ("model_spec.parallelize_fn = parallelize_fn is this file's (fsdp-planner's export): the job's figures "
               "are of its plan (FSDP_PLANNER_PLAN), its groups, checkpointing and layout")


@pytest.mark.integration  # ~25 s: auto's plan of llama3-8b, its export read back by plan and simulate
def test_an_exported_job_reads_back_as_its_plan_and_a_job_without_it_as_torchtitan_s_groups(tmp_path, capsys):
    """The export's job read back gave torchtitan's own grouping for its keys (1.01 s on llama3-8b, h100:8) beside
    the plan's 929 ms, and told the user to export the plan they had exported: the file holds its plan as data
    (FSDP_PLANNER_PLAN, a string literal, never run), which plan and simulate --from-torchtitan read where the job
    keeps the file's parallelize_fn. A job that sets another parallelize_fn is read as torchtitan groups it; a
    constant that is not a string literal is refused."""
    from fsdp_planner.cli import main

    out = tmp_path / "plan.json"
    # (checkpointing with torch's early stop: the export's parallelize_fn checkpoints as the plan says)
    assert main(["plan", "llama3-8b", "--policy", "auto", "--cluster", "h100:8", "--out", str(out), "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["plans"][0]["simulation"]["step_time"]
    exported = tmp_path / "job.py"
    assert main(["export", str(out), "--format", "torchtitan", "--out", str(exported)]) == 0
    spec = f"{exported}:fsdp_planner_job"
    assert main(["plan", "--from-torchtitan", spec, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config_step"]["step_time"] == pytest.approx(step, rel=1e-9) == doc["auto_step"]["step_time"]
    assert main(["simulate", "--from-torchtitan", spec, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time"] == pytest.approx(step, rel=1e-9)
    source = exported.read_text()
    other = tmp_path / "other.py"
    other.write_text(source.replace("config.model_spec.parallelize_fn = parallelize_fn",
                                    "config.model_spec.parallelize_fn = my_parallelize"))
    cfg = read_config(TORCHTITAN, f"{other}:fsdp_planner_job")
    assert cfg.plan is None and any("my_parallelize is not read" in n for n in cfg.notes)
    bad = tmp_path / "bad.py"
    bad.write_text(re.sub(r"FSDP_PLANNER_PLAN: str = .*", "FSDP_PLANNER_PLAN: str = open('x').read()", source))
    with pytest.raises(PlannerError, match="FSDP_PLANNER_PLAN is not a string literal"):
        read_config(TORCHTITAN, f"{bad}:fsdp_planner_job")
    # bound again (Python applies the last, the reader took the first: a trial's simulated another plan), or
    # elsewhere than at the top level
    for tail, says in (("\nFSDP_PLANNER_PLAN = '{}'\n", "is bound 2 times"),
                       ("\nfrom os import sep as FSDP_PLANNER_PLAN\n", "is bound 2 times"),
                       ("\ndef f():\n    global FSDP_PLANNER_PLAN\n", "is bound 2 times")):
        bad.write_text(source + tail)
        with pytest.raises(PlannerError, match=f"FSDP_PLANNER_PLAN {says}, and fsdp-planner's export binds it once"):
            read_config(TORCHTITAN, f"{bad}:fsdp_planner_job")
    bad.write_text(source + "\ndef g():\n    FSDP_PLANNER_PLAN = 1\n    return FSDP_PLANNER_PLAN\n")  # (a local)
    assert read_config(TORCHTITAN, f"{bad}:fsdp_planner_job").plan is not None
    bad.write_text(re.sub(r"FSDP_PLANNER_PLAN: str = ", "if True:\n    FSDP_PLANNER_PLAN: str = ", source))
    with pytest.raises(PlannerError, match="FSDP_PLANNER_PLAN is bound elsewhere than in one top-level assignment"):
        read_config(TORCHTITAN, f"{bad}:fsdp_planner_job")



@pytest.mark.integration  # (the debug model planned, exported and read back: a few seconds)
def test_an_exported_float8_plan_read_back_is_planned_in_float8(tmp_path, capsys):
    """A tensorwise float8 plan's export has no converter among its keys (torchtitan's converter has no
    tensorwise): its parallelize_fn converts the Linears as the plan it holds says, which the read-back simulated,
    while auto planned the job in bf16 and advised its slower plan (a torchtitan trial: 659 ms against auto's
    829 ms on llama3-8b, compiled, h100:8). Auto plans the held plan's float8: the same step."""
    from fsdp_planner.cli import main

    out, exported = tmp_path / "plan.json", tmp_path / "job.py"
    assert main(["plan", "llama3-debugmodel", "--policy", "auto", "--cluster", "h100:8", "--float8", "tensorwise",
                 "--out", str(out), "-q"]) == 0
    assert main(["export", str(out), "--format", "torchtitan", "--out", str(exported), "-q"]) == 0
    capsys.readouterr()
    assert main(["plan", "--from-torchtitan", f"{exported}:fsdp_planner_job", "--cluster", "h100:8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["float8"]["recipe"] == "tensorwise"
    assert doc["auto_step"]["step_time"] == pytest.approx(doc["config_step"]["step_time"], rel=1e-9)


def test_an_export_of_a_model_not_torchtitans_says_its_plan_is_not_applied(tmp_path, capsys):
    """The export of toy-llama's plan sets no parallelize_fn (torchtitan has no such model): read back, the job is
    torchtitan's own groups, said in a note, and the advice to export names the function to set (it went round in
    a circle: a new user's trial)."""
    from fsdp_planner.cli import main

    out, exported = tmp_path / "plan.json", tmp_path / "job.py"
    assert main(["plan", "toy-llama", "--policy", "auto", "--cluster", "h100:8", "--out", str(out)]) == 0
    assert main(["export", str(out), "--format", "torchtitan", "--out", str(exported)]) == 0
    capsys.readouterr()
    cfg = read_config(TORCHTITAN, f"{exported}:fsdp_planner_job")
    assert cfg.plan is None
    assert any(n.startswith("FSDP_PLANNER_PLAN holds an fsdp-planner plan that this job does not apply")
               for n in cfg.notes), cfg.notes
    assert main(["plan", "toy-llama", "--from-torchtitan", f"{exported}:fsdp_planner_job", "--cluster",
                 "h100:8"]) == 0
    said = capsys.readouterr()
    assert "FSDP_PLANNER_PLAN holds an fsdp-planner plan" in said.err
    assert "set the exported parallelize_fn on your model's spec" in said.out

@pytest.mark.integration  # ~20 s: the example 8B job planned, and its export read back and planned
def test_a_jobs_export_read_back_is_auto_plan_and_nothing_to_change(tmp_path, capsys):
    """A torchtitan job's auto plan was made with torchtitan's wrapper's early_stop=False, which the export's
    parallelize_fn does not use (it checkpoints as the plan says): read back, the export's job stopped early in
    auto's plan, "auto's differs", and only a second export settled. Auto now chooses early stop where its export
    applies it, and the export's job read back prints no changes table, and says nothing is to change."""
    from fsdp_planner.cli import main

    plan_file, exported = tmp_path / "plan.json", tmp_path / "job.py"
    example = Path(__file__).parents[1] / "docs" / "examples" / "llama3_8b.toml"
    assert main(["plan", "--from-torchtitan", str(example), "--out", str(plan_file), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    written = json.loads(plan_file.read_text())
    assert written["activation_checkpointing"] or written.get("selective_checkpointing")
    assert written.get("checkpoint_early_stop", True) is True  # (the job's own edits run torchtitan's wrapper)
    assert main(["export", str(plan_file), "--format", "torchtitan", "--out", str(exported), "-q"]) == 0
    assert main(["plan", "--from-torchtitan", f"{exported}:fsdp_planner_job", "--json"]) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["config_step"]["step_time"] == back["auto_step"]["step_time"] == doc["auto_step"]["step_time"]
    assert back["changes"] == [] and back["plan"] == doc["plan"] | {"policy": back["plan"]["policy"]}
    assert main(["plan", "--from-torchtitan", f"{exported}:fsdp_planner_job"]) == 0
    out = capsys.readouterr().out
    assert "config keys auto would change" not in out and "auto's plan for this job, nothing to change" in out


@pytest.mark.integration
def test_a_graphed_job_s_export_keeps_the_graphs_its_plan_was_simulated_with(tmp_path, capsys):
    """A registry job replays its step as a CUDA graph (TrainingConfig's default), so auto's plan is simulated with
    the grads kept all step; the export turned the graphs off, and read back, the eager job held less and auto
    changed the plan (a trial: 70.6 GiB planned, 70.3 GiB read back, another checkpointing). The plan file records
    ``zero_grad``, the export keeps the graphs, and read back the job is the plan, nothing to change."""
    from fsdp_planner.cli import main

    plan_file, exported = tmp_path / "plan.json", tmp_path / "job.py"
    assert main(["plan", "--from-torchtitan", job("llama3_8b"), "--cluster", "h100:8", "--out", str(plan_file),
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert json.loads(plan_file.read_text())["zero_grad"] == "zeros"
    assert main(["export", str(plan_file), "--format", "torchtitan", "--out", str(exported), "-q"]) == 0
    assert "config.training.disable_cuda_graphs = False" in exported.read_text()
    assert main(["plan", "--from-torchtitan", f"{exported}:fsdp_planner_job", "--json"]) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["config_step"]["step_time"] == back["auto_step"]["step_time"] == doc["auto_step"]["step_time"]
    assert back["changes"] == []
    # the plan file run without the job's zero_grad: said, with the flag that gives the planned figures
    assert main(["simulate", "llama3-8b", "--plan", str(plan_file), "--cluster", "h100:8", "--json"]) == 0
    assert "the plan was made with --zero-grad zeros and this command runs none: add --zero-grad zeros" in \
        capsys.readouterr().err


TITAN_FIELDS = json.loads((Path(__file__).parent / "fixtures" / "torchtitan" / "config_fields.json").read_text())
FLAG_SECTIONS = {"training": "TrainingConfig", "parallelism": "ParallelismConfig", "compile": "CompileConfig"}


@pytest.mark.parametrize(("tp", "float8", "compiled", "model"), [
    (TensorParallel(2, {}, loss_parallel=False, async_tp=True), Float8(), [], "llama3-8b"),  # eager async TP
    (TensorParallel(8, {}, async_tp=True), Float8.named("rowwise"), ["layers.0", "layers.1"], "llama3-405b"),
    (None, Float8(), ["layers.0"], "hf:titan-qwen3-debugmodel-moe"),
    (None, None, [], "toy-gpt2"),  # no torchtitan model: a Trainer.Config of the plan's settings
])
def test_the_torchtitan_export_passes_only_fields_torchtitan_has(tmp_path, tp, float8, compiled, model):
    """Every keyword fsdp_planner_job() passes, every field it sets on the job it builds on and every flag it lists
    is a field of torchtitan's dataclasses at b5bcd76 (it passed disable_loss_parallel and
    enable_async_tensor_parallel to ParallelismConfig, and a tensorwise Float8LinearConverter.Config with FSDP's
    float8 all-gather: TypeError there), and the job it builds on is one of torchtitan's registry's; what no field
    says is noted."""
    plan = Plan(fingerprint="", numel=2, model=model, groups=[Group(modules=["layers.0"], params=[]),
                                                              Group(modules=[""], params=[])],
                tensor_parallel=tp, float8=float8, compiled=compiled, optimizer="adamw-fused",
                selective_checkpointing={"layers.0": SacPolicy.TITAN}, workload=Workload(2, 4096))
    path, flags = exported(tmp_path, plan)
    job = next(n for n in ast.parse(path.read_text()).body if getattr(n, "name", "") == "fsdp_planner_job")
    jobs = {f for functions in TITAN_FIELDS["registry_jobs"].values() for f in functions}
    for call in (n for n in ast.walk(job) if isinstance(n, ast.Call)):
        name = ast.unparse(call.func)
        if name in jobs:  # the job it builds on, called as torchtitan's registry calls it
            assert not call.args and not call.keywords
            continue
        assert name in TITAN_FIELDS, name
        for k in call.keywords:
            assert k.arg in TITAN_FIELDS[name], f"{name}({k.arg}=...)"
            allowed = TITAN_FIELDS["literals"].get(f"{name}.{k.arg}")
            assert allowed is None or ast.literal_eval(k.value) in allowed, ast.unparse(k)
    for stmt in (n for n in job.body if isinstance(n, ast.Assign)):
        path_ = ast.unparse(stmt.targets[0]).split(".")
        if path_ == ["config"]:  # the job it builds on (above)
            continue
        assert path_[0] == "config" and path_[1] in TITAN_FIELDS["Trainer.Config"], path_
        if len(path_) == 3 and path_[1] != "model_spec":
            cls = {**FLAG_SECTIONS, "optimizer": "OptimizersContainer.Config"}[path_[1]]
            assert path_[2] in TITAN_FIELDS[cls], path_
            allowed = TITAN_FIELDS["literals"].get(f"{cls}.{path_[2]}")
            assert allowed is None or ast.literal_eval(stmt.value) in allowed, ast.unparse(stmt)
    for flag in flags:
        if flag.startswith("--"):
            section, _, key = flag[2:].partition(".")
            cls = {**FLAG_SECTIONS, "optimizer": "OptimizersContainer.Config"}[section]
            assert key in TITAN_FIELDS[cls] or (key.startswith("no_") and key[3:] in TITAN_FIELDS[cls]), flag
    source = path.read_text()
    assert ("Float8LinearConverter.Config(recipe_name='rowwise'" in source) == (
        float8 is not None and float8.recipe.value == "rowwise")
    assert ("enable_async_tensor_parallel=True" in source) == bool(tp and compiled)
    cfg = read_config(TORCHTITAN, f"{path}:fsdp_planner_job")
    assert (cfg.tp, cfg.async_tp, cfg.optimizer) == (tp.degree if tp else 1, bool(tp and compiled), "adamw-fused")
    if model != "toy-gpt2":
        assert cfg.float8 == ("rowwise" if float8.recipe.value == "rowwise" else None)


def test_an_option_that_contradicts_a_registry_job_names_its_key():
    with pytest.raises(PlannerError, match=r"--seq 4096 contradicts training.max_context_length in torchtitan config"):
        options(job("llama3_8b"), "--seq", "4096")
    with pytest.raises(PlannerError, match=r"--batch 4 contradicts training.num_tokens_per_microbatch_per_dp_rank"):
        options(job("llama3_8b"), "--batch", "4")
    # the error says how the job's own flags set it (fit's batch replayed so), and they do
    with pytest.raises(PlannerError) as refused:
        options(job("llama3_8b"), "--batch", "4")
    override = str(refused.value).partition("or set the job's own: -- ")[2].split()
    assert override == ["--training.num_tokens_per_microbatch_per_dp_rank", str(4 * 8192)], str(refused.value)
    assert options(job("llama3_8b"), flags=tuple(override))[0]["batch"] == 4


@pytest.mark.integration  # (two plans of the Llama 3 8B job: a few seconds)
def test_the_8b_registry_job_plans_as_its_toml(capsys):
    """`plan --json` of the registry job and of its TOML: the same document but for the config's path and how each
    form spells the checkpointing (a class, a mode). Auto without its refinement (``--search-effort 0``): the
    comparison is of the two jobs read, not of the search."""
    out = []
    for spec, more in ((job("llama3_8b"), ["--", "--training.disable_cuda_graphs"]),
                       (str(FIXTURES / "llama3_8b.toml"), ["--loss-chunks", "8"])):
        # (the registry's job computes its loss in 8 chunks, which its TOML of 2025 cannot say: given to it; and
        # replays its step as a CUDA graph, which the TOML's job did not: turned off)
        assert main(["plan", "--from-torchtitan", spec, "--cluster", "h100", "--json", "--search-effort", "0",
                     *more]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["config"].pop("path") == spec
        document["config"]["notes"] = unchunked(document["config"]["notes"])
        out.append(document)
    ac = [c for c in out[0]["changes"] if c["key"].startswith("activation_checkpoint")]
    assert [(c["key"], c["config"]) for c in ac] == [("activation_checkpoint", "SelectiveAC.Config()")]
    for document in out:
        for changes in (document["changes"], (document["best_edit"] or {}).get("changes", [])):
            for c in changes:
                if c["key"].startswith("activation_checkpoint"):
                    c.update(key="activation_checkpoint", config="", auto=c["auto"] if "per block" in c["auto"] else "")
    assert out[0] == out[1]
    assert out[0]["model"] == "llama3-8b" and out[0]["cluster"] == "h100:8"


def test_full_bf16_training_is_pure_bf16(tmp_path):
    """training.dtype = "bfloat16" (no fp32 copy of anything), from the registry and from a TOML alike."""
    registry = read_config(TORCHTITAN, job("llama3_8b"), ["--training.dtype", "bfloat16"])
    toml = read_config(TORCHTITAN, str(FIXTURES / "llama3_8b.toml"), ["--training.dtype", "bfloat16"])
    same_job(registry, toml)
    assert registry.precision == "pure-bf16" and unchunked(registry.notes)[0].startswith("training.dtype = bfloat16")
    assert read_config(TORCHTITAN, job("llama3_8b"), ["--training.dtype", "float32"]).precision == "bf16-mixed"
    # FSDP2 reduces the bf16 grads in mixed_precision_reduce, float32 by default (its MixedPrecisionPolicy keeps a
    # reduce dtype other than the param dtype): the reduction was simulated in bf16, half the job's bytes (a new
    # user's trial)
    assert registry.reduce_dtype == "fp32" and "the gradient reduction in fp32" in unchunked(registry.notes)[0]
    bf16 = read_config(TORCHTITAN, job("llama3_8b"), ["--training.dtype", "bfloat16",
                                                      "--training.mixed_precision_reduce", "bfloat16"])
    assert bf16.reduce_dtype is None and "the gradient reduction in bf16" in unchunked(bf16.notes)[0]


def test_a_value_nested_too_deeply_is_one_line(tmp_path):
    path = tmp_path / "config_registry.py"
    path.write_text(REGISTRY_HEAD + "        training=TrainingConfig(steps=" + "1 + " * 5000 + "1),\n    )\n")
    with pytest.raises(PlannerError, match=r"^torchtitan job '.*:job': .*nests? too deeply to (parse|read)$"):
        read_config(TORCHTITAN, f"{path}:job")


def test_the_export_of_a_pure_bf16_plan_reads_back_as_pure_bf16(tmp_path):
    plan = Plan(fingerprint="", numel=2, model="llama3-8b", groups=[Group(modules=[""], params=[])],
                workload=Workload(1, 8192))
    path = tmp_path / "titan_plan.py"
    path.write_text(export_plan(plan, ExportFormat.TORCHTITAN, PRECISIONS["pure-bf16"]))
    assert read_config(TORCHTITAN, f"{path}:fsdp_planner_job").precision == "pure-bf16"


def test_keys_of_the_current_dataclasses(tmp_path):
    """A key the TOML never had: read past (an option of a parallelism whose degree is noted) or one note; a key
    torchtitan does not have: the TOML reader's note."""
    cfg = read_config(TORCHTITAN, job("llama3_8b"), [
        "--parallelism.enable_fsdp_symm_mem", "--parallelism.spmd_backend", "partial_dtensor",
        "--parallelism.num_pp_microbatches", "4", "--training.disable_cuda_graphs", "--parallelism.typo_degree", "2"])
    assert unchunked(cfg.notes) == [
        "parallelism.enable_fsdp_symm_mem = true is left out: fsdp-planner models FSDP2's NCCL collectives, not "
        "symmetric-memory ones",
        "parallelism.typo_degree is not read: fsdp-planner does not know it"]
    # a letter from a key torchtitan has (its dataclass would raise TypeError): the degree would stay at 1
    with pytest.raises(PlannerError, match=re.escape("parallelism.tensor_paralel_degree is not a key of "
                                                     "[parallelism] (did you mean tensor_parallel_degree?)")):
        read_config(TORCHTITAN, job("llama3_8b"), ["--parallelism.tensor_paralel_degree", "8"])


def test_a_registry_job_without_a_model_names_model_registry_not_the_toml_table(tmp_path):
    path = tmp_path / "config_registry.py"
    path.write_text(REGISTRY_HEAD.replace('model_registry("8B")', "build_spec()") + "    )\n")
    args = build_parser().parse_args(["simulate", "--from-torchtitan", f"{path}:job"])
    with pytest.raises(PlannerError, match=r"names no model \(model_spec = model_registry\(FLAVOR\)\): give MODEL"):
        configured(args)


@pytest.mark.parametrize(("body", "flags", "optimizer", "notes"), [
    ("optimizer=default_adamw(lr=3e-4),", (), "adamw-fused", []),  # OptimizersContainer.Config's "fused"
    ("optimizer=OptimizersContainer.Config(implementation='foreach', param_groups=[ParamGroupConfig(pattern='.*', "
     "optimizer_name='Adam')]),", (), "adam", []),
    ("optimizer=default_adamw(lr=3e-4),", ("--optimizer.implementation", "foreach"), "adamw", []),
    ("", ("--optimizer.implementation", "for-loop"), "adamw", ["simulated as foreach"]),
    ("optimizer=default_adamw(lr=3e-4, fused=False, foreach=True),", (), "adamw", []),  # a group's own keywords
    ("optimizer=OptimizersContainer.Config(param_groups=make_groups()),", (), "adamw-fused",
     ["param_groups = make_groups(...) is not read (not a list)"]),
    ("optimizer=OptimizersContainer.Config(param_groups=[ParamGroupConfig(optimizer_name='Muon'), "
     "ParamGroupConfig(optimizer_name='AdamW')]),", (), "adamw-fused",
     ["param groups run \"Muon\", \"AdamW\": simulated as the first's", "\"Muon\" is simulated as AdamW"]),
])
def test_the_optimizer_and_its_implementation(tmp_path, body, flags, optimizer, notes):
    """torchtitan's optimizer container: fused unless the job says otherwise (``implementation``), its param
    groups' optimizer; what is simulated otherwise, a note each."""
    path = tmp_path / "config_registry.py"
    path.write_text(REGISTRY_HEAD + (f"        {body}\n" if body else "") + "    )\n")
    cfg = read_config(TORCHTITAN, f"{path}:job", list(flags))
    assert cfg.optimizer == optimizer
    assert len(cfg.notes) == len(notes) and all(n in line for n, line in zip(notes, cfg.notes, strict=True))
    shown, _ = options(f"{path}:job", "toy-llama", flags=flags)
    assert shown["optimizer"] == optimizer


def test_an_optimizer_implementation_that_is_not_a_literal_is_one_line(tmp_path):
    path = tmp_path / "config_registry.py"
    path.write_text(REGISTRY_HEAD + "        optimizer=OptimizersContainer.Config(implementation=IMPL),\n    )\n")
    with pytest.raises(PlannerError, match=re.escape("optimizer.implementation = IMPL is not a literal")):
        read_config(TORCHTITAN, f"{path}:job")
    cfg = read_config(TORCHTITAN, f"{path}:job", ["--optimizer.implementation", "foreach"])
    assert cfg.optimizer == "adamw"


STATEMENTS_HEAD = """from torchtitan.config import ParallelismConfig
from torchtitan.trainer import Trainer


def job() -> Trainer.Config:
"""


@pytest.mark.parametrize(("body", "says"), [
    # each was read without a word, the job planned without what it sets
    ("    par = dict(tensor_parallel_degree=2)\n    return Trainer.Config(model_spec=model_registry('8B'), "
     "parallelism=ParallelismConfig(**par))\n", "ParallelismConfig(...) takes **par, which the reader does not expand"),
    # a helper of the file taking **kwargs: its call was said not to match its parameters (a new user's trial)
    ("    return base(tensor_parallel_degree=2)\n\n\ndef base(**par) -> Trainer.Config:\n"
     "    return Trainer.Config(model_spec=model_registry('8B'), parallelism=ParallelismConfig(**par))\n",
     "base takes **par, which the reader does not expand without running the file: give it parameters of their own"),
    ("    par = ParallelismConfig(data_parallel_shard_degree=4)\n    par.tensor_parallel_degree = 2\n"
     "    return Trainer.Config(model_spec=model_registry('8B'), parallelism=par)\n",
     "par.tensor_parallel_degree is set after par is made"),
    ("    config = Trainer.Config(model_spec=model_registry('8B'))\n    config.parallelism.tensor_parallel_degree *= 2"
     "\n    return config\n", "changes a value in place"),
    ("    seq = 4096\n    config = Trainer.Config(model_spec=model_registry('8B'), "
     "training=TrainingConfig(max_context_length=seq))\n    seq = 8192\n    return config\n", "assigns seq again"),
])
def test_statements_the_reader_cannot_follow_are_one_line(tmp_path, body, says):
    _refused(tmp_path, STATEMENTS_HEAD + body, re.escape(says))


def test_setattr_is_read_as_the_assignment_it_makes(tmp_path):
    path = tmp_path / "config_registry.py"
    path.write_text(STATEMENTS_HEAD + "    config = Trainer.Config(model_spec=model_registry('8B'))\n"
                    "    setattr(config.parallelism, 'tensor_parallel_degree', 2)\n    return config\n")
    assert read_config(TORCHTITAN, f"{path}:job").tp == 2


CONSTANTS_HEAD = """from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

SEQ_LEN = 8192
LOCAL_BATCH: int = 2
FLAVOR = "70B"
"""


def test_module_level_constants_are_read_where_a_job_names_them(tmp_path):
    # the trial's registry (constants above the functions) was refused as "SEQ_LEN is not a literal"
    path = tmp_path / "config_registry.py"
    path.write_text(CONSTANTS_HEAD + "TP = 4 * 2\n\n\ndef job() -> Trainer.Config:\n    return Trainer.Config(\n"
                    "        model_spec=model_registry(FLAVOR),\n        training=TrainingConfig(max_context_length="
                    "SEQ_LEN, num_tokens_per_microbatch_per_dp_rank=LOCAL_BATCH * SEQ_LEN),\n"
                    "        parallelism=ParallelismConfig(tensor_parallel_degree=TP),\n    )\n\n\n"
                    "def short() -> Trainer.Config:\n    SEQ_LEN = 4096\n    return Trainer.Config(model_spec="
                    "model_registry(FLAVOR), training=TrainingConfig(max_context_length=SEQ_LEN, "
                    "num_tokens_per_microbatch_per_dp_rank=SEQ_LEN))\n")
    cfg = read_config(TORCHTITAN, f"{path}:job")
    assert (cfg.seq, cfg.batch, cfg.tp, cfg.notes) == (8192, 2, 8, [])
    assert '"70B"' in cfg.model_label
    cfg = read_config(TORCHTITAN, f"{path}:short")  # a local hides the constant of its name
    assert (cfg.seq, cfg.batch) == (4096, 1)
    # a negated name is arithmetic as a product of it is (it was "not a literal"; -1 as a literal always read)
    path.write_text(CONSTANTS_HEAD + "\n\ndef job() -> Trainer.Config:\n    return Trainer.Config(model_spec="
                    "model_registry(FLAVOR), training=TrainingConfig(max_context_length=-(-SEQ_LEN)))\n")
    assert read_config(TORCHTITAN, f"{path}:job").seq == 8192
    # a product past 10**18 is a number the job's checks judge as they judge the literal (it was "not a literal")
    path.write_text(CONSTANTS_HEAD + "\n\ndef job() -> Trainer.Config:\n    return Trainer.Config(model_spec="
                    "model_registry(FLAVOR), training=TrainingConfig(max_context_length=SEQ_LEN * 10**30))\n")
    with pytest.raises(PlannerError, match=r"max_context_length = 8192000000000000000000000000000000 is not a whole "
                                           r"number from 1 to 10,000,000"):
        read_config(TORCHTITAN, f"{path}:job")
    with pytest.raises(PlannerError, match=r"no function jbo \(its functions, closest first: job\)"):
        read_config(TORCHTITAN, f"{path}:jbo")


@pytest.mark.parametrize("defined", [
    "SEQ_LEN_2 = 1\nSEQ_LEN_2 = 4096\n",  # assigned twice: which one a job reads needs running the file
    "if True:\n    SEQ_LEN_2 = 4096\n",
    "SEQ_LEN_2 = 4096\nfor SEQ_LEN_2 in range(2):\n    pass\n",
    "SEQ_LEN_2 = 4096\n\n\ndef grow():\n    global SEQ_LEN_2\n    SEQ_LEN_2 = 1\n",
    "SEQ_LEN_2 = OTHER\nOTHER = SEQ_LEN_2\n",  # a cycle: bounded, then not a literal
])
def test_a_module_name_whose_value_needs_running_the_file_is_one_line(tmp_path, defined):
    _refused(tmp_path, CONSTANTS_HEAD + defined + "\n\ndef job() -> Trainer.Config:\n    return Trainer.Config("
             "model_spec=model_registry(FLAVOR), training=TrainingConfig(max_context_length=SEQ_LEN_2))\n",
             r"training\.max_context_length = (SEQ_LEN_2|OTHER) is not a literal")


FORMS_HEAD = """from dataclasses import dataclass
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

SPECIAL_TOKENS = {"bos": "<s>"}


@dataclass(kw_only=True)
class _MyTrainerConfig(Trainer.Config):
    pass


def _base(tp: int, seq: int = 4096, *, flavor: str = "70B") -> Trainer.Config:
    return _MyTrainerConfig(
        model_spec=model_registry(flavor),
        tokenizer=MultiModalTokenizer.Config(**SPECIAL_TOKENS),
        training=TrainingConfig(max_context_length=seq, num_tokens_per_microbatch_per_dp_rank=2 * seq),
        parallelism=ParallelismConfig(tensor_parallel_degree=tp),
    )
"""


@pytest.mark.parametrize(("body", "read"), [
    ("    return _base(8)\n", (4096, 2, 8, '"70B"')),  # a default, a model's own trainer config
    ("    return _base(4, seq=8192, flavor='8B')\n", (8192, 2, 4, '"8B"')),
    ("    return Trainer.Config(model_spec=model_registry(flavor='8B'), training=TrainingConfig("
     "max_context_length=2 ** 12, num_tokens_per_microbatch_per_dp_rank=2 ** 14))\n", (4096, 4, 1, '"8B"')),
    ("    config = _base(8)\n    config.compile = CompileConfig(enable=True, components=['loss'])\n    return config\n",
     (4096, 2, 8, '"70B"')),  # deepseek_v3_671b's: the model eager (tests/test_job_config.py)
    ("    config = _base(8)\n    config.compile = CompileConfig(enable=True, components=('loss',))\n"
     "    return config\n", (4096, 2, 8, '"70B"')),  # a tuple, as Python runs it (a trial's: refused as no list)
    ("    config = _base(2, 2048)\n    config.training.max_context_length = 1024\n    return config\n",
     (1024, 4, 2, '"70B"')),  # the edit after the call: the tokens stay 2 x 2048
])
def test_the_forms_torchtitan_s_2026_registries_use(tmp_path, body, read):
    """Read from torchtitan's own registries (gpt_oss, kimi_k2_7, qwen3_5 at b5bcd76 were refused): a job
    function called with arguments, a class of the file on Trainer.Config, ``**`` in a key that is not read."""
    path = tmp_path / "config_registry.py"
    path.write_text(FORMS_HEAD + "\n\ndef job() -> Trainer.Config:\n" + body)
    cfg = read_config(TORCHTITAN, f"{path}:job")
    assert (cfg.seq, cfg.batch, cfg.tp) == read[:3] and read[3] in cfg.model_label and not cfg.compile


@pytest.mark.parametrize(("body", "says"), [
    ("    return _base()\n", "_base's parameter tp has no default and no argument"),
    ("    return _base(2, 3, 4)\n", "_base(2, 3, 4) does not match _base's parameters"),
    ("    return _base(2, other=1)\n", "_base(2, other=1) does not match _base's parameters"),
    ("    return _base(steps())\n", "parallelism.tensor_parallel_degree = steps(...) is not a literal"),
])
def test_a_job_called_with_arguments_it_cannot_bind_is_one_line(tmp_path, body, says):
    _refused(tmp_path, FORMS_HEAD + "\n\ndef job() -> Trainer.Config:\n" + body, re.escape(says))


def test_model_registry_imported_under_other_names_is_read_as_its_model(tmp_path):
    """A file of several models imports each model_registry under its own name (a new user's trial: "not read"),
    and a keyword at the model's own default (gpt_oss's attn_backend "varlen") is read past without a note."""
    path = tmp_path / "jobs.py"
    path.write_text("from torchtitan.models.llama3 import model_registry as llama_registry\n"
                    "from torchtitan.models.gpt_oss import model_registry as oss_registry\n"
                    "from torchtitan.trainer import Trainer\n\n\n"
                    "def llama() -> Trainer.Config:\n    return Trainer.Config(model_spec=llama_registry('8B'))\n\n\n"
                    "def oss() -> Trainer.Config:\n    return Trainer.Config(model_spec=oss_registry('debugmodel', "
                    "attn_backend='varlen', moe_comm_backend='standard'))\n")
    llama, oss = read_config(TORCHTITAN, f"{path}:llama"), read_config(TORCHTITAN, f"{path}:oss")
    assert llama.model == "llama3-8b" and oss.model == "hf:titan-gpt-oss-debugmodel"
    # a relative import names its model (not the file's folder), and a name imported twice is the last import's
    path.write_text("from ..gpt_oss import model_registry as r\nfrom ..llama3 import model_registry as r\n"
                    "from torchtitan.trainer import Trainer\n\n\n"
                    "def llama() -> Trainer.Config:\n    return Trainer.Config(model_spec=r('8B'))\n")
    assert read_config(TORCHTITAN, f"{path}:llama").model == "llama3-8b"
    assert not any("model_registry" in n or "model_spec" in n for n in (*llama.notes, *oss.notes))


def test_a_registry_job_s_expert_tensor_parallel_degree_is_refused(tmp_path):
    """torchtitan's ParallelismConfig has no expert_tensor_parallel_degree since April 2026 (c4b409a): a
    registry job setting it would be refused by torchtitan (read past in silence before: a new user's trial)."""
    _refused(tmp_path, FORMS_HEAD + "\n\ndef job() -> Trainer.Config:\n    return Trainer.Config(model_spec="
             "model_registry('8B'), parallelism=ParallelismConfig(expert_tensor_parallel_degree=1))\n",
             "ParallelismConfig no longer has")


HELPERS = """

def _tune(config, degree=2):
    config.parallelism.tensor_parallel_degree = degree


def _kernels(config):
    for name in ("a.b", "c.d"):
        config.override.imports.append(name)


def _both(config):
    _kernels(config)
    _tune(config)


def _aliased(config):
    p = config.parallelism
    p.tensor_parallel_degree = 2
"""


@pytest.mark.parametrize(("body", "says"), [
    ("    config = _base(1)\n    for k, v in {'tensor_parallel_degree': 2}.items():\n"
     "        setattr(config.parallelism, k, v)\n    return config\n", r"\(for\) calls setattr\(config"),
    ("    config = _base(1)\n    _tune(config)\n    return config\n", r"\(_tune\(config\)\) hands config to a call"),
    ("    config = _base(1)\n    _both(config=config)\n    return config\n", "hands config to a call"),
    ("    config = _base(1)\n    config.parallelism.__init__(tensor_parallel_degree=2)\n    return config\n",
     "hands config.parallelism to a call"),
    ("    config = _base(1)\n    _aliased(config)\n    return config\n", "hands config to a call"),
])
def test_a_change_the_reader_does_not_run_is_refused(tmp_path, body, says):
    """A job changed by a loop or by a helper of the file the reader does not run would be simulated as another
    job (a new user's trial: TP 2 set so planned TP 1, with a note): one line; a helper that changes only what no
    step reads (torchtitan's ``enable_fused_swiglu``: kernel overrides) and a log line are read past."""
    _refused(tmp_path, FORMS_HEAD + HELPERS + "\n\ndef job() -> Trainer.Config:\n" + body, says)
    path = tmp_path / "config_registry.py"
    path.write_text(FORMS_HEAD + HELPERS + "\n\ndef job() -> Trainer.Config:\n    config = _base(4)\n"
                    "    _kernels(config)\n    print(config)\n    config.validate()\n    log.info(config)\n"
                    "    replace(config, steps=1)\n    if not isinstance(config, list):\n        print(len(config))\n"
                    "    for k in sorted(SPECIAL_TOKENS):\n        print(k)\n    return config\n")
    cfg = read_config(TORCHTITAN, f"{path}:job")  # (calls that only read: the review's, refused before)
    assert cfg.tp == 4 and sum("is not run" in n for n in cfg.notes) == 5


@pytest.mark.parametrize(("spec", "read"), [
    # (model, seq, batch, tp, ep, compile) as each job of torchtitan's 2026 registries (b5bcd76) sets them
    ("deepseek_v3/config_registry.py:deepseek_v3_671b", ("hf:deepseek-v3", 4096, 4, 1, 2, False)),
    ("deepseek_v3/config_registry.py:deepseek_v3_16b", ("hf:titan-deepseek-v3-16b", 4096, 4, 1, 8, False)),
    # a job with arguments
    ("gpt_oss/config_registry.py:gpt_oss_debugmodel_flex", ("hf:titan-gpt-oss-debugmodel", 2048, 8, 1, 1, False)),
    ("kimi_k2_7/config_registry.py:kimi_k2_5", (None, 4096, 4, 1, 8, False)),  # its own Trainer.Config subclass
    ("qwen3_5/config_registry.py:qwen35_397b_a17b", (None, 4096, 4, 8, 16, False)),  # a tokenizer's **TOKENS
])
def test_torchtitan_s_other_models_registries_read(spec, read):
    """Every job of torchtitan's llama3, deepseek_v3, gpt_oss, kimi_k2_7 and qwen3_5 registries is read or refused
    in one line; these were refused (a job called with arguments, a subclass of Trainer.Config, ** in a key no
    step reads) or misread (compile.components of the loss alone compiled every block)."""
    cfg = read_config(TORCHTITAN, str(FIXTURES / spec))
    assert (cfg.model, cfg.seq, cfg.batch, cfg.tp, cfg.ep, cfg.compile) == read
    if spec.endswith("deepseek_v3_671b"):
        assert any("compile.components = [\"loss\"] compiles no part of the model" in n for n in cfg.notes)


def test_a_plan_file_from_a_job_says_what_simulate_needs_to_run_it(tmp_path, capsys):
    """The plan file holds the sharding: the job's workload and optimizer (torchtitan's fused AdamW) must be given
    to simulate again, which the line that writes it says (without --optimizer adamw-fused the step read 502 ms
    against the plan's 482: a new user's finding)."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--from-torchtitan", job("llama3_debugmodel"), "--cluster", "h100:8", "--out", str(out),
                 "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)["auto_step"]
    assert main(["plan", "--from-torchtitan", job("llama3_debugmodel"), "--cluster", "h100:8", "--out", str(out)]) == 0
    written = capsys.readouterr().out.strip().splitlines()[-1]
    model, *flags = written.partition("(simulated with ")[2].partition(": give simulate and verify")[0].split()
    # (the model too: the user named the job, not the model; the line left it out, a new user's finding)
    assert [model, *flags] == ["llama3-debugmodel", "--batch", "8", "--seq", "2048", "--optimizer", "adamw-fused",
                               "--loss-chunks", "8"]
    assert main(["simulate", model, "--plan", str(out), "--cluster", "h100:8", *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time"] == auto["step_time"]


@pytest.mark.parametrize(("flag", "meant"), [("--training.max_context_lenght", "max_context_length"),
                                             ("--training.num_tokens_per_microbatch_per_dp_rnk",
                                              "num_tokens_per_microbatch_per_dp_rank")])
def test_a_typo_of_a_registry_key_is_one_error(flag, meant):
    """A misspelt registry-only key was a note and the job ran at the key's default (a new user's finding): its
    close match among the registry's own keys is named, not a TOML key the registry refuses."""
    with pytest.raises(PlannerError, match=re.escape(f"is not a key of [training] (did you mean {meant}?)")):
        options(job("llama3_8b"), flags=(flag, "4096"))


def test_sequence_parallel_off_under_tp_is_refused_and_another_compile_backend_noted():
    """SP off was a note and the job simulated with SP: a TP job holding each block's activations whole on every
    TP rank was said to fit at the SP job's memory (a new user's finding). Without TP it changes nothing."""
    _, cfg = options(job("llama3_8b"), flags=("--parallelism.enable_sequence_parallel", "false",
                                              "--compile.backend", "aot_eager"))
    assert cfg.tp == 1 and not any("sequence" in n for n in unchunked(cfg.notes)), cfg.notes
    assert any('compile.backend = "aot_eager" is left out' in n for n in cfg.notes), cfg.notes
    with pytest.raises(PlannerError, match=r"sets parallelism\.enable_sequence_parallel = false: fsdp-planner models "
                                           r"torchtitan's TP with sequence parallelism only .* \(set it to true\)$"):
        options(job("llama3_8b"), flags=("--parallelism.enable_sequence_parallel", "false",
                                         "--parallelism.tensor_parallel_degree", "2"))


def test_a_registry_job_s_global_batch_that_does_not_divide_is_said_in_its_tokens():
    """The error named the TOML's keys and counted sequences for a job that counts tokens (a new user's finding)."""
    with pytest.raises(PlannerError, match=r"training\.num_tokens_per_train_step = 32,768 is not a multiple of "
                                           r"training\.num_tokens_per_microbatch_per_dp_rank \(8,192\) x the 8 "
                                           r"data-parallel GPUs"):
        options(job("llama3_8b"), flags=("--training.num_tokens_per_train_step", "32768"))


@pytest.mark.parametrize(("extra", "workload", "says"), [
    ((), (8, 2048), "simulated here (--batch and --seq replace them)"),
    (("--seq", "4096"), (8, 4096), "simulated here; --seq 4,096 in place of its 2,048"),
    (("--batch", "2", "--seq", "4096"), (2, 4096), None),
])
def test_a_job_without_token_counts_runs_training_config_s_defaults(tmp_path, capsys, extra, workload, says):
    """torchtitan runs TrainingConfig's 16,384 tokens of 2,048 a micro-batch for a job that gives no token counts
    (it was simulated at the model's own default, the 8B's 1 x 8,192): a soft default that --batch and --seq
    replace without the contradiction a job's own counts would be."""
    path = tmp_path / "config_registry.py"
    path.write_text("from torchtitan.models.llama3 import model_registry\nfrom torchtitan.trainer import Trainer\n\n\n"
                    "def job() -> Trainer.Config:\n    return Trainer.Config(model_spec=model_registry('8B'))\n")
    shown, _ = options(f"{path}:job", *extra)
    assert (shown["batch"], shown["seq"]) == workload
    err = capsys.readouterr().err
    assert (says in err) if says else "gives no token counts" not in err, err


CNN = """import torch
import torch.nn as nn


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return x + torch.relu(self.conv(x))


def build(batch_size: int = 4):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), ConvBlock(), ConvBlock(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    return model, (torch.randn(batch_size, 3, 8, 8),)
"""


@pytest.mark.parametrize(("training", "workload", "says"), [
    ("", (None, None), "gives no token counts, and the model {cnn} takes no sequence: torchtitan's default counts "
                       "do not apply, simulated at its factory's batch"),
    ("training=TrainingConfig(num_tokens_per_microbatch_per_dp_rank=8192, max_context_length=2048)", None,
     "the torchtitan job '{job}' counts its micro-batch in tokens, in sequences of 2,048 "
     "(training.max_context_length), and the model {cnn} takes no sequence"),
], ids=["no-token-counts", "token-counts"])
def test_a_job_s_token_counts_are_not_a_sequence_for_a_model_without_one(tmp_path, capsys, training, workload, says):
    """A job (an export's of a CNN's plan: it gives no token counts) read for a model that takes no sequence:
    torchtitan's default counts were passed as its sequence, "--seq does not apply" to an option the user never
    gave; now its factory's batch is simulated, with a note, and a job's own counts are refused as the job's."""
    cnn, path = tmp_path / "cnn.py", tmp_path / "config_registry.py"
    cnn.write_text(CNN)
    path.write_text("from torchtitan.config import TrainingConfig\nfrom torchtitan.trainer import Trainer\n\n\n"
                    f"def job() -> Trainer.Config:\n    return Trainer.Config({training})\n")
    said = says.format(cnn=f"{cnn}:build", job=f"{path}:job")
    if workload is None:
        with pytest.raises(PlannerError, match=re.escape(said)):
            options(f"{path}:job", f"{cnn}:build")
        return
    shown, _ = options(f"{path}:job", f"{cnn}:build")
    assert (shown["batch"], shown["seq"]) == workload
    assert said in capsys.readouterr().err
    assert main(["simulate", f"{cnn}:build", "--from-torchtitan", f"{path}:job", "--cluster", "h100:2"]) == 0


def test_a_token_count_left_out_beside_one_given_is_training_config_s_default_and_said(tmp_path):
    """torchtitan fills in TrainingConfig's defaults for the counts a job leaves out; the step's count alone was
    refused, a length alone or a micro-batch alone took the defaults without a word."""
    path = tmp_path / "config_registry.py"
    for body, workload, says in (
            ("num_tokens_per_train_step=65536", (8, 2048, 32), "training.num_tokens_per_microbatch_per_dp_rank and "
             "training.max_context_length are not given: TrainingConfig's defaults, 16,384 and 2,048"),
            ("max_context_length=8192", (2, 8192, None), "training.num_tokens_per_microbatch_per_dp_rank is not "
             "given: TrainingConfig's default, 16,384"),
            ("num_tokens_per_microbatch_per_dp_rank=4096", (2, 2048, None), "training.max_context_length is not "
             "given: TrainingConfig's default, 2,048")):
        path.write_text(REGISTRY_HEAD + f"        training=TrainingConfig({body}),\n    )\n")
        cfg = read_config(TORCHTITAN, f"{path}:job")
        assert (cfg.batch, cfg.seq, cfg.global_batch) == workload
        assert any(says in n for n in cfg.notes), cfg.notes


def test_an_ep_plan_s_torchtitan_job_runs_torchtitan_s_parallelize(tmp_path):
    """A trial's findings with torchtitan b5bcd76's own launcher: an EP plan's job set parallelize_fn, which refuses
    EP on torchtitan's own MoE model at startup, and left CUDA graphs on, which Trainer.Config refuses with EP's
    all-to-all dispatcher ("CUDA graphs support only expert parallel token dispatcher configurations without CPU
    synchronization"); what the flags cannot set (the flavour, a float8 converter) is said."""
    from fsdp_planner.fsdp2.expert_parallel import ExpertParallel

    experts = "model.layers.1.mlp.experts"
    plan = Plan(fingerprint="", numel=2, model="hf:titan-deepseek-v3-16b", groups=[Group(modules=[experts]),
                                                                                  Group(modules=[""])],
                workload=Workload(2, 4096, 1, 64, 8), optimizer="adamw", expert_parallel=ExpertParallel(8, (experts,)))
    path, flags = exported(tmp_path, plan)
    source = path.read_text()
    assert "config.model_spec.parallelize_fn" not in source and "config.training.disable_cuda_graphs = True" in source
    assert "--training.disable_cuda_graphs" in flags
    said = unexpressed(plan, PRECISIONS["bf16-mixed"], None)
    assert any(n.startswith("the plan's expert parallelism on torchtitan's own MoE model is torchtitan's")
               for n in said)
    # experts in calls of their own (the plan's) are not torchtitan's placement: said (a trial's read-back was
    # another job's step, unexplained); in their blocks' calls, nothing to say
    placed = "the plan shards the experts in fully_shard calls of their own, and torchtitan's job shards them in"
    assert any(n.startswith(placed) for n in said)
    blocks = plan.replace(expert_parallel=ExpertParallel(8, (experts,), per_param_mesh=True))
    assert not any(n.startswith(placed) for n in unexpressed(blocks, PRECISIONS["bf16-mixed"], None))
    cfg = read_config(TORCHTITAN, f"{path}:fsdp_planner_job")
    assert (cfg.ep, cfg.shard) == (8, 64)
    dense = Plan(fingerprint="", numel=2, model="hf:qwen3-8b", groups=[Group(modules=[""])],
                 workload=Workload(1, 4096), optimizer="adamw", float8=Float8.named("rowwise"))
    said = unexpressed(dense, PRECISIONS["bf16-mixed"], None)
    assert any(n.startswith("torchtitan's registry has no bf16 or float8 pretraining job of hf:qwen3-8b (qwen3 8B): "
                            "fsdp_planner_job() builds on qwen3_14b()") for n in said)
    assert any(n.startswith("TORCHTITAN_FLAGS carry no float8 converter") for n in said)
    assert not any("pretraining job of" in n for n in unexpressed(dense.replace(model="llama3-405b"),
                                                               PRECISIONS["bf16-mixed"], None))


@pytest.mark.parametrize(("job", "section", "meant"), [("field_typo", "activation_checkpointing",
                                                        "activation_checkpoint"),
                                                       ("attribute_typo", "trainig", "training")])
def test_a_misspelled_section_of_a_job_is_an_error(job, section, meant):
    """A Trainer.Config field or attribute a letter or two from a section the reader reads was a note ("is not
    read") and the job simulated with that section's defaults (op-level checkpointing for the full it asked; seq
    8,192 for 4,096): torchtitan itself refuses it, and so does the reader, naming the section meant."""
    spec = f"{Path(__file__).parent / 'fixtures' / 'user_jobs' / 'moe_jobs.py'}:{job}"
    with pytest.raises(PlannerError, match=rf"\[{section}\] is not a section of the job \(did you mean {meant}\?\)"):
        read_config(TORCHTITAN, spec)


@pytest.mark.integration  # ~50 s: a 30B MoE job beside auto's plan and the job's edits, twice, and its export
def test_an_ep_jobs_advice_is_what_its_export_runs(capsys, tmp_path):
    """Qwen3-30B-A3B with EP 8 on 16 H100s. The export of an EP plan on torchtitan's MoE model keeps torchtitan's
    parallelize_fn (its groups, one checkpointing class, one reshard rule), and the output said to export auto's
    plan for auto's step (a new user's trial 5: auto 667 ms, the exported job 893 ms, the best edit 699 ms). It
    gives the step the export runs, exactly as ``simulate`` reads the exported job back, and recommends the faster
    of that and the edit."""
    spec = f"{Path(__file__).parent / 'fixtures' / 'user_jobs' / 'moe_jobs.py'}:qwen3_30b_a3b_ep8"
    plan_file, job = tmp_path / "plan.json", tmp_path / "job.py"
    assert main(["plan", "--from-torchtitan", spec, "--cluster", "h100", "--json", "--out", str(plan_file)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert main(["export", str(plan_file), "--format", "torchtitan", "--out", str(job), "-q"]) == 0
    assert main(["simulate", "--from-torchtitan", f"{job}:fsdp_planner_job", "--cluster", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time"] == result["exported_step"]["step_time"]
    assert result["auto_step"]["step_time"] < result["exported_step"]["step_time"]  # (the gap the trial saw)
    assert main(["plan", "--from-torchtitan", spec, "--cluster", "h100"]) == 0
    out = capsys.readouterr().out
    keep = "keep the edit" in out
    assert keep == (result["best_edit"] is not None and
                    result["best_edit"]["step"]["step_time"] < result["exported_step"]["step_time"])
    assert "auto's plan as exported (torchtitan's groups): step" in out
    assert keep != ("fsdp-planner export plan.json" in out)


@pytest.mark.integration
def test_auto_finds_the_expert_s_own_ep_job_where_it_fits(capsys):
    """torchtitan's DeepSeek-V3 16B job (a group per block, every block op-level, EP 8) on 8 H100s fits at 69.7 GiB.
    Auto's plan came out 0.8% slower: its EP screen took auto's own checkpointing, searched without EP, which left
    the last block uncheckpointed and went over the budget, and then tried its op-level blocks in full only. Every
    block op-level is screened now: auto's checkpointing and EP are the job's. (With the job's loss in its 8 chunks
    the job holds 65.9 GiB, and auto keeps most groups gathered after forward in what that leaves: 0.7% faster.)"""
    spec = f"{FIXTURES}/deepseek_v3/config_registry.py:deepseek_v3_16b"
    assert main(["plan", "--from-torchtitan", spec, "--cluster", "h100:8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["auto_step"]["step_time"] <= result["config_step"]["step_time"] and result["fits"]
    assert {c["key"] for c in result["changes"]} <= {"parallelism.fsdp_reshard_after_forward"}


def test_a_fault_tolerant_job_says_torchft_is_not_modelled(tmp_path):
    """torchtitan's torchft jobs (``FaultTolerantTrainer.Config(fault_tolerance=FaultTolerance(enable=True,
    semi_sync_method="diloco", ...))``) were read with the section dropped unsaid (a trial): DiLoCo's outer
    optimizer and params copy, and the replicas' all-reduce, are not in the step; a note says so, off when disabled."""
    notes = {}
    for enable in ("True", "False"):
        path = tmp_path / f"{enable}.py"
        path.write_text(REGISTRY_HEAD + f"        fault_tolerance=FaultTolerance(enable={enable}, "
                        "semi_sync_method=\"diloco\", sync_steps=10),\n    )\n")
        notes[enable] = [n for n in read_config(TORCHTITAN, f"{path}:job").notes if "fault_tolerance" in n]
    assert notes["False"] == [] and len(notes["True"]) == 1
    assert "torchft's replica groups are not modelled" in notes["True"][0] and '"diloco"' in notes["True"][0]


@pytest.mark.integration
def test_auto_s_tp_on_a_job_built_as_transformers_modules_says_its_layout_and_batch(capsys):
    """torchtitan's Qwen3 8B nvfp4 job on 8 H100s: auto takes TP 2, priced on transformers' TP plan (no sequence
    parallelism), which torchtitan does not run: said (the only note on it claimed --from-torchtitan jobs have
    torchtitan's layout); and its rows took the data-parallel degree 8 -> 4 without the tokens each rank runs, so
    following them halved the global batch (a trial)."""
    spec = f"{FIXTURES}/qwen3/config_registry.py:qwen3_8b_first_85_pct_layers_nvfp4"
    assert main(["plan", "--from-torchtitan", spec, "--cluster", "h100:8", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["plan"]["tensor_parallel"]["degree"] == 2
    changes = {c["key"]: (c["config"], c["auto"]) for c in result["changes"]}
    assert changes["parallelism.data_parallel_shard_degree"] == ("8", "4")
    assert changes["training.num_tokens_per_microbatch_per_dp_rank"] == ("2,048", "4,096")
    assert "auto's TP 2 would run torchtitan's own layout for \"qwen3\" flavor \"8B\", and its figures here are of " \
        "transformers' plan for hf:qwen3-8b (no sequence parallelism" in captured.err
    assert "--from-torchtitan jobs have torchtitan's" not in captured.err


@pytest.mark.integration
def test_auto_under_the_job_s_ep_fits_where_the_job_does(capsys):
    """torchtitan's Qwen3-30B-A3B job with EP 8 at 5 x 4,096 tokens on 8 H100s holds 70.0 GiB; auto searched its
    groups without EP (70.6 GiB), laid the job's EP on them (85.2 GiB), said "no plan fits" with the smallest peak
    70.6 GiB, under the budget, and ``fit`` gave batch 4 (a trial). Where auto's groups fit without EP and not under
    it, the expert's grouping is screened under EP too: auto's plan fits, no slower than the job."""
    spec = f"{FIXTURES}/qwen3/config_registry.py:qwen3_30b_a3b"
    assert main(["plan", "--from-torchtitan", spec, "--cluster", "h100", "--json", "--",
                 "--parallelism.expert_parallel_degree", "8", "--training.disable_cuda_graphs",
                 "--training.num_tokens_per_microbatch_per_dp_rank", "20480"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config_step"]["budget"]["fits"] and result["fits"], result.get("message")
    assert result["auto_step"]["step_time"] <= result["config_step"]["step_time"]
    assert result["plan"]["expert_parallel"]["degree"] == 8


@pytest.mark.integration
def test_the_ep_degree_auto_chooses_is_a_key_it_changes(capsys):
    """gpt-oss-20b's job runs without EP (expert_parallel_degree = 1); on 8 H100s auto's EP screen takes EP 8, and
    the table of keys auto would change left that key out: it is a row now, as torchtitan spells it."""
    spec = f"{FIXTURES}/gpt_oss/config_registry.py:gpt_oss_20b"
    assert main(["plan", "--from-torchtitan", spec, "--cluster", "h100:8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    degree = (result["plan"].get("expert_parallel") or {}).get("degree", 1)
    rows = [c for c in result["changes"] if c["key"] == "parallelism.expert_parallel_degree"]
    assert degree > 1 and rows == [{"key": "parallelism.expert_parallel_degree", "config": "1", "auto": str(degree),
                                    "expressible": True}]
    # the checkpointing row counts the blocks left uncheckpointed too ("23 op-level" read as all 24 checkpointed)
    plan = result["plan"]
    held = len(plan.get("activation_checkpointing", [])) + len(plan.get("selective_checkpointing", {}))
    ac = next(c["auto"] for c in result["changes"] if c["key"] == "activation_checkpoint")
    assert held < 24 and ac.startswith("per block: ") and f" + {24 - held} none" in ac, ac


def test_a_registry_jobs_float8_recipe_is_one_its_converter_takes_and_emulation_is_bf16():
    """The registry's Float8LinearConverter takes the rowwise recipes only (b5bcd76): a tensorwise job was read
    and simulated as tensorwise float8; an emulated one was simulated as float8 matmuls on an H100, and refused on
    an A100 (no float8 tensor cores), where emulation runs its matmuls in bf16."""
    jobs = Path(__file__).parent / "fixtures" / "user_jobs" / "moe_jobs.py"
    with pytest.raises(PlannerError, match=r'recipe_name = "tensorwise" is not rowwise or rowwise_with_gw_hp'):
        read_config(TORCHTITAN, f"{jobs}:tensorwise_float8")
    emulated = read_config(TORCHTITAN, f"{jobs}:emulated_float8")
    assert emulated.float8 is None and any("emulate runs float8 emulated" in n for n in emulated.notes)
    assert read_config(TORCHTITAN, f"{jobs}:float8_job").float8 == "rowwise"


def test_a_setting_assigned_inside_a_branch_the_reader_does_not_run_is_an_error():
    """``if big: config.parallelism.data_parallel_shard_degree = 16`` was a note ("is not read") and the job
    simulated on 64 GPUs where, as written, it runs on 128: which branch runs decides the job."""
    jobs = Path(__file__).parent / "fixtures" / "user_jobs" / "moe_jobs.py"
    with pytest.raises(PlannerError, match=r"line \d+ of conditional_job \(if\) assigns config\.parallelism\..* "
                                           r"inside, which the reader does not run"):
        read_config(TORCHTITAN, f"{jobs}:conditional_job")


def test_micro_batches_against_a_registry_job_name_its_token_count(capsys):
    """--micro-batches against a registry job's gradient accumulation named training.global_batch_size ("2"), a
    TOML key the job has not, and the count as if it were the key's value."""
    jobs = Path(__file__).parent / "fixtures" / "user_jobs" / "moe_jobs.py"
    assert main(["simulate", "--from-torchtitan", f"{jobs}:accumulating_job", "--cluster", "h100",
                 "--micro-batches", "4"]) == 2
    err = capsys.readouterr().err
    assert "contradicts training.num_tokens_per_train_step in torchtitan config" in err
    assert "(2 micro-batches a step)" in err
    assert read_config(TORCHTITAN, f"{jobs}:accumulating_job").global_batch == 64


def test_an_export_checkpoints_as_its_plan_and_torchtitan_s_own_wrapper_re_runs_whole(tmp_path, capsys):
    """The export's parallelize_fn checkpoints the plan's modules itself, with the plan's early stop; the job reads
    back so, and a plan made with --no-early-stop records it (its Python export passes it to torch). Only what runs
    torchtitan's own wrapper (early_stop=False) differs: TORCHTITAN_FLAGS on another job say so."""
    steps = {}
    for flags, stops in (([], True), (["--no-early-stop"], False)):
        plan = tmp_path / "plan.json"
        assert main(["plan", "llama3-debugmodel", "--policy", "titan", "--ac", "full", "--cluster", "h100:2",
                     "--out", str(plan), "--json", *flags]) == 0
        steps[stops] = json.loads(capsys.readouterr().out)["plans"][0]["simulation"]["step_time"]
        assert ('"checkpoint_early_stop": false' in plan.read_text()) != stops
        job = tmp_path / f"job_{stops}.py"
        assert main(["export", str(plan), "--format", "torchtitan", "--out", str(job)]) == 0
        assert ("TORCHTITAN_FLAGS on another job checkpoint with torchtitan's wrapper" in
                capsys.readouterr().err) == stops
        assert main(["simulate", "--from-torchtitan", f"{job}:fsdp_planner_job", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["step_time"] == pytest.approx(steps[stops], rel=1e-9)
        assert main(["export", str(plan), "--format", "python", "--out", str(tmp_path / "apply.py")]) == 0
        assert f"CHECKPOINT_EARLY_STOP: bool = {stops}" in (tmp_path / "apply.py").read_text()
    assert steps[False] > steps[True]


def test_a_registry_checkpointing_class_takes_only_its_own_fields(tmp_path):
    """torchtitan's FullAC.Config has no early_stop (its wrapper fixes False) and SelectiveAC.Config no
    selective_ac_option (the class is the mode): both were read as the TOML's keys and simulated so (a FullAC job
    with torch's early stop; a SelectiveAC one as op-level whatever it said). MemoryBudgetAC is named as the class."""
    (tmp_path / "acf.py").write_text(AC_JOBS)
    for job, message in (("es", "FullAC.Config has no field early_stop (torchtitan's checkpoint wrapper runs "
                                "early_stop=False)"),
                         ("sel2", "SelectiveAC.Config has no field selective_ac_option"),
                         ("mb", "activation_checkpoint = MemoryBudgetAC.Config() is torch.compile's")):
        with pytest.raises(PlannerError, match=re.escape(message)):
            read_config(TORCHTITAN, f"{tmp_path / 'acf.py'}:{job}")
    assert read_config(TORCHTITAN, f"{tmp_path / 'acf.py'}:ok").ac is ACMode.OP
    with pytest.raises(PlannerError, match=re.escape("SelectiveAC.Config has no field early_stop")):
        read_config(TORCHTITAN, f"{tmp_path / 'acf.py'}:ok", ["--activation_checkpoint.early_stop", "true"])


AC_JOBS = """from torchtitan.trainer import Trainer
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC, MemoryBudgetAC
from torchtitan.models.llama3 import model_registry


def es():
    return Trainer.Config(model_spec=model_registry("debugmodel"),
                          training=TrainingConfig(num_tokens_per_microbatch_per_dp_rank=4096, max_context_length=2048),
                          parallelism=ParallelismConfig(data_parallel_shard_degree=8),
                          activation_checkpoint=FullAC.Config(early_stop=True))


def sel2():
    c = es()
    c.activation_checkpoint = SelectiveAC.Config(selective_ac_option="2")
    return c


def mb():
    c = es()
    c.activation_checkpoint = MemoryBudgetAC.Config(memory_budget=0.5)
    return c


def ok():
    c = es()
    c.activation_checkpoint = SelectiveAC.Config(debug=False)
    return c
"""


def test_another_save_list_than_a_registry_jobs_is_said(capsys):
    """``--ac-policy titan-2025`` beside a registry job checkpointing with SelectiveAC simulated the 2025 list
    without a word (a new user's trial 5): torchtitan's SelectiveAC at b5bcd76 runs one list, --ac-policy titan."""
    from fsdp_planner.cli import main

    for policy, said in (("titan-2025", True), ("titan", False)):
        assert main(["simulate", "--from-torchtitan", job("llama3_debugmodel"), "--cluster", "h100:8",
                     "--ac-policy", policy]) == 0
        assert ("simulates the job's SelectiveAC (and op-level edits of it) with another save list"
                in capsys.readouterr().err) == said


def test_a_qwen3_5_job_is_planned_on_its_text_decoder_when_asked(capsys):
    """torchtitan's qwen3_5 trains Qwen3.5's multimodal model; the planner builds its text decoder (hf:qwen3.5-*):
    refused naming it, then planned with it given as MODEL, the vision encoder's absence said."""
    pytest.importorskip("transformers")
    spec = str(FIXTURES / "qwen3_5/config_registry.py:qwen35_9b")
    assert main(["plan", "--from-torchtitan", spec, "--cluster", "h100:8"]) == 2
    err = capsys.readouterr().err
    assert "is multimodal" in err and "give hf:qwen3.5-9b as MODEL" in err, err
    assert main(["simulate", "hf:qwen3.5-9b", "--from-torchtitan", spec, "--cluster", "h100:64", "--json"]) == 0
    out = capsys.readouterr()
    assert "MODEL hf:qwen3.5-9b is the text decoder of the torchtitan job's multimodal model" in out.err
    assert "linear attention (24 gated DeltaNet calls)" in out.err
    assert json.loads(out.out)["step_time"] > 0


@pytest.mark.integration
def test_a_chunked_loss_job_is_judged_with_its_loss_in_chunks(capsys):
    """torchtitan's Qwen3.5 9B job on 8 H100s computes its loss in 8 chunks (ChunkedLossWrapper). Simulated whole,
    its loss's logits were the step's largest term and nothing fitted; the verdict then said the loss was
    over-counted. Simulated in its chunks (``trace/chunked_loss.py``), the job fits, as it runs."""
    pytest.importorskip("transformers")
    spec = str(FIXTURES / "qwen3_5/config_registry.py:qwen35_9b")
    assert read_config(TORCHTITAN, spec).loss_chunks == 8
    assert main(["plan", "hf:qwen3.5-9b", "--from-torchtitan", spec, "--cluster", "h100:8", "--json"]) == 0
    out = capsys.readouterr()
    assert "loss in 8 chunks (torchtitan's ChunkedLossWrapper)" in out.err
    assert json.loads(out.out)["config_step"]["budget"]["fits"]


@pytest.mark.parametrize(("chunks", "read", "note"), [
    ("", 8, None), ("num_chunks=4", 4, None), ("num_chunks=1", None, "num_chunks = 1 is simulated as one"),
    ("num_chunks=n()", 0, "num_chunks = n(...) (not a literal) is simulated as one"),
    ("loss_fn=MSELoss.Config()", 8, "loss_fn = MSELoss.Config is simulated as its default")])
def test_a_chunked_loss_is_read_or_said(tmp_path, chunks, read, note):
    """``loss = ChunkedLossWrapper.Config(...)``: its chunks given to the step (the default 8 where not set); one
    chunk is the whole loss; a number it cannot read is the whole loss with a note; another inner loss is said."""
    path = tmp_path / "config_registry.py"
    path.write_text(REGISTRY_HEAD + f"        loss=ChunkedLossWrapper.Config({chunks}),\n    )\n")
    cfg = read_config(TORCHTITAN, f"{path}:job")
    assert cfg.loss_chunks == read
    said = [n for n in cfg.notes if n.startswith(CHUNKED)]
    assert said == [] if note is None else note in said[0]


@pytest.mark.parametrize(("chunks", "says"), [
    ("num_chunks=0", "num_chunks = 0: torchtitan's wrapper splits the tokens into num_chunks equal chunks"),
    ("num_chunks=None", "num_chunks = None: torchtitan's wrapper"), ("num_chunks='4'", "num_chunks = '4': "),
    ("num_chunks=4096", "num_chunks = 4,096: fsdp-planner plans a loss in at most 1,024 chunks"),
    ("4", "ChunkedLossWrapper.Config takes keyword arguments only"),
    # a new user's trial: a misspelled num_chunks ran the default's 8 chunks without a word
    ("num_chunk=4", 'loss = ChunkedLossWrapper.Config has no field "num_chunk" (did you mean num_chunks?)'),
    ("chunks=4, num_chunks=2", 'has no field "chunks", which torchtitan\'s dataclass refuses')])
def test_a_chunk_count_torchtitan_refuses_is_one_error(tmp_path, chunks, says):
    """A count the wrapper would fail on (or more than the planner plans) is one sentence naming the job, not a
    note beside a whole-sequence loss (a new user's trial: 0, None and '4' were notes)."""
    _refused(tmp_path, REGISTRY_HEAD + f"        loss=ChunkedLossWrapper.Config({chunks}),\n    )\n",
             r"^torchtitan job '.*:job': .*" + re.escape(says))


@pytest.mark.parametrize(("name", "flag", "says"), [
    ("llama3_debugmodel", "--loss.num_chunk", 'ChunkedLossWrapper.Config has no field "num_chunk" (did you mean '
                                              'num_chunks?)'),
    ("llama3_debugmodel", "--los.num_chunks", "[los] is not a section of the job (did you mean loss?)"),
    ("llama3_debugmodel_ce_loss", "--loss.num_chunks", 'CrossEntropyLoss.Config has no field "num_chunks", which '
                                                       "torchtitan's dataclass refuses: the job's loss runs over the "
                                                       "whole sequence")])
def test_a_loss_flag_the_job_s_loss_has_no_field_for_is_one_error(capsys, name, flag, says):
    """``--loss.KEY`` after ``--``: a key the job's loss Config lacks is refused, as torchtitan's dataclass does (a new
    user's trial: a misspelled key planned the default 8 chunks, and num_chunks on a whole loss planned it whole,
    both without a word)."""
    assert main(["simulate", "--from-torchtitan", job(name), "--cluster", "h100:8", "--", flag, "4"]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(("loss", "flags", "says"), [
    # (a job that sets no loss has Trainer.Config's BaseLoss.Config, which has no fields)
    ("", ["--loss.num_chunks", "4"], 'loss = BaseLoss.Config has no field "num_chunks", which torchtitan\'s '
                                     "dataclass refuses: the job's loss runs over the whole sequence"),
    ("        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(vocab=8)),\n", [],
     'loss = CrossEntropyLoss.Config has no field "vocab"')])
def test_a_loss_field_torchtitan_lacks_is_refused_wherever_it_is(tmp_path, loss, flags, says):
    """A reviewer's findings: a flag on a job without a loss of its own, and the wrapper's inner loss."""
    path = tmp_path / "config_registry.py"
    path.write_text(REGISTRY_HEAD + loss + "    )\n")
    with pytest.raises(PlannerError, match=re.escape(says)):
        read_config(TORCHTITAN, f"{path}:job", flags)


def test_chunks_given_to_a_job_with_a_whole_loss_contradict_it(capsys):
    """A job that names its whole-sequence loss (llama3_debugmodel_ce_loss: CrossEntropyLoss) is not run in chunks
    because the command line asks: one error, as for a chunk count the job's own contradicts (a new user's
    trial: it planned 8 chunks without a word)."""
    spec = job("llama3_debugmodel_ce_loss")
    assert read_config(TORCHTITAN, spec).loss_whole
    assert main(["simulate", "--from-torchtitan", spec, "--cluster", "h100:8", "--loss-chunks", "8"]) == 2
    assert "--loss-chunks 8 contradicts torchtitan config" in capsys.readouterr().err


def test_an_ep_job_torchtitan_would_not_capture_in_a_cuda_graph_is_refused():
    """torchtitan's Trainer.Config refuses CUDA graphs (on unless training.disable_cuda_graphs) around an EP
    dispatch that syncs with the host (its standard all-to-all); the reader simulated such a job as if it ran (a
    torchtitan trial). torchtitan's own HybridEP and MinimalAsyncEP jobs run graphed, and the flag its EP jobs set
    turns them off; a value the reader cannot read is asked for, not taken as the default."""
    jobs = Path(__file__).parent / "fixtures" / "user_jobs" / "moe_jobs.py"
    with pytest.raises(PlannerError, match=r"torchtitan refuses this job: its CUDA graphs .* expert_parallel_degree "
                                           r"= 8 runs \"standard\": set disable_cuda_graphs=True in the job's"):
        read_config(TORCHTITAN, f"{jobs}:graphed_ep8")
    assert not read_config(TORCHTITAN, f"{jobs}:graphed_ep8", ["--training.disable_cuda_graphs"]).cuda_graphs
    assert read_config(TORCHTITAN, f"{jobs}:graphed_ep8", ["--parallelism.expert_parallel_degree", "1"]).ep == 1
    deepseek = FIXTURES / "deepseek_v3" / "config_registry.py"
    for function in ("deepseek_v3_16b_hybridep", "deepseek_v3_16b_minimal_async_ep"):
        assert read_config(TORCHTITAN, f"{deepseek}:{function}").cuda_graphs
    assert not read_config(TORCHTITAN, f"{deepseek}:deepseek_v3_16b").cuda_graphs  # (EP 8, graphs off)
    with pytest.raises(PlannerError, match="torchtitan refuses this job"):
        read_config(TORCHTITAN, f"{deepseek}:deepseek_v3_16b", ["--training.no-disable-cuda-graphs"])
    with pytest.raises(PlannerError, match=r"training.disable_cuda_graphs = bool\(...\) is not a literal"):
        read_config(TORCHTITAN, f"{jobs}:unread_graphs")


@pytest.mark.integration  # (the debug job planned twice: a few seconds)
def test_a_graphed_job_bound_by_the_host_says_the_replay_is_faster(capsys):
    """The debug model's eager step waits on the host for nearly half its time; torchtitan replays it as a CUDA
    graph, which does not: said, with the share, and not said once the flag turns the graphs off."""
    assert main(["plan", "--from-torchtitan", job("llama3_debugmodel"), "--cluster", "h100:8", "--json"]) == 0
    captured = capsys.readouterr()
    said = re.search(r"the step here is eager, ([\d.]+) ms of it \((\d+)%\) waiting", captured.err)
    assert said is not None and int(said[2]) >= 10
    # torchtitan clears the grads with set_to_none=False under its graphs: kept all step
    assert "simulated as --zero-grad zeros" in captured.err
    graphed = json.loads(captured.out)["config_step"]
    assert main(["plan", "--from-torchtitan", job("llama3_debugmodel"), "--cluster", "h100:8", "--json", "--",
                 "--training.disable_cuda_graphs"]) == 0
    captured = capsys.readouterr()
    assert "CUDA graph" not in captured.err
    eager = json.loads(captured.out)["config_step"]
    assert graphed["memory_at_peak"]["grads"] > eager["memory_at_peak"]["grads"]


def test_simulate_says_the_graphed_job_s_host_wait_too(capsys):
    """``simulate --from-torchtitan`` said nothing of the replay where ``plan`` did (the review)."""
    from fsdp_planner.cli import main

    assert main(["simulate", "--from-torchtitan", job("llama3_debugmodel"), "--cluster", "h100:8"]) == 0
    assert "torchtitan replays the forward and backward as a CUDA graph" in capsys.readouterr().err


@pytest.mark.parametrize(("budget", "offloads", "flags"), [("16GiB", False, []), ("20GiB", True, []),
                                                      ("16GiB", False, ["--", "--training.num_tokens_per_train_step",
                                                                        "131072"])])  # 2 micro-batches a step
def test_the_keys_auto_changes_say_its_tp_degree_and_activation_offloading(capsys, budget: str, offloads: bool,
                                                                            flags: list[str]):
    """Auto's plan of a job under a small budget took TP 4, said as "data_parallel_replicate_degree 1 -> 1,
    data_parallel_shard_degree 8 -> 2" (the TP degree's own key was missing), and one offloading every block's
    activations to the host said "activation_checkpoint: ... -> None", read as advice to drop checkpointing (a
    trial). The TP key has its row, an unchanged degree none, and the offloading is said and marked as no key's."""
    assert main(["plan", "--from-torchtitan", job("llama3_8b"), "--cluster", "h100:8", "--memory-budget", budget,
                 "--json", "--quiet", *flags]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["tensor_parallel"]["degree"] == 4
    changes = {c["key"]: c for c in out["changes"]}
    assert (changes["parallelism.tensor_parallel_degree"]["config"],
            changes["parallelism.tensor_parallel_degree"]["auto"]) == ("1", "4")
    assert changes["parallelism.data_parallel_shard_degree"]["auto"] == "2"
    assert "parallelism.data_parallel_replicate_degree" not in changes
    # the same step on 2 data-parallel ranks: 4x the tokens each, as the plan (and its export) runs them; the rows
    # above alone would have quartered the global batch (a trial)
    tokens = {side: int(changes["training.num_tokens_per_microbatch_per_dp_rank"][side].replace(",", ""))
              for side in ("config", "auto")}
    workload = out["plan"]["workload"]  # (the key is a micro-batch's: the plan's step batch over its micro-batches)
    assert tokens["auto"] == 4 * tokens["config"] == workload["batch"] // workload["micro_batches"] * workload["seq"]
    assert workload["micro_batches"] == (2 if flags else 1)
    ac = changes["activation_checkpoint"]
    assert ("offloaded to the host" in ac["auto"]) is offloads and ac["expressible"] is not offloads

"""The files a command reads and writes, checked before any work: a bad path fails in one line, not after minutes
of tracing and planning, and no command overwrites what it reads or what it did not write. Imports nothing heavy:
``cli.main`` checks the paths before the command's modules (and torch) are imported."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
from pathlib import Path

from fsdp_planner.choices import POLICY_NAMES
from fsdp_planner.configs.torchtitan_registry import is_registry_spec, registry_file
from fsdp_planner.errors import PlannerError
from fsdp_planner.userfiles import EXPORT_STAMP, MAX_FILE_BYTES, WRITTEN_BY, as_stamped


def output_file(arg: str | None, example: str = "plan.json", code: bool = False,
                force: bool = False, kind: str = "plan", hook_of: Path | None = None) -> Path | None:
    """``--out``: checked before any work, so a bad path fails in one line, not after minutes of planning. An
    existing regular file is overwritten only when it is what the command writes: a plan or cluster file (JSON
    that fsdp-planner wrote), or for ``code`` (``export``) code export wrote, or with ``force`` (``--force``). A typo
    such as ``--out model.py`` must not replace the user's code, nor ``--out data.json`` the user's JSON, nor
    ``export ... --out plan.json`` the plan, nor a plan's ``--out`` a cluster file (``kind``: what this command
    writes, "plan" or "cluster"); ``hook_of``: the --out whose Python hook ``arg`` is (the accelerate export's YAML),
    which a refusal names and renames."""
    if arg is None:
        return None
    path = _file_to_write(arg, "--out", example)
    real = _replaced(path)
    written = None if code or not real.is_file() else _written_json(real)
    if written not in (None, kind) and not force:
        raise PlannerError(f"--out '{arg}' is a {written} file fsdp-planner wrote, and this command writes a {kind} "
                           f"file: refusing to replace it (give another name, or add --force to replace it)")
    exported = _exported(real) if real.is_file() and not force else None
    if real.is_file() and not force and not (exported == "as written" or written):
        what = EXPORTED_SINCE.get(exported or "") or ("not code fsdp-planner export wrote" if code else
                                                      "neither a plan or cluster file fsdp-planner wrote nor code "
                                                      "its export wrote")
        what = f"a link to '{real}', {what}" if path.is_symlink() else what
        if hook_of is not None:  # (the name to change is the YAML's: a .py given as --out is refused)
            raise PlannerError(f"--out '{hook_of}' writes its Python hook beside it as '{arg}', which already exists "
                               f"and is {what}: refusing to overwrite it (give another --out, e.g. "
                               f"{hook_of.with_stem(hook_of.stem + '_plan')}, or add --force to replace it)")
        other = path.with_stem(path.stem + ("_plan" if code else "2"))
        other = other.with_suffix(".py") if code and other.suffix.lower() not in CONFIG_SUFFIXES else other
        raise PlannerError(f"--out '{arg}' already exists and is {what}: refusing to overwrite it (give a new name, "
                           f"e.g. {other}, or add --force to replace it)")
    return path


def _replaced(path: Path) -> Path:
    """The file a write to ``path`` replaces: the atomic writer follows a symlink, so ``out.json -> mycode.py``
    is judged by mycode.py, not by the link's name."""
    return Path(os.path.realpath(path))


def _exported(path: Path) -> str | None:
    """What ``path`` is of the files ``fsdp-planner export`` writes: "as written" where its first line's checksum
    (``userfiles.stamped``) is still that of the text below it, safe to write again; "edited" where it is not (the
    user's changes); "unchecked" where export's header has no checksum (an older fsdp-planner's: edited or not, no
    one can tell); None for any other file."""
    try:
        with path.open("rb") as f:
            head = f.read(1000)
            if not head.startswith(STAMP_START):
                return "unchecked" if GENERATED_MARK.encode() in head else None
            data = head + f.read(MAX_FILE_BYTES)
    except OSError:
        return None
    return {True: "as written", False: "edited", None: None}[as_stamped(data)]


def _written_json(path: Path) -> str | None:
    """What ``path`` is of the JSON fsdp-planner writes with ``--out``: "cluster" or "plan" (an object whose first
    key is its ``version``, then a cluster's ``name``: ``Cluster.to_json``, ``Plan.to_json``), None for any other
    file. A user's other JSON is not replaced without --force."""
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            head = f.read(1000)
            found = WRITTEN_JSON.match(head)
            if found is None:
                return None
            text = head + f.read(KIND_READ_BYTES)  # a hand-written cluster may begin with any of its keys
    except OSError:
        return None
    try:
        data = json.loads(text)
    except ValueError:  # (longer than read, or not JSON after all: by its second key)
        return "cluster" if found.group(1) in CLUSTER_KEYS else "plan"
    return "cluster" if isinstance(data, dict) and CLUSTER_KEYS & set(data) else "plan"


KIND_READ_BYTES = 16 << 20  # a plan or cluster file is read whole up to this, to tell which it is
CLUSTER_KEYS = {"gpu", "gpus_per_node", "nodes", "name", "intra", "inter"}  # a cluster file's (a plan has none)


# how the plan and cluster files fsdp-planner writes begin: their version, then a cluster's name or a plan's model
WRITTEN_JSON = re.compile(r'\s*\{\s*"version"\s*:\s*\d+\s*,\s*"(\w+)"')
GENERATED_MARK = "Generated by fsdp-planner"  # the header of every file `export` writes (apply/export.py)
STAMP_START = EXPORT_STAMP.partition("{")[0].encode()  # its checksum line, first since export wrote one
# what an export's file is where --out refuses it (``_exported``)
EXPORTED_SINCE = {"edited": "a file fsdp-planner export wrote and someone edited since (the checksum on its first "
                            "line is no longer that of its text)",
                  "unchecked": "a file an older fsdp-planner export wrote, without the checksum that tells whether it "
                               "was edited since"}


def _file_to_write(arg: str, option: str, example: str) -> Path:
    """A file name an option gives for writing: not empty, not a directory, in a directory that exists."""
    if not arg.strip():
        raise PlannerError(f"{option} is empty: give the file to write, e.g. {option} {example}")
    path = Path(arg)
    if path.is_dir():
        raise PlannerError(f"{option} '{arg}' is a directory: give a file name, e.g. {path / example}")
    if not path.parent.is_dir():
        raise PlannerError(f"{option} '{arg}': directory '{path.parent}' does not exist")
    return path


def picture_file(arg: str | None, option: str, suffixes: tuple[str, ...], stem: str = "step",
                 force: bool = False) -> Path | None:
    """``--timeline`` / ``--html`` / ``--picture``: checked before any work (as ``--out``); the suffix says the
    format, and an existing file is replaced only when fsdp-planner wrote it (its metadata or generator tag names
    it, ``WRITTEN_BY``), or with ``force``: a user's own page or picture of that name is not lost to a typo.
    ``stem``: the name suggested for a directory given instead of a file (``fit.png`` for fit's picture)."""
    if arg is None:
        return None
    path = _file_to_write(arg, option, f"{stem}{suffixes[0]}")
    if path.suffix.lower() not in suffixes:
        raise PlannerError(f"{option} '{arg}' must end in {' or '.join(suffixes)} (the format it writes), "
                           f"e.g. {path.with_suffix(suffixes[0])}")
    real = _replaced(path)
    if real.suffix.lower() not in suffixes and real.exists():
        raise PlannerError(f"{option} '{arg}' is a link to '{real}', which is not a {'/'.join(suffixes)} file: "
                           f"refusing to overwrite it (give a new name)")
    if real.is_file() and not force and not written_by_us(real):
        raise PlannerError(f"{option} '{arg}' already exists and fsdp-planner did not write it: refusing to "
                           f"overwrite it (give a new name, e.g. {path.with_stem(path.stem + '2')}, or add --force "
                           "to replace it)")
    return path


def profile_dir(directory: Path, force: bool = False) -> None:
    """``verify --profile DIR``: a new or empty directory, or one an earlier --profile wrote (its ``rankR.json``
    traces each beside the ``rankR.cpu.json`` that names fsdp-planner); anything else in it is the user's, which
    the ranks' traces would replace, and is refused without ``force``."""
    if directory.exists() and not directory.is_dir():
        raise PlannerError(f"--profile '{directory}' is not a directory: give a directory for the ranks' traces, "
                           "e.g. --profile profile")
    if force or not directory.is_dir():
        return
    names = {p.name for p in directory.iterdir()}
    ours = {n for n in names if (m := PROFILE_FILE.fullmatch(n)) and written_by_us(directory / f"rank{m[1]}.cpu.json")}
    if names - ours:
        other = sorted(names - ours)[0]
        raise PlannerError(f"--profile '{directory}' holds '{other}', which an earlier --profile did not write: "
                           "the ranks' traces (rankR.json, rankR.cpu.json) could replace files there; give a new or "
                           "empty directory (or add --force to write there anyway)")


PROFILE_FILE = re.compile(r"rank(\d+)(?:\.cpu)?\.json")  # what verify --profile writes (``worker.profile_steps``)


def written_by_us(path: Path) -> bool:
    """Whether a picture, page or profile file names fsdp-planner as its writer within its first ``MARK_BYTES``
    (a PNG's Software chunk, an SVG's creator and an HTML generator tag come first; a PDF's Info dict last, so a
    PDF is read whole up to that)."""
    try:
        with path.open("rb") as f:
            return WRITTEN_BY.encode() in f.read(MARK_BYTES)
    except OSError:
        return False


MARK_BYTES = 16 << 20


def _looks_like_cluster_file(spec: str) -> bool:
    """What ``parse_cluster`` reads as a file rather than a preset name."""
    text = spec.strip()
    return Path(text).suffix.lower() == ".json" or "/" in text or os.path.isfile(text)


def _model_file(spec: str) -> str | None:
    target = spec.rpartition(":")[0]
    return target if target.endswith(".py") else None


def input_file(arg: str, what: str) -> Path:
    """A file the command reads: 'does not exist', 'is a directory' and 'is not a regular file' told apart."""
    path = Path(arg)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise PlannerError(f"{what} '{arg}' does not exist") from None
    except OSError as e:
        raise PlannerError(f"cannot read {what} '{arg}': {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise PlannerError(f"{what} '{arg}' is a directory: give the file itself")
    if not stat.S_ISREG(mode):
        raise PlannerError(f"{what} '{arg}' is not a regular file")
    return path


def _model_inputs(model: str | None) -> list[tuple[str, str]]:
    """The files a model spec reads: ``path/file.py:fn``'s code, ``hf:path/config.json`` (or a directory's
    config.json)."""
    if not model:
        return []
    if _model_file(model):
        return [(_model_file(model), "the model file")]  # type: ignore[list-item]
    if model.startswith(HF_PREFIX):
        config = Path(model.removeprefix(HF_PREFIX))
        config = config / "config.json" if config.is_dir() else config
        if config.is_file():
            return [(str(config), "the model's config file")]
    return []


HF_PREFIX = "hf:"  # models/hf.py's PREFIX (not imported: that module imports torch)


def _inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Every file or directory the command reads, (path, what it is); the plain files are checked to be ones."""
    inputs = _model_inputs(getattr(args, "model", None))
    for attr in ("plan", "compare"):
        spec = getattr(args, attr, None)
        if spec and (attr == "plan" or (spec not in POLICY_NAMES and os.path.lexists(spec))):  # or a policy
            input_file(spec, "plan file")
            inputs.append((spec, "the plan file"))
    for attr in ("cluster", "base"):
        spec = getattr(args, attr, None)
        if spec and _looks_like_cluster_file(spec) and os.path.lexists(spec.strip()):
            input_file(spec.strip(), "cluster file")
            inputs.append((spec.strip(), "the cluster file"))
    for attr, what in (("from_torchtitan", "torchtitan config"), ("from_accelerate", "accelerate config")):
        spec = getattr(args, attr, None)
        if spec and attr == "from_torchtitan" and is_registry_spec(spec):
            spec = registry_file(spec)  # FILE.py:FUNCTION's file; a MODULE:FUNCTION is found when read
        if spec:
            input_file(spec, what)
            inputs.append((spec, f"the {what}"))
    for log in getattr(args, "logs", None) or ():
        if os.path.lexists(log) and not os.path.isdir(log):  # a directory of logs is read whole
            input_file(log, "nccl-tests log")
        inputs.append((log, "a log"))
    if getattr(args, "load_checkpoint", None) is not None:
        inputs.append((str(args.load_checkpoint), "the checkpoint"))
    return inputs


# (attribute, option, an example of another name) of every option that names a file or directory a command writes
OUTPUT_OPTIONS = (("out", "--out", ""), ("timeline", "--timeline", "step.png"), ("html", "--html", "step.html"),
                  ("picture", "--picture", "fit.png"),
                  ("save_checkpoint", "--save-checkpoint", "a new directory"))


def check_paths(args: argparse.Namespace) -> None:
    """Before any work: the files a command reads exist and are regular files, and no file it writes is one of
    them (``plan m.py:f --out m.py`` once replaced the user's model with a plan; ``plan hf:d/config.json --out
    d/config.json`` the config), unless ``--force`` says so."""
    inputs = _inputs(args)
    force = getattr(args, "force", False)
    command = getattr(args, "command", None)
    example = {"calibrate": "cluster.json", "export": "plan_code.py"}.get(command, "plan.json")
    for attr, option, other in OUTPUT_OPTIONS:
        arg = getattr(args, attr, None)
        if arg is None or not str(arg).strip() or force:
            continue
        for path, what in inputs:
            if _same_file(Path(arg), Path(path)):
                raise PlannerError(f"{option} '{arg}' is {what} this command reads: write to another file, e.g. "
                                   f"{other or example} (or add --force to replace it)")
    if getattr(args, "profile", None) is not None:
        profile_dir(args.profile, force)
    if getattr(args, "out", None) is not None:
        output_file(args.out, example, code=command == "export", force=force,
                    kind="cluster" if command == "calibrate" else "plan")
        if command == "export":
            export_files(args.out, args.format, force)


CONFIG_SUFFIXES = (".yaml", ".yml")  # what ``export --format accelerate --out`` takes: Accelerate's config files


def export_files(out: str, fmt: str, force: bool = False) -> Path | None:
    """``export --out``: the suffix says what is written, and it must be what the format writes (``--out x.yaml``
    once got Python). The accelerate export is a launch config (.yaml) with its Python hook beside it (same name,
    .py): that file is checked as ``--out`` is, and returned; None for the other formats."""
    path = Path(out)
    if path.exists() and not path.is_file():  # a FIFO or /dev/stdout: no suffix to judge
        return None
    suffix = path.suffix.lower()
    if fmt == "accelerate":
        if suffix not in CONFIG_SUFFIXES:
            raise PlannerError(f"--out '{out}': the accelerate export is the YAML accelerate launch --config_file "
                               f"takes: give a .yaml file, e.g. {path.with_suffix('.yaml')} (its Python hook is "
                               f"written beside it as {path.with_suffix('.py')})")
        return output_file(str(path.with_suffix(".py")), "plan_accelerate.py", code=True, force=force, hook_of=path)
    if suffix != ".py":  # a config or plan file above all: never where code is written
        raise PlannerError(f"--out '{out}': the {fmt} export is Python code: give a .py file, e.g. "
                           f"{path.with_suffix('.py')}")
    return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()

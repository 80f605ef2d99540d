"""Shared fixtures: traces of the built-in models are cached per test session (tracing is cheap but not free)."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from slow_tests import ROOT, listed

from fsdp_planner.models import load_model
from fsdp_planner.runtime.launch import FORK_ENV
from fsdp_planner.runtime.zygote import PRELOAD_ENV, ZYGOTE_ENV
from fsdp_planner.trace import Trace, record

# The suite's torchrun jobs fork their ranks from the launcher (``launch.rank_command``): about 4 s of CPU less a
# rank, a third of the suite's; and this process's jobs fork their launchers from a zygote (``runtime/zygote.py``),
# ~3 s less a job. Tests of how a failed or stopped job is reported run launchers and ranks as users get them
# (``as_users_run``).
os.environ.setdefault(FORK_ENV, "1")
os.environ[ZYGOTE_ENV] = str(os.getpid())  # this process's own (each xdist worker's), not its subprocesses'
# transformers and the models the suite's ranks build, imported once in the zygote: ~3 s of CPU a rank otherwise
os.environ[PRELOAD_ENV] = ",".join(("transformers", "transformers.activations", "transformers.masking_utils",
                                    "transformers.models.auto.modeling_auto", "torchao.float8", "peft",
                                    "torch._inductor.compile_fx",
                                    *(f"transformers.models.{t}.modeling_{t}" for t in (
                                        "llama", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3", "gpt2", "bloom",
                                        "phi3", "llama4", "llava", "qwen3_5", "nemotron_h", "jamba", "clip"))))


SLOW = frozenset(listed())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``integration`` the test functions a full run measured over 0.3 s (``slow_tests.txt``,
    written by ``slow_tests.py``), beside those marked so where they are defined: the fast subset is what is left."""
    for item in items:
        # (named from this checkout's root, as the list is, whatever --rootdir the run was given)
        name = item.nodeid.partition("::")[2].partition("[")[0]
        if f"{item.path.relative_to(ROOT).as_posix()}::{name}" in SLOW:
            item.add_marker(pytest.mark.integration)


def as_users_run() -> dict[str, str]:
    """This process's environment less the suite's own launch settings: torchrun's launcher and ranks started
    fresh, as every ``verify`` a user runs starts them."""
    return {k: v for k, v in os.environ.items() if k not in (FORK_ENV, ZYGOTE_ENV)}


def launch_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """The environment of a job a test launches as users launch it (plain torchrun, ``accelerate launch``, a
    Lightning script): one thread a rank, and the test's own directory as the temp directory, where torchrun
    without ``--log-dir`` makes a ``torchelastic_*`` directory it never removes (pytest removes the test's)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), **settings}


@functools.cache
def traced(spec: str) -> Trace:
    lm = load_model(spec, meta=True)
    return record(lm.model, lm.example_inputs, lm.loss_fn)


@pytest.fixture
def seed_trace() -> Trace:
    return traced("seed-net")


def policy(name: str, **settings: object):
    """A policy by name, as the CLI's --policy makes it."""
    from fsdp_planner.planners import PolicyRequest, make_policy

    return make_policy(PolicyRequest.named(name, **settings))


@contextlib.contextmanager
def gathers_by_group(plan) -> Iterator[list[int]]:
    """The plan groups of the all-gathers real FSDP2 issues inside the block, in order: FSDP2's own
    ``foreach_all_gather`` observed, then run."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from fsdp_planner.patching import patched

    owner = {p: i for i, g in enumerate(plan.groups) for p in g.params}
    issued: list[int] = []
    gather = _fsdp_param_group.foreach_all_gather

    def recording(fsdp_params, *args, **kwargs):
        issued.append(owner[fsdp_params[0]._param_fqn])
        return gather(fsdp_params, *args, **kwargs)

    with patched(_fsdp_param_group, "foreach_all_gather", recording):
        yield issued


@dataclass(frozen=True)
class Done:
    """What a CLI command exited with and printed."""

    returncode: int
    stdout: str
    stderr: str


def run_main(*args: str) -> Done:
    """The CLI command ``args`` run in this process (``fsdp_planner.cli.main``): what a subprocess would give, less
    its seconds of imports (a torchrun job it starts is a real one all the same) and what importing prints. Warnings
    go to its stderr under Python's own filters, as a command's do (pytest would record them instead)."""
    from fsdp_planner.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", quiet)  # Python's defaults outside __main__
        warnings.showwarning = _printed
        code = main(list(args))
    return Done(code, out.getvalue(), err.getvalue())


def verify_passes(*args: str) -> Done:
    """``verify ARGS`` run (``run_main``), asserted to pass."""
    r = run_main("verify", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout
    return r


def runs_the_reference(model: Any, layer: Any, name: str, ids: Any) -> None:
    """A stand-in's wrapper (``name``, a module global of ``layer``'s modeling module) hands real tensors to the
    function it wraps: ``model``'s output on ``ids`` is the same with the wrapper as with the wrapped function."""
    import torch

    from fsdp_planner.patching import patched

    module = sys.modules[type(layer).__module__]
    wrapper = getattr(module, name)
    assert getattr(wrapper, "__wrapped_by_fsdp_planner__", False)
    got = model(ids).logits
    with patched(module, name, wrapper.__wrapped__):
        want = model(ids).logits
    assert torch.equal(got, want)


def _printed(message, category, filename, lineno, file=None, line=None) -> None:  # type: ignore[no-untyped-def]
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def max_abs_diff(stdout: str) -> float:
    """The parity a launched example prints (``max_abs_diff X``): read by pattern, since another rank's line may
    land right after it on the shared pipe ("max_abs_diff 0rank 1 of 2: ...")."""
    found = re.search(r"max_abs_diff ([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))", stdout)
    assert found, stdout[-2000:]
    return float(found.group(1))

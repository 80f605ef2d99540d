"""No file from anyone breaks the readers: seeded random mutations of valid plan files, cluster files, checkpoint
metadata and Hugging Face configs (keys deleted, types changed, huge, negative, NaN and infinite numbers, long
strings, control characters, deep nesting, wrong versions, unknown keys), each read by the real reader. Every one
ends in a valid result or a PlannerError of one bounded line, never another exception, and the lot in seconds.

A few go through the CLI in-process as well (``cost`` reads a cluster file, ``export`` and ``simulate`` a plan
file)."""

from __future__ import annotations

import copy
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import traced

from fsdp_planner import cli
from fsdp_planner.errors import PlannerError
from fsdp_planner.fsdp2.collectives import CollectiveKind
from fsdp_planner.fsdp2.plan import Plan, check_plan_world_size
from fsdp_planner.hardware.cluster import Cluster, parse_cluster
from fsdp_planner.hardware.cost import collective_time
from fsdp_planner.models.hf import read_config
from fsdp_planner.planners import SizeBasedPolicy
from fsdp_planner.runtime.checkpoint import parse_meta

SEED = 20261124
CASES = 250  # per kind of file
MAX_MESSAGE = 400  # characters of an error line: long values are cut short, never echoed whole
DEEP = "__DEEP__"  # stands for a value nested thousands of lists deep (json.dumps cannot write one)
HUGE = "__HUGE__"  # stands for an integer of 5,000 digits (json.dumps refuses more than 4,300)

ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1.5, -1e-308, 1e308, 10**40, -(10**40), 10**4000, HUGE, math.nan, math.inf, -math.inf,
    "", "x", "a" * 100_000, "\x00\x1b[31m\nred\r", "名前", [], {}, [1, "a", None], {"a": {"b": [{}]}},
    [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]], DEEP,
]


def _nodes(doc: Any, path: tuple = ()) -> list[tuple]:
    """Every path into ``doc`` (dict keys and list indices), the root included."""
    found = [path]
    if isinstance(doc, dict):
        for k, v in doc.items():
            found += _nodes(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found += _nodes(v, (*path, i))
    return found


def _parent(doc: Any, path: tuple) -> Any:
    for step in path[:-1]:
        doc = doc[step]
    return doc


def _mutate(doc: Any, rng: random.Random) -> Any:
    """One random change of ``doc`` (a deep copy is changed; the root itself may be replaced)."""
    doc = copy.deepcopy(doc)
    path = rng.choice(_nodes(doc))
    choice = rng.randrange(6)
    if not path:
        return rng.choice(ODD_VALUES)
    parent, key = _parent(doc, path), path[-1]
    if choice == 0:  # delete
        del parent[key]
    elif choice == 1 and isinstance(parent, dict):  # an unknown key beside it
        parent[rng.choice(["extra", "grups", "\n", "k" * 5000])] = rng.choice(ODD_VALUES)
    elif choice == 2 and isinstance(parent[key], int | float) and not isinstance(parent[key], bool):
        parent[key] = parent[key] * rng.choice([-1, 0, 1e-300, 1e300, 10**30, math.nan, math.inf])
    elif choice == 3 and isinstance(parent[key], str):
        short = parent[key][:100]  # a long string made longer still would only test the machine's memory
        parent[key] = short * rng.choice([0, 2, 1000]) + rng.choice(["", "\x07", ".", " x", "..", "__init__"])
    elif choice == 4 and isinstance(doc, dict):
        doc["version"] = rng.choice([0, 2, "1", 1.0, None, True, 10**4000, HUGE])
    else:
        parent[key] = rng.choice(ODD_VALUES)
    return doc


def _text(doc: Any) -> str:
    text = json.dumps(doc)  # NaN and Infinity spelled as JavaScript does, as Python's json reads them
    return text.replace(json.dumps(DEEP), "[" * 5000 + "1" + "]" * 5000).replace(json.dumps(HUGE), "9" * 5000)


def _documents(base: dict[str, Any], seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(CASES):
        doc = base
        for _ in range(rng.choice([1, 1, 2, 3])):
            doc = _mutate(doc, rng)
        docs.append(_text(doc))
    return docs


def _plan_doc() -> dict[str, Any]:
    plan = SizeBasedPolicy(2000).plan(traced("seed-net"), "seed-net")
    plan.forward_methods = [("", "loss")]
    return plan.to_dict()


def _cluster_doc() -> dict[str, Any]:
    d = parse_cluster("h100:16").to_dict()
    d["fits"] = {"all_gather": {"8": [2e-5, 3e11]}, "reduce_scatter": {"16": [4e-5, 1e11]}}
    d["tables"] = {"all_gather": [[4096, 1e-4], [1 << 20, 1e-3]]}
    return d


def _meta_doc() -> dict[str, Any]:
    return {"version": 1, "step": 3, "world": 2, "policy": "size", "model": {"name": "seed-net"},
            "fingerprint": "ab", "seed": 0, "lr": 0.1, "digests": {"model.w": "00ff"}}


def _hf_doc() -> dict[str, Any]:
    return {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}


def _settings(seed: int, count: int) -> list[str]:
    """seed-net's own plan with random settings changed (reshard_after_forward, prefetch, labels): files that load,
    so they reach the model and the cluster, where some are refused (3 ranks do not divide 8) and some run."""
    rng = random.Random(seed)
    base = SizeBasedPolicy(2000).plan(traced("seed-net"), "seed-net").to_dict()
    docs = []
    for _ in range(count):
        doc = copy.deepcopy(base)
        group = rng.choice(doc["groups"])
        group["reshard_after_forward"] = rng.choice([True, False, 1, 2, 3, 4, 8, 16])
        group["forward_prefetch"] = rng.sample(range(-1, len(doc["groups"]) + 1), rng.choice([0, 0, 1]))
        doc["policy"] = rng.choice(["", "mine", "\x1b[31mred", "p" * 200])
        docs.append(_text(doc))
    return docs


def _use_plan(text: str, _: Path) -> None:
    plan = Plan.from_json(text, "plan file 'p.json'")
    check_plan_world_size(plan, 8)  # where a plan meets a world size
    assert Plan.from_json(plan.to_json()).signature() == plan.signature()  # what loads, saves and loads again


def _use_cluster(text: str, _: Path) -> None:
    cluster = Cluster.from_json(text, "cluster file c.json")
    for kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
        seconds = collective_time(cluster, kind, 1 << 30)
        assert math.isfinite(seconds) and seconds > 0, (kind, seconds)


def _use_meta(text: str, _: Path) -> None:
    meta = parse_meta(text, "the checkpoint's fsdp-planner.json")
    assert isinstance(meta["step"], int) and meta["step"] >= 0


def _use_hf(text: str, tmp: Path) -> None:
    path = tmp / "config.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    assert isinstance(read_config(str(path))["model_type"], str)


KINDS: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[str, Path], None]]] = {
    "plan": (_plan_doc, _use_plan),
    "cluster": (_cluster_doc, _use_cluster),
    "checkpoint-meta": (_meta_doc, _use_meta),
    "hf-config": (_hf_doc, _use_hf),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_mutated_files_end_in_a_result_or_one_bounded_line(tmp_path: Path, kind: str) -> None:
    make, use = KINDS[kind]
    base = make()
    use(_text(base), tmp_path)  # the unmutated file is read as valid
    start, outcomes = time.perf_counter(), {"valid": 0, "refused": 0}
    for i, text in enumerate(_documents(base, SEED + len(kind))):
        case_start = time.perf_counter()
        try:
            use(text, tmp_path)
            outcomes["valid"] += 1
        except PlannerError as e:
            message = str(e)
            assert "\n" not in message and "\r" not in message, (i, message[:200])
            assert 0 < len(message) <= MAX_MESSAGE, (i, len(message), message[:200])
            outcomes["refused"] += 1
        assert time.perf_counter() - case_start < 2.0, (i, text[:200])
    assert outcomes["refused"] > CASES // 4, outcomes  # the mutations do reach the checks
    assert time.perf_counter() - start < 30.0, outcomes


def test_mutated_files_through_the_cli(capsys, tmp_path: Path) -> None:
    """A few of the same mutations, read by commands in-process: exit 0, or exit 2 with one ``error:`` line."""
    cases = [(t, ["cost", "all-gather", "1GiB", "--cluster", str(tmp_path / "c.json")], "c.json")
             for t in _documents(_cluster_doc(), SEED)[:25]]
    cases += [(t, ["export", str(tmp_path / "p.json")], "p.json") for t in _documents(_plan_doc(), SEED)[:25]]
    # where a plan meets the model and a cluster: the mutations that still load reach check_plan_matches
    simulate = ["simulate", "seed-net", "--plan", str(tmp_path / "p.json"), "--cluster", "h100:8", "--json"]
    cases += [(t, simulate, "p.json") for t in _documents(_plan_doc(), SEED + 1)[:10] + _settings(SEED, 10)]
    succeeded = 0
    for text, argv, name in cases:
        (tmp_path / name).write_text(text)
        code = cli.main(argv)
        err = capsys.readouterr().err
        assert code in (0, 2), (code, err[:300])
        succeeded += code == 0
        if code == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), err[:300]
            assert "internal error" not in err and len(lines[0]) <= MAX_MESSAGE + 100, err[:300]
    assert 0 < succeeded < len(cases)  # some mutations are harmless, some are refused

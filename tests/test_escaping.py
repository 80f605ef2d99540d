"""Data is never code: a name from a plan, cluster or model file (a module, the policy, the model, a GPU) reaches
each output as text. Exported Python holds it as a literal that round-trips and runs nothing, the HTML page's data
is valid JSON that cannot end its <script>, matplotlib never reads it as TeX, and the terminal gets no control
character nor rich markup from it. The payloads are the model's module names (tests/fixtures/hostile_names.py),
the policy and model names of a plan, and a cluster's GPU name; each output is checked on the objects and through
the CLI (whose file loaders may refuse some payloads first: then the one-line error is checked instead)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import io
import json
import math
import re
import shutil
import struct
import subprocess
import tokenize
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fsdp_planner import cli
from fsdp_planner.apply.export import ExportFormat, export_plan, py_literal
from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import printable
from fsdp_planner.fsdp2.plan import Group, Plan
from fsdp_planner.hardware.cluster import parse_cluster
from fsdp_planner.models import load_model
from fsdp_planner.planners import PolicyRequest, make_policy
from fsdp_planner.report.step_view import Bar, BarKind, Lane, StepView, step_view
from fsdp_planner.report.timeline_html import render_html, script_json
from fsdp_planner.report.timeline_png import plain, write_png
from fsdp_planner.trace import record

FIXTURES = Path(__file__).parent / "fixtures"
MODEL_FILE = FIXTURES / "hostile_names.py"


def _payloads() -> tuple[str, ...]:
    """The fixture's payloads, as the model names its modules."""
    spec = importlib.util.spec_from_file_location("hostile_names", MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PAYLOADS


PAYLOADS = _payloads()

# The report's exploit: a policy that closes the exported docstring, runs code and opens a string, and a
# checkpointed module (the last name) that closes that string and runs more; the same for a single-quoted literal
# and a comment.
CODE = ['order(168 KiB)"""\nPWNED = 1\n_ = \'\'\'', "'''\nPWNED = 1\n'''", "'];PWNED = 1;x = ['", "x\nPWNED = 1 #",
        "x''' ;PWNED = 2 #"]
NAMES = [*PAYLOADS, *CODE]


# a plan's labels are one line (a line break is refused when it is read: it would pose as the program's own line), so
# their payloads are the one-line ones; module names keep every payload
ONE_LINE = [c for c in CODE if "\n" not in c]


def _plan(names: list[str] = NAMES, policy: str = ONE_LINE[0], model: str = "m\x1b]0;pwned\x07<!--$x$[/b]") -> Plan:
    """A plan whose every string is a payload: one group per name, the first checkpointed and listing a method."""
    groups = [Group([n], [f"{i}.weight"], reshard_after_forward=True) for i, n in enumerate(names)]
    return Plan([*groups, Group([""], [], False)], "fingerprint", 1, policy=policy, model=model,
                activation_checkpointing=[names[0], names[-1]], forward_methods=[(names[1], "loss")])


def _run_module(source: str) -> dict:
    """Compile and run an exported module; it must be ASCII (no encoding can garble it) and define no PWNED."""
    assert source.isascii()
    scope: dict = {"__name__": "exported"}
    exec(compile(ast.parse(source), "exported.py", "exec"), scope)
    assert "PWNED" not in scope
    return scope


@pytest.mark.parametrize("fmt", list(ExportFormat))
def test_exported_code_holds_every_name_as_a_literal_that_round_trips(fmt):
    plan = _plan()
    source = export_plan(plan, fmt)
    scope = _run_module(source)
    assert scope["POLICY"] == plan.policy and scope["MODEL"] == plan.model
    assert [names for names, _ in scope["GROUPS"]] == [[n] for n in NAMES]
    assert scope["CHECKPOINTED"] == [NAMES[0], NAMES[-1]] and scope["FORWARD_METHODS"] == [(NAMES[1], "loss")]
    docstring = ast.get_docstring(ast.parse(source))
    assert "PWNED" not in docstring and "$x$" not in docstring  # the names are in the constants only
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    assert comments and not any("PWNED" in c or "$x$" in c or "\\x1b" in c for c in comments)


def test_py_literal_writes_plain_values_and_refuses_others():
    class Sneaky(str):
        def __repr__(self) -> str:
            return "__import__('os').system('true')"

    assert py_literal(Sneaky("a")) == "'a'"  # the str's value, not its class's repr
    assert py_literal([("é\u2028\x00", True, None, 3)]) == "[('\\xe9\\u2028\\x00', True, None, 3)]"
    assert ast.literal_eval(py_literal({1: ["\\N", '"""']})) == {1: ["\\N", '"""']}

    class SneakyFloat(float):
        def __repr__(self) -> str:
            return "__import__('os').system('true')"

    assert py_literal(SneakyFloat(1.5)) == "1.5"  # a float as its value (issue 40: floats export exactly)
    for value in (math.nan, math.inf, object(), {"a"}):
        with pytest.raises(PlannerError, match="cannot export a plan holding"):
            py_literal(value)


@pytest.fixture(scope="module")
def hostile_view() -> StepView:
    """The hostile model's step on a cluster whose GPU is a payload, with a payload policy; its all-gather lane
    replaced by one bar per name, each wide enough (1/22 of the step) for both pictures to write the name in it."""
    lm = load_model(f"{MODEL_FILE}:build")
    tr = record(lm.model, lm.example_inputs, lm.loss_fn)
    plan = make_policy(PolicyRequest.named("order", min_nonwrapped_numel=1000)).plan(tr)
    plan = plan.replace(policy="<script>alert(1)</script> $x$ [/bold] \x1b[2J")
    base = parse_cluster("h100:8")
    cluster = dataclasses.replace(base, gpu=dataclasses.replace(base.gpu, name="</script><!--$y$"))
    view = step_view(tr, plan, cluster)
    span = view.report.step_time / len(PAYLOADS)
    wide = Lane(view.lanes[1].name, [Bar(BarKind.ALL_GATHER, n, i * span, (i + 1) * span)
                                     for i, n in enumerate(PAYLOADS)])
    return dataclasses.replace(view, lanes=[view.lanes[0], wide, *view.lanes[2:]])


class _Scripts(HTMLParser):
    """The page's <script> elements as the browser's parser splits them."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[tuple[dict, str]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "script":
            self.scripts.append((dict(attrs), ""))

    def handle_data(self, data: str) -> None:
        if self.scripts and self.lasttag == "script":
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)


def _no_constant(name: str) -> float:
    raise AssertionError(f"JSON holds {name}")


def test_html_data_cannot_end_its_script_and_loads_as_json(hostile_view):
    page = render_html([hostile_view], "<b>title</b> \x1b[2J")
    parser = _Scripts()
    parser.feed(page)
    assert [a.get("id") for a, _ in parser.scripts] == ["timeline-data", None]  # both scripts, neither cut short
    text = parser.scripts[0][1]
    for bad in ("</script", "<!--", "<script", "\u2028"):
        assert bad not in text.lower()
    data = json.loads(text, parse_constant=_no_constant)
    assert set(PAYLOADS) <= set(data["views"][0]["names"])
    assert data["views"][0]["gpu"] == "</script><!--$y$" and "<script>alert(1)</script>" in data["views"][0]["summary"]
    assert "<b>title</b>" not in page and "&lt;b&gt;title&lt;/b&gt;" in page


def test_html_data_has_no_nan(hostile_view):
    nan_view = dataclasses.replace(hostile_view, capacity=math.nan)
    data = json.loads(script_json({"v": [math.nan, math.inf, 1.5], "s": "<&>"}), parse_constant=_no_constant)
    assert data == {"v": [None, None, 1.5], "s": "<&>"}
    page = render_html([nan_view], "t")
    loaded = json.loads(re.search(r'id="timeline-data">(.*?)</script>', page, re.S).group(1),
                        parse_constant=_no_constant)
    assert loaded["views"][0]["capacity"] is None


def test_timeline_js_writes_text_nodes_only():
    script = (Path(cli.__file__).parents[1] / "report" / "timeline.js").read_text()
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "document.write" not in script


def _png_ok(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24])[0] > 0


def test_png_draws_every_name_as_text(hostile_view, tmp_path):
    from matplotlib.cbook import is_math_text
    from matplotlib.figure import Figure

    write_png([hostile_view], tmp_path / "t.png", "$\\frac{$ <title>")
    _png_ok(tmp_path / "t.png")
    fig = Figure()
    texts = [fig.text(0.1, i / len(NAMES), plain(n)) for i, n in enumerate(NAMES)]
    fig.savefig(tmp_path / "names.png")  # each parsed as mathtext here would fail ($\frac{$) or be typeset
    for t in texts:
        assert not is_math_text(t.get_text())


def test_printable_shows_control_characters_as_escapes():
    shown = printable("a\x1b]0;pwned\x07b\x1b[2J\tc\nd\u202e\x9b\x7fé")
    assert shown == "a\\x1b]0;pwned\\x07b\\x1b[2J\tc\nd\\u202e\\x9b\\x7fé"  # tab, newline and letters kept
    # invisible characters: a name of a no-break space read as the root's blank row (a trial); letters of any script,
    # dashes and ellipses stay
    assert printable("\u00a0|\ufeffa|b\u200bc|\u00ad|\u2060") == "\\xa0|\\ufeffa|b\\u200bc|\\xad|\\u2060"
    assert printable("é中文—…ß") == "é中文—…ß"


@pytest.mark.parametrize("edit, said", [
    (lambda p: p.with_group(0, modules=("x\ny",)), "plan names modules the model does not have: x\\ny"),
    (lambda p: p.replace(activation_checkpointing=["x\ny"]), "activation_checkpointing names a module the model "
                                                             "does not have: 'x\\ny'"),
    (lambda p: p.replace(compiled=["x\ny"]), "plan 'compiled' names modules the model does not have: x\\ny"),
    (lambda p: p.replace(activation_offloading=["x\ny"]), "activation_offloading names a module the model does not "
                                                          "have: 'x\\ny'"),
    (lambda p: p.replace(forward_methods=[("x\ny", "loss")]), "the model has no module 'x\\ny'"),
], ids=["group", "checkpointed", "compiled", "offloaded", "forward-method"])
def test_apply_plan_refusals_show_a_name_s_newline_escaped(edit, said):
    """A module name is anything add_module takes, a newline too: apply_plan's refusals naming one are one line
    (the CLI showed the rest as '+1 more lines', an API caller a line that posed as its own)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_planner.apply import apply_plan
    from fsdp_planner.runtime.fake_world import fake_process_group

    lm = load_model("toy-llama", meta=False)
    plan = make_policy(PolicyRequest.named("titan")).plan(record(lm.model, lm.example_inputs, lm.loss_fn))
    with fake_process_group(2), pytest.raises(PlannerError) as refused:
        apply_plan(lm.model, edit(plan), mesh=init_device_mesh("cpu", (2,)))
    assert len(str(refused.value).splitlines()) == 1 and said in str(refused.value), str(refused.value)


def test_a_plan_file_s_params_listed_in_a_refusal_stay_on_its_line(tmp_path, capsys):
    """simulate and export list a plan's extra params (short_list): a newline in one split the line."""
    plan = tmp_path / "plan.json"
    assert cli.main(["plan", "toy-llama", "--policy", "titan", "--out", str(plan), "--quiet"]) == 0
    data = json.loads(plan.read_text())
    data["groups"][0]["params"].append("x\ny")
    plan.write_text(json.dumps(data))
    capsys.readouterr()
    for command in (["simulate", "toy-llama", "--plan", str(plan), "--cluster", "h100:2"], ["export", str(plan)]):
        assert cli.main(command) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "extra parameters: x\\ny" in err, err


# -- the CLI: every command that prints a name from a file ------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A cluster file with payload names, a plan file of the hostile model with a payload policy and model name."""
    d = tmp_path_factory.mktemp("files")
    cluster = parse_cluster("h100:8").to_dict()
    cluster["name"] = "[/bold]\x1b]0;pwned\x07"
    cluster["gpu"]["name"] = "[/x]\x1b[2J<!--"
    cluster["overhead"]["source"] = "[/i]\x1b[31m"
    (d / "cluster.json").write_text(json.dumps(cluster))
    (d / "cluster2.json").write_text(json.dumps({**cluster, "gpus_per_node": 2}))  # for verify's 2 ranks
    lm = load_model(f"{MODEL_FILE}:build")
    plan = make_policy(PolicyRequest.named("order", min_nonwrapped_numel=1000)).plan(
        record(lm.model, lm.example_inputs, lm.loss_fn))
    plan = plan.replace(policy="order[/bold]\x1b]0;pwned\x07" + ONE_LINE[0], model="net[/b]\x1b[2J")
    (d / "plan.json").write_text(plan.to_json())
    model_dir = d / "net[/bold]\x1b[2J"  # the model's own name (its path) a payload too
    model_dir.mkdir(parents=True)  # ("net[" holding "bold]...")
    shutil.copy(MODEL_FILE, model_dir / MODEL_FILE.name)
    (d / "out[").mkdir()  # output paths with markup in them: out[/b].json is out[ / b].json
    return {"cluster": d / "cluster.json", "plan": d / "plan.json", "dir": d,
            "model": f"{model_dir / MODEL_FILE.name}:build", "out": d / "out[" / "b]"}


def _clean(capsys, *args: str) -> tuple[int, str, str]:
    """Run a command; whatever it answers, no raw control character, no markup error, no internal error."""
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    for text in (out, err):
        assert not re.search("[\x00-\x08\x0b-\x1f\x7f]", text), (args, text[-500:])
        assert "MarkupError" not in text and "internal error" not in text and "Traceback" not in text, text[-500:]
    # a file loader that refuses a payload answers in one line (never a usage error: the arguments are right)
    refused = code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "--help" not in err
    assert code == 0 or refused, (args, code, err)
    return code, out, err


@pytest.mark.integration  # over a second: the full suite runs it, the fast subset does not
def test_commands_print_names_from_files_as_text(files, capsys):
    model, cluster, plan = files["model"], str(files["cluster"]), str(files["plan"])
    dest = files["out"]
    runs = [("plan", model, "--policy", "order", "--cluster", cluster, "--out", f"{dest}.json"),
            ("plan", model, "--policy", "auto", "--cluster", cluster, "--explain"),
            ("simulate", model, "--plan", plan, "--cluster", cluster, "--compare", "size"),
            ("check", model, "--plan", plan, "--cluster", cluster),
            ("memory", model, "--world-size", "8"),
            ("cost", "all-gather", "1GiB", "--cluster", cluster),
            ("export", plan),
            ("calibrate", str(FIXTURES / "nccl" / "all_gather_perf_8xh100.log"), "--base", cluster, "--out",
             f"{dest}.cluster.json"),
            ("verify", model, "--plan", plan, "--fake-world-size", "2", "--precision", "fp32"),
            ("plan", f"{MODEL_FILE}:no_bf16", "--policy", "order"),  # the model's own error, quoted in the verdict
            ("models",)]
    shown = ""
    for args in runs:
        _, out, err = _clean(capsys, *args)
        shown += out + err
    assert "\\x1b]0;pwned\\x07" in shown and "net[/bold]\\x1b[2J" in shown  # the names printed, as written
    assert "the model's forward raised ValueError: [/bold] no bf16 here \\x1b[2J; cast in forward" in shown
    assert f"plan written to {dest}.json" in shown and f"cluster written to {dest}.cluster.json" in shown


def test_simulate_writes_both_pictures_of_hostile_names(files, capsys):
    html, png = Path(f"{files['out']}.html"), Path(f"{files['out']}.png")
    code, _, err = _clean(capsys, "simulate", files["model"], "--plan", str(files["plan"]), "--cluster",
                          str(files["cluster"]), "--html", str(html), "--timeline", str(png))
    assert code == 0, err
    _png_ok(png)
    json.loads(re.search(r'id="timeline-data">(.*?)</script>', html.read_text(), re.S).group(1),
               parse_constant=_no_constant)


def test_exported_plan_file_runs_nothing(files, capsys, tmp_path):
    out = tmp_path / "exported.py"
    for fmt in ExportFormat:
        target = out.with_suffix(".yaml") if fmt is ExportFormat.ACCELERATE else out  # (the code beside the YAML)
        code, _, _ = _clean(capsys, "export", str(files["plan"]), "--format", fmt.value, "--out", str(target))
        if code == 0:  # (a loader that refuses the plan's names answers in one line instead)
            scope = _run_module(out.read_text(encoding="ascii"))
            assert scope["POLICY"] == json.loads(files["plan"].read_text())["policy"]


@pytest.mark.integration
def test_slower_commands_print_names_from_files_as_text(files, capsys):
    """verify on 2 torchrun ranks (the hostile model, plan and cluster), a calibration from a hostile base cluster,
    and the demo on the hostile model."""
    code, out, _ = _clean(capsys, "verify", files["model"], "--plan", str(files["plan"]), "--nproc", "2", "--steps",
                          "2", "--cluster", str(files["dir"] / "cluster2.json"))
    assert code == 2 or ("PASS" in out and "net[/bold]\\x1b[2J" in out)  # (2: a loader refused a payload)
    log = FIXTURES / "nccl" / "all_gather_perf_8xh100.log"
    _clean(capsys, "calibrate", str(log), "--base", str(files["cluster"]), "--out", str(files["dir"] / "cal.json"))
    _clean(capsys, "demo", "--model", files["model"], "--cluster", str(files["cluster"]), "--out-dir",
           f"{files['out']}.demo")


@pytest.mark.integration
def test_html_shows_a_script_module_name_as_text_in_chromium(hostile_view, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run installs it)")
    path = tmp_path / "hostile.html"
    path.write_text(render_html([hostile_view], "<script>document.title='pwned'</script>"), encoding="utf-8")
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                        "--window-size=3000,1000",  # each name's bar over 60 pixels wide: the page writes it inside
                        "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Uncaught" not in r.stderr and ":CONSOLE" not in r.stderr, r.stderr[-2000:]
    assert 'data-rendered="1"' in r.stdout  # the page's script ran to its end
    dom = r.stdout
    assert dom.count("</script>") == 2 and "<title>pwned" not in dom  # no element came from a name
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom  # the policy in the plan's title, as text
    labels = re.findall(r'font-size="11" pointer-events="none">([^<]*)</text>', dom)
    assert "&lt;!--&lt;script&gt;" in labels and "&lt;/script&gt;" in labels  # module names inside their bars
    path.write_text(render_html([dataclasses.replace(hostile_view, capacity=math.nan)], "t"), encoding="utf-8")
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                        "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120)
    assert "Uncaught" not in r.stderr and 'data-rendered="1"' in r.stdout, r.stderr[-2000:]  # a NaN figure too
    assert "&lt;/script&gt;&lt;!--$y$: n/a" in r.stdout  # the capacity it could not show


def test_verify_table_shows_names_from_a_run_as_text():
    """What a torchrun job reports back (the checkpoint's plan name, its directory, the worst param, the cluster)
    comes from files too: the table renders it as written."""
    from rich.console import Console

    from fsdp_planner.cli.render import verify_table
    from fsdp_planner.runtime.verify import VerifyResult

    counts = {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 0}
    result = VerifyResult(2, 1, "gloo", counts, [counts], [counts], counts, [1.0], [1.0], 1.0, param_error=2.0,
                          worst_param="w[/bold]", start_step=1, saved="ck[/i]", step_seconds=[0.1],
                          predicted_step=0.1, loaded={"step": 1, "world": 2, "policy": "order[/bold]", "tensors": 3,
                                                      "mismatched": ["k[/x]"]})
    console = Console(file=io.StringIO(), width=400)
    console.print(verify_table(result, cluster="c[/b]"))
    shown = console.file.getvalue()
    assert all(name in shown for name in ("w[/bold]", "ck[/i]", "order[/bold]", "k[/x]", "c[/b]")), shown
    # a long name on a narrow terminal folds, whole, where it was cut short with an ellipsis
    long = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    console = Console(file=io.StringIO(), width=80)
    console.print(verify_table(dataclasses.replace(result, worst_param=long)))
    measured = "".join(line.split("│")[3].strip() for line in console.file.getvalue().splitlines()
                       if line.count("│") == 5)  # the measured column's cells, read down
    assert long in measured and "…" not in measured, console.file.getvalue()


def test_a_name_no_text_can_hold_is_said_as_that(tmp_path, capsys):
    """A module named by a lone surrogate (Python's str takes it; UTF-8 and so a plan file cannot) failed as
    "tracing ... failed: UnicodeEncodeError" (a trial): the name is said, in one line."""
    from fsdp_planner.cli import main

    path = tmp_path / "odd.py"
    path.write_text("import torch\nfrom torch import nn\n\n\ndef build():\n    m = nn.Sequential()\n"
                    "    m.add_module('\\ud800', nn.Linear(4, 4))\n    return m, (torch.randn(2, 4),)\n")
    assert main(["plan", f"{path}:build", "--policy", "titan", "--cluster", "h100:8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: model '{path}:build' names a module, param or buffer '\\ud800', which is no valid text "
                   "(a lone surrogate: UTF-8 cannot hold it, nor a plan file): rename it"), err
    # a buffer so named, and a module's second name (an alias tracing reads too), the same (the review)
    for second in ("m.register_buffer('\\ud800', torch.ones(1))", "m.add_module('\\udc00', m[0])"):
        path.write_text("import torch\nfrom torch import nn\n\n\ndef build():\n    m = nn.Sequential(nn.Linear(4, 4))\n"
                        f"    {second}\n    return m, (torch.randn(2, 4),)\n")
        assert main(["plan", f"{path}:build", "--policy", "titan", "--cluster", "h100:8"]) == 2
        assert "which is no valid text (a lone surrogate" in capsys.readouterr().err

"""The docs stay true to the code: docs/api.md is what docs/gen_api.py makes of today's docstrings, and every
relative link in the docs and the README names a file that exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# [text](target) and ![alt](target); the target ends at whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date(tmp_path: Path) -> None:
    out = tmp_path / "api.md"
    _gen_api().main(["gen_api.py", str(out)])
    assert out.read_text(encoding="utf-8") == (DOCS / "api.md").read_text(encoding="utf-8"), (
        "docs/api.md is out of date: run `python docs/gen_api.py`")


def test_api_reference_follows_a_changed_docstring(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsdp_planner

    gen = _gen_api()
    monkeypatch.setattr(fsdp_planner.apply_plan, "__doc__", "A docstring nobody wrote.")
    assert "A docstring nobody wrote." in gen.render()
    assert gen.render() != (DOCS / "api.md").read_text(encoding="utf-8")


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    targets = (m.group(1) for m in LINK.finditer(text))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(page: Path) -> None:
    missing = [t for t in _relative_links(page) if not (page.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("[ok](p.md) [gone](nowhere.md#x) [web](https://x.org) ![pic](img.png)\n```\n[code](no.md)\n```\n")
    assert _relative_links(page) == ["p.md", "nowhere.md#x", "img.png"]

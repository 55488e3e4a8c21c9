"""Issue 30, deliver 3: each technique file's technique section (tests/section.py: from its first heading to
check_args) is what a copier takes, so it needs torch, einops and the standard library only, every name it
reads is defined in it, and every collective, point-to-point op and rank query in it names its group. Each
file's own copy-out test then runs the section so loaded (`section.load`) on a model that is not the GPT."""

import re

import pytest

import section
from helpers import ROOT
from test_repo import TECHNIQUES


@pytest.mark.parametrize("name", TECHNIQUES)
def test_section_needs_only_torch_and_einops(name):
    assert not section.imported_roots(name), section.imported_roots(name)
    assert not section.free_names(name), (
        f"{name}'s technique section reads names it does not define: "
        f"{sorted(section.free_names(name))}"
    )
    # runs: its definitions, defaults and class bodies evaluate with torch and einops alone
    section.load(name)


@pytest.mark.parametrize("name", TECHNIQUES)
def test_section_names_its_group_in_every_collective(name):
    assert not section.ungrouped(name), section.ungrouped(name)


@pytest.mark.parametrize("name", TECHNIQUES)
def test_section_is_run_alone_by_a_test(name):
    """Some test executes this file's section alone (section.load) rather than importing the file."""
    callers = [
        f.name
        for f in (ROOT / "tests").glob("*.py")
        if re.search(rf"""section\.load\(\s*["']{re.escape(name)}["']""", f.read_text())
    ]
    assert callers, f"no test runs {name}'s technique section through section.load"


def test_the_checks_catch_what_they_are_for():
    """Each check fails on a section broken on purpose: a name taken from common.py, a numpy import, a
    collective on the default group, a point-to-point op without its group, a rank asked of the world."""
    text = (ROOT / "context_parallel.py").read_text()
    start = re.search(r"^# [-=]{10}", text, re.M).start()

    def with_(line, imports=""):
        body = text[:start] + line + "\n\n\n" + text[start:]
        return imports + body if imports else body

    # the unbroken sample passes
    assert not section.free_names("x.py", text) and not section.ungrouped("x.py", text)
    assert "IGNORE" in section.free_names(
        "x.py", with_("# " + "-" * 20 + "\ndef loss(y):\n    return y != IGNORE")
    )
    assert section.imported_roots("x.py", "import numpy as np\n" + text) == {"numpy"}
    for bad in [
        "dist.all_reduce(x)",
        "dist.P2POp(dist.isend, t, peer)",
        "dist.get_rank()",
        "torch.distributed.broadcast(t, 0)",
        "dist.all_to_all_single(out, x, None, None)",
        "dist.all_gather_single(out, x)",
        "dist.get_backend()",
    ]:
        broken = with_("# " + "-" * 20 + f"\ndef f(x, t, peer, out):\n    {bad}")
        assert section.ungrouped("x.py", broken), bad
    for good in [
        "dist.all_reduce(x, group=g)",
        "dist.P2POp(dist.isend, t, peer, g)",
        "dist.get_rank(g)",
        "all_reduce(x, g)",
    ]:  # the last: the file's own helper, which takes the group itself
        assert not section.ungrouped(
            "x.py", with_("# " + "-" * 20 + f"\ndef f(x, t, peer, g):\n    {good}")
        ), good

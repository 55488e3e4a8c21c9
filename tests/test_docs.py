"""Every command printed in README.md and docs/*.md runs as printed, as far as can be checked without
training: the file exists, torchrun's own flags parse (torch's torchrun parser), the script's flags parse with
its Args (harness.parse_args) and its argument checks accept them at the printed world size (--nnodes x
--nproc_per_node; 1 for plain `python`). In process, without a launch: the script's main() runs with sys.argv
and WORLD_SIZE set as torchrun would set them, and stops the moment its check_args returns (a refusal is the
SystemExit(2) of `common.fail`). Training is what the per-file tests launch; the README's first command is
launched for real in test_repo.py."""

import ast
import contextlib
import functools
import importlib.util
import inspect
import io
import os
import re
import shlex
import subprocess
import sys
from unittest import mock

import pytest
from torch.distributed.run import get_args_parser

from helpers import ROOT

COMMAND = re.compile(r"^(torchrun|python3?|bash|pip|srun)\b")
# check_args, check_bench_args; never check_common_args alone
CHECKS = re.compile(r"^check_(\w+_)?args$")


def commands_in(text):
    """Command lines of a Markdown text: lines of fenced blocks and inline `code` spans that start with a
    command word (after an optional `$ ` prompt and VAR=value prefixes); `\\` continuations joined."""
    found, fenced = [], False
    for line in text.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        spans = [line] if fenced else re.findall(r"`([^`]+)`", line)
        for span in spans:
            span = re.sub(
                r"\s+#\s.*$", "", re.sub(r"^\s*\$\s+", "", span.strip())
            )  # prompt, comment
            for part in re.split(r"\s*&&\s*(?=(?:[^']*'[^']*')*[^']*$)", span):  # && outside quotes
                part = re.sub(r"^(\w+=\S*\s+)+", "", part.strip())  # OMP_NUM_THREADS=1 torchrun ...
                part = re.split(r"\s+\|\s+(?=(?:[^']*'[^']*')*[^']*$)", part)[
                    0
                ]  # not what it is piped into
                if COMMAND.match(part) and part.split()[0] != part:  # a command word alone is prose
                    found.append(part)
    return found


def printed_commands():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [
        (page.relative_to(ROOT).as_posix(), cmd)
        for page in pages
        for cmd in commands_in(page.read_text())
    ]


def docstring_commands():
    """The indented command lines of each script's module docstring (its "commands" part, DESIGN.md)."""
    found = []
    for path in sorted(ROOT.glob("*.py")):
        doc = re.sub(r"\\\n\s*", " ", ast.get_docstring(ast.parse(path.read_text())) or "")
        found += [
            (path.name, c)
            for l in doc.splitlines()
            if re.match(r"\s+(torchrun|python3?|bash)\s", l)
            for c in commands_in(f"`{l.strip()}`")
        ]
    return found


class Accepted(Exception):
    """Raised when a script's check_args returned: its flags passed at this world size."""


@functools.lru_cache(maxsize=None)
def load(path):
    """Import a repo script once, as a fresh module (its own name, so that parse_args finds its Args' source),
    with its argument checks wrapped to raise Accepted once they return."""
    if str(ROOT) not in sys.path:
        # the scripts import common and harness, as `python FILE.py` lets them
        sys.path.insert(0, str(ROOT))
    name = f"_docs_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    checks = [
        n
        for n in vars(module)
        if CHECKS.match(n)
        and n != "check_common_args"
        and getattr(getattr(module, n), "__module__", "") == name
    ]

    def stop_after(check):
        def wrapped(*a, **k):
            check(*a, **k)
            raise Accepted

        return wrapped

    for n in checks:
        setattr(module, n, stop_after(getattr(module, n)))
    return module, checks


# parse_args reads each Args' help from its source: once per class here, not once per command (a 1 s parse)
getsource = functools.lru_cache(maxsize=None)(inspect.getsource)


def accepts(script, argv, world, local=None):
    """None if `script argv` passes its parse and checks at `world` processes (`local` of them on this node),
    else the reason (a string)."""
    path = ROOT / script
    if not path.is_file():
        return f"{script}: no such file"
    if path.suffix == ".sh":
        words = set(re.findall(r"--[\w-]+", " ".join(argv)))
        named = [
            ROOT / f for f in re.findall(r"[\w/]+\.py", path.read_text())
        ]  # what the script runs
        text = path.read_text() + "".join(f.read_text() for f in named if f.is_file())
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        missing = [w for w in words if w not in text]
        return (
            (syntax.returncode and syntax.stderr)
            or (missing and f"{script}: no flag {missing}")
            or None
        )
    module, checks = load(path)
    if not checks:  # a helper script: its flags must at least appear in it
        missing = [w for w in re.findall(r"--[\w-]+", " ".join(argv)) if w not in path.read_text()]
        return missing and f"{script}: no flag {missing}" or None
    env = dict(
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local or world), RANK="0", LOCAL_RANK="0"
    )
    saved_env, saved_argv, err = {k: os.environ.get(k) for k in env}, sys.argv, io.StringIO()
    os.environ.update(env)
    sys.argv = [str(path), *argv]
    try:
        with (
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
            mock.patch.object(inspect, "getsource", getsource),
        ):
            module.main()
        return f"{script}: main() returned without calling {checks}"
    except Accepted:
        return None
    except SystemExit as e:
        why = err.getvalue().strip()
        return f"{script} {' '.join(argv)}: refused at world {world} (exit {e.code}): {why}"
    finally:
        sys.argv = saved_argv
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def runs_as_printed(cmd):
    """None if the command line would start and pass its argument checks, else why not."""
    # $(scontrol ...): a host name
    words = shlex.split(re.sub(r"\$\([^)]*\)", "HOST", cmd), comments=True)
    head, rest = words[0], words[1:]
    if head == "srun":  # srun ... bash -c 'torchrun ...': the command srun starts on each node
        inner = rest[rest.index("-c") + 1] if "-c" in rest else None
        return runs_as_printed(inner) if inner else f"srun without bash -c: {cmd}"
    if head == "pip":
        reqs = [rest[i + 1] for i, w in enumerate(rest) if w == "-r"]
        return next((f"no file {r}" for r in reqs if not (ROOT / r).is_file()), None)
    if head == "bash":
        return (
            accepts(rest[0], rest[1:], 1) if rest and rest[0] != "-c" else runs_as_printed(rest[1])
        )
    if head == "torchrun":
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                t = get_args_parser().parse_args(rest)
        except SystemExit:
            return f"torchrun refuses its flags: {err.getvalue().strip().splitlines()[-1]}"
        nodes, local = int(str(t.nnodes).split(":")[-1]), int(t.nproc_per_node)
        return accepts(t.training_script, t.training_script_args, nodes * local, local)
    if rest[:1] == ["-m"]:  # python -m venv DIR / python -m pytest PATHS
        if rest[1] == "pytest":
            paths = [
                w
                for i, w in enumerate(rest[2:])
                if not w.startswith("-") and not (i and rest[1 + i] in ("-k", "-m", "-o", "-p"))
            ]  # not an option's value
            return next(
                (f"no path {p}" for p in paths if not (ROOT / p.split("::")[0]).exists()), None
            )
        return None if rest[1] == "venv" else f"python -m {rest[1]}: not a command this repo prints"
    return accepts(rest[0], rest[1:], 1)


def test_the_reader_finds_the_commands():
    """The extraction sees fenced, inline, prompted, env-prefixed, continued and srun-wrapped commands, and
    not prose; and the docs print commands for every technique file."""
    sample = (
        "Run `torchrun --nproc_per_node=2 dp.py --check` or `python` alone.\n```bash\n"
        "$ OMP_NUM_THREADS=1 python plan.py --model gpt3-6.7b \\\n  --nodes 1   # a comment\n"
        "srun -N 2 bash -c 'torchrun --nnodes=2 --nproc_per_node=4 dp.py'\n"
        "python plan.py --tp 8 | tail -1\nplan (predictions): ...\n```\n"
    )
    assert commands_in(sample) == [
        "torchrun --nproc_per_node=2 dp.py --check",
        "python plan.py --model gpt3-6.7b    --nodes 1",
        "srun -N 2 bash -c 'torchrun --nnodes=2 --nproc_per_node=4 dp.py'",
        "python plan.py --tp 8",
    ]
    printed = " ".join(c for _, c in printed_commands())
    from test_repo import TECHNIQUES

    assert not [t for t in TECHNIQUES if t not in printed], [
        t for t in TECHNIQUES if t not in printed
    ]


def test_the_check_catches_what_it_is_for():
    """Each way a printed command can be wrong is caught: a misspelt flag, a missing file, a flag torchrun
    does not know, a layout the file refuses at the printed world size, a helper-script flag that does not
    exist; and the right commands pass (the control)."""
    assert runs_as_printed("torchrun --nproc_per_node=4 gpipe.py --microbatches 8 --check") is None
    assert runs_as_printed("python plan.py --model gpt3-6.7b --nodes 1") is None
    assert runs_as_printed("bash tests/gpu_check.sh --cpu") is None
    assert "microbatchs" in runs_as_printed(
        "torchrun --nproc_per_node=4 gpipe.py --microbatchs 8 --check"
    )
    assert "no such file" in runs_as_printed("torchrun --nproc_per_node=4 gpipe2.py --check")
    assert "torchrun refuses" in runs_as_printed("torchrun --nproc_per_nodes=4 gpipe.py --check")
    # 8 sequences in 3 micro-batches
    # needs a process per stage
    assert "refused at world 3" in runs_as_printed(
        "torchrun --nproc_per_node=3 gpipe.py --batch-size 8 --microbatches 3"
    )
    assert "refused at world 1" in runs_as_printed("python gpipe.py --check")
    # 4 layers only
    assert "world 8" in runs_as_printed("torchrun --nnodes=2 --nproc_per_node=4 gpipe.py")
    assert "no flag" in runs_as_printed("bash tests/gpu_check.sh --gpus")
    assert "no path" in runs_as_printed("python -m pytest -q tests/test_nothing.py")
    page = (
        "Pipelines:\n```bash\ntorchrun --nproc_per_node=4 gpipe.py --microbatchs 8 --check\n```\n"
    )
    assert [runs_as_printed(c) for c in commands_in(page)] != [None]  # read from a page, as below


@pytest.mark.parametrize(
    "page,cmd", printed_commands(), ids=lambda x: x if x.endswith(".md") else x[:60]
)
def test_printed_command_runs_as_printed(page, cmd):
    why = runs_as_printed(cmd)
    assert why is None, f"{page}: `{cmd}`: {why}"


def links_in(page):
    """Relative links of a Markdown page, `[text](path)` and `[text](path#anchor)`, that do not resolve."""
    text = page.read_text()
    targets = [
        t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"\w+://", t)
    ]
    return [t for t in targets if t and not (page.parent / t).exists()]


def test_links_resolve(tmp_path):
    """Every page the README and docs/ link to exists (a link to a missing page is caught)."""
    (tmp_path / "tests.md").write_text("")
    sample = tmp_path / "sample.md"
    sample.write_text("[ok](tests.md) [web](https://pytorch.org) [gone](no.md#x)\n")
    assert links_in(sample) == ["no.md"]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = {p.relative_to(ROOT).as_posix(): links_in(p) for p in pages}
    assert not {k: v for k, v in broken.items() if v}, broken


@pytest.mark.parametrize(
    "script,cmd", docstring_commands(), ids=lambda x: x if x.endswith(".py") else x[:60]
)
def test_docstring_command_runs_as_printed(script, cmd):
    """The same check for the commands a file's docstring prints: the reader meets them first."""
    why = runs_as_printed(cmd)
    assert why is None, f"{script} docstring: `{cmd}`: {why}"


def test_gpu_plan_sizes_in_the_docs_are_the_plans():
    """docs/gpus.md's table and the README's figures are what `gpu_check.py --dry-run` plans (they drifted
    once: 121 launches printed where the plan had 135)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import gpu_check

    row = (
        r"^\| (`--one-gpu`|(\d) GPUs \(world \d, then world 1\)) \| (\d+) \| (\d+) \| ([\d.]+) min"
    )
    table = re.findall(row, (ROOT / "docs/gpus.md").read_text(), re.M)
    assert len(table) == 3, table
    for _, gpus, runs, launches, minutes in table:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            gpu_check.main(["--dry-run", *(["--for-gpus", gpus] if gpus else ["--one-gpu"])])
        planned = re.search(
            r"planned: (\d+) runs \((\d+) launches\).*estimated ([\d.]+) min", out.getvalue()
        )
        assert planned.groups()[:2] == (runs, launches), (gpus, planned.group(0))
        assert abs(float(planned.group(3)) - float(minutes)) <= 0.5, (gpus, planned.group(0))
    readme = (ROOT / "README.md").read_text()
    one, eight = re.search(
        r"--one-gpu` runs .*?\((\d+) launches.*?\((\d+) launches", readme, re.S
    ).groups()
    assert (one, eight) == (table[0][3], table[2][3]), (one, eight)

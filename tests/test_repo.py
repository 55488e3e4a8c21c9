"""The repo's promises to a newcomer: the README's commands are what CI runs, its first command works in
an environment made from requirements.txt alone, and only tensors cross the wire."""

import ast
import io
import re
import subprocess
import sys
import tokenize

import line_counts
from helpers import ENV, ROOT


def readme_setup_block():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Set up and run\s+```bash\n(.*?)```", text, re.S)
    assert block, "README has no ```bash block under '## Set up and run'"
    return block.group(1).splitlines()


def test_ci_runs_the_readme_lines_character_for_character():
    ci = (ROOT / ".ci" / "run").read_text().split("# --- the README's lines")[1].splitlines()[1:]
    ci = [l for l in ci if l.strip()]
    assert ci == ["pip install -r requirements.txt", "python -m pytest -q tests"], ci
    readme = readme_setup_block()
    assert all(l in readme for l in ci), (ci, readme)
    assert "venv" in (ROOT / ".ci" / "run").read_text()  # a fresh environment, not this machine's


def test_readme_first_command_passes_silently():
    """`torchrun --nproc_per_node=4 dp.py --check`, as typed: exit 0, PASSED, nothing on stderr that is a
    warning or a traceback (torch without numpy warns on every import; an object collective crashes)."""
    line = next(l for l in readme_setup_block() if l.startswith("torchrun "))
    assert line == "torchrun --nproc_per_node=4 dp.py --check", line
    cmd = [sys.executable, "-m", "torch.distributed.run", *line.split()[1:]]
    p = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "-> PASSED" in p.stdout, p.stdout[-3000:]
    assert not re.search(r"warn|traceback|error", p.stderr, re.I), p.stderr[-3000:]


def test_no_object_collectives():
    """Object collectives pickle through numpy and, on NCCL, through the GPU: only tensors may cross."""
    # the pattern catches what it is for (samples spelled in two pieces, so that no grep finds them here)
    pattern = re.compile(
        r"\b(broadcast|all_gather|gather|scatter)_object(_list)?\(|\bsend_object_list\(|recv_object_list\("
    )
    assert pattern.search("dist.all_gather" + "_object(out, mine)") and pattern.search(
        "dist.broadcast" + "_object_list(b)"
    )
    hits = [
        f"{f.relative_to(ROOT)}:{i + 1}"
        for f in [*ROOT.glob("*.py"), *ROOT.glob("tests/*.py")]
        for i, l in enumerate(f.read_text().splitlines())
        if pattern.search(l)
    ]
    assert not hits, hits


# ------------------------------------------------------------------------- the shape of the files (DESIGN.md)
TECHNIQUES = [
    "dp.py",
    "ddp_bucketed.py",
    "diloco.py",
    "fault_tolerance.py",
    "zero.py",
    "memory_savers.py",
    "gpipe.py",
    "pipedream.py",
    "zero_bubble.py",
    "megatron_tp.py",
    "ptdp.py",
    "moe.py",
    "context_parallel.py",
]
TECHNIQUES += [
    "moe_deepseek.py",
    "fp8.py",
    "dualpipev.py",
]  # issues 43 (the 2024 MoE line), 42 and 51
# Read path: the source from the end of the module docstring to the `# --- measurement ---` fence, weighed in
# code tokens (tests/line_counts.py: comments and layout left out, a string is one token), what a learner parses.
READ_PATH = {name: line_counts.BUDGET.get(name, line_counts.DEFAULT_BUDGET) for name in TECHNIQUES}
# Over the design budget, recorded so that growth stays a decision (nothing was moved below the fence to meet
# a budget, no refusal cut, no golfing), each with its reason; the weight is a ceiling, to come down.
READ_PATH.update(
    {
        # stages 0-3, prefetch, ordered asynchronous reductions, HSDP, mixed precision and offload on one
        # core: a second file could not import Zero and would copy its ~3,000 tokens
        "zero.py": 4109,
        # TP, SP and the overlapped ring of issue 51 (its GEMM-scatter needs its own autograd pair, ~490);
        # `megatron_tp.py --overlap` is the command, so the ring stays in this file
        "megatron_tp.py": 4029,
    }
)
# Whole-file ceilings in code tokens against drift for the shared modules and tools (about today's + room).
# bench.py 8,000 -> 12,000: both sides of a pair now run in the same processes, ours built from each file's
# core (2,041 tokens of builders, the paired worker and its statistics), and three pairs more (HSDP,
# DualPipeV, the overlapped TP ring). plan.py 13,000 -> 13,700: issue 49's two costs --search lacked
# (ZB-H1's and ZB-V's orders walked at each layout's F, B, W; NCCL's ring latency across nodes), 630
# tokens, and the published rows' sources in STACKS.
TOTAL = {"common.py": 2400, "harness.py": 7000, "bench.py": 12000, "plan.py": 13700}
README_LINES = 200
# What may not stand above a technique file's measurement fence outside main(): name -> (pattern, a line it
# must catch, a near miss it must let through). Bookkeeping is measurement, logging, checkpointing and the
# --check verdict; the technique exposes plain attributes or return values and is watched from outside.
RULES = {
    "counter": (
        r"\bCommCounter\(|\bmeter\.|\bCOMM\.|\.handed\(|count_saved|\bstats\[|"
        r"\b(LiveStorages|SavedActivations|HeldForB)\(",
        "comm = CommCounter()",
        "commit = True",
    ),
    "timer": (
        r"perf_counter|\bEvent\(|\bStepTimer\(|\bTimeline\(",
        "t0 = time.perf_counter()",
        "timeline_len = 3",
    ),
    "summary": (
        r"\bjson\.|write_summary\(|peak_memory_bytes\(",
        "json.dump(x, f)",
        "args.json_path",
    ),
    # A schedule may take one observe(kind, mb) callback and enter it around each F / B / W (DESIGN.md: "pipeline
    # events by one callback per forward/backward"); building or driving the watcher is bookkeeping.
    "watcher": (
        r"\b(Watch|Observer|PipelineWatch)\(|\bwatch\.\w+\s*=|\.observe\.\w+\(",
        "watch = Watch(d, args)",
        'span = observe("F", i)',
    ),
    "phase": (r"\bcomm\.phase\b|\.phase\(", 'phase = comm.phase("step")', "phases = 2"),
    "log line": (r"\bd\.log\(|\blog_step\(", 'd.log(f"step {s}")', "d.logits = y"),
    "run": (
        r"\bRun\(|\brun\.(watching|end_step|finish|steps)\b",
        "run = Run(d, args, state)",
        "runner.run(ops)",
    ),
    "checkpoint": (
        r"\bCheckpointer\(|\bmaybe_fail\(|_extra_state\(",
        "ckpt = Checkpointer(d, path)",
        "checkpoint_every = 2",
    ),
    "check": (
        r"check_against_reference\(|\breference_train\(",
        "check_against_reference(d, args, ls, ps)",
        "check_args(args)",
    ),
}
BOOKKEEPING = re.compile("|".join(f"(?:{pattern})" for pattern, _, _ in RULES.values()))
FENCE = re.compile(r"# -+ *(measurement|reference|checkpoint)")


def too_wide(text, cols=100, picture_cols=110):
    """Line numbers past `cols` columns. A line of a docstring that is a picture, a table or a command
    (a run of two spaces inside it, a `|`, or a leading `torchrun` / `python`) may run to `picture_cols`:
    rewrapping a picture breaks it, and the formatter holds code to `cols` anyway."""
    in_doc = set()
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type == tokenize.STRING and t.start[0] != t.end[0]:
            in_doc.update(range(t.start[0], t.end[0] + 1))
    wide = []
    for i, line in enumerate(text.splitlines(), 1):
        body = line.strip()
        picture = re.search(r"\S {2,}\S|\|", body) or re.match(r"(torchrun|python|bash)\b", body)
        limit = picture_cols if i in in_doc and picture else cols
        if len(line) > limit:
            wide.append(i)
    return wide


def measurement_fence(text):
    """Index of the `# --- measurement ---` line, or None: the read path and the fence rule end here."""
    return next(
        (i for i, l in enumerate(text.splitlines()) if FENCE.match(l) and "measurement" in l), None
    )


def read_path(text):
    """Lines from the end of the module docstring to the measurement fence (gpipe.py at d58b272: 297 - 38)."""
    doc = ast.parse(text).body[0]
    doc_end = (
        doc.end_lineno if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) else 0
    )
    return measurement_fence(text) + 1 - doc_end


def leaks(text):
    """Bookkeeping above the measurement fence outside main(): (line number, rule, line) for each hit.
    Comments, docstrings, main() and a train* function defined after check_args (main's loop, in main's
    section) are skipped; everything else above the fence is the lesson."""
    lines, tree = text.splitlines(), ast.parse(text)
    fence = measurement_fence(text)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    after_checks = next((k for k, n in enumerate(defs) if n.name == "check_args"), len(defs))
    skip = {
        i
        for k, n in enumerate(defs)
        if n.name == "main" or (n.name.startswith("train") and k > after_checks)
        for i in range(n.lineno - 1 - len(n.decorator_list), n.end_lineno)
    }  # main() and the loop it runs
    skip |= {
        i
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr)
        and isinstance(n.value, ast.Constant)
        and isinstance(n.value.value, str)
        for i in range(n.lineno - 1, n.end_lineno)
    }  # docstrings
    hits = []
    for i, line in enumerate(lines[: len(lines) if fence is None else fence]):
        code = re.sub(r"\s#\s.*$|^\s*#.*$", "", line)  # a trailing or whole-line comment
        if i not in skip and BOOKKEEPING.search(code):
            rule = next(name for name, (pattern, _, _) in RULES.items() if re.search(pattern, code))
            hits.append((i + 1, rule, line.strip()))
    return hits


def test_files_keep_their_shape():
    """No line past 100 columns in the repo's own files (a docstring's picture, table or command line
    may run to 110); every technique file's read path and every shared module within its ceiling; each technique file fenced, its measurement fence first, with no counter,
    timer, observer, log line, Run, checkpoint or check call above the fence except in main() (the technique
    comes first); no technique file imports another. Each rule catches what it is for (samples below)."""
    assert too_wide("x" * 101) == [1] and not too_wide("x" * 100)
    picture = '"""A picture:\n' + "r0  " + "x" * 104 + '\n"""\n'  # a docstring's drawing: up to 110
    assert not too_wide(picture) and too_wide(picture.replace("r0  ", "r0 ")) == [2]
    assert too_wide("# " + "word " * 21 + "\n") == [1]  # a comment is prose
    fence = "# --- measurement ---\n"
    for name, (pattern, hit, miss) in RULES.items():
        assert re.search(pattern, hit) and not re.search(pattern, miss), name
        # caught in the lesson
        assert leaks(f"def step(x):\n    {hit}\n{fence}") == [(2, name, hit)], name
        # main() and below the fence may
        assert not leaks(f"def main():\n    {hit}\n{fence}{hit}\n"), name
        loop = f"def train_x():\n    {hit}\n"  # main's loop: allowed after check_args, caught in the lesson
        assert not leaks(f"def check_args(a):\n    pass\n{loop}{fence}"), name
        assert leaks(f"{loop}def check_args(a):\n    pass\n{fence}") == [(2, name, hit)], name
        assert not leaks(
            f'def step(x):\n    """{hit}"""\n    {miss}  # {hit}\n    # {hit}\n{fence}'
        ), name
    sample = '"""doc\n"""\nimport torch\n\n\ndef f():\n    pass\n# --- measurement ---\nx = 1\n'
    assert read_path(sample) == 6 and measurement_fence("# --- reference ---\n" + fence) == 1
    wide = {f.name: too_wide(f.read_text()) for f in ROOT.glob("*.py")}  # the files a reader reads
    assert not {k: v for k, v in wide.items() if v}, {k: v[:5] for k, v in wide.items() if v}
    for name, limit in TOTAL.items():
        n = line_counts.code_tokens((ROOT / name).read_text())
        assert n <= limit, f"{name}: {n} code tokens > {limit}"
    problems = []
    for name in TECHNIQUES:
        if not (ROOT / name).is_file():
            problems.append(f"{name}: missing")
            continue
        text = (ROOT / name).read_text()
        at = measurement_fence(text)
        if at is None:
            problems.append(f"{name} has no '# --- measurement ---' fence")
            continue
        first = next(i for i, l in enumerate(text.splitlines()) if FENCE.match(l))
        if first != at:
            problems.append(f"{name}: a fence above '# --- measurement ---' (line {first + 1})")
        weight = line_counts.code_tokens(line_counts.read_path_text(text))
        if weight > READ_PATH[name]:
            problems.append(f"{name}: read path {weight} code tokens > {READ_PATH[name]}")
        if leaks(text):
            problems.append(
                f"{name}: bookkeeping above the fence outside main(): {leaks(text)[:4]}"
            )
        others = [t[:-3] for t in TECHNIQUES if t != name]
        imports = re.findall(r"^\s*(?:from|import)\s+(\w+)", text, re.M)
        if set(imports) & set(others):
            problems.append(f"{name} imports {set(imports) & set(others)}")
    assert not problems, "\n".join(problems)


def test_read_paths_are_weighed_in_code_tokens():
    """A read path's weight is its Python tokens without comments, newlines and indentation; a string (a
    docstring too) is one token, so a why costs nothing and packing three names on a line saves nothing;
    test_files_keep_their_shape turns a weight past its recorded budget into a failure."""
    fence = "# --- measurement ---\n"
    packed = '"""doc"""\nimport torch\n\n\ndef f(a, b):  # why\n    x, y, z = a, b, "s t u"\n    return x\n'
    # import torch: 2; def f ( a , b ) : 8; x , y , z = a , b , "s t u": 11 packed, 9 spread; return x: 2
    spread = packed.replace(
        '    x, y, z = a, b, "s t u"\n', '    x = a\n    y = b\n    z = "s t u"\n'
    )
    assert line_counts.code_tokens(line_counts.read_path_text(packed + fence)) == 23
    assert line_counts.code_tokens(line_counts.read_path_text(spread + fence)) == 21
    assert line_counts.code_tokens("# a comment\n'''a docstring\nof two lines'''\n") == 1
    assert line_counts.texture("x" * 101 + "\n\nab\n") == (51.5, 0.5)


def packed_assignments(text):
    """Line numbers of assignments that pack three or more names from a tuple written out on the right
    (`a, b, c = x, y, z`); unpacking one returned tuple (`a, b, c = f()`) is one idea and passes."""
    hits = []
    for n in ast.walk(ast.parse(text)):
        if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Tuple, ast.List)):
            for target in n.targets:
                if isinstance(target, (ast.Tuple, ast.List)):
                    flat = [
                        e
                        for t in target.elts
                        for e in (t.elts if isinstance(t, ast.Tuple) else [t])
                    ]
                    if len(flat) >= 3:
                        hits.append(n.lineno)
    return hits


def test_one_idea_per_line():
    """No file a reader reads packs three or more names into one assignment (STYLE.md 10)."""
    assert packed_assignments(
        "a, b, c = 1, 2, 3\n(x, y), z = p, q\nu, v, w = f()\nm, n = 1, 2\n"
    ) == [1, 2]
    hits = {f.name: packed_assignments(f.read_text()) for f in ROOT.glob("*.py")}
    assert not {k: v for k, v in hits.items() if v}, {k: v for k, v in hits.items() if v}


def test_readme_is_read_in_five_minutes():
    """The README is the front door (<= 200 lines); the rest lives in docs/ and the files' docstrings."""
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_LINES, f"README.md: {n} lines > {README_LINES}"


# ------------------------------------------------------------------------- tests/line_counts.py, on a sample
LINE_SAMPLE = [  # (expected category, line): each category, and the places the old count went wrong
    ("docstring", '"""A ring: send right, receive from the left."""'),
    ("boilerplate", "import torch"),
    ("boilerplate", "from harness import CommCounter, Run, fail, parse_args"),
    (None, ""),
    (None, ""),
    ("boilerplate", "@dataclass"),
    ("boilerplate", "class Args:"),
    ("boilerplate", "    steps: int = 2  # optimizer steps"),
    (None, ""),
    (None, ""),
    (
        "boilerplate",
        "# ----------------------------------------------------------------- the technique",
    ),
    ("technique", "class Ring:"),
    ("technique", '    """One shift per step."""'),
    ("technique", "    def __init__(self, n):"),
    ("validation", "        if n < 2:"),
    ("validation", '            raise ValueError("a ring needs two ranks")'),
    ("technique", "        self.n = n  # ranks"),
    ("measure", "        # bytes, for the report"),
    ("measure", "        self.meter = CommCounter()"),
    (None, ""),
    ("technique", "    def step(self, x, observe=None):"),
    ("measure", '        with observe("F", 0):'),
    ("technique", "            y = x.roll(1)"),
    ("technique", "        return y"),
    (None, ""),
    ("checkpoint", "    def state_dict(self):"),
    ("checkpoint", '        return {"n": self.n}'),
    (None, ""),
    (None, ""),
    ("validation", "def check_args(args):"),
    ("validation", "    need = 1  # a step at least"),
    ("validation", "    if args.steps < 1:"),
    ("validation", '        fail("--steps must be >= 1")'),
    (None, ""),
    (None, ""),
    ("boilerplate", "def main():"),
    ("boilerplate", "    args = parse_args(Args)"),
    ("validation", "    check_args(args)"),
    ("technique", "    ring = Ring(4)"),
    ("checkpoint", "    run = Run(None, args, {})"),
    ("technique", "    for step in run.steps():"),
    ("technique", "        y = ring.step(torch.ones(2), observe=ring.meter)"),
    ("measure", '        d.log(f"step {step}")'),
    ("check", "    if args.check:  # the one-process reference"),
    ("check", "        check_against_reference(None, args, [], {})"),
    (None, ""),
    (None, ""),
    ("measure", "# --- measurement ---"),
    ("measure", "def summary(meter):"),
    ("measure", "    return meter.total()"),
    (None, ""),
    (None, ""),
    ("check", "# --- reference for --check ---"),
    ("check", "def reference(args):"),
    ("check", "    return 0"),
    (None, ""),
    (None, ""),
    ("checkpoint", "# --- checkpoint state ---"),
    ("checkpoint", "def shards(ring):"),
    ("checkpoint", "    return [ring.n]"),
    (None, ""),
    (None, ""),
    ("boilerplate", 'if __name__ == "__main__":'),
    ("boilerplate", "    main()"),
]


def test_line_counts_sorts_a_sample_by_what_each_line_does(monkeypatch):
    """tests/line_counts.py puts every line of a sample file in its category (a log line or a Run inside
    main() is not technique, a guarded failure in a technique class is validation, a comment goes with its
    line, the fenced sections by their fence); with any one of its rules switched off it misplaces a sample
    line (the mutants), so each rule is needed and the sample shows it."""
    import line_counts

    fence = "# --- measurement ---"
    text = "\n".join(line for _, line in LINE_SAMPLE) + "\n"
    expected = [cat for cat, _ in LINE_SAMPLE]
    got = line_counts.classify(text)
    wrong = [
        (i + 1, e, g, l)
        for i, (e, g, (_, l)) in enumerate(zip(expected, got, LINE_SAMPLE))
        if e != g
    ]
    assert not wrong, wrong
    assert set(expected) - {None} == set(line_counts.CATEGORIES)
    counts = line_counts.row_of_text(text)
    assert counts["technique"] == expected.count("technique") and counts["read_path"] == 47
    for table in ("PATTERNS", "WHOLE_DEF", "FENCES"):
        for key in getattr(line_counts, table):
            # a rule that never fires / a fence ignored
            off = "(?!)" if table != "FENCES" else "technique"
            monkeypatch.setitem(getattr(line_counts, table), key, off)
            assert line_counts.classify(text) != expected, (
                f"{table}[{key!r}] switched off, still right"
            )
            monkeypatch.undo()
    # the old count: all of main() and everything between Args and main() as technique
    lesson = range(
        [l for _, l in LINE_SAMPLE].index("class Ring:"), [l for _, l in LINE_SAMPLE].index(fence)
    )
    old = [
        "technique" if e in ("measure", "checkpoint", "check", "validation") and i in lesson else e
        for i, e in enumerate(expected)
    ]
    assert old != got

"""How much of each technique file is the technique, each line sorted by what it does (the rules of
shared/reviews/reading-review-2.md, section 1):

    python tests/line_counts.py            # one row per file: docs/lines.md holds the table
    python tests/line_counts.py -v dp.py   # and every line of dp.py with its category

Categories (non-blank lines; a comment line takes the category of the code line it stands above):
    technique   what the reader came for: the technique's classes and functions, their docstrings and
                comments, and the lines of main() that build and drive it (the batch, zero_grad, the step,
                the sync, clipping, the optimizer step)
    measure     counters, timers, observer callbacks, log lines, the report and summary, `run.watching` /
                `run.end_step` / `run.finish`, and the `# --- measurement ---` section
    checkpoint  `Run(...)`, checkpoints, `maybe_fail`, state_dict / extra-state methods, the checkpoint
                section
    validation  check_args() and every `fail(...)` / `raise ...Error` with the `if` that guards it
    check       the --check call sites, gathering for the check, the `# --- reference for --check ---` section
    docstring   the module docstring
    boilerplate imports, section headers, the Args dataclass, parse / init / data / model set-up lines,
                `if __name__ == "__main__"`
A line is sorted by its statement's text, wherever it stands: a log line inside a technique class is
measurement, a checkpoint call inside main() is checkpoint. Compound statements are sorted by their header,
their bodies line by line; an `if` guarding only a failure is validation, an `if args.check:` block is check.
read path = the source from the end of the module docstring to the measurement fence, weighed in code tokens
(comments and layout left out, a string one token) beside its budget (BUDGET: never met by moving what the
technique runs below the fence, tests/test_fence.py holds the fence), its lines, characters per non-blank line and
the share of its lines past 100 columns beside them as information;
share = technique / (non-blank lines - docstring); path share = technique / non-blank lines of the read path.
The classifier reads text, so it cannot see intent: an attribute kept only for a watcher (a list of
events, a layout method) counts as technique unless its line names a counter; the review's hand count is the arbiter."""

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = [
    "dp.py",
    "ddp_bucketed.py",
    "diloco.py",
    "fault_tolerance.py",
    "zero.py",
    "memory_savers.py",
    "fp8.py",
    "gpipe.py",
    "pipedream.py",
    "zero_bubble.py",
    "dualpipev.py",
    "megatron_tp.py",
    "ptdp.py",
    "moe.py",
    "moe_deepseek.py",
    "context_parallel.py",
]
# Read-path budgets in code tokens (DESIGN.md): 3,400; the files with several variants 3,800, fault_tolerance.py
# 4,200, ptdp.py (four axes) 4,800. Lines are reported beside them as information, no longer a budget: a line
# budget rewards packing lines.
BUDGET = {
    "megatron_tp.py": 3800,
    "moe.py": 3800,
    "context_parallel.py": 3800,
    "zero.py": 3800,
    "zero_bubble.py": 3800,
    "fault_tolerance.py": 4200,
    "ptdp.py": 4800,
}
DEFAULT_BUDGET = 3400
# What a reader parses: Python tokens without comments and layout (a string, a docstring too, is one token).
NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}
CATEGORIES = (
    "technique",
    "measure",
    "checkpoint",
    "validation",
    "check",
    "docstring",
    "boilerplate",
)
# Sorting a statement by its text: the first category whose pattern matches (in this order) wins.
PATTERNS = {
    "validation": r"\bfail\(|\braise\s+\w*(Error|Exception)\b|\bcheck(_\w+)?_args\(",
    "check": r"check_against_reference\(|\breference_train\(|\bassemble_full\(|\bgather_rows\(|"
    r"\bargs\.check\b|^\s*check = None$",
    "checkpoint": r"\bRun\(|\bCheckpointer\(|\bmaybe_fail\(|_extra_state\b|\bstate_dict\(|\bckpt\b|"
    r"\brefuse_checkpoint\(",
    "measure": r"\bCommCounter\(|\bmeter\.|\bCOMM\.|\.handed\(|count_saved|\bstats\[|\bperf_counter|"
    r"\bEvent\(|\bStepTimer\(|\bTimeline\(|\bHeldForB\(|\bLiveStorages\(|\bSavedActivations\(|"
    r"\bSentCopies\(|\bjson\.|\bwrite_summary\(|\bpeak_memory_bytes\(|\bstate_bytes\(|"
    r"\bobserve\(|\bobserve\s*=\s*observe\b|\.observe\s*=|\.phase\(|\bd\.log\(|\blog_step\(|"
    r"\bprint\(|\brun\.(watching|end_step|finish)\b|\breport\(|_figures\(|\bfigures\b|"
    r"\bwrite_trace\(",
    "boilerplate": r"\bparse_args\(|\binit_dist\(|\bMarkovData\(|\bbuild_gpt\(|\bclose_dist\(|"
    r"\benv_world_size\(",
}
WHOLE_DEF = {
    "checkpoint": r"^(state_dict|load_state_dict|get_extra_state|set_extra_state)$",
    "validation": r"^check(_\w+)?_args$",
    "boilerplate": r"^Args$",
}
FENCES = {"measurement": "measure", "reference": "check", "checkpoint": "checkpoint"}
FENCE = re.compile(r"# -+ *(measurement|reference|checkpoint)")


def by_text(text, default="technique"):
    code = "\n".join(
        re.sub(r"\s#\s.*$|^\s*#.*$", "", l) for l in text.splitlines()
    )  # comments say, not do
    return next((cat for cat, pattern in PATTERNS.items() if re.search(pattern, code)), default)


def classify(text):
    """One category per line of a technique file (blank lines: None)."""
    lines, tree = text.splitlines(), ast.parse(text)
    label = [None] * len(lines)

    def src(a, b):  # lines a..b, 1-based inclusive
        return "\n".join(lines[a - 1 : b])

    def put(a, b, cat):
        for i in range(a - 1, b):
            label[i] = cat

    def block(body, default):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                definition(node)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # a docstring
                put(node.lineno, node.end_lineno, default)
            elif isinstance(getattr(node, "body", None), list):  # if / for / while / with / try
                compound(node, default)
            else:
                put(
                    node.lineno,
                    node.end_lineno,
                    by_text(src(node.lineno, node.end_lineno), default),
                )

    def compound(node, default):
        first = node.body[0].lineno - 1
        head = by_text(src(node.lineno, first), default)
        guards = all(by_text(src(n.lineno, n.end_lineno)) == "validation" for n in node.body)
        if isinstance(node, ast.If) and guards:
            head = "validation"  # an `if` that guards a failure
        # `if args.check:`, a guarded failure: all of it
        if isinstance(node, ast.If) and head != default:
            put(node.lineno, node.end_lineno, head)
            return
        put(node.lineno, first, head)
        for part in ("body", "orelse", "finalbody"):
            block(getattr(node, part, []), default)
        for handler in getattr(node, "handlers", []):
            put(handler.lineno, handler.body[0].lineno - 1, default)
            block(handler.body, default)

    def definition(node):
        start, cat = (
            node.lineno - len(node.decorator_list),
            next((c for c, pattern in WHOLE_DEF.items() if re.match(pattern, node.name)), None),
        )
        if cat:  # check_args, Args, a checkpoint method: the whole definition
            put(start, node.end_lineno, cat)
            return
        head = src(start, node.body[0].lineno - 1)
        put(start, node.body[0].lineno - 1, "boilerplate" if node.name == "main" else by_text(head))
        block(node.body, "technique")

    fence = next((i for i, l in enumerate(lines) if FENCE.match(l)), len(lines))
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        put(body[0].lineno, body[0].end_lineno, "docstring")
        body = body[1:]
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (
            isinstance(node, ast.If) and "__name__" in src(node.lineno, node.lineno)
        ):
            put(node.lineno, node.end_lineno, "boilerplate")
        elif node.lineno - 1 < fence or node is main:
            block([node], "technique")
    section = None
    for i, l in enumerate(lines):  # the fenced sections, main() and `if __name__` excepted
        if m := FENCE.match(l):
            section = FENCES[m.group(1)]
        in_main = (
            main is not None and main.lineno - 1 - len(main.decorator_list) <= i < main.end_lineno
        )
        if section and not in_main and label[i] != "boilerplate":
            label[i] = section
    for i in range(len(lines) - 1, -1, -1):  # a comment takes the category of the line below it
        if not lines[i].strip():
            label[i] = None
        elif lines[i].lstrip().startswith("#") and label[i] is None:
            header = not lines[i].startswith((" ", "\t")) and re.match(r"# -{3,}", lines[i])
            below = next(
                (label[j] for j in range(i + 1, len(lines)) if label[j] is not None), "boilerplate"
            )
            label[i] = "boilerplate" if header else below
    for i in range(len(lines)):  # `else:`, `try:` and the like: the category of the line above
        if label[i] is None and lines[i].strip():
            label[i] = next(
                (label[j] for j in range(i - 1, -1, -1) if label[j] is not None), "boilerplate"
            )
    return label


def read_path_lines(text):
    """(first, last): 0-based line indices, from the end of the module docstring to the `# --- measurement ---`
    fence (inclusive)."""
    lines, tree = text.splitlines(), ast.parse(text)
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    fence = next(
        (i for i, l in enumerate(lines) if FENCE.match(l) and "measurement" in l), len(lines)
    )
    return (doc.end_lineno if doc else 0), fence


def read_path(text):
    """Lines from the end of the module docstring to the `# --- measurement ---` fence."""
    first, last = read_path_lines(text)
    return last + 1 - first


def code_tokens(text):
    """Python tokens in `text` that are code: comments, newlines and indentation left out; a string is one."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return sum(1 for t in tokens if t.type not in NOT_CODE)


def read_path_text(text):
    """The read path's source: the lines after the module docstring, up to (not including) the fence."""
    first, last = read_path_lines(text)
    return "\n".join(text.splitlines()[first:last]) + "\n"


def texture(text):
    """(characters per non-blank line, share of non-blank lines past 100 columns) of `text`."""
    lines = [l for l in text.splitlines() if l.strip()]
    chars = sum(len(l) for l in lines) / max(len(lines), 1)
    wide = sum(len(l) > 100 for l in lines) / max(len(lines), 1)
    return chars, wide


def row_of_text(text, name=""):
    labels = classify(text)
    counts = {c: labels.count(c) for c in CATEGORIES}
    body = sum(counts.values()) - counts["docstring"]
    first, last = read_path_lines(text)
    on_path = [c for c in labels[first : last + 1] if c is not None]
    path = read_path_text(text)
    chars, wide = texture(path)
    return dict(
        file=name,
        lines=len(text.splitlines()),
        read_path=read_path(text),
        tokens=code_tokens(path),
        budget=BUDGET.get(name, DEFAULT_BUDGET),
        chars_per_line=chars,
        past_100=wide,
        **counts,
        share=counts["technique"] / max(body, 1),
        path_share=on_path.count("technique") / max(len(on_path), 1),
    )


def table(files=FILES):
    return [row_of_text((ROOT / f).read_text(), f) for f in files if (ROOT / f).exists()]


if __name__ == "__main__":
    verbose = "-v" in sys.argv
    files = [a for a in sys.argv[1:] if a != "-v"] or FILES
    if verbose:
        for f in files:
            text = (ROOT / f).read_text()
            for n, (l, cat) in enumerate(zip(text.splitlines(), classify(text)), 1):
                print(f"{n:4} {cat or '':11} {l}")
    cols = ("tokens", "budget", "read_path", "lines", *CATEGORIES)
    print(
        "| file | read path tokens | token budget | read path lines | chars / line | past 100 cols | lines | "
        + " | ".join(CATEGORIES)
        + " | share | path share |"
    )
    print("|---|" + "---:|" * (len(cols) + 4))
    for r in table(files):
        head = [str(r[c]) for c in cols[:3]] + [
            f"{r['chars_per_line']:.1f}",
            f"{r['past_100']:.0%}",
        ]
        rest = [str(r[c]) for c in cols[3:]]
        print(
            f"| {r['file']} | "
            + " | ".join(head + rest)
            + f" | {r['share']:.0%} | {r['path_share']:.0%} |"
        )

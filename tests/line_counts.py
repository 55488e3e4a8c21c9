"""Lines of each technique file by section, as the README and the session notes report them:

    python tests/line_counts.py            # one row per file

Non-blank lines only. Sections, by the file's own shape (DESIGN.md):
    docstring   the module docstring
    setup       imports, module constants and the Args dataclass (everything before the first technique def)
    technique   every top-level def / class (and the lines between them) after Args and before check_args()
                or main(), comments and shape notes included
    checks      check_args(), the argument checks (bad input: one line, exit 2)
    main        main(): build, the training loop, report, check
    end         the fenced sections `# --- measurement ---`, `# --- reference for --check ---` (from the first
                fence on, wherever it stands, main excepted) and every def after main
share = (technique + main) / all non-docstring lines: what a reader of the lesson reads."""
import ast, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ["dp.py", "ddp_bucketed.py", "gpipe.py", "pipedream.py", "megatron_tp.py", "ptdp.py", "moe.py", "zero.py",
         "context_parallel.py"]


def sections(path):
    text = Path(path).read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    label = ["setup"] * len(lines)
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    if doc is not None:
        for i in range(doc.lineno - 1, doc.end_lineno):
            label[i] = "docstring"
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    args = next((n for n in nodes if n.name == "Args"), None)
    first_def = next((n for n in nodes if n is not args and (args is None or n.lineno > args.lineno)), None)
    main = next((n for n in nodes if n.name == "main"), None)
    checks = next((n for n in nodes if n.name == "check_args"), None)
    stop = min(x.lineno for x in (main, checks) if x is not None) if (main or checks) else len(lines) + 1
    start = (first_def.lineno - len(first_def.decorator_list)) if first_def else stop
    # comments just above the first technique def belong to it
    while start > 1 and lines[start - 2].lstrip().startswith("#"):
        start -= 1
    for i in range(start - 1, stop - 1):
        label[i] = "technique"
    for node, name in ((checks, "checks"), (main, "main")):
        if node is not None:
            for i in range(node.lineno - 1 - len(node.decorator_list), node.end_lineno):
                label[i] = name
    after = max((n.end_lineno for n in (main, checks) if n is not None), default=len(lines))
    for i in range(after, len(lines)):
        if label[i] == "setup" and not lines[i].startswith("if __name__"):
            label[i] = "end"
    fence = next((i for i, l in enumerate(lines) if re.match(r"# -+ *(measurement|reference)", l)), None)
    if fence is not None:  # everything from the first fence on is an end section (main excepted)
        for i in range(fence, len(lines)):
            if label[i] != "main":
                label[i] = "end"
    for n in nodes:  # defs after main are the fenced end sections
        if main is not None and n.lineno > main.end_lineno:
            for i in range(n.lineno - 1 - len(getattr(n, "decorator_list", [])), n.end_lineno):
                label[i] = "end"
    counts = {k: 0 for k in ("docstring", "setup", "technique", "checks", "main", "end")}
    for l, lab in zip(lines, label):
        if l.strip():
            counts[lab] += 1
    return len(lines), counts


def table(files=FILES):
    rows = []
    for f in files:
        if (ROOT / f).exists():
            total, c = sections(ROOT / f)
            body = sum(c.values()) - c["docstring"]
            rows.append((f, total, c, (c["technique"] + c["main"]) / max(body, 1)))
    return rows


if __name__ == "__main__":
    files = sys.argv[1:] or FILES
    print("| file | lines | docstring | setup | technique | checks | main | end | share |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f, total, c, share in table(files):
        print(f"| {f} | {total} | {c['docstring']} | {c['setup']} | {c['technique']} | {c['checks']} | {c['main']} | "
              f"{c['end']} | {share:.0%} |")

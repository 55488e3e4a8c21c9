"""A technique file's technique section, taken out the way a copier takes it: the text from its first heading
(a `# ----` or `# ====` line at column 0) to `def check_args`, with the file's imports minus common.py and
harness.py. `load(name)` executes it with nothing else and returns its namespace; `free_names` and
`ungrouped` say what it would still need from outside (a name) or from the default group (a collective)."""

import ast
import builtins
import re
import symtable
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {"torch", "einops"}  # and the standard library
# torch.distributed's calls that communicate or ask a group: name -> the index of `group` among positionals
GROUP_ARG = {
    "all_reduce": 2,
    "all_gather": 2,
    "all_gather_into_tensor": 2,
    "reduce_scatter": 3,
    "reduce_scatter_tensor": 3,
    "broadcast": 2,
    "reduce": 3,
    "gather": 3,
    "scatter": 3,
    "all_to_all": 2,
    "all_to_all_single": 4,
    "barrier": 0,
    "monitored_barrier": 0,
    "send": 2,
    "recv": 2,
    "isend": 2,
    "irecv": 2,
    "P2POp": 3,
    "get_rank": 0,
    "get_world_size": 0,
    "get_backend": 0,
    "all_gather_single": 2,
    "reduce_scatter_single": 3,
}  # (the last two: this torch's flat forms)


def source(name, text=None):
    """(imports, section): the file's import lines but common's and harness's, and its technique section."""
    text = (ROOT / name).read_text() if text is None else text
    imports = [
        ast.get_source_segment(text, n)
        for n in ast.parse(text).body
        if isinstance(n, (ast.Import, ast.ImportFrom))
        and getattr(n, "module", None) not in ("common", "harness")
    ]
    start = re.search(r"^# [-=]{10}", text, re.M)
    end = text.index("\ndef check_args")
    assert start and start.start() < end, f"{name}: no heading before check_args"
    return "\n".join(imports), text[start.start() : end]


def imported_roots(name, text=None):
    """The top-level packages the section's imports name, which must be torch, einops or the standard library."""
    imports, _ = source(name, text)
    roots = set()
    for node in ast.parse(imports).body:
        for alias in node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]:
            roots.add(alias.name.split(".")[0])
    return {r for r in roots if r not in ALLOWED and r not in sys.stdlib_module_names}


def load(name, text=None):
    """Execute the section with its imports only (as `<name> (technique section)`) and return its namespace."""
    imports, core = source(name, text)
    namespace = {"__name__": "section_" + name.removesuffix(".py")}
    exec(compile(imports + "\n" + core, f"{name} (technique section)", "exec"), namespace)
    return namespace


def free_names(name, text=None):
    """The global names the section reads (at any depth: in functions, methods, defaults, class bodies) that
    neither it, its imports nor the builtins define: what a copier would find missing only when it runs."""
    imports, core = source(name, text)
    code = imports + "\n" + core
    top = symtable.symtable(code, name, "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    defined |= set(dir(builtins))
    missing = set()

    def walk(table):
        for s in table.get_symbols():
            if (
                s.is_referenced()
                and (table is top or s.is_global())
                and s.get_name() not in defined
            ):
                missing.add(s.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return missing


def ungrouped(name, text=None):
    """`line: call` for each call in the section to a torch.distributed collective, point-to-point op or
    rank/size query that does not name its group (keyword `group=` or the positional in its place)."""
    _, core = source(name, text)
    text = (ROOT / name).read_text() if text is None else text
    offset = text[: text.index(core)].count("\n")
    out = []
    for node in ast.walk(ast.parse(core)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        fn = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if isinstance(f, ast.Attribute) and not re.fullmatch(
            r"(dist|torch\.distributed)", ast.unparse(f.value)
        ):
            continue
        # a bare name is the file's own helper (megatron's all_reduce)
        if isinstance(f, ast.Name) and fn != "P2POp":
            continue
        if fn not in GROUP_ARG:
            continue
        if (
            any(k.arg == "group" or k.arg is None for k in node.keywords)
            or len(node.args) > GROUP_ARG[fn]
        ):
            continue
        out.append(f"{node.lineno + offset}: {ast.unparse(node)[:80]}")
    return out


def attempt(call):
    """(what call() raised, as "Type: message", or "no error"; {op: calls} it handed to collectives, counted at
    the dispatcher by harness.CommCounter): how a copy-out test calls a core with an input it cannot take."""
    from harness import CommCounter  # (the repo's counter; the section never needs it)

    with CommCounter() as comm:
        try:
            call()
            error = "no error"
        except Exception as e:  # noqa: BLE001 (any other error is reported, and fails the test)
            error = f"{type(e).__name__}: {e}"
    return error, dict(comm.calls)


def refused(call, words):
    """(refused, what happened): call() raised a ValueError naming every word, and no collective was sent."""
    error, calls = attempt(call)
    ok = error.startswith("ValueError") and all(w in error for w in words) and not calls
    return ok, f"{error[:100]}; collectives: {calls}"

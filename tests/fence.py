"""The fence contract (DESIGN.md), as a copier would try it: everything that decides a training result sits
above a technique file's `# --- measurement ---` fence, so a run with every function and class defined below
it replaced by a no-op trains the same. Used by tests/test_fence.py:

    stub_below_fence(text)      the file with each definition below the fence replaced by `Stub("name")`
    rebindings(text)            the names defined above the fence that a statement below it binds again
    move_below_fence(text, n)   a mutant: the definition `n` cut from above the fence and pasted below it

Run as a script (what test_fence.py launches through tests/helpers.forked, in place of the file), it runs
the technique file given in the environment (FENCE_FILE; FENCE_MODE "normal" or "stubbed"; FENCE_MOVE, a
definition to move below the fence first) as `__main__` with this process's argv, and records from outside,
after every optimizer step and every step's log line, the training result so far into
FENCE_OUT/<process>.pt: the losses handed to harness.log_step (every Run.end_step goes through it) and, after
every step of a torch optimizer, its parameters (the trajectory: which optimizer, its parameters then). A
crash after training (a stubbed summary) leaves that record complete; the process then exits 0, so that
its peers, whose collectives fail once it is gone, record theirs too. A process the file starts itself (fault_tolerance.py's replicas: `sys.executable sys.argv[0]`) runs this script
again with the same environment, and records under its own command line."""

import ast
import hashlib
import os
import re
import sys
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"# -+ *measurement")


def fence_line(text):
    """The 1-based line of the `# --- measurement ---` fence."""
    return next(i for i, l in enumerate(text.splitlines(), 1) if FENCE.match(l))


def _definitions(tree):
    """Top-level function and class definitions, with the `if`/`try` blocks at module level opened."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(node)
        elif (
            isinstance(node, ast.Try)
            or isinstance(node, ast.If)
            and "__name__" not in ast.unparse(node.test)
        ):
            for part in ("body", "orelse", "finalbody"):
                todo += getattr(node, part, [])
            for h in getattr(node, "handlers", []):
                todo += h.body
    return out


def _span(node):
    return node.lineno - len(getattr(node, "decorator_list", [])), node.end_lineno


def stub_below_fence(text):
    """`text` with every function and class defined below the fence replaced by
    `NAME = __fence_stub__("NAME")`
    (blank lines keep the numbering, so a traceback still points into the file)."""
    lines, fence = text.splitlines(), fence_line(text)
    for node in _definitions(ast.parse(text)):
        a, z = _span(node)
        if a > fence:
            indent = re.match(r"\s*", lines[a - 1]).group(0)
            lines[a - 1 : z] = [f"{indent}{node.name} = __fence_stub__({node.name!r})"] + [""] * (
                z - a
            )
    return "\n".join(lines) + "\n"


def move_below_fence(text, name):
    """A mutant: the top-level definition `name`, cut from above the fence, pasted just below it."""
    lines, fence = text.splitlines(), fence_line(text)
    node = next(n for n in _definitions(ast.parse(text)) if n.name == name)
    a, z = _span(node)
    assert z < fence, f"{name} is not above the fence"
    moved = lines[a - 1 : z]
    return "\n".join(lines[: a - 1] + lines[z:fence] + moved + lines[fence:]) + "\n"


def _bound(nodes):
    """(line, name) for every module-level name these statements bind: definitions, imports, assignment and
    loop/with targets, and `global` names assigned inside functions; attribute and item stores on a
    module-level name (`X.y = ...`, `X[k] = ...`, `setattr(X, ...)`) count as binding X."""
    out = []

    def targets(t, line):
        if isinstance(t, ast.Name):
            out.append((line, t.id))
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                targets(e, line)
        elif isinstance(t, ast.Starred):
            targets(t.value, line)
        # X.y = / X[k] = : binds into X, at module level
        elif isinstance(t, (ast.Attribute, ast.Subscript)):
            root = t.value
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if isinstance(root, ast.Name):
                out.append((line, root.id))

    def module_level(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.lineno, node.name))
            inside(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.extend((node.lineno, (a.asname or a.name).split(".")[0]) for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in getattr(node, "targets", None) or [node.target]:
                targets(t, node.lineno)
            calls(node)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            targets(node.target, node.lineno)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    targets(item.optional_vars, node.lineno)
        elif isinstance(node, ast.Expr):
            calls(node)
        for part in ("body", "orelse", "finalbody"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for child in getattr(node, part, []):
                    module_level(child)
        for h in getattr(node, "handlers", []):
            for child in h.body:
                module_level(child)

    def calls(node):  # setattr(X, ...), globals()[...] = ..., anywhere in the statement
        for n in ast.walk(node):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id == "setattr"
                and n.args
                and isinstance(n.args[0], ast.Name)
            ):
                out.append((n.lineno, n.args[0].id))

    def inside(fn):  # a function below the fence may rebind a module name through `global`
        for n in ast.walk(fn):
            if isinstance(n, ast.Global):
                out.extend((n.lineno, g) for g in n.names)

    for node in nodes:
        module_level(node)
    return out


def rebindings(text):
    """["line N: NAME", ...]: a statement below the fence that binds a name a statement above it defined."""
    tree, fence = ast.parse(text), fence_line(text)
    above = {name for _, name in _bound([n for n in tree.body if n.lineno < fence])}
    below = _bound([n for n in tree.body if n.lineno > fence])
    return [f"line {line}: {name}" for line, name in below if name in above]


# ------------------------------------------------------------------------- the runner (a launched process)
class Stub:
    """What stands for a definition below the fence: it accepts any call, attribute, item, `with`, iteration
    (none), arithmetic and comparison, and is false and empty; each returns another stub (a comparison:
    False). A measurement line in main() (`watch.held = max(watch.held, n)`) then runs on; a stub that
    reaches training reaches torch, which refuses it, or changes what is trained: either way the result
    differs. Only what a summary does with numbers (float(), format specs, unpacking) still raises."""

    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def __call__(self, *args, **kwargs):
        return Stub(f"{self._name}()")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Stub(f"{self._name}.{attr}")

    def __setattr__(self, attr, value):
        pass

    def __getitem__(self, key):
        return Stub(f"{self._name}[]")

    def __setitem__(self, key, value):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __bool__(self):
        return False

    def _arith(self, *other):
        return Stub(f"{self._name}+")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = (
        _arith
    )
    __floordiv__ = __rfloordiv__ = __mod__ = __pow__ = __neg__ = __or__ = __ror__ = __and__ = _arith

    def _compare(self, other):
        return False

    __lt__ = __le__ = __gt__ = __ge__ = _compare

    def __repr__(self):
        return f"<stub {self._name}>"


def _process_key():
    """This process's name among the run's: its torchrun rank, or else its command line (a launcher's replica,
    the port of its coordinator left out)."""
    if "RANK" in os.environ:
        return f"rank{os.environ['RANK']}"
    argv = re.sub(r"--coordinator \S+", "", " ".join(sys.argv[1:]))
    return "argv-" + hashlib.sha1(argv.encode()).hexdigest()[:12]


def _run():
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    sys.path.insert(0, str(ROOT))
    import harness

    path, mode = ROOT / os.environ["FENCE_FILE"], os.environ["FENCE_MODE"]
    out = Path(os.environ["FENCE_OUT"])
    text = path.read_text()
    if os.environ.get("FENCE_MOVE"):
        text = move_below_fence(text, os.environ["FENCE_MOVE"])
    if mode == "stubbed":
        text = stub_below_fence(text)
    record, optimizers, key = dict(losses=[], trajectory=[]), [], _process_key()

    def save():
        tmp = out / f"{key}.tmp"
        torch.save(record, tmp)
        os.replace(tmp, out / f"{key}.pt")

    def stepped(opt, args, kwargs):
        if not any(o is opt for o in optimizers):
            optimizers.append(opt)
        index = next(i for i, o in enumerate(optimizers) if o is opt)
        params = [p.detach().cpu().clone() for g in opt.param_groups for p in g["params"]]
        # tiny models, a few steps: every step's parameters
        record["trajectory"].append((index, params))
        save()

    register_optimizer_step_post_hook(stepped)
    log_step = harness.log_step

    def logged(d, step, loss, *args, **kwargs):
        as_float = lambda v: v.item() if isinstance(v, torch.Tensor) else v  # noqa: E731
        record["losses"].append(
            (
                step,
                [as_float(v) for v in loss] if isinstance(loss, (tuple, list)) else as_float(loss),
            )
        )
        save()
        return log_step(d, step, loss, *args, **kwargs)

    harness.log_step = logged

    module = types.ModuleType("__main__")
    module.__file__, module.__fence_stub__ = str(path), Stub
    sys.modules["__main__"] = module
    try:
        exec(compile(text, str(path), "exec"), module.__dict__)
    except SystemExit:
        pass
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _run()

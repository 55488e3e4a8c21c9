"""The repo's promises to a newcomer: the README's commands are what CI runs, its first command works in
an environment made from requirements.txt alone, and only tensors cross the wire."""
import re, subprocess, sys

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
    pattern = re.compile(r"\b(broadcast|all_gather|gather|scatter)_object(_list)?\(|\bsend_object_list\(|recv_object_list\(")
    # the pattern catches what it is for (samples spelled in two pieces, so that no grep finds them here)
    assert pattern.search("dist.all_gather" + "_object(out, mine)") and pattern.search("dist.broadcast" + "_object_list(b)")
    hits = [f"{f.relative_to(ROOT)}:{i + 1}" for f in [*ROOT.glob("*.py"), *ROOT.glob("tests/*.py")]
            for i, l in enumerate(f.read_text().splitlines()) if pattern.search(l)]
    assert not hits, hits

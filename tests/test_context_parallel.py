"""context_parallel.py: each attention on its own against one-process attention, and the copy-out check
(one launch, cp 2, 3 and 4); --check parity with one-process training for every attention and layout at cp
4, 3 and 2 x dp 2 (with --ragged), each run's bytes, ring blocks and saved activations against closed forms
written here; the three broken pieces caught by --check; world 1; a restart bit for bit; bad input, to
main() and to each core; the peak read before report()'s unsplit GPT runs."""

import json

import pytest

from helpers import (
    TINY,
    assert_each_rank_fails,
    assert_matches_reference,
    run_python,
    run_ranks,
    torchrun,
)

SCRIPT = "context_parallel.py"
ES, L, B = 8, 2, 12  # float64; TINY's layers and global batch
ATTENTIONS, LAYOUTS = ("allgather", "ring", "ulysses"), ("contiguous", "zigzag")
MODEL4 = [
    *TINY,
    "--n-heads",
    "4",
]  # T 8, d 16, 4 heads: ulysses at cp 4, zig-zag chunks of one token
MODEL3 = [
    *TINY,
    "--seq-len",
    "12",
    "--d-model",
    "12",
    "--n-heads",
    "3",
]  # cp 3: 12 = 2 x 3 x 2, 3 heads
MUTANTS = ("plain-sum", "stale-kv", "dkv-kept")


def last(model, name):  # the value of the last `name` flag in an argv list
    return int(model[len(model) - 1 - model[::-1].index(name) + 1])


def assert_run(s, cp, dp, attention, layout, T, d):
    """Parity, and every figure the run measured against its closed form, written here from the shapes."""
    assert_matches_reference(s)
    f, world = s["figures"], cp * dp
    assert (f["cp"], f["dp"], f["attention"], f["layout"]) == (cp, dp, attention, layout)
    b, t = B // dp, T // cp
    blk = b * t * d * ES  # bytes of one (b, T/cp, d) block
    fwd, bwd = (
        {
            "ring": (2 * (cp - 1) * blk, 4 * (cp - 1) * blk),
            "allgather": (2 * blk, 2 * cp * blk),
            "ulysses": (4 * blk, 4 * blk),
        }[attention]
        if cp > 1
        else (0, 0)
    )
    assert (
        f["bytes_per_layer_fwd"] == [fwd] * world and f["bytes_per_layer_bwd"] == [bwd] * world
    ), f
    assert f["bytes_per_layer_theory"] == [fwd, bwd], f  # the theory the summary prints, too
    calls = f["collectives"]["all_reduce/world/fwd"][0]
    assert calls == 1, f["collectives"]  # one flat all-reduce of all gradients (not the log's loss)
    if attention == "ring":
        zz = layout == "zigzag"
        assert f["blocks"] == [cp if zz else r % cp + 1 for r in range(world)], f["blocks"]
        half = t * t // 2  # a zig-zag ring step off the diagonal: half a (t, t) block
        assert f["scores"] == [
            t * t + (cp - 1) * half if zz else (r % cp + 1) * t * t for r in range(world)
        ]
        assert f["blocks_theory"] == f["blocks"][:cp] and f["scores_theory"] == f["scores"][:cp]
    # saved for backward: 1/cp of the unsplit GPT's (common.GPT on the same sequences), exactly, plus for
    # ulysses its heads' output beside my tokens' output, for allgather the other ranks' K, V and the mask
    extra = (
        {"ring": 0, "ulysses": b * t * d, "allgather": 2 * b * (T - t) * d + t * T}[attention]
        * L
        * ES
    )
    extra = extra if cp > 1 else 0  # one rank: plain scaled_dot_product_attention
    for saved, unsplit in zip(f["saved_activation_bytes"], f["saved_activation_bytes_unsplit"]):
        assert saved * cp == unsplit + cp * extra, (saved, unsplit, extra)
    assert f["saved_activation_bytes_theory"] == f["saved_activation_bytes"], f


def run_spec(tmp_path, runs):
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    return spec


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    """One launch of 4 for the tests below: main() at cp 4 and at cp 2 x dp 2 with --ragged, for every
    attention and layout, and the three mutants under --check; then tests/context_parallel_checks.py --layers
    (each attention and layout on its own at cp 2, 3 and 4; the copy-out check). Returns (folder, checks)."""
    tmp = tmp_path_factory.mktemp("world4")
    runs = [
        dict(name=f"cp4-{a}-{l}", argv=[*MODEL4, "--attention", a, "--layout", l, "--check"])
        for a in ATTENTIONS
        for l in LAYOUTS
    ]
    runs += [
        dict(
            name=f"cp2dp2-{a}-{l}",
            argv=[
                *MODEL4,
                "--cp",
                "2",
                "--dp",
                "2",
                "--ragged",
                "--attention",
                a,
                "--layout",
                l,
                "--check",
            ],
        )
        for a in ATTENTIONS
        for l in LAYOUTS
    ]
    runs += [
        dict(
            name=m, argv=[*MODEL4, "--attention", "ring", "--layout", "zigzag", "--check"], mutant=m
        )
        for m in MUTANTS
    ]
    torchrun(
        "tests/context_parallel_checks.py",
        4,
        "--runs",
        run_spec(tmp, runs),
        tmp,
        "--layers",
        tmp,
        tmp_path=tmp,
        timeout=600,
        name="unused",
    )
    checks = [c for r in range(4) for c in json.loads((tmp / f"layers-rank{r}.json").read_text())]
    return tmp, checks


def assert_checks(checks, kind, count):
    mine = [c for c in checks if c["kind"] == kind]
    assert len(mine) == count, (kind, len(mine))  # every check ran, on every rank of every group
    wrong = [f"{c['name']}: {c['what']}" for c in mine if not c["ok"]]
    assert not wrong, "\n".join(wrong)


def test_attention_on_its_own_equals_one_process_attention(world4):
    """Each attention and layout at cp 2 (twice), 3 and 4, against F.scaled_dot_product_attention on the whole
    sequence: output and dQ/dK/dV (1e-12), bytes handed to each collective against the closed form, every ring
    send forward to r+1 and backward to r-1, blocks and scores the ring computed. Per rank: 6 variants x 5
    checks, + 3 for each ring variant."""
    ranks = 2 * 2 + 3 + 4
    assert_checks(world4[1], "attention", ranks * (6 * 5 + 2 * 3))


def test_copy_out_attention_functions_on_a_model_that_is_not_the_gpt(world4):
    """The three attention functions in a model of their own (fused qkv, a nested MLP, a gain on the root,
    3-token chunks, a regression loss), 3 Adam steps with gradients summed over the cp group, equal to plain
    one-process training of that model with scaled_dot_product_attention (1e-10)."""
    assert_checks(world4[1], "copy-out", (2 * 2 + 3 + 4) * 6)


def test_parity_at_cp4_and_cp2_dp2(world4):
    T, d = last(MODEL4, "--seq-len"), last(MODEL4, "--d-model")
    for a in ATTENTIONS:
        for l in LAYOUTS:
            assert_run(json.loads((world4[0] / f"cp4-{a}-{l}.json").read_text()), 4, 1, a, l, T, d)
            s = json.loads((world4[0] / f"cp2dp2-{a}-{l}.json").read_text())
            assert s["config"]["ragged"]
            assert_run(s, 2, 2, a, l, T, d)


def test_each_broken_piece_is_caught(world4):
    """A plain sum for the log-sum-exp merge, a ring backward on the stale K/V block, dK/dV never sent on:
    each changes the attention on its own (on some rank of every group), and --check fails each run."""
    assert_checks(world4[1], "mutant", (2 * 2 + 3 + 4) * 3)
    for m in MUTANTS:
        c = json.loads((world4[0] / f"{m}.json").read_text())["check"]
        assert not c["passed"] and c["max_param_diff"] > 1e-4, (m, c)


def assert_peak_first(folder, name):
    """main() read the peak before report() ran the unsplit GPT beside the split one (issue 31): on a GPU,
    CUDA's peak read after it would be at least the unsplit activations, hiding the saving."""
    events = json.loads((folder / f"{name}.events.json").read_text())
    assert events == ["peak read", "unsplit GPT forward"], (name, events)


def test_peak_is_read_before_the_unsplit_gpt_runs(world4):
    """tests/context_parallel_checks.py --runs wraps main()'s peak reader and the GPT it builds: the order of
    the two, for every run of the launch of 4 (and of cp 3, below)."""
    names = [f"{p}-{a}-{l}" for p in ("cp4", "cp2dp2") for a in ATTENTIONS for l in LAYOUTS] + list(
        MUTANTS
    )
    for name in names:
        assert_peak_first(world4[0], name)


def test_each_core_refuses_what_it_cannot_split(world4):
    """At cp 2 (both groups of the launch of 4): shard_sequence given T = 7 (contiguous) and T = 6 (zig-zag, 2cp =
    4 chunks), each attention given t = 3 tokens a rank under zig-zag, Ulysses given 3 heads: a ValueError that
    names what would work, and no collective counted before it. 4 ranks x 6 inputs."""
    assert_checks(world4[1], "bad-input", 4 * 6)


def test_parity_at_cp3(tmp_path):
    runs = [
        dict(
            name=f"cp3-{a}-{l}",
            argv=[
                *MODEL3,
                "--attention",
                a,
                "--layout",
                l,
                "--check",
                *(["--ragged"] if l == "zigzag" else []),
            ],
        )
        for a in ATTENTIONS
        for l in LAYOUTS
    ]
    torchrun(
        "tests/context_parallel_checks.py",
        3,
        "--runs",
        run_spec(tmp_path, runs),
        tmp_path,
        tmp_path=tmp_path,
        timeout=400,
        name="unused",
    )
    for a in ATTENTIONS:
        for l in LAYOUTS:
            assert_run(
                json.loads((tmp_path / f"cp3-{a}-{l}.json").read_text()),
                3,
                1,
                a,
                l,
                last(MODEL3, "--seq-len"),
                last(MODEL3, "--d-model"),
            )
            assert_peak_first(tmp_path, f"cp3-{a}-{l}")


def test_world1_is_the_reference(tmp_path):
    out = tmp_path / "w1.json"
    p = run_python(SCRIPT, *TINY, "--check", "--json", out, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    T, d = last(TINY, "--seq-len"), last(TINY, "--d-model")
    assert_run(json.loads(out.read_text()), 1, 1, "ring", "zigzag", T, d)


def test_restart_resumes_bit_for_bit(tmp_path):
    """The last rank dies at step 3; torchrun restarts both, they resume from step 2's checkpoint and give the
    uninterrupted run's losses bit for bit (and still pass --check)."""
    args = [*TINY, "--steps", "6", "--ragged"]
    full, _ = torchrun(SCRIPT, 2, *args, tmp_path=tmp_path, name="full")
    crash = ["--ckpt-dir", tmp_path / "ck", "--save-every", "2", "--fail-at-step", "3", "--check"]
    resumed, out = torchrun(
        SCRIPT, 2, *args, *crash, tmp_path=tmp_path, max_restarts=1, name="resumed"
    )
    assert "simulated failure at step 3" in out and "at step 2" in out, out[-3000:]
    assert resumed["losses"] == full["losses"], (resumed["losses"], full["losses"])
    assert_matches_reference(resumed)


def test_bad_input_one_line_exit_2_on_every_rank():
    """Plain processes with RANK / WORLD_SIZE, no rendezvous: a rank that reached a collective would crash.
    (The other bad inputs are tests/test_resilience.py's MATRIX lines for context_parallel.py.)"""
    results = run_ranks(SCRIPT, 2, *TINY, "--layout", "zigzag", "--seq-len", "6")
    assert_each_rank_fails(
        results, ["--seq-len 6 is not divisible by 2 x cp = 4", "use --seq-len 8"]
    )

"""diloco.py: DiLoCo and Streaming DiLoCo equal their own one-process simulation of the M workers (float64,
worlds 1-4); inner SGD with H = 1 and outer SGD lr 1 is synchronous data parallel SGD; the mutants are
caught; the bytes per inner step are P x b / H, counted at the dispatcher; a worker that dies mid-run
(exchanges in flight) is restarted to the uninterrupted run's losses and state, bit for bit; bad input is
one line and exit 2. tests/diloco_checks.py (one launch at world 3) holds the checks that patch the code."""

import json
import subprocess
import sys

import pytest
import torch

from helpers import (
    ENV,
    ROOT,
    TINY,
    assert_matches_reference,
    check_lines,
    passed,
    run_python,
    torchrun,
)

sys.path.insert(0, str(ROOT))
from common import GPT, GPTConfig  # noqa: E402  (the model's size, not diloco.py)

CFG = GPTConfig(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)
P = sum(p.numel() for p in GPT(CFG).parameters())  # parameters of TINY's model


@pytest.fixture(scope="module")
def checks():
    """tests/diloco_checks.py at world 3, once for the tests below: its lines "ok ..."."""
    return check_lines("tests/diloco_checks.py", 3, timeout=400)


def test_copy_out_core_on_another_model(checks):
    """DiLoCo, from diloco.py's technique section run alone (section.load), on a model that is not the GPT, inner SGD, H 1: outer SGD lr 1 == plain SGD and outer
    Nesterov == one-process Nesterov SGD with the product of the learning rates (torch's SGD, 1e-12); H 2
    differs (the comparison can fail)."""
    assert passed(checks, "copy-out", "outer SGD lr 1 == plain SGD", "restart from theta"), checks
    assert passed(checks, "copy-out", "outer Nesterov 0.7/0.9 == one-process Nesterov SGD"), checks
    assert passed(checks, "copy-out", "negative: H = 2 differs"), checks


def test_check_passes_and_bytes_are_p_b_over_h(checks):
    """World 3: DiLoCo and Streaming DiLoCo (bfloat16 on the wire) pass --check, and the latter fails it
    against a reference that does not round as the wire does; the bytes handed to the collectives per inner
    step (measured) equal P x b / H, computed from the parameter count."""
    assert passed(checks, "--inner-steps 3 --check", "PASSED", "(measured) == P x 8 / H"), checks
    assert passed(
        checks, "streaming", "PASSED", "(measured) == P x 2 / H", "== the largest fragment"
    ), checks
    assert passed(
        checks, "negative: against a reference that skips the bfloat16 rounding", "FAILS"
    ), checks


def test_copy_out_streaming_on_another_model(checks):
    """StreamingDiLoCo from the technique section alone, on that model (2 fragments, H 4, overlap 1, mix 0.5,
    bfloat16 on the wire, AdamW in, Nesterov out; the last exchange drained by finish): theta and the worker's
    weights == the workers simulated by hand in the checks (1e-12); without the rounding that simulation
    differs (the comparison can fail)."""
    assert passed(checks, "copy-out StreamingDiLoCo", "== the workers simulated by hand"), checks
    assert passed(
        checks, "copy-out StreamingDiLoCo: negative: the simulation without the wire's rounding"
    ), checks


def test_workers_start_from_rank_0s_theta(checks):
    """DiLoCo (the section alone) on workers whose weights differ (a fresh start from other seeds): every
    rank holds rank 0's after the first inner step's start (its broadcast); without the broadcast they
    differ (the check can fail)."""
    assert passed(checks, "copy-out DiLoCo", "all start from rank 0's"), checks
    assert passed(
        checks, "copy-out DiLoCo: negative: without the broadcast the workers' starts differ"
    ), checks


def test_resume_in_either_order(checks):
    """DiLoCo and StreamingDiLoCo (the section alone) cut after inner step 5 (Streaming: fragment 0's
    exchange in flight; every worker mid-round) and continued by fresh objects from the state dicts, at
    worlds 2 and 3: loading the model before building the wrapper, or after, ends bit for bit where the
    uninterrupted run ends. Negative: with the start sync back in the constructor (the code before), the
    model-first order ends elsewhere at both worlds."""
    for kind in ("StreamingDiLoCo, world {},", "DiLoCo, world {},"):
        for world in (2, 3):
            for order in ("model first", "wrapper first"):
                assert passed(checks, "resume: " + kind.format(world), order, "(0.0e+00)"), checks
    caught = "StreamingDiLoCo world 2 model first, DiLoCo world 2 model first"
    assert passed(checks, "resume: negative", caught, "DiLoCo world 3 model first"), checks


def test_overlap_is_real_with_the_exchange_slowed(checks):
    """diloco.py --overlap 2 with every exchange slowed to 300 ms by a stand-in for NCCL on gloo (a collective
    on the exchange's group waits behind it, as on NCCL's one stream per communicator): by the recorded order,
    TAU inner steps start between each exchange's launch and its wait and nothing queues behind it; --check
    passes; the run prints the exposed time beside the exchange's own (measured, reported). Mutants caught: the
    exchange waited for at launch; the exchange on WORLD, where the loss's all-reduce queues behind it. The
    exchange's bytes are counted on its own group ("exchange"), in the checks' byte tests."""
    assert passed(checks, "overlap 2, each exchange slowed", "[2, 2, 2, 0]", "--check PASSED"), (
        checks
    )
    assert passed(checks, "mutant: waits for the exchange at launch: caught"), checks
    assert passed(checks, "mutant: the exchange on WORLD, with the loss's all-reduce: caught"), (
        checks
    )


def test_exposed_time_is_the_stall_not_the_hosts_wait(checks):
    """ExchangeWatch on exchanges whose wait() returns at once and whose work completes 50 ms after it (as
    NCCL's wait() only makes the stream wait): each exchange, landed right after its launch, is reported
    >= 50 ms exposed; the rule before (the host's time in wait()) is caught reporting less."""
    assert passed(checks, "exposed time: exchanges whose work completes 50 ms after", "(>= 50)"), (
        checks
    )
    assert passed(checks, "exposed time: negative: the host's time in wait()", "caught"), checks


def test_cores_refuse_bad_input_before_any_collective(checks):
    """Each core of the section alone, given what it cannot do: a ValueError that says what would work, no
    collective seen by harness.CommCounter; a valid sync under the same counter is seen, and the section with
    its checks taken out lets all 13 through."""
    for what in (
        "DiLoCo, H 0",
        "DiLoCo, outer lr 0",
        "DiLoCo, Nesterov momentum 1",
        "DiLoCo, Nesterov momentum 0",
        "StreamingDiLoCo, no fragments",
        "StreamingDiLoCo, an empty fragment",
        "StreamingDiLoCo, a shared parameter",
        "StreamingDiLoCo, int8 wire",
        "StreamingDiLoCo, H 3, F 2",
        "StreamingDiLoCo, overlap 4 = H",
        "StreamingDiLoCo, mix 1",
        "gpt_fragments, 3 of 2 blocks",
        "gpt_fragments, 0",
    ):
        assert passed(
            checks, f"bad input: {what}: refused before any collective", "collectives: {}"
        ), (what, checks)
    assert passed(
        checks, "bad input: negative: a valid DiLoCo's sync under the same counter all-reduces"
    ), checks
    assert passed(
        checks, "bad input: negative: the section without its checks lets 13/13 of them through"
    ), checks


def test_sgd_h1_equals_synchronous_data_parallel(checks):
    assert passed(checks, "H 1, outer SGD lr 1 == synchronous data parallel SGD", "PASSED"), checks
    assert passed(checks, "negative: H 2 against synchronous SGD FAILS"), checks


def test_mutants_are_caught(checks):
    assert passed(checks, "mutant: the outer step applied to the workers' weights: FAILS"), checks
    assert passed(checks, "mutant: fragment 1 synced one step late: FAILS"), checks


def test_world_1():
    p = run_python("diloco.py", *TINY, "--inner-steps", "3", "--steps", "6", "--check")
    assert p.returncode == 0 and "-> PASSED" in p.stdout, p.stdout + p.stderr


def test_world_4_streaming_float8_odd_sizes(tmp_path):
    """H 10, 2 fragments, overlap 3, float8 with a scale per fragment: fragment 1's exchange lands after the
    last step (drained). d_model 30: no fragment's element count is a multiple of 8, so the float64 scale's
    bytes sit at an offset 8 does not divide in each worker's row (viewing them in place raised before).
    Bytes: the last 10 steps hold each fragment's exchange once, 1 B per element and 8 B of scale each."""
    cfg = GPTConfig(vocab=32, seq_len=8, d_model=30, n_heads=2, n_layers=2)
    gpt = GPT(cfg)
    frag0 = [gpt.tok_emb.weight, gpt.pos_emb.weight, *gpt.blocks[0].parameters()]
    assert sum(p.numel() for p in frag0) % 8 == 4  # 12300 B of float8, then the scale
    s, _ = torchrun(
        "diloco.py",
        4,
        *TINY,
        "--d-model",
        "30",
        "--steps",
        "12",
        "--inner-steps",
        "10",
        "--fragments",
        "2",
        "--overlap",
        "3",
        "--outer-dtype",
        "float8_e4m3fn",
        "--check",
        tmp_path=tmp_path,
    )
    assert_matches_reference(s)
    assert (
        s["figures"]["bytes_per_inner_step"]
        == (sum(p.numel() for p in gpt.parameters()) * 1 + 2 * 8) / 10
    )


def test_world_2_restart_with_exchanges_in_flight(tmp_path):
    """Streaming, float32 on the wire under float64, overlap 1: the checkpoint at step 4 holds fragment 1's
    exchange in flight (as does step 8's, the same phase, which is kept). A worker dies at step 5; torchrun
    restarts both from step 4; losses, theta, outer
    momentum, every worker's weights and AdamW state end bit for bit as in the uninterrupted run."""
    args = [
        *TINY,
        "--steps",
        "10",
        "--inner-steps",
        "4",
        "--fragments",
        "2",
        "--overlap",
        "1",
        "--outer-dtype",
        "float32",
    ]
    full, _ = torchrun(
        "diloco.py",
        2,
        *args,
        "--check",
        "--ckpt-dir",
        tmp_path / "full",
        tmp_path=tmp_path,
        name="full",
    )
    assert_matches_reference(full)
    rs, out = torchrun(
        "diloco.py",
        2,
        *args,
        "--ckpt-dir",
        tmp_path / "rs",
        "--save-every",
        "2",
        "--fail-at-step",
        "5",
        tmp_path=tmp_path,
        name="rs",
        max_restarts=1,
    )
    assert "simulated failure at step 5" in out and "at step 4" in out, out[-3000:]
    # step 8 is step 4's phase (H = 4): fragment 1's exchange, sent after step 7, was saved in flight
    saved = torch.load(tmp_path / "rs" / "rank0" / "step8.pt", weights_only=False)
    assert [f for f, *_ in saved["diloco"]["pending"]] == [1]
    assert rs["losses"] == full["losses"]
    for r in range(2):
        a, b = (
            torch.load(tmp_path / k / f"rank{r}" / "step10.pt", weights_only=False)
            for k in ("full", "rs")
        )
        for key in ("model", "inner", "diloco"):
            assert_identical(a[key], b[key])


def assert_identical(a, b):
    if torch.is_tensor(a):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_identical(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_identical(x, y)
    else:
        assert a == b


BAD = [  # (world, flags, words): each on every rank, in one process (tests/bad_input_matrix.py); the messages
    # are the cores' own (check_args calls their checks), the last three check_args's alone
    (1, ["--inner-steps", "0"], ["DiLoCo: inner_steps must be >= 1, got 0"]),
    (1, ["--fragments", "3"], ["3 fragments of 2 blocks", "1 <= n <= 2"]),
    (1, ["--inner-steps", "3", "--fragments", "2"], ["inner_steps % fragments == 0 (got 3 % 2)"]),
    (1, ["--inner-steps", "4", "--overlap", "4"], ["0 <= overlap < inner_steps = 4 (got 4)"]),
    (1, ["--mix", "1"], ["0 <= mix < 1 (got 1.0)"]),
    (1, ["--outer-momentum", "1"], ["0 < outer_momentum < 1", "not 0.7 and 1.0"]),
    (1, ["--outer-momentum", "0"], ["0 < outer_momentum < 1", "none: plain SGD"]),
    (1, ["--outer-lr", "0"], ["outer_lr > 0", "not 0.0 and 0.9"]),
    (1, ["--check", "--dropout", "0.1"], ["--check needs --dropout 0"]),
    (1, ["--dtype", "bfloat16", "--outer-dtype", "float32"], ["wider than --dtype bfloat16"]),
    (3, ["--batch-size", "8"], ["--batch-size 8 is not divisible by the 3 workers"]),
]


def test_bad_input_exits_2_with_one_line(tmp_path):
    cases = [
        dict(file="diloco.py", world=w, rank=r, argv=[*TINY, *a], words=words)
        for w, a, words in BAD
        for r in range(w)
    ]
    # the control: a valid configuration passes every check and crashes at the rendezvous, which this
    # runner does not provide: a case whose check were missing would show up so
    cases.append(dict(file="diloco.py", world=2, rank=1, argv=TINY, words=[]))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    runner = [
        sys.executable,
        str(ROOT / "tests" / "bad_input_matrix.py"),
        str(tmp_path / "cases.json"),
    ]
    p = subprocess.run(runner, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    results = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    assert len(results) == len(cases), p.stdout[-2000:] + p.stderr[-2000:]
    control = results.pop()
    assert control["code"] == "crash" and "MASTER_ADDR" in control["stderr"], control
    for c, r in zip(cases, results):
        lines = r["stderr"].strip().splitlines()
        assert r["code"] == 2 and len(lines) == 1 and f"error (rank {c['rank']})" in lines[0], (
            c,
            r,
        )
        assert all(w in lines[0] for w in c["words"]), (c, lines[0])

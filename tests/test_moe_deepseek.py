"""moe_deepseek.py (fine-grained + shared experts, sigmoid gates, loss-free balancing, dropless dispatch):
layer-level checks in one 4-rank launch (EP 1/2/4 parity, dropless against identity experts and a per-token
loop, the bias lowering MaxVio, resume of the bias, a bias from one rank's counts caught by --check:
tests/moe_deepseek_checks.py), which also runs this module's copy-out check (DeepSeekMoE in a model that is not
the GPT); the command line at EP 3 killed and restarted equal to the one-process reference, its summary's
figures beside their theory; the gates and the sequence-wise loss against DeepSeek-V3's formulas computed by
hand, the bias update against its closed form, each broken and caught; exact ties go to the lower expert
index; bad input exits 2."""

import ast
import math
import sys

import pytest
import torch
import torch.distributed as dist

from helpers import (
    ROOT,
    TINY,
    assert_bad_input,
    assert_each_rank_fails,
    assert_matches_reference,
    run_python,
    run_ranks,
    torchrun,
)
from moe_common import (
    EXPERTS,
    HIDDEN,
    ROWS,
    D,
    ResidualMoEStack,
    assert_all_pass,
    copy_out_case,
    launch_checks,
    rel_diff,
)

sys.path.insert(0, str(ROOT))
import moe_deepseek as ds  # noqa: E402  (importing must not run main())


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """tests/moe_deepseek_checks.py at world 4, once for the module: its output."""
    return launch_checks("tests/moe_deepseek_checks.py", tmp_path_factory)


def test_layer_checks(checks):
    out = checks
    assert "ALL CHECKS PASSED" in out and "FAIL" not in out, out[-6000:]
    assert out.count("PASS  parity") == out.count("PASS  loss-free bias moved") == 6, out[
        -6000:
    ]  # 2 x EP 1, 2, 4
    assert out.count("PASS  dropless") == 2 and "PASS  negative: a loss-free bias" in out, out[
        -6000:
    ]
    assert (
        "PASS  balance: bias rate 0.01 lowers MaxVio" in out
        and "PASS  loss-free: the bias is in" in out
    )


def test_ep3_restart(tmp_path):
    """World 3 = EP 3 with 6 fine-grained experts and a shared one, killed at step 2 and restarted by torchrun
    from its checkpoints: --check equals the one-process reference, the loss-free biases compared by name (a
    bias lost in the restart would move the routing and the losses); each step's loads add up to every token's
    k choices (nothing dropped), and the uneven all-to-all's bytes per rank equal their value expected from
    the routed counts."""
    s, out = torchrun(
        "moe_deepseek.py",
        3,
        *TINY,
        "--experts",
        "6",
        "--shared-experts",
        "1",
        "--bias-rate",
        "0.005",
        "--seq-aux-weight",
        "0.01",
        "--check",
        "--ckpt-dir",
        tmp_path / "ckpt",
        "--save-every",
        "1",
        "--fail-at-step",
        "2",
        tmp_path=tmp_path,
        max_restarts=1,
        name="ep3",
    )
    assert "simulated failure at step 2" in out and "resumed from" in out, out[-3000:]
    assert_matches_reference(s)
    f, cfg = s["figures"], s["config"]
    tokens = cfg["batch_size"] * cfg["seq_len"]
    assert [[sum(l) for l in step] for step in f["expert_load_per_step"]] == [
        [2 * tokens] * 2
    ] * 2, f  # steps 2, 3
    assert len(f["maxvio_per_step"]) == 2 and all(v >= 0 for v in f["maxvio_per_step"])
    # (at 0.02 it
    assert any(b != 0 for bias in f["expert_bias"] for b in bias) and len(f["expert_bias"]) == 2, f
    # oscillates back to 0 in 4 steps: the tiny gates' score gaps are smaller than the rate)
    sent, expected = f["alltoall_bytes_per_rank"], f["alltoall_bytes_expected_per_rank"]
    assert sent == expected and min(sent) > 0 and len(set(sent)) > 1, (
        sent,
        expected,
    )  # uneven across ranks
    assert s["comm_bytes"] == sent[0] and f["counts_bytes_per_step"] == 2 * 6 * 8, f
    # the history resumes too
    assert len(s["losses"]) == len(f["lm_losses"]) == len(f["aux_losses"]) == 4
    for total, lm, aux in zip(s["losses"], f["lm_losses"], f["aux_losses"]):
        assert abs(total - (lm + 0.01 * aux)) < 1e-12 and aux > 0


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--experts", "6", "--ep", "4"],
            ["--experts 6, --ep 4", "experts = 6 is not divisible by ep = 4", "try experts = 8"],
        ),
        (["--top-k", "9"], ["--experts 8", "--top-k 9", "top_k = 9 with 8 experts", "1..8"]),
        (["--granularity", "3"], ["--granularity 3", "4 x --d-model"]),
    ],
)
def test_bad_input_world1(flags, words):
    p = run_python("moe_deepseek.py", *TINY, *flags)
    assert_bad_input(p, 1, words)


def test_bad_input_every_rank():
    """Each rank of a world of 2, started alone (torchrun's environment but no rendezvous: a check placed
    after init_dist would crash instead), says the same one line and exits 2."""
    assert_each_rank_fails(
        run_ranks("moe_deepseek.py", 2, "--experts", "3"),
        ["--experts 3, --ep 2", "experts = 3 is not divisible by ep = 2"],
    )


@pytest.mark.parametrize(
    "flags, words",
    [
        (dict(score="tanh"), ["--score tanh: ", "score = 'tanh': use sigmoid"]),
        (dict(top_k=0), ["--top-k 0", "top_k = 0 with 8 experts"]),
        (dict(shared_experts=-1), ["--shared-experts must be >= 0"]),
        (dict(bias_rate=-1.0), ["--bias-rate must be >= 0"]),
        (dict(seq_aux_weight=-1.0), ["--seq-aux-weight must be >= 0"]),
        (dict(batch_size=3), ["--batch-size 3", "world size 2"]),
    ],
)
def test_bad_input_flags(flags, words, capsys):
    """The checks main() runs on every rank before init_dist: one line, exit 2 (world 2 given)."""
    with pytest.raises(SystemExit) as e:
        ds.check_args(ds.Args(**flags), 2)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and all(w in lines[0] for w in words), lines


# ----------------------------------------------------------------------------- the gates and the balancing, by hand
LF_LOGITS = [
    [0.2, -0.1, 0.4, 0.0],
    [1.0, 0.9, -0.3, 0.2],
    [-0.5, 0.3, 0.1, 0.35],
    [0.0, 0.1, 0.2, 0.3],
]
LF_BIAS = [0.3, 0.0, -0.4, 0.1]  # token 0: e2, e0 by score; e0, e3 once the bias is added


def loss_free_diff(k=2, n=2):
    """Wang et al. 2024 / DeepSeek-V3 eq. 12-20 on N = 4 tokens (two sequences of n = 2), E = 4, in Python
    floats: the top k of s + b choose (s = sigmoid(logits)); gate = s / (sum of the chosen s), no bias in it;
    sequence-wise loss sum_e f_e P_e, f_e = E / (k n) x (tokens choosing e), P_e = mean of s_e / sum_j s_j.
    Returns the largest relative diff of gates and per-sequence losses, and the bias's gradient."""
    E = 4
    s = [[1 / (1 + math.exp(-v)) for v in row] for row in LF_LOGITS]
    chosen = [sorted(range(E), key=lambda e: -(row[e] + LF_BIAS[e]))[:k] for row in s]
    gates = [
        [row[e] / sum(row[j] for j in top) if e in top else 0.0 for e in range(E)]
        for row, top in zip(s, chosen)
    ]
    per_seq = []
    for q in range(0, len(s), n):
        f = [E / (k * n) * sum(e in chosen[t] for t in range(q, q + n)) for e in range(E)]
        P = [sum(s[t][e] / sum(s[t]) for t in range(q, q + n)) / n for e in range(E)]
        per_seq.append(sum(fe * pe for fe, pe in zip(f, P)))
    bias = torch.tensor(LF_BIAS, dtype=torch.float64, requires_grad=True)
    scores = torch.tensor(LF_LOGITS, dtype=torch.float64).requires_grad_().sigmoid()
    expert, gate = ds.route(scores, bias, k)
    aux = ds.seq_balance_loss(scores, expert, n)
    # (N, E): each token's gate per expert
    dense = torch.zeros_like(scores).scatter(-1, expert, gate)
    weights = torch.arange(1.0, 5.0, dtype=torch.float64)  # any loss of the gates and the aux loss
    grad = torch.autograd.grad(
        (dense.sum(-1) * weights).sum() + (dense * dense).sum() + aux.sum(), bias, allow_unused=True
    )[0]
    return max(rel_diff(dense, gates), rel_diff(aux, per_seq)), grad


def test_loss_free_by_hand(monkeypatch):
    diff, grad = loss_free_diff()
    assert diff < 1e-12 and grad is None  # the bias only chooses: no gradient reaches it
    route, seq = ds.route, ds.seq_balance_loss

    def biased_gates(scores, bias, k):  # broken: the gates weigh with s + b
        expert, _ = route(scores, bias, k)
        g = (scores + bias).gather(-1, expert)
        return expert, g / g.sum(-1, keepdim=True)

    with monkeypatch.context() as m:
        m.setattr(ds, "route", biased_gates)
        diff, grad = loss_free_diff()
        assert diff > 1e-2 and grad is not None
    with monkeypatch.context() as m:  # broken: the balance loss over all tokens, not per sequence
        m.setattr(
            ds,
            "seq_balance_loss",
            lambda scores, expert, n: seq(scores, expert, scores.shape[0]).expand(2),
        )
        assert loss_free_diff()[0] > 1e-2


def test_bias_update_closed_form(monkeypatch):
    """b_e + u sign(mean c - c_e) from counts c, in Python, against ds.update_biases (one process: the counts
    are the batch's); under-loaded experts move up, over-loaded down, one at the mean stays."""
    from types import SimpleNamespace

    counts, bias, u = (
        [[5.0, 1.0, 3.0, 3.0], [0.0, 2.0, 2.0, 8.0]],
        [[0.1, -0.2, 0.0, 0.05], [0.0] * 4],
        0.01,
    )
    layers = [
        SimpleNamespace(wanted=torch.tensor(c), expert_bias=torch.tensor(b, dtype=torch.float64))
        for c, b in zip(counts, bias)
    ]

    def want():
        mean = [sum(c) / len(c) for c in counts]
        return [
            [b + u * ((x < m) - (x > m)) for x, b in zip(c, bs)]
            for c, bs, m in zip(counts, bias, mean)
        ]

    flat = lambda rows: [v for row in rows for v in row]  # noqa: E731
    ds.update_biases(layers, u, None)
    assert flat(l.expert_bias.tolist() for l in layers) == pytest.approx(flat(want()), abs=1e-15)
    # at the mean: stays; below: up
    assert want()[0][2] == bias[0][2] and want()[1][1] == bias[1][1] + u
    # broken: the sign reversed (over-loaded experts made more attractive)
    for l, b in zip(layers, bias):
        l.expert_bias = torch.tensor(b, dtype=torch.float64)
    monkeypatch.setattr(ds.torch, "sign", lambda t: t.neg().sign_())
    ds.update_biases(layers, u, None)
    assert flat(l.expert_bias.tolist() for l in layers) != pytest.approx(flat(want()), abs=1e-6)


def test_ties_go_to_the_lower_expert_index(monkeypatch):
    """Review 2, R4: a near-tie that rounds to an exact tie on one device must route the same everywhere, so
    the top k of s + b breaks exact ties by index (torch.topk leaves their order to the kernel)."""
    # expert 3's 0.7 + 0.2 leads token 0
    scores = torch.tensor(
        [[0.5, 0.7, 0.7, 0.7], [0.6, 0.6, 0.6, 0.6], [0.9, 0.1, 0.9, 0.1]], dtype=torch.float64
    )
    bias = torch.tensor([0.0, 0.0, 0.0, 0.2], dtype=torch.float64)
    want = [[3, 1, 2], [3, 0, 1], [0, 2, 3]]
    assert ds.route(scores, bias, 3)[0].tolist() == want
    top_k = ds.top_k
    # broken: ties to the higher index (a kernel free to order them could do this on one device)
    monkeypatch.setattr(
        ds, "top_k", lambda s, k: (lambda v, i: (v, s.shape[-1] - 1 - i))(*top_k(s.flip(-1), k))
    )
    assert ds.route(scores, bias, 3)[0].tolist() != want


# ----------------------------------------------------------------------------- copy-out: check your own MoE
# DeepSeekMoE and its balancing, taken from moe_deepseek.py's technique section alone (tests/section.py: torch
# and einops only), in a model that is not the GPT (a parameter on the root module, nested modules, odd sizes:
# width 6, expert width 10, 6 experts, 5 positions, 3 input features; an MSE loss), expert parallel at EP 2 x 2
# replicas, against the same model with every expert local trained by plain torch in one process
# (tests/moe_common.py: the stack and both trainings, shared with moe.py's test). tests/moe_deepseek_checks.py
# runs copy_out() in its 4-rank launch; test_copy_out_moe_deepseek reads the verdicts.
def copy_out(d, lay, steps=3, aux_weight=0.1, bias_rate=0.05):
    """[(name, ok, detail)] for a sigmoid-gated layer with a shared expert and the sequence-wise loss, and a
    softmax-gated top-3 one without shared experts, with the cores of the technique section executed alone."""
    import section

    core = section.load("moe_deepseek.py")
    MoE, aux_share = core["DeepSeekMoE"], core["aux_share"]

    def loss_free_by_hand(layers):  # the reference's loss-free update from the batch's counts
        for m in layers:
            c = m.wanted.double()
            m.expert_bias += bias_rate * torch.sign(c.mean() - c)

    # the EP run's: the section's update, its counts summed over every rank
    def loss_free_by_section(
        model,
    ):
        core["update_biases"](core["moe_layers"](model), bias_rate, dist.group.WORLD)

    verdicts = []
    for flags in (dict(top_k=2, shared=1), dict(top_k=3, shared=0, score="softmax")):

        def build(ep_group):
            torch.manual_seed(0)
            model = ResidualMoEStack(
                lambda i, gen: MoE(
                    D, EXPERTS, hidden=HIDDEN, ep_group=ep_group, generator=gen, **flags
                )
            )
            model = model.double().to(d.device)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

        name = "copy-out " + " ".join(f"{k}={v}" for k, v in flags.items())
        verdicts += copy_out_case(
            d,
            lay,
            name,
            build,
            MoE,
            core["sync_grads"],
            lambda model: aux_share(model, ROWS),
            steps,
            aux_weight,
            ref_update=loss_free_by_hand,
            ep_update=loss_free_by_section,
        )
    return verdicts


def test_cores_refuse_bad_input_before_any_collective(checks):
    """DeepSeekMoE and AllToAll, from the technique section alone, each given what it cannot do at EP 2, raise
    a ValueError naming what would work before any collective (harness.CommCounter saw none; given good input
    it sees the all-to-alls); with the checks made no-ops (the mutant), the layers are built silently
    (tests/moe_deepseek_checks.py, 5)."""
    assert_all_pass(checks, "  bad input", 2 * 4 + 1 + 3)


def test_copy_out_moe_deepseek(checks):
    """Check your own DeepSeek-style MoE the same way: the layer inside your model, expert parallel, against the
    model with every expert local trained in one process (copy_out above, run in the checks' launch)."""
    assert_all_pass(checks, "copy-out", 4)


# What moe_deepseek.py's docstring says repeats moe.py line for line (docstrings aside), and nothing else.
SAME_AS_MOE = {"init", "top_k", "mlps", "make_layout", "split_params", "sync_grads"}


def code_of(text):
    """{name: the code of each top-level function or class of `text`, its docstrings left out}."""
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            for f in ast.walk(node):
                if (
                    isinstance(f, (ast.FunctionDef, ast.ClassDef))
                    and ast.get_docstring(f) is not None
                ):
                    f.body = f.body[1:] or [ast.Pass()]
            out[node.name] = ast.dump(node)
    return out


def test_repeats_of_moe_py_are_the_declared_ones():
    """The functions whose code moe_deepseek.py shares with moe.py are exactly those its docstring declares
    (SAME_AS_MOE); a declared copy changed in one file is caught, and so is a copy not declared."""
    moe_code = code_of((ROOT / "moe.py").read_text())
    text = (ROOT / "moe_deepseek.py").read_text()

    def shared(text):
        return {k for k, code in code_of(text).items() if moe_code.get(k) == code}

    assert shared(text) == SAME_AS_MOE
    changed = "    replica, ep_rank = divmod(d.rank, ep)\n"
    assert text.count(changed) == 1
    drifted = text.replace(changed, "    replica, ep_rank = divmod(d.rank, ep)\n    replica += 0\n")
    assert shared(drifted) == SAME_AS_MOE - {"make_layout"}
    undeclared = text.replace("def moe_layers(", "def moe_layers_renamed(")
    undeclared += "\n\ndef set_step(model, step, row0):\n    for m in moe_layers(model):\n"
    undeclared += "        m.step = step\n        m.row0 = row0\n"
    assert shared(undeclared) != SAME_AS_MOE

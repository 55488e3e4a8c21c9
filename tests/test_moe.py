"""moe.py (noisy top-k, GShard, Switch, expert choice): layer-level checks in one 4-rank launch (EP 1/2/4 parity
for every router, dispatch/combine, hand-written routing, load balancing, training toward the floor:
tests/moe_checks.py), which also runs this module's copy-out check (moe.MoE in a model that is not the GPT);
the command line at EP 2 with replicas equal to the one-process reference with the same routing groups, the
summary's figures beside their theory; EP 3 equal to it too; a run killed and restarted by torchrun equal bit
for bit to an uninterrupted one; each router's maths against its paper's closed form computed by hand, and a
broken router caught by it; exact ties go to the lower expert index; the peak memory read before --check's
reference; bad input exits 2."""

import math
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

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
import harness  # noqa: E402
import moe  # noqa: E402  (importing must not run main())


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """tests/moe_checks.py at world 4, once for the module: its output."""
    return launch_checks("tests/moe_checks.py", tmp_path_factory)


def test_layer_checks(checks):
    out = checks
    assert "ALL CHECKS PASSED" in out and "FAIL" not in out, out[-6000:]
    assert out.count("PASS  parity") == 12, out[-6000:]  # 4 routers x EP 1, 2, 4


def test_replicas_x_ep_gshard_figures(tmp_path):
    """World 4 = 2 replicas x EP 2, MoE in every other block, 4 routing groups: equals the one-process
    reference, and the summary's numbers agree with each other and with their theory."""
    s, out = torchrun(
        "moe.py",
        4,
        *TINY,
        "--router",
        "gshard",
        "--ep",
        "2",
        "--moe-every",
        "2",
        "--capacity-factor",
        "1.0",
        "--check",
        tmp_path=tmp_path,
        name="gshard",
    )
    assert_matches_reference(s)
    f, cfg = s["figures"], s["config"]
    assert (f["ep"], f["replicas"], f["groups"], f["tokens_per_group"], f["capacity"]) == (
        2,
        2,
        4,
        24,
        12,
    ), f
    assert len(f["expert_load"]) == 1  # 2 layers, MoE in block 1 only
    load = f["expert_load"][0]
    tokens = cfg["batch_size"] * cfg["seq_len"]
    assert all(0 <= l <= f["groups"] * f["capacity"] for l in load), f  # never past G x C slots
    assert f["expert_load_theory_balanced"] == tokens * 2 / cfg["experts"]
    # a token with no expert lost at least one of its (at most 2) wanted assignments
    # 4 all-to-alls per MoE layer per step (dispatch, combine, and their backward), each sending the
    # (E, G/W, C, D) buffer's other-rank half: 4 x 1 x (1/2) x 4 x 1 x 12 x 16 x 8 bytes.
    assert (
        0 <= f["dropped_frac"] < 1 and f["tokens_without_expert_frac"] <= 2 * f["dropped_frac"]
    ), f
    assert (
        s["comm_bytes"]
        == f["alltoall_bytes_per_step"]
        == f["alltoall_bytes_theory"]
        == 4 * 4 * 12 * 16 * 8 // 2
    )
    for total, lm, aux in zip(s["losses"], f["lm_losses"], f["aux_losses"]):
        assert abs(total - (lm + cfg["aux_weight"] * aux)) < 1e-12 and aux > 0
    assert "expert load, MoE layer 0" in out and "all-to-all bytes sent / step / rank" in out
    assert (
        f["alltoall_bytes_per_rank"]
        == f["alltoall_bytes_expected_per_rank"]
        == [f["alltoall_bytes_theory"]] * 4
    )


def test_ep3_expert_choice(tmp_path):
    """World 3 = EP 3 with 6 experts, expert choice (every expert exactly full), MoE in every block: --check
    equals the one-process reference; each expert takes C per routing group, and the all-to-all bytes per rank
    equal their theory."""
    s, _ = torchrun(
        "moe.py",
        3,
        *TINY,
        "--router",
        "expert_choice",
        "--experts",
        "6",
        "--steps",
        "2",
        "--check",
        tmp_path=tmp_path,
        name="ep3",
    )
    assert_matches_reference(s)
    f = s["figures"]
    assert all(l == f["groups"] * f["capacity"] for layer in f["expert_load"] for l in layer), f
    assert (
        f["alltoall_bytes_per_rank"]
        == f["alltoall_bytes_expected_per_rank"]
        == [f["alltoall_bytes_theory"]] * 3
    )


def last_checkpoint(ckpt_dir, rank):
    """The newest checkpoint a rank wrote: the run's final state (Checkpointer saves after the last step)."""
    files = sorted((ckpt_dir / f"rank{rank}").glob("step*.pt"), key=lambda p: int(p.stem[4:]))
    return torch.load(files[-1], map_location="cpu", weights_only=False)


def flat_state(state, prefix=""):
    """Every tensor of a nested state dict, by path."""
    if torch.is_tensor(state):
        return {prefix: state}
    items = (
        state.items()
        if isinstance(state, dict)
        else enumerate(state)
        if isinstance(state, list)
        else []
    )
    return {k: v for key, sub in items for k, v in flat_state(sub, f"{prefix}/{key}").items()}


def test_ep2_restart_bit_for_bit(tmp_path):
    """noisy_topk (router noise from (seed, step, layer, row)) at EP 2, each rank holding half the experts,
    with 4 routing groups, padding and dropout (per-rank RNG), killed at step 2 and restarted by torchrun
    from its checkpoints, launched exactly as the README says: bit for bit the per-step losses, final
    parameters (expert shards included) and optimizer state of the same run uninterrupted."""
    flags = [*TINY, "--router", "noisy_topk", "--groups", "4", "--ragged", "--dropout", "0.1"]
    plain, _ = torchrun(
        "moe.py", 2, *flags, "--ckpt-dir", tmp_path / "plain", tmp_path=tmp_path, name="plain"
    )
    s, out = torchrun(
        "moe.py",
        2,
        *flags,
        "--ckpt-dir",
        tmp_path / "ckpt",
        "--save-every",
        "1",
        "--fail-at-step",
        "2",
        tmp_path=tmp_path,
        max_restarts=1,
        name="restarted",
    )
    assert "simulated failure at step 2" in out and "resumed from" in out, out[-3000:]
    assert (
        s["losses"] == plain["losses"]
        and s["figures"]["aux_losses"] == plain["figures"]["aux_losses"]
    )
    for rank in range(2):
        a, b = (
            flat_state({k: last_checkpoint(tmp_path / d, rank)[k] for k in ("model", "optim")})
            for d in ("plain", "ckpt")
        )
        assert a.keys() == b.keys() and any(".w1" in k for k in a), sorted(a)
        assert all(torch.equal(a[k], b[k]) for k in a), [
            k for k in a if not torch.equal(a[k], b[k])
        ]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--experts", "6", "--ep", "4"], ["--experts 6", "--ep 4"]),
        (
            ["--router", "noisy_topk", "--top-k", "5", "--experts", "4"],
            ["--top-k 5: k = 5 with 4 experts", "--experts 4"],
        ),
        (
            ["--capacity-factor", "-1"],
            ["--capacity-factor -1.0", "capacity_factor must be > 0, got -1.0"],
        ),
        (["--router", "switch", "--top-k", "2"], ["top-1"]),
    ],
)
def test_bad_input_world1(flags, words):
    p = run_python("moe.py", *flags)
    assert_bad_input(p, 1, words)


def test_bad_input_every_rank():
    """Each rank of a world of 2, started alone (torchrun's environment but no rendezvous: a check placed
    after init_dist would crash instead), says the same one line and exits 2. Through torchrun, the agent
    SIGTERMs the slower rank once the first exits, so its own exit code is not always observable."""
    # ep = world size by default
    assert_each_rank_fails(
        run_ranks("moe.py", 2, "--experts", "3"),
        ["--experts 3, --ep 2", "experts = 3 is not divisible by ep = 2", "try experts = 4"],
    )


# ----------------------------------------------------------------------------- the routing maths, by hand
# Each router against its paper's formulas, evaluated in plain Python floats on a tiny input (one routing
# group), independent of moe.py's tensor code; then a deliberately broken router must fail the same check.
def softmax(xs):
    e = [math.exp(x - max(xs)) for x in xs]
    return [v / sum(e) for v in e]


def phi(z):  # the standard normal CDF
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def cv2(v):  # squared coefficient of variation, population variance (Shazeer et al. 2017, Sec. 4)
    m = sum(v) / len(v)
    return sum((x - m) ** 2 for x in v) / len(v) / m**2


def group(rows):  # a list of T rows of E numbers -> one routing group (1, T, E)
    return torch.tensor([rows], dtype=torch.float64)


CLEAN = [
    [0.3, -0.2, 0.8, 0.1],
    [1.0, 0.4, -0.5, 0.2],
    [-0.3, 0.6, 0.0, 0.9],
]  # x W_g: T = 3 tokens, E = 4
STD = [[0.5, 1.0, 0.3, 0.7], [0.2, 0.6, 0.9, 0.4], [1.1, 0.3, 0.5, 0.8]]  # softplus(x W_noise)
EPS = [[0.4, -1.2, 0.1, 0.9], [-0.7, 1.5, 0.3, -0.2], [0.2, -0.4, 1.3, -1.0]]  # N(0, 1) draws


def noisy_topk_diff(k=2):
    """Shazeer et al. 2017: H = clean + eps * std, gates = softmax over the top k of H (Sec. 2.1);
    importance = sum of gates, load = sum of P(x, i) = Phi((clean_i - kth_excluding(H, k, i)) / std_i)
    (Appendix A); aux = CV(importance)^2 + CV(load)^2 (Sec. 4). Largest relative diff of gates, load, aux."""
    E, gates, importance, load = 4, [], [0.0] * 4, [0.0] * 4
    for c, s, e in zip(CLEAN, STD, EPS):
        H = [ci + ei * si for ci, si, ei in zip(c, s, e)]
        top = sorted(range(E), key=lambda i: -H[i])[:k]
        g = dict(zip(top, softmax([H[i] for i in top])))
        gates.append([g.get(i, 0.0) for i in range(E)])
        for i in range(E):
            importance[i] += g.get(i, 0.0)
            kth_other = sorted((H[j] for j in range(E) if j != i), reverse=True)[k - 1]
            load[i] += phi((c[i] - kth_other) / s[i])
    clean, std, eps = group(CLEAN), group(STD), group(EPS)
    expert, gate, keep, aux = moe.route_noisy_topk(clean, std, eps, k)
    _, combine = moe.fill_slots(expert, gate, keep, 3, 4)  # C = T: nothing dropped
    got_load = moe.smooth_load(clean, std, clean + eps * std, k).sum(1)
    return max(
        rel_diff(combine.sum(-1), gates),
        rel_diff(got_load, load),
        rel_diff(aux, cv2(importance) + cv2(load)),
    )


def test_noisy_topk_by_hand(monkeypatch):
    # moe.cv_squared's 1e-10 guard on mean^2 (0.56 here) is the 2e-10
    assert noisy_topk_diff() < 1e-9
    # broken: the load threshold counts the expert itself among the top k
    with monkeypatch.context() as m:
        m.setattr(
            moe,
            "smooth_load",
            lambda c, s, H, k: torch.special.ndtr((c - H.topk(k).values[..., -1:]) / s),
        )
        assert noisy_topk_diff() > 1e-2
    with monkeypatch.context() as m:  # broken: CV^2 with the sample variance
        m.setattr(moe, "cv_squared", lambda v: v.var(-1) / v.mean(-1) ** 2)
        assert noisy_topk_diff() > 1e-2


def all_experts_chosen_grads():
    """k = E: every expert is in every token's top k, so the load is 1 per token and expert, and the aux loss's
    gradients (to x W_g and to the noise scale) must be finite: they reach the router's weights."""
    clean, std = group(CLEAN).requires_grad_(), group(STD).requires_grad_()
    _, _, _, aux = moe.route_noisy_topk(clean, std, group(EPS), 4)
    load = moe.smooth_load(clean, std, clean + group(EPS) * std, 4)
    aux.backward()
    return load.detach(), torch.cat([clean.grad.flatten(), std.grad.flatten()])


def test_noisy_topk_with_every_expert_chosen(monkeypatch):
    # gpu_check's 2 experts, top-2: NaN from step 1 before the fix
    load, grads = all_experts_chosen_grads()
    assert torch.equal(load, torch.ones_like(load)) and torch.isfinite(grads).all()
    # broken: the old margin to a k+1-th expert of -inf (0 x inf in backward)
    with monkeypatch.context() as m:
        m.setattr(moe, "smooth_load", lambda c, s, H, k: torch.special.ndtr((c + math.inf) / s))
        assert not torch.isfinite(all_experts_chosen_grads()[1]).all()


GS_LOGITS = [[2.0, 1.0, -1.0], [0.5, 1.5, 0.0], [0.2, -0.3, 1.1], [1.0, 0.9, -2.0]]  # T = 4, E = 3
GS_UNIFORM = [
    0.9,
    0.05,
    0.6,
    0.7,
]  # 2 g2 = 0.54, 0.54, 0.58, 0.95: the 2nd expert kept for tokens 1 and 3


def gshard_diff():
    """GShard Alg. 1: g1, g2 = the top two softmax gates renormalised to sum 1; the 2nd expert is used iff
    uniform < 2 g2; aux = mean_e (c_e / S) m_e (c_e: tokens whose 1st choice is e, m_e: mean gate), times
    E^2 here (the file's convention: 1 under uniform routing). Largest relative diff of gates and aux."""
    E, T, probs = 3, 4, [softmax(r) for r in GS_LOGITS]
    gates, first = [], []
    for p, u in zip(probs, GS_UNIFORM):
        e1, e2 = sorted(range(E), key=lambda e: -p[e])[:2]
        row = [0.0] * E
        row[e1] = p[e1] / (p[e1] + p[e2])
        if u < 2 * p[e2] / (p[e1] + p[e2]):
            row[e2] = p[e2] / (p[e1] + p[e2])
        gates.append(row), first.append(e1)
    aux = sum(first.count(e) / T * sum(p[e] for p in probs) / T for e in range(E)) / E * E**2
    expert, gate, keep, got_aux = moe.route_gshard(
        group(GS_LOGITS), torch.tensor([GS_UNIFORM], dtype=torch.float64)
    )
    _, combine = moe.fill_slots(expert, gate, keep, 4, E)
    return max(rel_diff(combine.sum(-1), gates), rel_diff(got_aux, aux))


def test_gshard_by_hand(monkeypatch):
    assert gshard_diff() < 1e-12
    route, balance = moe.route_gshard, moe.balance_loss
    # broken: random routing keeps the 2nd expert with probability g2
    with monkeypatch.context() as m:
        m.setattr(moe, "route_gshard", lambda logits, u: route(logits, 2 * u))
        assert gshard_diff() > 1e-2
    # broken: P_e from the 1st-choice mask instead of the router's gates
    with monkeypatch.context() as m:
        m.setattr(
            moe, "balance_loss", lambda probs, top1: balance(F.one_hot(top1, 3).to(probs), top1)
        )
        assert gshard_diff() > 1e-2


def test_second_choice_depends_on_later_tokens():
    """With a capacity, every 1st choice is served before any 2nd choice: token 0's 2nd choice (expert 1)
    is dropped or kept depending on the 1st choice of the later token 1 (information from the future)."""
    u = torch.zeros(1, 2, dtype=torch.float64)  # every 2nd choice wanted
    later_takes_e1 = moe.fill_slots(
        *moe.route_gshard(group([[2.0, 1.0, -1.0], [-1.0, 2.0, 1.0]]), u)[:3], 1, 3
    )[0]
    later_takes_e2 = moe.fill_slots(
        *moe.route_gshard(group([[2.0, 1.0, -1.0], [-1.0, 1.0, 2.0]]), u)[:3], 1, 3
    )[0]
    assert later_takes_e1[0, 0, 1].sum() == 0 and later_takes_e2[0, 0, 1].sum() == 1
    # the 1st choice: served
    assert later_takes_e1[0, 0, 0].sum() == later_takes_e2[0, 0, 0].sum() == 1


SW_LOGITS = [
    [1.0, 0.2, -0.5, 0.0],
    [0.8, 0.9, 0.1, -0.3],
    [1.5, -1.0, 0.3, 0.2],
    [0.1, 0.0, 0.7, 0.4],
    [1.2, 0.3, 0.3, -0.2],
    [-0.4, 0.5, 0.2, 0.6],
]  # T = 6, E = 4; 1st choices 0 1 0 2 0 3


def switch_diff(alpha=1e-2, C=2):
    """Switch (Fedus et al. 2021, Sec. 2.1-2.2) with C = 2, so token 4 is dropped from expert 0: gate = p of
    the argmax for a token with a slot; loss = alpha N sum_i f_i P_i, f_i = share of tokens whose argmax is
    i (before capacity), P_i = mean p_i; its gradient in the logits: alpha N / T p_tj (f_j - sum_i f_i p_ti).
    Largest relative diff of gates, loss and gradient."""
    N, T, probs = 4, 6, [softmax(r) for r in SW_LOGITS]
    first = [max(range(N), key=lambda e: p[e]) for p in probs]
    f = [first.count(i) / T for i in range(N)]
    P = [sum(p[i] for p in probs) / T for i in range(N)]
    gates = [
        [p[e] if e == first[t] and first[:t].count(e) < C else 0.0 for e in range(N)]
        for t, p in enumerate(probs)
    ]
    grad = [
        [alpha * N / T * p[j] * (f[j] - sum(fi * pi for fi, pi in zip(f, p))) for j in range(N)]
        for p in probs
    ]
    logits = group(SW_LOGITS).requires_grad_()
    expert, gate, keep, aux = moe.route_switch(logits)
    _, combine = moe.fill_slots(expert, gate, keep, C, N)
    if aux.requires_grad:
        (alpha * aux).sum().backward()
    # no path: no gradient
    got_grad = torch.zeros_like(logits) if logits.grad is None else logits.grad
    return max(
        rel_diff(combine.sum(-1), gates),
        rel_diff(alpha * aux, alpha * N * sum(a * b for a, b in zip(f, P))),
        rel_diff(got_grad, grad),
    )


def test_switch_by_hand(monkeypatch):
    assert switch_diff() < 1e-12
    route, balance = moe.route_switch, moe.balance_loss
    with monkeypatch.context() as m:  # broken: P detached, so the router gets no balancing gradient
        m.setattr(moe, "balance_loss", lambda probs, top1: balance(probs.detach(), top1))
        assert switch_diff() > 1e-2

    # broken: f counts the tokens that kept a slot (C = 2, as switch_diff's)
    def f_after_capacity(
        logits,
    ):
        expert, gate, keep, _ = route(logits)
        probs, N, T = logits.softmax(-1), logits.shape[-1], logits.shape[1]
        dispatch, _ = moe.fill_slots(expert, gate, keep, 2, N)
        return expert, gate, keep, N * (dispatch.sum((1, 3)) / T * probs.mean(1)).sum(-1)

    with monkeypatch.context() as m:
        m.setattr(moe, "route_switch", f_after_capacity)
        assert switch_diff() > 1e-2


EC_LOGITS = [
    [0.5, -0.2, 1.0],
    [1.2, 0.3, -0.4],
    [0.5, -0.2, 1.0],
    [-0.6, 0.9, 0.1],
    [0.0, 0.0, 0.8],
    [1.0, 1.1, -1.0],
]  # T = 6, E = 3; tokens 0 and 2 tie exactly


def expert_choice_errors(C=2):
    """Expert choice (Zhou et al. 2022, Sec. 3.1): S = softmax over experts of each token's logits; expert e
    takes the C tokens of highest S[:, e] (an exact tie: the earlier token), gate = S[t, e]."""
    T, E, S = 6, 3, [softmax(r) for r in EC_LOGITS]
    picked = [sorted(range(T), key=lambda t: (-S[t][e], t))[:C] for e in range(E)]
    want = torch.zeros(1, T, E, C, dtype=torch.float64)
    for e, tokens in enumerate(picked):
        for c, t in enumerate(tokens):
            want[0, t, e, c] = 1
    gates = want * group(S)[..., None]
    dispatch, combine = moe.route_expert_choice(group(EC_LOGITS), C)
    return not torch.equal(dispatch, want), rel_diff(combine, gates), picked


def test_expert_choice_by_hand(monkeypatch):
    bad_dispatch, gate_diff, picked = expert_choice_errors()
    assert picked == [
        [1, 5],
        [3, 5],
        [4, 0],
    ]  # token 5 gets two experts, token 2 none; the tie goes to token 0
    assert not bad_dispatch and gate_diff < 1e-12

    def softmax_over_tokens(logits, C):  # broken: affinities normalised over the group's tokens
        probs = logits.softmax(1)  # (G, T, E)
        top = probs.topk(C, dim=1)  # (G, C, E)
        # (G, T, E, C)
        dispatch = F.one_hot(top.indices, logits.shape[1]).permute(0, 3, 2, 1).to(probs)
        return dispatch, dispatch * top.values.transpose(1, 2)[:, None]

    with monkeypatch.context() as m:
        m.setattr(moe, "route_expert_choice", softmax_over_tokens)
        bad_dispatch, gate_diff, _ = expert_choice_errors()
        assert bad_dispatch or gate_diff > 1e-2


def test_peak_memory_read_before_reference(monkeypatch, tmp_path):
    """On a GPU the summary's peak must be the technique's own: read before --check trains the one-process
    reference on rank 0's device. moe.main() at world 1 in this process, recording the order of the calls."""
    calls = []
    peak, reference = moe.peak_memory_bytes, moe.moe_reference
    monkeypatch.setattr(moe, "peak_memory_bytes", lambda *a: calls.append("peak") or peak(*a))
    monkeypatch.setattr(moe, "moe_reference", lambda *a: calls.append("reference") or reference(*a))
    # Run.finish ends the run through it
    monkeypatch.setattr(harness, "close_dist", lambda ok: calls.append(ok))
    monkeypatch.setattr(
        sys,
        "argv",
        ["moe.py", *TINY, "--steps", "2", "--check", "--json", str(tmp_path / "s.json")],
    )
    try:
        moe.main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert calls == ["peak", "reference", True], calls


# ----------------------------------------------------------------------------- exact ties, by expert index
TIE = [[0.5, 0.9, 0.9, 0.9], [0.2, 0.2, 0.2, 0.2], [0.9, 0.1, 0.9, 0.1]]  # T = 3, E = 4: exact ties


def tie_picks():
    """Each router's choices on logits with exact ties: [noisy top-2 (no noise), gshard, switch, expert choice's
    tokens per expert (C = 2)]. The lower expert index (the earlier token) must win every tie."""
    logits, zeros = group(TIE), torch.zeros(1, 3, 4, dtype=torch.float64)
    noisy = moe.route_noisy_topk(logits, zeros + 1, zeros, 2)[0]
    gshard = moe.route_gshard(logits, torch.zeros(1, 3, dtype=torch.float64))[0]
    switch = moe.route_switch(logits)[0]
    ec = moe.route_expert_choice(group([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]), 2)[0]  # (1, T, E, C)
    return [
        noisy[0].tolist(),
        gshard[0].tolist(),
        switch[0].tolist(),
        [ec[0, :, e].nonzero()[:, 0].tolist() for e in range(2)],
    ]


def test_ties_go_to_the_lower_expert_index(monkeypatch):
    """Review 2, R4: a near-tie that rounds to an exact tie on one device must route the same everywhere, so
    every top-k breaks exact ties by index (torch.topk leaves their order to the kernel)."""
    want = [[[1, 2], [0, 1], [0, 2]], [[1, 2], [0, 1], [0, 2]], [[1], [0], [0]], [[0, 1], [0, 1]]]
    assert tie_picks() == want
    top_k = moe.top_k
    # broken: ties to the higher index (a kernel free to order them could do this on one device)
    monkeypatch.setattr(
        moe, "top_k", lambda s, k: (lambda v, i: (v, s.shape[-1] - 1 - i))(*top_k(s.flip(-1), k))
    )
    got = tie_picks()
    assert all(g != w for g, w in zip(got, want)), got


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            dict(router="expert_choice", capacity_factor=0.0),
            ["--capacity-factor 0.0", "capacity_factor must be > 0, got 0.0", "moe_deepseek.py"],
        ),
        (dict(router="gshard", top_k=2), ["--top-k 2", "only noisy_topk"]),
        (dict(router="noisy_topk", top_k=5), ["--experts 4", "--top-k 5: k = 5 with 4 experts"]),
        (dict(aux_weight=-1.0), ["--aux-weight must be >= 0"]),
        (dict(groups=3), ["--batch-size 8 must be divisible by --groups 3"]),
    ],
)
def test_bad_input_new_flags(flags, words, capsys):
    """The checks main() runs on every rank before init_dist (tests above show the order with subprocesses):
    one line, exit 2."""
    with pytest.raises(SystemExit) as e:
        moe.check_args(moe.Args(**flags), 1)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and all(w in lines[0] for w in words), lines


# ----------------------------------------------------------------------------- copy-out: check your own MoE
# MoE with its routers, taken from moe.py's technique section alone (tests/section.py: torch and einops only, as
# a copier takes it), in a model that is not the GPT (a parameter on the root module, nested modules, odd
# sizes: width 6, expert width 10, 6 experts, 5 positions, 3 input features; an MSE loss), expert parallel at
# EP 2 x 2 replicas, against the same model with every expert local trained by plain torch in one process
# (tests/moe_common.py: the stack and both trainings, shared with the 2024 file's test). tests/moe_checks.py
# runs copy_out() in its 4-rank launch; test_copy_out_moe reads the verdicts.
GROUP_ROWS = 2  # rows per routing group: ROWS // GROUP_ROWS groups


def copy_out(d, lay, steps=3, aux_weight=0.1):
    """[(name, ok, detail)] for gshard (random routing) and noisy top-k, each with a capacity that drops, with
    the cores of moe.py's technique section executed alone (section.load)."""
    import section

    core = section.load("moe.py")
    MoE, set_step, aux_share = core["MoE"], core["set_step"], core["aux_share"]
    verdicts = []
    for router, flags in (
        ("GShard", dict(capacity_factor=1.0)),
        ("NoisyTopK", dict(capacity_factor=0.75)),
    ):

        def build(ep_group):
            torch.manual_seed(0)

            def layer(i, gen):  # block i's MoE, its router drawn from the same generator first
                return MoE(
                    D,
                    EXPERTS,
                    core[router](D, EXPERTS, generator=gen),
                    hidden=HIDDEN,
                    group_rows=GROUP_ROWS,
                    ep_group=ep_group,
                    seed=3,
                    layer=i,
                    generator=gen,
                    **flags,
                )

            model = ResidualMoEStack(layer)
            model = model.double().to(d.device)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

        name = f"copy-out {router} capacity factor {flags['capacity_factor']}"
        verdicts += copy_out_case(
            d,
            lay,
            name,
            build,
            MoE,
            core["sync_grads"],
            lambda model: aux_share(model, ROWS // GROUP_ROWS),
            steps,
            aux_weight,
            on_step=set_step,
        )
    return verdicts


def test_cores_refuse_bad_input_before_any_collective(checks):
    """Issue 30, deliver 2: MoE, its forward and AllToAll, from moe.py's technique section alone, each given what
    it cannot do at EP 2, raise a ValueError naming what would work before any collective (harness.CommCounter
    saw none; given good input it sees the all-to-alls); with the checks made no-ops (the mutant), the layers
    are built silently and the forward fails inside einops (tests/moe_checks.py, 7). AllToAll (even blocks
    here; the uneven exchange is moe_deepseek.py's): rows that do not split, and the control."""
    assert_all_pass(checks, "  bad input", 2 * 6 + 3 + 2)


def test_copy_out_moe(checks):
    """Check your own MoE the same way: the layer inside your model, expert parallel, against the model with
    every expert local trained in one process (copy_out above, run in tests/moe_checks.py's launch)."""
    assert_all_pass(checks, "copy-out", 4)

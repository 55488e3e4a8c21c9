"""pipedream.py's messages under NCCL's rules, simulated without a process: no deadlock, every message paired.

Each rank's stream runs its items in order: a batch_isend_irecv group, or a collective. A group's send or receive
completes only when its counterpart (the n-th message from that sender to that receiver, matched in order as
NCCL matches them) is in the peer's group that runs now; the group ends when all of its ops have; a collective
needs every rank at the same one. items_for mirrors main's first collective, StageRunner.run / exchange / drain
and the policies' drains (flush: an all-reduce; 2bw: a broadcast), on the file's own schedules (one_f_one_b,
split_at_step_ends), checkpoint drains included. (Adapted from the review's nccl-sims/sim_pipedream.py to the
runner.)

    python tests/pipedream_sim.py       # every mode, p = 2..6, m = 1..8, with and without checkpoint drains"""

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import pipedream  # noqa: E402


def items_for(mode, p, m, steps, save_every, s, start=0):
    """Stage s's stream of items for a run of `steps` steps, as the runner issues them."""
    sync = mode == "flush"
    ends = [
        t
        for t in range(start + 1, steps + 1)
        if sync or t == steps or (save_every and t % save_every == 0)
    ]
    stream = [
        (kind, a * m + k)
        for a, z in zip([start] + ends, ends)
        for kind, k in pipedream.one_f_one_b((z - a) * m, p, s)
    ]
    chunks = pipedream.split_at_step_ends(stream, m)
    prev, nxt = (s - 1 if s > 0 else None), (s + 1 if s < p - 1 else None)
    items, outbox = (
        [("coll", "all_reduce")],
        [],
    )  # main's first collective, before any point-to-point

    def batch(sends, recvs):
        ops = [("S", peer, what) for what, peer in sends] + [
            ("R", peer, what) for what, peer in recvs
        ]
        if ops:
            items.append(("batch", ops))

    for step in range(start, steps):
        for kind, k in chunks[step - start]:
            peer = {"F": prev, "B": nxt}.get(kind)
            what = "act" if kind == "F" else "grad"
            batch(outbox, [] if peer is None else [((what, k), peer), (("tag", kind, k), peer)])
            outbox = []
            if kind == "F" and nxt is not None:
                outbox = [(("act", k), nxt), (("tag", "F", k), nxt)]
            if kind == "B" and prev is not None:
                outbox = [(("grad", k), prev), (("tag", "B", k), prev)]
        if step + 1 in ends:
            batch(outbox, [])
            outbox = []
            if sync or mode == "2bw":
                items.append(("coll", "all_reduce" if sync else "broadcast"))
    return items


def simulate(queues):
    """'ok', or what went wrong: a deadlock (the items each rank is stuck in), a payload or a count mismatch."""
    seq, qs = collections.Counter(), []
    # number each message per (sender, receiver), as NCCL pairs them in order
    for r, q in enumerate(queues):
        out = []
        for kind, x in q:
            if kind == "batch":
                ops = []
                for op, peer, what in x:
                    key = (op, (r, peer) if op == "S" else (peer, r))
                    ops.append((key, seq[key], what))
                    seq[key] += 1
                out.append(("batch", ops))
            else:
                out.append((kind, x))
        qs.append(collections.deque(out))
    for (op, pair), n in seq.items():
        if seq[("R" if op == "S" else "S", pair)] != n:
            return f"{n} {op} on {pair}, {seq[('R' if op == 'S' else 'S', pair)]} the other way"
    while any(qs):
        heads = [q[0] if q else None for q in qs]
        if all(h is not None and h[0] == "coll" for h in heads):
            if len({h[1] for h in heads}) != 1:
                return f"collective mismatch {[h[1] for h in heads]}"
            for q in qs:
                q.popleft()
            continue
        posted = {(key, n): what for h in heads if h and h[0] == "batch" for key, n, what in h[1]}
        progressed = False
        for r, h in enumerate(heads):
            if h and h[0] == "batch":
                left = []
                for (op, pair), n, what in h[1]:
                    other = posted.get((("R" if op == "S" else "S", pair), n))
                    if other is None:
                        left.append(((op, pair), n, what))
                    elif other[0] != what[0] or other[1:] != what[1:]:
                        return f"payload mismatch on {pair}: {what} vs {other}"
                progressed |= len(left) < len(h[1])
                h[1][:] = left
                if not left:
                    qs[r].popleft()
        if not progressed:
            return "DEADLOCK: " + "; ".join(f"rank {r}: {h}" for r, h in enumerate(heads))
    return "ok"


def configs():
    for mode in ("flush", "stash", "2bw"):
        for p in range(2, 7):
            for m in range(1, 9):
                if mode == "2bw" and m < p:
                    continue
                for steps, save_every in ((3, 0), (4, 2), (5, 3)):
                    yield mode, p, m, steps, save_every


if __name__ == "__main__":
    bad = [
        (c, r)
        for c in configs()
        if (r := simulate([items_for(*c, s) for s in range(c[1])])) != "ok"
    ]
    for c, r in bad:
        print(c, r[:300])
    print(f"pipedream configurations with problems: {len(bad)} of {len(list(configs()))}")
    sys.exit(1 if bad else 0)

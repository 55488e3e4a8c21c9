"""The bubble of a recorded pipeline schedule, as load cannot move it (issue 43 item 6).

A run with --stage-ms measures each stage's F and B in wall time; on a few shared cores a stalled process adds
idle time that is the machine's, not the schedule's. What the run decides itself is the order in which each
stage ran its ops. `replayed_bubble` takes that order from the measured events and replays it with each op
at its nominal length (F one unit, B two: --stage-ms's F ms and 2F ms) and free messages, every op at its
earliest start: F of micro-batch i on stage s once stage s-1 ended it, B of i once stage s+1 ended it and
stage s ran its F. Its idle fraction is the recorded schedule's bubble: exactly (p-1)/(m+p-1) for GPipe and
1F1B, more for any order that waits where it need not. The wall-time bubble stays in the summary, reported."""


def orders_of(events, p):
    """Each stage's ops (kind, mb) in the order it ran them (by measured start: one op at a time)."""
    return [
        [(e["kind"], e["mb"]) for e in sorted(events, key=lambda e: e["start"]) if e["rank"] == r]
        for r in range(p)
    ]


def replay(orders, op_time):
    """{(rank, kind, mb): (start, end)} with every op at its earliest start (see the module docstring)."""
    p, at, nxt, free = len(orders), {}, [0] * len(orders), [0.0] * len(orders)
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                kind, mb = orders[r][nxt[r]]
                deps = {
                    "F": [(r - 1, "F", mb)] if r > 0 else [],
                    "B": [(r, "F", mb)] + ([(r + 1, "B", mb)] if r < p - 1 else []),
                }[kind]
                if any(dep not in at for dep in deps):
                    break
                start = max([free[r]] + [at[dep][1] for dep in deps])
                at[r, kind, mb] = (start, start + op_time[kind])
                free[r], nxt[r], moved = start + op_time[kind], nxt[r] + 1, True
        if not moved:
            raise ValueError("the recorded order waits on itself: an op before the op it needs")
    return at


def replayed_bubble(events, p, op_time=None):
    """Per stage, the idle fraction of the replayed step [0, end]: the bubble of the recorded order."""
    at = replay(orders_of(events, p), op_time or {"F": 1.0, "B": 2.0})
    end = max(e for _, e in at.values())
    return [1 - sum(e - s for (q, _, _), (s, e) in at.items() if q == r) / end for r in range(p)]

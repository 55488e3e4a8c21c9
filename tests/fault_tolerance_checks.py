"""fault_tolerance.py with one function replaced by a wrong one (a mutant), to show that a check catches it:

    python tests/fault_tolerance_checks.py NAME ARGS...     (ARGS: fault_tolerance.py's flags)

NAME goes to the environment (FT_MUTANT), and the launcher starts every replica with this same script and
environment, so the launcher and every replica run the mutant. NAME is one of
    old-membership      each replica divides its loss by the tokens of all R shards, not the participants'
                        (the gradient is averaged over the old membership after a replica is lost)
    commit-anyway       a round is committed whatever the vote says: a failed all-reduce's partial gradient
                        (this replica's own, or a half-reduced sum) is applied
    no-detector         the spike detector never fires: a spiking batch is trained on
    rollback-keeps-adam a rollback restores the weights and counters but keeps AdamW's current moments
    no-checksum         every checksum is 0: a corrupted replica is never found
    recover-weights-only  a replica repaired or recovering from a peer loads its weights but starts AdamW
                        from scratch
"""
import os, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

import fault_tolerance as ft

local_grads, vote, apply_update, load_full = ft.local_grads, ft.vote, ft.apply_update, ft.Replica.load_full


def old_membership(model, x, y, members, me, replicas, *loss_and_scale):
    everyone = [ft.Member(r, 0, 0, 0, -1, 0) for r in range(replicas)]
    return local_grads(model, x, y, everyone, me, replicas, *loss_and_scale)


def commit_anyway(store, k, members, me, ok, timeout_s):
    vote(store, k, members, me, ok, timeout_s)
    return True


def rollback_keeps_adam(rep, loss, spike, norm, clip, max_skips, snapshot_every):
    moments = [t.clone() for t in rep.tensors[len(rep.params):]]  # AdamW's moments and steps before it
    what = apply_update(rep, loss, spike, norm, clip, max_skips, snapshot_every)
    if what == "rollback":
        for t, m in zip(rep.tensors[len(rep.params):], moments):
            t.copy_(m)
    return what


def weights_only(self, flat):
    load_full(self, flat)
    for t in self.tensors[len(self.params):]:  # AdamW from scratch: zero moments, step 0
        t.zero_()


MUTANTS = {
    "old-membership": lambda: setattr(ft, "local_grads", old_membership),
    "commit-anyway": lambda: setattr(ft, "vote", commit_anyway),
    "no-detector": lambda: setattr(ft, "is_spike", lambda *a, **k: False),
    "rollback-keeps-adam": lambda: setattr(ft, "apply_update", rollback_keeps_adam),
    "no-checksum": lambda: setattr(ft, "checksum", lambda params: torch.zeros((), dtype=torch.long)),
    "recover-weights-only": lambda: setattr(ft.Replica, "load_full", weights_only),
}
if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):  # the launcher: NAME ARGS...
    os.environ["FT_MUTANT"] = sys.argv.pop(1)
MUTANTS[os.environ["FT_MUTANT"]]()
ft.main()

"""Break ptdp.py on purpose, under torchrun, to show that its --check catches the break:

    torchrun --nproc_per_node=4 tests/ptdp_checks.py BREAK [ptdp.py flags]

BREAK is one of
    norm-counts-replicas  every TP rank adds its copy of the replicated tensors to the clipping norm (t times)
    no-dp-all-reduce      the data-parallel gradient all-reduce after the flush is skipped
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ptdp  # noqa: E402

BREAK = sys.argv.pop(1)
if BREAK == "norm-counts-replicas":
    ptdp.squared_norm_piece = lambda params, tp_rank: sum((q.grad.double() ** 2).sum() for q in params)
elif BREAK == "no-dp-all-reduce":
    real_all_reduce = ptdp.all_reduce
    ptdp.all_reduce = lambda x, group, key: x if key == "dp" else real_all_reduce(x, group, key)
else:
    sys.exit(f"unknown break {BREAK!r}")
ptdp.main()

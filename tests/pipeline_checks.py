"""Break gpipe.py or pipedream.py on purpose, then run it as usual: the negatives that show the tests' checks
can fail. Each case monkeypatches one piece of the technique and calls the file's own main():

    gpipe-leak      gpipe.py --recompute whose forward keeps its graph alive (a buffer kept by mistake): the
                    arithmetic is unchanged, only the measured "held for B" bytes can notice
    stash-newest    pipedream.py --mode stash whose backward runs on the newest weights instead of the version
                    its forward read (no weight stashing): the gradients land on the wrong tensors
    2bw-fewer       pipedream.py --mode 2bw with its m >= p guard lifted, so the drain would skip a norm
    resume-newest   pipedream.py resumed from a checkpoint with every stashed version replaced by the live weights
                    (the checkpoint's versions ignored): the run goes on, on the wrong weights

Run: torchrun --standalone --nproc_per_node=P tests/pipeline_checks.py CASE [the file's flags]"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
case = sys.argv.pop(1)

if case == "gpipe-leak":
    import gpipe

    kept = []

    def leaky_forward(forward, i, recompute):
        out = forward(i)  # with its graph, even under --recompute ...
        kept.append(out)  # ... and kept until the end of the run
        return out

    gpipe.run_forward = leaky_forward
    gpipe.main()

elif case == "stash-newest":
    import pipedream
    from common import lm_loss

    stashed_backward = pipedream.StageRunner.backward

    def backward_on_newest(self, k, grad, tag):
        inp, out, v, held = self.alive[k]
        newest = self.snap[max(self.snap)]  # the weights after the latest update, not version v
        tokens, targets, n_tok = self.batch_of(k // self.m)
        out = newest(tokens[k % self.m] if self.s == 0 else inp)
        if self.stage.last:
            out = lm_loss(out, targets[k % self.m], n_tok)
        self.alive[k] = (inp, out, v, held)
        stashed_backward(self, k, grad, tag)

    pipedream.StageRunner.backward = backward_on_newest
    pipedream.main()

elif case == "2bw-fewer":
    import pipedream

    real_fail = pipedream.fail
    pipedream.fail = lambda msg: None if msg.startswith("--mode 2bw needs --microbatches") else real_fail(msg)
    pipedream.main()

elif case == "resume-newest":
    import copy

    import pipedream

    load_with_versions = pipedream.StageRunner.load_state_dict

    def load_live_only(self, state):
        load_with_versions(self, state)
        self.snap = {v: copy.deepcopy(self.stage) for v in self.snap}  # each kept version = the live weights

    pipedream.StageRunner.load_state_dict = load_live_only
    pipedream.main()

else:
    sys.exit(f"unknown case {case!r}")

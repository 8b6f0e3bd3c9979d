"""Repros of the review of 7ddb2d9 (rev2): one process each, no oracle. From the repository root:

    PYTHONPATH=. python tests/exactness/minrepro_rev2.py CASE

Runs the loop uninterrupted (ref), with one notice (trial), then resumed from what the trial committed, and
prints the trial's and the resumed run's final states against the reference (SAME / DIFFERENT).

- ``nogradbn``: a train-mode forward under ``torch.no_grad()`` (pseudo-labels, FixMatch/mean-teacher style)
  before the training forward; BatchNorm. The buffers of S are cloned at the *training* forward, after the
  no-grad forward already updated them (a regression of 7ddb2d9: any forward snapshotted them before).
- ``evalmeter``: a loop that trains in eval mode (``model.eval()``: frozen BN/dropout fine-tuning) with a
  meter updated after the forward: no forward is ever an anchor any more; the small state is read at the
  pre-hook (the meter's change of iteration S+1 read into S).
- ``mocorace``: ``moco`` with the agreement thread descheduled for 1.2 s (the loop sleeps 0.5 s after the notice) between ``_save_next_iteration``
  setting ``_steps.target = S+1`` and ``_prehook_read`` setting ``_state_at.want_state`` (two critical sections): the
  anchor passes unserved and the read happens at the pre-hook of step S+2, after that iteration's
  in-forward write.
- ``mocolast``: ``moco`` with the notice in the last iteration (the fallback's S+1 is the last step; no
  destroy_process_group, single process: served at interpreter exit).
- ``mocorebal``: ``moco`` with a rebalance notice (ordinary): training must go on to the end, bitwise.
- ``fsdp2rebal``: FSDP2 (world 1, gloo), ``p.data.mul_()`` before the step (fallback), a rebalance
  notice: the training-thread read at the anchor runs ``state_dict()`` inside FSDP2's forward (after its
  prepended pre-forward unshard); its ``to_sharded`` state-dict pre-hook swaps the root's parameters back
  to sharded DTensors and the forward raises.
"""
import copy, json, os, subprocess, sys, tempfile, time
from datetime import timedelta

CASE = sys.argv[1]
if len(sys.argv) == 2:  # driver
    d = tempfile.mkdtemp(prefix=f"rev2-{CASE}-")

    def run(mode, store):
        p = subprocess.run([sys.executable, __file__, CASE, mode, store], capture_output=True, text=True,
                           env={**os.environ, "SPOTGUARD_SOCKET": os.path.join(d, "none.sock")}, timeout=60)
        out = [l for l in p.stdout.splitlines() if l.startswith("FINAL ")]
        evs = [json.loads(l[l.index("{"):]) for l in (p.stdout + p.stderr).splitlines()
               if any(k in l for k in ('"event": "exit"', '"checkpoint_staged"', '"checkpoint_fallback"',
                                       '"checkpoint_committed"', '"checkpoint_failed"'))]
        errs = [l[-300:] for l in p.stderr.splitlines() if "Error" in l and "Warning" not in l and "no spotguard daemon" not in l][-2:]
        return p.returncode, (out[0][6:] if out else None), evs, errs

    rc, ref, _, _ = run("ref", f"file://{d}/ref")
    rc2, tri, ev, errs = run("trial", f"file://{d}/ck")
    print("trial rc", rc2, [(e["event"], e.get("step"), e.get("committed", e.get("small_state_from",
                            e.get("tensors_from", e.get("reason", e.get("error", ""))[:90])))) for e in ev])
    if errs:
        print("trial stderr:", errs)
    rc3, res, _, _ = run("resume", f"file://{d}/ck")
    print("reference:", ref, "\ntrial:    ", tri, "\nresumed:  ", res, f"(rc {rc3})")
    print("trial", "SAME" if ref == tri else "DIFFERENT", "| resumed", "SAME" if ref == res else "DIFFERENT")
    sys.exit(0)

MODE, STORE = sys.argv[2], sys.argv[3]
import torch
from spotguard import install_preemption_hook
from spotguard.notice import Notice
from spotguard.timefmt import utcnow

torch.manual_seed(0)
torch.set_num_threads(1)
N = 6


def notice_here(i, at, kind="termination"):
    if MODE == "trial" and i == at:
        now = utcnow()
        hook.notify(Notice(id=f"rev2-{i}", source="drill", kind=kind, deadline=now + timedelta(seconds=25 if kind ==
                           "termination" else 90), received_at=now))
        time.sleep(0.5)  # the background round acts while the loop is here


class Meter:
    def __init__(self): self.count = 0
    def state_dict(self): return {"count": self.count}
    def load_state_dict(self, sd): self.count = sd["count"]


class MoCoLike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(4, 1)
        self.k = copy.deepcopy(self.q).requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():  # momentum update inside the forward (MoCo's reference code)
            for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                pk.mul_(0.9).add_(pq, alpha=0.1)
        return self.q(x) + self.k(x)


if CASE == "mocorace" and MODE == "trial":
    from spotguard.hook.save import SaveMixin
    orig = SaveMixin._prehook_read

    def delayed(self, *a, **k):
        time.sleep(1.2)  # the agreement thread descheduled between the two critical sections
        return orig(self, *a, **k)
    SaveMixin._prehook_read = delayed

if CASE == "fsdp2rebal":
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.fsdp import fully_shard
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    fully_shard(model)
elif CASE.startswith("moco"):
    model = MoCoLike()
elif CASE == "nogradbn":
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
else:
    model = torch.nn.Linear(4, 1)
if CASE == "evalmeter":
    model.eval()
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
state = {"model": model, "optimizer": opt}
meter = Meter()
if CASE == "evalmeter":
    state["meter"] = meter
hook = install_preemption_hook(state, storage=STORE)
for i in range(hook.resume(), N):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
    if CASE == "nogradbn":
        with torch.no_grad():  # pseudo-labels from a weakly augmented batch, model in train mode
            model(x * 0.5 + 1.0)
    loss = model(x).pow(2).mean()
    meter.count += 1
    if CASE in ("nogradbn", "evalmeter", "mocorace"):
        notice_here(i, 3)  # after the forward, before the step
    if CASE == "mocolast":
        notice_here(i, N - 1)
    if CASE == "mocorebal":
        notice_here(i, 3, "rebalance")
    opt.zero_grad()
    loss.backward()
    if CASE == "fsdp2rebal":
        with torch.no_grad():
            for p in model.parameters():
                p.data.mul_(0.99)  # weight decay by hand: the watch cannot prove the state (fallback)
        notice_here(i, 3, "rebalance")
        time.sleep(0.5)
    opt.step()


def flat(t):
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return [round(v, 7) for v in t.detach().reshape(-1).tolist()]


print("FINAL", json.dumps({"p": [flat(p) for p in model.parameters()],
                           "b": [flat(b) for b in model.buffers()],
                           "meter": meter.count if CASE == "evalmeter" else None}))
if CASE == "fsdp2rebal":
    dist.destroy_process_group()

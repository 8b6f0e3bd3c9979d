"""Smallest repros of the review of issue 22 (rev22): one process, no torch.distributed, no oracle. Run from the
repository root with ``PYTHONPATH=.``:

    python tests/exactness/minrepro_rev22.py CASE

It runs the loop uninterrupted, then with one termination notice (``hook.notify``) at a fixed moment, then resumed
from what that trial committed, and prints both final states and SAME or DIFFERENT. Cases (all exit 143 with
``committed: true``, i.e. "nothing lost"):

- ``meter``: a user stateful object in the dict updated after the forward, notice before the step (DIFFERENT)
- ``plateau``: ``ReduceLROnPlateau.step(val)`` after an evaluation forward, notice between the two (DIFFERENT)
- ``nanskip``: ``optimizer.step()`` skipped once on a non-finite norm; ``hook.resume()`` returns optimizer steps,
  not iterations (DIFFERENT)
- ``moco``: a no-grad parameter updated in place inside the forward (momentum encoder) (DIFFERENT)
- ``handwd``: ``p.data.mul_()`` weight decay by hand between backward and step, notice after it (DIFFERENT)
- ``twonotices``: a rebalance at iteration 2, a termination at 4 (SAME)

``MINREPRO_RANGE=1`` runs the same loop under ``hook.range(6)``: ``meter``, ``plateau`` and ``nanskip`` are SAME
there (the small state is read at the boundary; a skipped step moves the loop to the boundary path), ``moco`` and
``handwd`` stay DIFFERENT (the fallback reads the tensors at the next ``optimizer.step()``).
"""
import copy, json, os, subprocess, sys, tempfile, time
from datetime import timedelta

CASE = sys.argv[1]
if len(sys.argv) == 2:  # driver
    d = tempfile.mkdtemp(prefix=f"min-{CASE}-")
    def run(mode, store):
        p = subprocess.run([sys.executable, __file__, CASE, mode, store], capture_output=True, text=True,
                           env={**os.environ, "SPOTGUARD_SOCKET": os.path.join(d, "none.sock")})
        out = [l for l in p.stdout.splitlines() if l.startswith("FINAL ")]
        exits = [json.loads(l[l.index("{"):]) for l in (p.stdout + p.stderr).splitlines()
                 if '"event": "exit"' in l or '"checkpoint_staged"' in l or '"checkpoint_fallback"' in l]
        return p.returncode, (out[0][6:] if out else None), exits
    rc, ref, _ = run("ref", f"file://{d}/ref")
    rc2, _, ev = run("trial", f"file://{d}/ck")
    print("trial rc", rc2, [(e["event"], e.get("step"), e.get("committed", e.get("small_state_from", e.get("reason"))))
                            for e in ev])
    rc3, res, _ = run("resume", f"file://{d}/ck")
    print("reference:", ref, "\nresumed:  ", res, "\n", "SAME" if ref == res else "DIFFERENT")
    sys.exit(0)

MODE, STORE = sys.argv[2], sys.argv[3]
import torch
import torch.nn.functional as F
from spotguard import install_preemption_hook
from spotguard.notice import Notice
from spotguard.timefmt import utcnow

torch.manual_seed(0)
torch.set_num_threads(1)


def notice_here(i, at, kind="termination"):
    if MODE == "trial" and i == at:
        now = utcnow()
        hook.notify(Notice(id=f"min-{i}", source="drill", kind=kind, deadline=now + timedelta(seconds=25 if kind ==
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


model = MoCoLike() if CASE == "moco" else torch.nn.Linear(4, 1)
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
state = {"model": model, "optimizer": opt}
meter = Meter()
if CASE == "meter":
    state["meter"] = meter
if CASE == "plateau":
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, threshold=0.5)
    state["scheduler"] = sched
hook = install_preemption_hook(state, storage=STORE)
# MINREPRO_RANGE=1: the same loop under hook.range() (explicit boundaries)
for i in (hook.range(6) if os.environ.get("MINREPRO_RANGE") == "1" else range(hook.resume(), 6)):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
    if CASE == "nanskip" and i == 1:
        x[0, 0] = float("nan")  # a corrupt record: the step is skipped
    loss = model(x).pow(2).mean()
    meter.count += 1  # a stateful object updated after the forward
    if CASE in ("meter", "moco"):
        notice_here(i, 3)  # after the forward, before the step
    if CASE == "twonotices":
        notice_here(i, 2, "rebalance")
        notice_here(i, 4)
    opt.zero_grad()
    loss.backward()
    if CASE == "handwd":
        with torch.no_grad():
            for p in model.parameters():
                p.data.mul_(0.99)  # decoupled weight decay by hand, right before the step
        notice_here(i, 3)
    if CASE == "nanskip":
        notice_here(i, 3)
        if not torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)):
            continue
    opt.step()
    if CASE == "plateau":
        with torch.no_grad():
            val = model(torch.ones(2, 4)).pow(2).mean()  # the evaluation: the model's first forward after the step
        notice_here(i, 3)
        sched.step(val.item())
print("FINAL", json.dumps({"w": model.weight.tolist() if hasattr(model, "weight") else
                           [p.tolist() for p in model.parameters()],
                           "meter": meter.count if CASE == "meter" else None, "lr": opt.param_groups[0]["lr"],
                           "sched": sched.state_dict()["last_epoch"] if CASE == "plateau" else None}))

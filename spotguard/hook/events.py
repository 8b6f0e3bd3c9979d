"""Stable names of the hook's timeline events (structlog ``event`` field).

Why constants: ``make demo`` and the tests parse the workers' JSON log lines to
draw the per-notice timeline; renaming one of these is a breaking change.

Every timeline line carries ``component="hook"``, ``rank`` and, once a notice
is known, ``notice_id``. Fields per event:

- ``hook_installed``: world_size, storage, objects (key -> role), socket, pid
- ``resumed``: step, uri, from_notice_id (the notice the checkpoint was written for, or null)
- ``elastic_resume`` (only when the world size changed or the rank is new): dir, old_world_size,
  world_size, resharded (model/optimizer keys), dropped_ranks (rank 0), state_from_rank, global,
  per_rank_own, per_rank_fresh, missing, rng ("own" | "derived")
- ``notice_seen``: notice_id, kind, source, via ("daemon" | "signal"), deadline, seconds_left
- ``notice_ignored``: notice_id, reason
- ``notice_deferred``: notice_id, kind, lead, acts_in (an emergency notice further off than
  ``SPOTGUARD_EMERGENCY_LEAD``: training goes on; the emergency checkpoint starts ``lead`` s before
  the deadline)
- ``notice_cancelled``: notice_id
- ``agreed``: notice_id, step (completed iterations the checkpoint stands for), flag (0-3), kind,
  action ("emergency" | "checkpoint" | "exit" | "none"), seconds_since_notice, seconds_left
- ``checkpoint_started``: notice_id, step, uri, reason
- ``checkpoint_staged`` (background save only): notice_id, step, bytes, seconds (notice round -> tensors
  copied; the training thread is released here), small_state_from ("pre-hook" | "background"); HF Trainer's
  any-moment path: notice_id, step, seconds, in_place, parts (seconds of each part of the write)
- ``checkpoint_safe`` (a doomed rank, survivors without a notice): notice_id, step, bytes, seconds, at,
  waits_for; evacuated: evacuated_to, evacuated_bytes (``evacuate.py``)
- ``checkpoint_evacuated`` (doomed): notice_id, step, to_rank, bytes, files, seconds, decision;
  ``checkpoint_evacuation_received`` (its survivor): from_rank, bytes, receive_seconds, upload_seconds;
  ``checkpoint_evacuation_declined`` (its survivor, no room in ``SPOTGUARD_EVACUATE_MAX_MB``): from_rank, bytes, budget
- ``checkpoint_handed_over`` (a safe doomed rank leaving the save to the survivors, ``handoff.py``): notice_id,
  step, to_rank (the survivor that commits and tells it), waits_seconds (its bound for that word)
- ``checkpoint_committed``: notice_id, step, uri, bytes, seconds, seconds_left
- ``checkpoint_failed``: notice_id, step, error, seconds
- ``checkpoint_late`` (warning, after ``checkpoint_committed``): notice_id, step, seconds_past, source, why, fix —
  an emergency checkpoint committed after the notice's deadline: on a real VM it would not have survived;
  the exit code is then 75, never 143
- ``deadline_at_risk`` (warning, boundary path only, at the notice): notice_id, seconds_left, estimate,
  iteration_seconds, why, fix — the next boundary plus the save is further off than the deadline
- ``drill_verdict`` (a drill's commit): notice_id, seconds_since_notice, would_beat ({cloud: bool}: within
  GCP's/Azure's 30 s and AWS's 120 s)
- ``checkpoint_skipped``: notice_id, step, reason ("nothing_to_save": an ordinary notice before the first
  step; "already_committed": at the step this run resumed from) — an ordinary (rebalance/maintenance) notice
  for which nothing needs writing; training goes on
- ``peers_lost``, two origins: (1) the notice path, fields where ("agreement" | "hold" | "save"), error — a
  bounded wait of a notice round ran out: the process exits ``EXIT_SAVE_FAILED`` (75) with nothing committed
  for this notice; (2) the peer-liveness watch (``spotguard/hook/peers.py``), fields below — a peer stopped
  answering heartbeats, notice or not
- ``teardown``: notice_id, method ("destroy" | "abort" | "none" | "timeout"), seconds
- ``exit``: notice_id, code (143 / ``exit_code=`` when nothing was lost, 75 when the save failed), step,
  committed (bool: a checkpoint of this run's state at ``step`` is committed), nothing_to_save (bool: the
  notice came before the first step and no checkpoint exists), seconds_since_notice, seconds_left
- ``iterations_unproven`` (warning): step, steps, first, clock_steps, clock_first, why, fix, and ``ambiguous``
  or ``confirmed`` — several optimizers in a loop without ``hook.range()``/``hook.step()``: an iteration starts at
  a step of the first optimizer (the clock) after another optimizer's (WGAN's n_critic D steps and G are one
  iteration). Said once each: ``ambiguous: true`` at the end of the first iteration when the clock stepped more
  than once in it (n_critic and "G every n-th iteration" look alike); an iteration whose steps (the clock's or
  the others') differ from the first one's; ``confirmed: false`` before a commit when no iteration since the
  first has stepped like it
- ``not_resumed``: uri, committed_step, step, fix (rank 0, once: training started without ``hook.resume()``
  while the storage already holds a committed checkpoint)
- ``notice_after_last_step``: notice_id, step (the job finished its work; exit code unchanged)
- ``notice_path``: path ("any-moment": agreed and saved off the training thread within about a second of the
  notice; "boundary": acted on at the next iteration boundary), loop ("implicit" | "hook.range()" |
  "hook.step()" | "any"), why, world_size — once per (path, loop); a loop that leaves the any-moment path
  (its optimizer steps do not map one to one onto iterations) says so at warning level
- ``peers_lost`` from the watch (``spotguard/hook/peers.py``): lost_ranks, hosts, silent_seconds, left_ranks, timeout, step,
  notice_ids, committed, code (69, or 143 when this run's state at the current step is committed), action, detail;
  followed by ``exit`` with reason "peers_lost" and the process's ``os._exit``
"""

from __future__ import annotations

HOOK_INSTALLED = "hook_installed"
RESUMED = "resumed"
ELASTIC_RESUME = "elastic_resume"
NOTICE_SEEN = "notice_seen"
NOTICE_IGNORED = "notice_ignored"
NOTICE_DEFERRED = "notice_deferred"
NOTICE_CANCELLED = "notice_cancelled"
AGREED = "agreed"
CHECKPOINT_STARTED = "checkpoint_started"
CHECKPOINT_STAGED = "checkpoint_staged"
#: the background read could not be proven exact; the training thread reads the state at its next step
CHECKPOINT_FALLBACK = "checkpoint_fallback"
#: a notice found iterations trained that no optimizer step hook counted (nothing exact to save)
UNTRACKED_TRAINING = "untracked_training"
#: after a resume, the global RNG was drawn from before the first forward: set back to the saved state
RNG_REALIGNED = "rng_realigned"
#: the HF Trainer resumed mid-epoch: the RNG of the batches fetched ahead set as the interrupted run had it
#: (``adapters/hf_fetch.py``); ``replayed: false`` (warning): the resumed fetch was another batch, not replayed
DATA_RNG_REPLAYED = "data_rng_replayed"
#: Accelerate: a scheduler stepped before the first optimizer.step() (at the iteration's top): its state and lr
#: of step S are read at S's optimizer step (``adapters/accelerate_sched.py``); why, fix
SCHEDULER_AT_ITERATION_TOP = "scheduler_at_iteration_top"
#: Accelerate resumed: the user's own checkpoint_<k> folders (k >= the restored iteration) that the interrupted
#: run wrote after the resumed step, removed at the first automatically named save_state (``accelerate_own.py``)
OWN_CHECKPOINTS_REPLACED = "own_checkpoints_replaced"
#: gradients were discarded without an optimizer step (a NaN guard): the implicit clock counts steps, not
#: iterations, so hook.resume() would not match the loop's own counter (the fix: hook.range()/hook.step())
OPTIMIZER_STEP_SKIPPED = "optimizer_step_skipped"
#: several optimizers in an implicit loop: the iteration count learned from the optimizer steps may not be the
#: loop's (ambiguous first iteration, an iteration unlike the first, a commit before any confirmed one; the fix:
#: hook.range())
ITERATIONS_UNPROVEN = "iterations_unproven"
DEADLINE_AT_RISK = "deadline_at_risk"
CHECKPOINT_LATE = "checkpoint_late"
DRILL_VERDICT = "drill_verdict"
#: a doomed rank's own bytes are durable (the survivors write the replicated ones); it waits for the commit
CHECKPOINT_SAFE = "checkpoint_safe"
#: a doomed rank's unique shards reached a survivor's memory (acknowledged); the survivor uploads them
CHECKPOINT_EVACUATED = "checkpoint_evacuated"
#: a survivor received a doomed rank's shards (receive and upload seconds)
EVACUATION_RECEIVED = "checkpoint_evacuation_received"
#: a survivor had no room in its memory budget for a doomed rank's shards: that rank uploads them itself
EVACUATION_DECLINED = "checkpoint_evacuation_declined"
#: a safe doomed rank left the save's collectives: the survivors finish and commit it (``handoff.py``)
CHECKPOINT_HANDED_OVER = "checkpoint_handed_over"
CHECKPOINT_COMMITTED = "checkpoint_committed"
CHECKPOINT_FAILED = "checkpoint_failed"
CHECKPOINT_SKIPPED = "checkpoint_skipped"
PEERS_LOST = "peers_lost"
TEARDOWN = "teardown"
EXIT = "exit"
NOTICE_AFTER_LAST_STEP = "notice_after_last_step"
NOT_RESUMED = "not_resumed"
#: once per loop kind: how this process acts on a notice ("any-moment" | "boundary") and why
NOTICE_PATH = "notice_path"

TIMELINE: tuple[str, ...] = (
    NOTICE_SEEN,
    AGREED,
    CHECKPOINT_STARTED,
    CHECKPOINT_STAGED,
    CHECKPOINT_FALLBACK,
    CHECKPOINT_SAFE,
    CHECKPOINT_EVACUATED,
    EVACUATION_RECEIVED,
    EVACUATION_DECLINED,
    CHECKPOINT_HANDED_OVER,
    CHECKPOINT_COMMITTED,
    CHECKPOINT_LATE,
    DEADLINE_AT_RISK,
    DRILL_VERDICT,
    CHECKPOINT_FAILED,
    CHECKPOINT_SKIPPED,
    TEARDOWN,
    EXIT,
    RESUMED,
)

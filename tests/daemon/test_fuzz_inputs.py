"""Property-based fuzzing of every parser of outside input on the daemon side.

- AWS IMDS answers (spot instance-action, rebalance, scheduled events, ASG lifecycle, identity);
- GCP metadata values (preempted, maintenance-event) through ``_parse`` + ``_observe``;
- Azure Scheduled Events documents through ``_json`` + ``_validate`` + ``_process``;
- the notice state file a restarted daemon reads (``persist.parse_state``);
- daemon configuration (flags and ``SPOTGUARD_*`` env) and the storage env knobs.

Rule for each: the parser returns valid records (every ``Notice`` encodes as one protocol
line after the daemon's ``_fit_line``) or raises its own labelled fault / ``ConfigError``;
nothing else may escape. ``COUNTS`` tallies the inputs tried; the last test prints them.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spotguard.daemon.noticeloop import _fit_line
from spotguard.daemon.config import _OPTIONS, ConfigError, DaemonConfig
from spotguard.daemon.persist import parse_state
from spotguard.daemon.watchers import aws as aws_mod
from spotguard.daemon.watchers import azure as az_mod
from spotguard.daemon.watchers import gcp as gcp_mod
from spotguard.daemon.watchers.http import Fault, Resp
from spotguard.notice import Cancel, Notice
from spotguard.protocol import NoticeMsg, encode
from spotguard.timefmt import utcnow

COUNTS: Counter[str] = Counter()
SETTINGS = settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.function_scoped_fixture])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                              max_size=4),
                           max_leaves=12)
times = st.one_of(
    st.datetimes(timezones=st.just(utcnow().tzinfo)).map(lambda d: d.strftime("%Y-%m-%dT%H:%M:%SZ")),
    st.sampled_from(["2017-09-18T08:22:00Z", "2017-09-18T08:22:00.004Z", "0000-00-00T00:00:00Z", "", "Z",
                     "9999-12-31T23:59:59Z", "2017-09-18T08:22:00+25:00", "2017-09-18 08:22:00",
                     "21 Jan 2019 09:00:43 GMT", "Mon, 19 Sep 2016 18:29:47 GMT", "31 Feb 2019 09:00:43 GMT",
                     "1 Jan 0001 00:00:00 GMT", "Mon, 99 Sep 2016 18:29:47 GMT", "\x00", "NaN"]),
    st.text(max_size=40),
)


def _dump(v: Any) -> str:
    try:
        return json.dumps(v)
    except (ValueError, TypeError):
        return str(v)


bodies = st.one_of(
    st.text(max_size=300),
    st.binary(max_size=200).map(lambda b: b.decode("utf-8", errors="replace")),
    json_values.map(_dump),
)
statuses = st.sampled_from([200, 200, 200, 200, 404, 401, 403, 429, 500, 503, 302, 418])
ctypes = st.sampled_from(["text/plain", "application/json", "text/html", "", "text/html; charset=utf-8",
                          "application/json; charset=utf-8"])


def _resp(status: int, text: str, ctype: str, headers: dict[str, str] | None = None) -> Any:
    return Resp(status, text, ctype, headers or {})


def _check_events(events: list[Any]) -> None:
    for e in events:
        assert isinstance(e, (Notice, Cancel)), e
        if isinstance(e, Notice):
            encode(NoticeMsg(notice=_fit_line(e)))  # what the daemon sends must fit one line


# --- AWS ---------------------------------------------------------------------------------

spot_docs = st.fixed_dictionaries({}, optional={"action": st.one_of(st.sampled_from(["terminate", "stop",
                                                                                    "hibernate"]), json_scalars),
                                                "time": st.one_of(times, json_scalars)}).map(_dump)
sched_event = st.fixed_dictionaries(
    {"EventId": st.one_of(st.text(max_size=30), st.just("instance-event-0d59937288b749b32"))},
    optional={"Code": st.one_of(st.sampled_from(["system-reboot", "instance-stop", "instance-retirement",
                                                 "system-maintenance"]), json_scalars),
              "State": st.one_of(st.sampled_from(["active", "completed", "canceled", "Active"]), json_scalars),
              "NotBefore": st.one_of(times, json_scalars), "Description": json_scalars})
sched_docs = st.one_of(st.lists(sched_event, max_size=4).map(_dump),
                       st.lists(st.one_of(sched_event, json_values), max_size=3).map(_dump))


@SETTINGS
@given(status=statuses, ctype=ctypes, body=st.one_of(bodies, spot_docs, sched_docs,
                                                       st.sampled_from(["InService", "Terminated", "Terminated\n",
                                                                        "Pending:Wait", ""])),
       which=st.sampled_from(["spot", "rebalance", "scheduled", "asg", "identity"]), repeat=st.integers(1, 3))
def test_aws_answers_never_crash_the_watcher(status: int, ctype: str, body: str, which: str, repeat: int) -> None:
    COUNTS["aws"] += 1
    w = aws_mod.AwsWatcher("http://127.0.0.1:1")
    handler = {"spot": w._handle_spot, "rebalance": w._handle_rebalance, "scheduled": w._handle_scheduled,
               "asg": w._handle_asg, "identity": w._handle_identity}[which]
    ids: set[str] = set()
    for _ in range(repeat):  # repeated polls of the same answer never re-send a notice
        try:
            events = handler(_resp(status, body, ctype), utcnow()) if which != "identity" else (
                handler(_resp(status, body, ctype)) or [])
        except Fault:
            continue
        _check_events(events)
        new = {e.id for e in events if isinstance(e, Notice)}
        assert not (new & ids), "the same answer polled again produced the same notice twice"
        ids |= new


# --- GCP ---------------------------------------------------------------------------------

gcp_values = st.one_of(st.sampled_from(["TRUE", "FALSE", "NONE", "TERMINATE_ON_HOST_MAINTENANCE",
                                        "MIGRATE_ON_HOST_MAINTENANCE", "TRUE\n", " true", ""]), bodies)


@SETTINGS
@given(seq=st.lists(st.tuples(statuses, ctypes, gcp_values, st.text(max_size=20)), min_size=1, max_size=6),
       path=st.sampled_from([gcp_mod.PREEMPTED, gcp_mod.MAINTENANCE]))
def test_gcp_values_never_crash_and_notices_pair_with_cancels(seq: list[tuple[int, str, str, str]],
                                                              path: str) -> None:
    COUNTS["gcp"] += len(seq)
    w = gcp_mod.GcpWatcher("http://127.0.0.1:1")
    active: set[str] = set()
    for status, ctype, body, etag in seq:
        resp = _resp(status, body, ctype, {"ETag": etag})
        try:
            value = w._parse(path, resp)
        except Fault:
            continue
        w._observe(path, value, etag, resp.text.strip())
        while not w._queue.empty():
            ev = w._queue.get_nowait()
            _check_events([ev])
            if isinstance(ev, Notice):
                assert not active, "a second notice for one path while the first is active"
                active.add(ev.id)
            else:
                assert ev.id in active, "cancel of a notice that was never sent"
                active.discard(ev.id)


# --- Azure -------------------------------------------------------------------------------

az_event = st.fixed_dictionaries(
    {"EventId": st.one_of(st.uuids().map(str), st.text(max_size=10)),
     "EventType": st.one_of(st.sampled_from(["Preempt", "Terminate", "Reboot", "Redeploy", "Freeze"]),
                            st.text(max_size=10))},
    optional={"Resources": st.one_of(st.just(["vm-0"]), st.lists(st.one_of(st.just("VM-0"), json_scalars),
                                                                 max_size=3), json_scalars),
              "EventStatus": st.one_of(st.sampled_from(["Scheduled", "Started"]), json_scalars),
              "NotBefore": st.one_of(times, json_scalars), "Description": json_scalars,
              "DurationInSeconds": json_scalars})
az_docs = st.fixed_dictionaries(
    {}, optional={"DocumentIncarnation": st.one_of(st.integers(-5, 2**64), json_scalars),
                  "Events": st.one_of(st.lists(az_event, max_size=4), st.lists(json_values, max_size=2),
                                      json_scalars)}).map(_dump)


@SETTINGS
@given(seq=st.lists(st.tuples(statuses, ctypes, st.one_of(az_docs, bodies)), min_size=1, max_size=5),
       name=st.sampled_from(["vm-0", None]))
def test_azure_documents_never_crash_the_watcher(seq: list[tuple[int, str, str]], name: str | None) -> None:
    COUNTS["azure"] += len(seq)
    w = az_mod.AzureWatcher("http://127.0.0.1:1", vm_name=name)
    active: set[str] = set()
    for status, ctype, body in seq:
        resp = _resp(status, body, ctype)
        try:
            if status != 200:
                raise az_mod._status_fault(resp, "x")
            inc, events = w._validate(w._json(resp, "x"), body)
            out = w._process(inc, events)
        except Fault:
            continue
        _check_events(out)
        for ev in out:
            if isinstance(ev, Notice):
                assert ev.id not in active
                active.add(ev.id)
            else:
                assert ev.id in active
                active.discard(ev.id)


# --- the notice state file ----------------------------------------------------------------

state_entry = st.fixed_dictionaries(
    {}, optional={"id": json_scalars, "source": st.one_of(st.sampled_from(["aws", "gcp", "azure"]), json_scalars),
                  "kind": st.one_of(st.sampled_from(["preemption", "termination"]), json_scalars),
                  "deadline": st.one_of(times, json_scalars), "received_at": st.one_of(times, json_scalars),
                  "detail": json_values, "key": json_scalars})
state_docs = st.one_of(
    st.binary(max_size=300),
    st.fixed_dictionaries({}, optional={"format": st.one_of(st.just(1), json_scalars),
                                        "notices": st.one_of(st.lists(st.one_of(state_entry, json_values),
                                                                      max_size=5), json_scalars)}).map(
        lambda d: _dump(d).encode()),
)


@SETTINGS
@given(raw=state_docs)
def test_notice_state_file_never_crashes_the_daemon(raw: bytes) -> None:
    COUNTS["state_file"] += 1
    entries, problems = parse_state(raw)
    for (source, key), n in entries.items():
        assert isinstance(n, Notice) and n.source == source and n.key == key and key
        encode(NoticeMsg(notice=_fit_line(n)))


# --- configuration --------------------------------------------------------------------------

config_values = st.one_of(st.none(), st.text(max_size=30).filter(lambda t: "\x00" not in t),
                          st.sampled_from(["0", "-1", "1e309", "nan", "inf", "65536", "aws", "AUTO", "yes", "off",
                                           "http://127.0.0.1:8999", "ftp://x", "http://", "/tmp/" + "x" * 120,
                                           " 2 ", "0x10", "1_000"]))


@SETTINGS
@given(flags=st.dictionaries(st.sampled_from([o.dest for o in _OPTIONS]), config_values, max_size=6),
       env=st.dictionaries(st.sampled_from([o.env for o in _OPTIONS]), config_values.filter(lambda v: v is not None),
                           max_size=6))
def test_configuration_is_valid_or_one_config_error(flags: dict[str, Any], env: dict[str, str]) -> None:
    COUNTS["config"] += 1
    ns = argparse.Namespace(**{o.dest: None for o in _OPTIONS})
    for k, v in flags.items():
        setattr(ns, k, v)
    if isinstance(getattr(ns, "socket_group", None), str):
        ns.socket_group = None  # group lookup depends on this machine's /etc/group: covered elsewhere
    env.pop("SPOTGUARD_SOCKET_GROUP", None)
    try:
        cfg = DaemonConfig.from_args(ns, env, create_socket_dir=False)
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    assert cfg.cloud in ("auto", "aws", "gcp", "azure", "none")
    assert len(os.fsencode(cfg.socket)) <= 107
    for num in ("poll_interval", "sigterm_grace", "ping_interval"):
        v = getattr(cfg, num)
        assert v is None or (v == v and v not in (float("inf"), float("-inf")) and v >= 0), (num, v)


@SETTINGS
@given(raw=st.one_of(st.text(max_size=20).filter(lambda t: "\x00" not in t),
                     st.sampled_from(["1e400", "-1e400", "inf", "nan", "16MiB", "-5MiB", "0", "1.5G", "KiB"])))
def test_storage_env_numbers_are_a_number_or_a_storage_error(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from spotguard.storage.base import StorageError
    from spotguard.storage.objstore import env_int

    COUNTS["storage_env"] += 1
    monkeypatch.setenv("SG_FUZZ_INT", raw)
    try:
        v = env_int("SG_FUZZ_INT", 7)
    except StorageError:
        return
    assert isinstance(v, int)


def test_report_inputs_tried(capsys: Any) -> None:
    """Runs last in this file: the number of inputs each parser was fed (0 when run alone)."""
    with capsys.disabled():
        print(f"\n[fuzz] daemon-side inputs tried: {dict(COUNTS)} total {sum(COUNTS.values())}")


@pytest.mark.parametrize("raw", ["1e400", "-1e400", "inf", "INF", "-inf"])
def test_regression_env_int_overflow_is_a_storage_error(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the fuzzer: SPOTGUARD_PART_SIZE=1e400 raised OverflowError (not StorageError) from
    ``int(float('inf'))``; and a huge part size or concurrency is now capped instead of allocated."""
    from spotguard.storage.base import StorageError
    from spotguard.storage.objstore import MAX_CONCURRENCY, MAX_PART_SIZE, env_int
    from spotguard.storage.s3 import S3Storage

    monkeypatch.setenv("SPOTGUARD_PART_SIZE", raw)
    with pytest.raises(StorageError, match="finite number"):
        env_int("SPOTGUARD_PART_SIZE", 1)
    monkeypatch.setenv("SPOTGUARD_PART_SIZE", "1e18")
    monkeypatch.setenv("SPOTGUARD_UPLOAD_CONCURRENCY", "1e9")
    s = S3Storage("s3://bucket/x")
    assert s.part_size <= MAX_PART_SIZE and s.concurrency <= MAX_CONCURRENCY

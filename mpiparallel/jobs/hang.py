"""What a hung job was doing, from its ranks' flight-recorder dumps (`collectives.flight`): `mpiparallel debug
hang DIR`, and the lines the stall watchdog adds to its own.

Every communicator numbers its calls (#0, #1, … the same call on every rank of it), so the dumps line up: per
communicator, the last call each rank entered and finished. A rank that never entered the call its peers wait in
is behind — and the analysis says where it is instead (its open call on another communicator, if any). A call
still open says which step of its algorithm it is in and whom it sends to and receives from, in world ranks.
Ranks whose calls with one number differ (operation, elements, dtype, root) are named: a mismatch hangs or
corrupts a collective. A rank with no dump was stopped or dead when the others wrote theirs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

DUMP_GLOB = "flight-rank-*.json"


@dataclass(frozen=True)
class Group:
    """One communicator as the dumps show it: its label (a mesh axis, or "" for a communicator without one), its
    members' world ranks, and whether these are its point-to-point messages (numbered per rank) or its
    collectives."""

    label: str
    members: tuple[int, ...]
    point_to_point: bool = False

    def name(self) -> str:
        ranks = ",".join(str(rank) for rank in self.members)
        messages = " messages" if self.point_to_point else ""
        return f"{self.label or 'communicator'}{messages} {{{ranks}}}"


def read_dumps(folder: str | Path) -> tuple[dict[int, dict[str, Any]], int]:
    """The dumps in `folder` by world rank, and the world size they report; one ConfigError if there are none."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder of flight-recorder dumps ({DUMP_GLOB})")
    dumps = {}
    for path in sorted(folder.glob(DUMP_GLOB)):
        try:
            dump = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"{path}: not a flight-recorder dump ({error})") from None
        dumps[int(dump["rank"])] = dump
    if not dumps:
        raise ConfigError(f"no flight-recorder dumps ({DUMP_GLOB}) in {folder}: send SIGUSR2 to the ranks of a "
                          f"running job (`pkill -USR2 -f 'mpiparallel train'`), or see `train --flight-dir`")
    return dumps, max(int(dump["world"]) for dump in dumps.values())


def calls_by_group(dumps: dict[int, dict[str, Any]]) -> dict[Group, dict[int, list[dict[str, Any]]]]:
    """Group -> world rank -> that rank's recorded calls on it, oldest first."""
    groups: dict[Group, dict[int, list[dict[str, Any]]]] = {}
    for rank, dump in dumps.items():
        for communicator in dump["communicators"]:
            group = Group(communicator["label"], tuple(communicator["members"]),
                          bool(communicator.get("point_to_point")))
            groups.setdefault(group, {})[rank] = communicator["calls"]
    return groups


def describe_call(call: dict[str, Any], members: tuple[int, ...], now: float | None = None) -> str:
    """`all_reduce #1042 (ring, float32, 1024 elements; step 2, sending to rank 2, receiving from rank 2, 12.3 s)`."""
    words = [call["algo"], call["dtype"], f"{call['count']} elements"]
    if call.get("tag", -1) >= 0:
        words.append(f"tag {call['tag']}")
    if call["root"] >= 0:
        words.append(f"root {members[call['root']]}")
    if call["ended"] is None:
        if call["step"] >= 0:
            words.append(f"step {call['step']}")
            if call["dest"] >= 0:
                words.append(f"sending to rank {members[call['dest']]}")
            if call["source"] >= 0:
                words.append(f"receiving from rank {members[call['source']]}")
        if now is not None:
            words.append(f"open for {now - call['started']:.1f} s")
    return f"{call['op']} #{call['seq']} ({', '.join(words)})"


def _signature(call: dict[str, Any]) -> tuple:
    return call["op"], call["count"], call["dtype"], call["root"]


def _open_call(calls: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((call for call in reversed(calls) if call["ended"] is None), None)


def _where_is(rank: int, groups: dict[Group, dict[int, list[dict[str, Any]]]], now: float) -> str:
    """What `rank` is doing: its most recently started open call on any communicator, or that it is computing."""
    open_calls = [(call, group) for group, ranks in groups.items() for call in [_open_call(ranks.get(rank, []))]
                  if call is not None]
    if not open_calls:
        return "it is in no call (computing, or waiting outside the collectives)"
    call, group = max(open_calls, key=lambda pair: pair[0]["started"])
    return f"it is in {group.name()} {describe_call(call, group.members, now)}"


def analyse(folder: str | Path) -> list[str]:
    """The report's lines: missing ranks, then per communicator that does not agree — the ranks behind and what
    they do, the ranks waiting and on whom, and any mismatched calls."""
    dumps, world = read_dumps(folder)
    now = max(dump["time"] for dump in dumps.values()) if dumps else time.time()
    groups = calls_by_group(dumps)
    lines = [f"flight records of {len(dumps)} of {world} ranks in {folder}"]
    missing = sorted(set(range(world)) - set(dumps))
    if missing:
        lines.append(f"no dump from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}: "
                     f"stopped or dead when the others wrote theirs")
    for group in sorted(groups, key=lambda g: (-len(g.members), g.label, g.members)):
        lines += _group_report(group, groups, missing, now)
    if len(lines) == 1 + bool(missing):
        lines.append("every communicator agrees: no rank behind, no call open, no mismatch")
    return lines


def _group_report(group: Group, groups: dict[Group, dict[int, list[dict[str, Any]]]], missing: list[int],
                  now: float) -> list[str]:
    if group.point_to_point:
        return _messages_report(group, groups, missing, now)
    ranks = groups[group]
    lines = []
    entered = {rank: calls[-1]["seq"] if calls else -1 for rank, calls in ranks.items()}
    newest = max(entered.values(), default=-1)
    waiting = {rank: call for rank, calls in ranks.items() if (call := _open_call(calls)) is not None}
    behind = [rank for rank in sorted(ranks) if entered[rank] < newest]
    absent = [rank for rank in group.members if rank in missing]
    if waiting or behind:
        head = f"{group.name()}:"
        for rank, call in sorted(waiting.items()):
            lines.append(f"{head} rank {rank} waits in {describe_call(call, group.members, now)}")
            head = " " * len(head)
        for rank in behind:
            last = f"its last call here is #{entered[rank]}" if entered[rank] >= 0 else "it made no call here"
            lines.append(f"{head} rank {rank} never entered #{newest}: {last}; {_where_is(rank, groups, now)}")
            head = " " * len(head)
        for rank in absent:
            lines.append(f"{head} rank {rank}: no dump (stopped or dead)")
            head = " " * len(head)
    lines += _mismatches(group, ranks)
    return lines


def _mismatches(group: Group, ranks: dict[int, list[dict[str, Any]]]) -> list[str]:
    """Calls with one number whose operation, elements, dtype or root differ between ranks."""
    by_seq: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, calls in ranks.items():
        for call in calls:
            by_seq.setdefault(call["seq"], {})[rank] = call
    lines = []
    for seq in sorted(by_seq):
        calls = by_seq[seq]
        if len({_signature(call) for call in calls.values()}) > 1:
            each = "; ".join(f"rank {rank}: {call['op']} of {call['count']} {call['dtype']}"
                             + (f" root {group.members[call['root']]}" if call["root"] >= 0 else "")
                             for rank, call in sorted(calls.items()))
            lines.append(f"{group.name()}: mismatch at #{seq}: {each}")
    return lines


def _messages_report(group: Group, groups: dict[Group, dict[int, list[dict[str, Any]]]], missing: list[int],
                     now: float) -> list[str]:
    """Each send or receive still open, and whether its peer has the other half: a receive posted for the send
    (same tag, from this rank), or a send made for the receive. A half with no other half names where the peer
    is instead."""
    ranks, lines = groups[group], []
    for rank, calls in sorted(ranks.items()):
        for call in (call for call in calls if call["ended"] is None):
            sending = call["op"] == "send"
            peer = group.members[call["dest"] if sending else call["source"]]
            line = f"{group.name()}: rank {rank} waits in {describe_call(call, group.members, now)}"
            other, side = ("recv", "source") if sending else ("send", "dest")
            matched = any(theirs["op"] == other and theirs["tag"] == call["tag"]
                          and group.members[theirs[side]] == rank for theirs in ranks.get(peer, []))
            if peer in missing:
                line += f"; rank {peer} left no dump"
            elif not matched:
                missing_half = "posted no receive for it" if sending else "sent nothing for it"
                line += f"; rank {peer} {missing_half}: {_where_is(peer, groups, now)}"
            lines.append(line)
    return lines

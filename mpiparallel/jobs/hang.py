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


def read_dumps(folder: str | Path, since: float = 0.0) -> tuple[dict[int, dict[str, Any]], int]:
    """The dumps in `folder` by world rank, and the world size they report; one ConfigError if there are none.
    `since`: a time (seconds since the epoch) before which a dump is old — another run's — and left out."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder of flight-recorder dumps ({DUMP_GLOB})")
    dumps = {}
    for path in sorted(folder.glob(DUMP_GLOB)):
        try:
            dump = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"{path}: not a flight-recorder dump ({error})") from None
        if dump["time"] >= since:
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
    """`all_reduce #1042 (ring, float32, 1024 elements; step 2, sending to rank 2, receiving from rank 2, 12.3 s)`;
    a message: `send #3 (p2p, float64, 512 elements, tag 7, sending to rank 1, waited on, open for 2.0 s)`."""
    words = [call["algo"], call["dtype"], f"{call['count']} elements"]
    if call.get("tag", -1) >= 0:
        words.append(f"tag {call['tag']}")
    if call["root"] >= 0:
        words.append(f"root {members[call['root']]}")
    if call["ended"] is None:
        if call["step"] >= 0:
            words.append(f"step {call['step']}")
        if call["step"] >= 0 or _is_message(call):
            if call["dest"] >= 0:
                words.append(f"sending to rank {members[call['dest']]}")
            if call["source"] >= 0:
                words.append(f"receiving from rank {members[call['source']]}")
        if call.get("background"):
            words.append("in the background, not waited on yet")
        elif _is_message(call):
            words.append("waited on")
        if now is not None:
            words.append(f"open for {now - call['started']:.1f} s")
    return f"{call['op']} #{call['seq']} ({', '.join(words)})"


def _is_message(call: dict[str, Any]) -> bool:
    return call.get("tag", -1) >= 0


def _signature(call: dict[str, Any]) -> tuple:
    return call["op"], call["count"], call["dtype"], call["root"]


def _open_call(calls: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest call still open that holds its rank up: not one in the background (a message posted, an
    `_async` collective), which holds nobody up until a wait on it begins."""
    return next((call for call in reversed(calls) if call["ended"] is None and not call.get("background")), None)


def _blocked_in(rank: int, groups: dict[Group, dict[int, list[dict[str, Any]]]]
                ) -> tuple[dict[str, Any], Group] | None:
    """The call `rank` sits in: its most recently started open call on any communicator (None: in no call)."""
    open_calls = [(call, group) for group, ranks in groups.items() for call in [_open_call(ranks.get(rank, []))]
                  if call is not None]
    return max(open_calls, key=lambda pair: pair[0]["started"]) if open_calls else None


def _where_is(rank: int, groups: dict[Group, dict[int, list[dict[str, Any]]]], now: float) -> str:
    """What `rank` is doing: the call it sits in, or that it is computing."""
    found = _blocked_in(rank, groups)
    if found is None:
        return "it is in no call (computing, or waiting outside the collectives)"
    call, group = found
    return f"it is in {group.name()} {describe_call(call, group.members, now)}"


def waits_on(rank: int, groups: dict[Group, dict[int, list[dict[str, Any]]]], missing: list[int]) -> list[int]:
    """The ranks `rank` waits for: the peers of the step (or message) it sits in; where the call shows no step
    (MPI's own algorithms), the members that have not entered it, or else every other member. Empty: it is in
    no call and waits for nobody."""
    found = _blocked_in(rank, groups)
    if found is None:
        return []
    call, group = found
    peers = {group.members[peer] for peer in (call["dest"], call["source"]) if peer >= 0} - {rank}
    if peers or group.point_to_point:
        return sorted(peers)
    entered = {member: calls[-1]["seq"] if calls else -1 for member, calls in groups[group].items()}
    others = [member for member in group.members if member != rank]
    behind = [member for member in others if member in missing or entered.get(member, -1) < call["seq"]]
    return behind or others


def holding_up(dumps: dict[int, dict[str, Any]], world: int) -> tuple[dict[int, list[int]], list[list[int]]]:
    """Follow who waits for whom. Returns the ranks at the ends of the chains — in no call, or without a dump
    (stopped, dead) — each with the ranks that wait on it directly or through others; and the sets of ranks that
    wait only on each other, reaching no such end (a deadlock: calls that do not pair up)."""
    groups = calls_by_group(dumps)
    missing = sorted(set(range(world)) - set(dumps))
    edges = {rank: waits_on(rank, groups, missing) for rank in dumps}
    ends: dict[int, set[int]] = {}
    deadlocked: list[list[int]] = []
    for start in sorted(rank for rank, peers in edges.items() if peers):
        reached, stack, stuck = {start}, [start], True
        while stack:
            rank = stack.pop()
            if not edges.get(rank):  # a rank that waits for nobody (or left no dump) ends the chain
                ends.setdefault(rank, set()).add(start)
                stuck = False
            for peer in edges.get(rank, []):
                if peer not in reached:
                    reached.add(peer)
                    stack.append(peer)
        if stuck and sorted(reached) not in deadlocked:
            deadlocked.append(sorted(reached))
    return {rank: sorted(waiting) for rank, waiting in sorted(ends.items())}, deadlocked


def analyse(folder: str | Path, since: float = 0.0) -> list[str]:
    """The report's lines: missing ranks; the ranks holding the others up (or the ranks deadlocked on each other);
    then per communicator that does not agree — the ranks behind and what they do, the ranks waiting and
    on whom, and any mismatched calls."""
    dumps, world = read_dumps(folder, since)
    now = max(dump["time"] for dump in dumps.values()) if dumps else time.time()
    groups = calls_by_group(dumps)
    lines = [f"flight records of {len(dumps)} of {world} ranks in {folder}"]
    missing = sorted(set(range(world)) - set(dumps))
    if missing:
        lines.append(f"no dump from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}: "
                     f"stopped or dead when the others wrote theirs")
    lines += _summary(dumps, world, groups, missing, now)
    details = [line for group in sorted(groups, key=lambda g: (-len(g.members), g.label, g.members))
               for line in _group_report(group, groups, missing, now)]
    lines += details or ["every communicator agrees: no rank behind, no call open, no mismatch"]
    return lines


def _summary(dumps: dict[int, dict[str, Any]], world: int, groups: dict[Group, dict[int, list[dict[str, Any]]]],
             missing: list[int], now: float) -> list[str]:
    """`held up by rank 3: …; ranks 0, 1, 2 wait on it` per end of a chain of waits; the deadlocked sets."""
    ends, deadlocked = holding_up(dumps, world)
    lines = []
    for rank, waiting in ends.items():
        state = "it left no dump (stopped or dead)" if rank in missing else _where_is(rank, groups, now)
        ranks = ", ".join(map(str, waiting))
        lines.append(f"held up by rank {rank}: {state}; rank{'s' if len(waiting) > 1 else ''} {ranks} "
                     f"{'wait' if len(waiting) > 1 else 'waits'} on it, directly or through each other")
    for ranks in deadlocked:
        lines.append(f"ranks {', '.join(map(str, ranks))} wait in calls on one another and on no rank outside them: "
                     f"their calls do not pair up, or their messages do not arrive")
    return lines


def held_up_by(folder: str | Path, since: float = 0.0) -> tuple[int, ...]:
    """The ranks at the ends of the chains of waits in the dumps in `folder` (see `holding_up`); () if none."""
    dumps, world = read_dumps(folder, since)
    return tuple(holding_up(dumps, world)[0])


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
    """Each send or receive still waited on, and whether its peer has the other half: a receive posted for the send
    (same tag, from this rank), or a send made for the receive. A half with no other half names where the peer
    is instead."""
    ranks, lines = groups[group], []
    for rank, calls in sorted(ranks.items()):
        for call in (call for call in calls if call["ended"] is None and not call.get("background")):
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

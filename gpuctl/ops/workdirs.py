"""Nodes that share a work dir: lab hosts with one NFS home (root@ on each is common) see one
`remote.workdir`, and two nodes writing one job script, one queue and one guard config get the
same task index and wait for each other forever. `up` finds them by a random token written on each
node and looked for on the others, and gives each such node its own subdirectory,
`<work dir>/node-<rank>` (said in the output), as separate machines would have.
"""

from __future__ import annotations

import posixpath
import secrets
from concurrent.futures import ThreadPoolExecutor

from gpuctl.model.records import ClusterRecord, InstanceRecord
from gpuctl.ops.session import Progress, Session
from gpuctl.provision import Provider
from gpuctl.remote.host import Host

TOKEN = ".gpuctl-node-"  # + a random hex token: one such empty file per node, removed at once
# Prints the names of the files given that exist here (the other nodes' tokens seen from this one).
LOOK = 'for f; do [ -e "$f" ] && printf "%s\\n" "${f##*/}"; done; exit 0'


def subdir(root: str, rank: int) -> str:
    return posixpath.join(root, f"node-{rank}")


def sharing(hosts: list[Host]) -> list[set[int]]:
    """Groups (two or more node indexes) of these hosts that see one work dir."""
    tokens = [TOKEN + secrets.token_hex(8) for _ in hosts]

    def write(i: int) -> None:
        hosts[i].write_text(posixpath.join(hosts[i].root, tokens[i]), "", mode=0o600)

    def look(i: int) -> set[int]:
        others = [posixpath.join(hosts[i].root, t) for j, t in enumerate(tokens) if j != i]
        seen = hosts[i].run(["sh", "-c", LOOK, "sh", *others]).stdout.split()
        return {i} | {j for j, t in enumerate(tokens) if t in seen}  # only our own tokens count

    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        list(pool.map(write, range(len(hosts))))  # every token is written before any is looked for
        seen = list(pool.map(look, range(len(hosts))))
        list(pool.map(lambda i: hosts[i].run(["rm", "-f", posixpath.join(hosts[i].root, tokens[i])]),
                      range(len(hosts))))
    groups: list[set[int]] = []
    for group in seen:
        if len(group) > 1 and group not in groups:
            groups.append(group)
    return groups


def separate(s: Session, cluster: ClusterRecord, provider: Provider, progress: Progress) -> list[InstanceRecord]:
    """The cluster's instances, each node that shares its work dir with another moved to its own
    subdirectory (recorded in the ledger and by the provider); as they were when none shares."""
    pairs = s.hosts(cluster)
    records = [inst for inst, _ in pairs]
    if len(pairs) < 2:
        return records
    groups = sharing([host for _, host in pairs])
    if not groups:
        return records
    moved = set().union(*groups)
    for n in sorted(moved):
        inst, host = pairs[n]
        records[n] = inst.model_copy(update={"workdir": subdir(host.root, inst.node)})
        host.run(["mkdir", "-p", records[n].workdir])
        s.ledger.put_instance(cluster.id, records[n])
    for group in groups:
        ranks = sorted(records[n].node for n in group)
        root = pairs[min(group)][1].root
        progress(f"nodes {', '.join(map(str, ranks))} see one work dir ({root}, a shared home?): each works in its "
                 f"own subdirectory, {subdir(root, ranks[0])} and so on (set remote.workdir to a local disk to avoid it)")
    s.forget_hosts(cluster)  # the hosts made with the shared dir as their root
    provider.remember(records)
    return records

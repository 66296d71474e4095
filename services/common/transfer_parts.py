"""A multicast plan as the TransferPart each worker executes (planner and benchmarks)."""

from collections.abc import Mapping, Sequence

from libs.planning.multicast import node_parts
from libs.planning.scaleout import MulticastPlan
from libs.protocol import messages as m


def transfer_parts(plan: MulticastPlan, nodes: Sequence[str], addresses: Mapping[str, str],
                   blocks: Sequence[m.BlockInfo], *, transfer_id: str, model: str, chunk_bytes: int = 1 << 20,
                   stall_timeout_s: float = 30.0, scale_op_id: str | None = None) -> dict[str, m.TransferPart]:
    """Worker id -> its part, for every node that sends or receives; receivers come first, so a
    caller that sends them in order has every receiver registered before a source starts."""
    parts = node_parts(plan.schedule, len(nodes))
    out = {}
    for v in sorted(range(len(nodes)), key=lambda v: v < plan.k):
        part = parts[v]
        if not (part.sends or part.receives):
            continue
        peers = {nodes[t.dst]: addresses[nodes[t.dst]] for t in part.sends}
        peers |= {nodes[t.src]: addresses[nodes[t.src]] for t in part.receives}
        out[nodes[v]] = m.TransferPart(
            transfer_id=transfer_id, model=model, algorithm=plan.algorithm, blocks=list(blocks), peers=peers,
            sends=[m.TransferHop(step=t.step, peer=nodes[t.dst], block=t.block) for t in part.sends],
            receives=[m.TransferHop(step=t.step, peer=nodes[t.src], block=t.block) for t in part.receives],
            chunk_bytes=chunk_bytes, stall_timeout_s=stall_timeout_s, scale_op_id=scale_op_id)
    return out


def gather_parts(receiver: str, from_peers: Mapping[int, str], addresses: Mapping[str, str],
                 blocks: Sequence[m.BlockInfo], *, transfer_id: str, model: str, chunk_bytes: int = 1 << 20,
                 stall_timeout_s: float = 30.0) -> dict[str, m.TransferPart]:
    """Blocks held by several peers brought to one receiver (the parameter pool's re-replication):
    the receiver's part first, then one part per sending peer."""
    order = sorted(from_peers)
    hops = [m.TransferHop(step=i, peer=from_peers[b], block=b) for i, b in enumerate(order)]
    out = {receiver: m.TransferPart(
        transfer_id=transfer_id, model=model, algorithm="gather", blocks=list(blocks),
        peers={p: addresses[p] for p in set(from_peers.values())}, receives=hops, chunk_bytes=chunk_bytes,
        stall_timeout_s=stall_timeout_s)}
    for peer in sorted(set(from_peers.values())):
        out[peer] = m.TransferPart(
            transfer_id=transfer_id, model=model, algorithm="gather", blocks=list(blocks),
            peers={receiver: addresses[receiver]}, chunk_bytes=chunk_bytes, stall_timeout_s=stall_timeout_s,
            sends=[m.TransferHop(step=h.step, peer=receiver, block=h.block) for h in hops if h.peer == peer])
    return out

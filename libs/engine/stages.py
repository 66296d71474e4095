"""Pipeline stages: a contiguous layer range with its own KV cache, here or on another worker.

A stage takes token ids (first stage) or hidden states and returns hidden states
or, for the last stage, logits. `open`/`close` reserve and free a request's KV
slot: the KV of a request lives with the stage that computed it. `fork` copies
one slot's first tokens into another (the choices of an n > 1 request share the
prompt's prefill), where that KV lives.

`StageServer` hosts local stages for remote callers and `RemoteStage` calls one
of them: activations travel on the data plane's small-message channel (their
own connections, never behind bulk block transfers), one call and one reply
per forward pass.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import queue
import struct
import threading
import weakref
from typing import Protocol

import torch

from libs.transfer.base import Transport, TransferError

from .model import LayerRange

log = logging.getLogger(__name__)

CALL_CHANNEL = "stage.call"
REPLY_CHANNEL = "stage.reply"
_LEN = struct.Struct("!I")


class Stage(Protocol):
    slots: int

    def open(self, request_id: str) -> None: ...

    def close(self, request_id: str) -> None: ...

    def fork(self, src_id: str, dst_id: str, length: int) -> None: ...

    def forward(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, logits_to_keep: int = 0
                ) -> torch.Tensor: ...


class LocalStage:
    """A LayerRange with a pre-allocated slot KV cache, in this process."""

    def __init__(self, model: LayerRange, slots: int, max_seq_len: int):
        self.model = model
        self.kv = model.new_slot_cache(slots, max_seq_len)
        self._slot: dict[str, int] = {}

    @property
    def slots(self) -> int:
        return self.kv.slots

    def open(self, request_id: str) -> None:
        if request_id in self._slot:
            raise ValueError(f"request {request_id!r} already holds a slot")
        slot = self.kv.allocate()
        if slot is None:
            raise RuntimeError(f"no free KV slot for {request_id!r} ({self.kv.slots} in use)")
        self._slot[request_id] = slot

    def close(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self.kv.release(slot)

    def resize(self, slots: int) -> None:
        """Its KV cache to `slots` slots, every open request keeping its KV (SlotKVCache.resize)."""
        moved = self.kv.resize(slots)
        self._slot = {r: moved[s] for r, s in self._slot.items()}

    def fork(self, src_id: str, dst_id: str, length: int) -> None:
        self.kv.copy(self._slot[src_id], self._slot[dst_id], length)

    def forward(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, logits_to_keep: int = 0
                ) -> torch.Tensor:
        return self.forward_blocks(request_ids, inputs, q_len, (self.model.block_start, self.model.block_end),
                                   logits_to_keep)

    def forward_blocks(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, blocks: tuple[int, int],
                       logits_to_keep: int = 0) -> torch.Tensor:
        """Blocks [a, b) of a pass. A pass may run in parts, each at the same positions (its first
        blocks while the later ones still arrive: Engine.prefill_ahead); its tokens count as in the
        cache only once the part with the range's last block has run."""
        view = self.kv.batch([self._slot[r] for r in request_ids], q_len)
        out = self.model(inputs, view, logits_to_keep=logits_to_keep, blocks=blocks)
        if blocks[1] == self.model.block_end:
            view.commit()
        return out

    def length(self, request_id: str) -> int:
        """Tokens of the request in this stage's KV cache."""
        return self.kv.lengths[self._slot[request_id]]

    def forward_rest(self, request_ids: list[str], hidden: torch.Tensor, q_len: int, front_kv: torch.Tensor,
                     from_block: int, logits_to_keep: int = 0) -> torch.Tensor:
        """The blocks [from_block, end) of a pass whose first blocks ran elsewhere (a live pair's
        split prefill): `front_kv` ([2, layers, rows, kv heads, q_len, head dim], what
        `PrefillFront.forward` returns) goes into this cache's first layers at each row's
        position, so the request's KV here is complete and it decodes alone."""
        view = self.kv.batch([self._slot[r] for r in request_ids], q_len)
        write_kv(self.kv, view.slots, view.starts, front_kv)
        out = self.model(hidden, view, logits_to_keep=logits_to_keep, blocks=(from_block, self.model.block_end))
        view.commit()
        return out


def read_kv(cache, slots: list[int], starts: list[int], layers: int, q_len: int) -> torch.Tensor:
    """The KV of the first `layers` layers of `cache` at positions [start, start + q_len) of each
    slot: [2, layers, rows, kv heads, q_len, head dim]."""
    return torch.stack([
        torch.stack([torch.stack([pool[i][s, :, a:a + q_len] for s, a in zip(slots, starts)]) for i in range(layers)])
        for pool in (cache.keys, cache.values)])


def write_kv(cache, slots: list[int], starts: list[int], kv: torch.Tensor) -> None:
    """`read_kv`'s tensor into the first layers of `cache`, at each slot's position."""
    _, layers, rows, _, q_len, _ = kv.shape
    if rows != len(slots) or layers > len(cache.keys):
        raise ValueError(f"KV of {layers} layers x {rows} rows does not fit {len(slots)} rows of "
                         f"{len(cache.keys)} layers")
    kv = kv.to(cache.device, cache.keys[0].dtype)
    for pool, part in zip((cache.keys, cache.values), kv):
        for i in range(layers):
            for r, (s, a) in enumerate(zip(slots, starts)):
                pool[i][s, :, a:a + q_len] = part[i, r]


# --- activations on the wire ----------------------------------------------------------------------


def pack(header: dict, tensor: torch.Tensor | None = None) -> bytes:
    """JSON header (+ dtype and shape of the tensor) followed by the tensor's raw bytes."""
    raw = b""
    if tensor is not None:
        t = tensor.detach().to("cpu").contiguous()
        header = {**header, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        # (flat first: a 0-d tensor of a multi-byte dtype has no byte view)
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    head = json.dumps(header).encode()
    return _LEN.pack(len(head)) + head + raw


class StageMessageError(ValueError):
    """A stage call or reply whose bytes do not follow `pack`'s format."""


# What a stage sends: token ids, hidden states, logits and KV in the model's dtypes, a count.
WIRE_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}
MAX_DIMS = 8


def unpack(payload: bytes) -> tuple[dict, torch.Tensor | None]:
    """`pack`'s header and tensor; a StageMessageError for bytes that are not one. The tensor is a
    view of the payload's copy: its shape must account for exactly the bytes that came."""
    if len(payload) < _LEN.size:
        raise StageMessageError("stage message too short")
    (n,) = _LEN.unpack_from(payload)
    if n > len(payload) - _LEN.size:
        raise StageMessageError(f"stage message header of {n} bytes, {len(payload) - _LEN.size} sent")
    try:
        header = json.loads(payload[_LEN.size:_LEN.size + n])
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested too deep
        raise StageMessageError(f"stage message header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise StageMessageError("stage message header is not an object")
    if "dtype" not in header:
        return header, None
    dtype = WIRE_DTYPES.get(header["dtype"]) if isinstance(header["dtype"], str) else None
    if dtype is None:
        raise StageMessageError(f"unknown dtype {header['dtype']!r}")
    shape = header.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(d) is int and d >= 0 for d in shape)):  # (bool is an int: type(), not isinstance)
        raise StageMessageError(f"shape {shape!r} is not a list of at most {MAX_DIMS} sizes")
    data = bytearray(payload[_LEN.size + n:])
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize != len(data):
        raise StageMessageError(f"a {dtype} tensor of shape {shape} is {numel * dtype.itemsize} bytes, "
                                f"{len(data)} sent")
    t = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return header, t.view(dtype).reshape(shape)


class StageServer:
    """Runs calls from remote engines on local stages, one at a time on its own thread.

    Calls are taken only from the callers it names: those given at its start (for its
    lifetime) and each hosted stage's caller (while the stage is hosted); the transport
    refuses the messages of any other peer (Transport.admit_messages)."""

    def __init__(self, transport: Transport, peers: dict[str, str]):
        self.transport = transport
        self.peers = peers  # caller node id -> address, for the replies
        self._lifelong = set(peers)  # callers named at the start: for the server's lifetime
        for peer, address in peers.items():
            transport.admit_messages(peer, address)
        self.stages: dict[str, LocalStage] = {}  # (or a live pair's PrefillFront: open, close, front)
        self._callers: dict[str, tuple[str, str]] = {}  # stage id -> (its caller, the caller's address)
        self._inbox: queue.Queue = queue.Queue()
        transport.on_message(CALL_CHANNEL, lambda src, payload: self._inbox.put((src, payload)))
        self._thread = threading.Thread(target=self._run, name="stage-server", daemon=True)
        self._thread.start()

    def add(self, stage_id: str, stage, caller: str | None = None, address: str | None = None) -> None:
        """Serve `stage`; `caller` (at `address`: where its pipeline or pair says it is) may call it."""
        self.remove(stage_id)
        self.stages[stage_id] = stage
        if caller is not None and address is not None:
            self.peers[caller] = address
            self.transport.admit_messages(caller, address)
            self._callers[stage_id] = (caller, address)

    def remove(self, stage_id: str) -> None:
        """Stop serving a stage (its KV cache goes with it); later calls for it fail, and its caller's
        messages are no longer taken unless something else here names it."""
        self.stages.pop(stage_id, None)
        caller = self._callers.pop(stage_id, None)
        if caller is not None:
            self.transport.revoke_messages(*caller)

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while (item := self._inbox.get()) is not None:
            src, payload = item
            if src not in self._lifelong and all(c != src for c, _ in self._callers.values()):
                # (a transport that filters never lets it through; one that cannot, rdma, does)
                log.warning("stage call from %s dropped: no stage hosted here is called by it", src)
                continue
            call_id = None
            try:
                header, tensor = unpack(payload)
                call_id = header.get("call_id")
                out = self._serve(header, tensor)
                reply = pack({"call_id": call_id, "ok": True}, out)
            except Exception as e:  # a bad call fails that call, never the server
                log.warning("stage call from %s failed: %s", src, e)
                reply = pack({"call_id": call_id, "ok": False, "error": f"{type(e).__name__}: {e}"})
            try:
                self.transport.send_message(src, self.peers[src], REPLY_CHANNEL, reply)
            except (KeyError, TransferError) as e:
                log.warning("cannot reply to %s: %s", src, e)

    @torch.inference_mode()
    def _serve(self, header: dict, tensor: torch.Tensor | None) -> torch.Tensor | None:
        stage = self.stages.get(str(header.get("stage")))
        if stage is None:
            raise KeyError(f"no stage {header.get('stage')!r} here")
        op = header.get("op")
        if op == "open":
            stage.open(str(header["request_id"]))
            return None
        if op == "close":
            stage.close(str(header["request_id"]))
            return None
        if op == "fork":
            stage.fork(str(header["src"]), str(header["dst"]), int(header["length"]))
            return None
        if op == "front" and tensor is not None and hasattr(stage, "front_call"):  # a live pair's target
            return stage.front_call(header, tensor)
        if op == "held" and hasattr(stage, "held"):
            return torch.tensor([stage.held()])
        if op == "forward" and tensor is not None:
            return stage.forward([str(r) for r in header["request_ids"]], tensor, int(header["q_len"]),
                                 int(header.get("logits_to_keep", 0)))
        raise ValueError(f"unknown stage operation {op!r}")


class RemoteStage:
    """A stage hosted by a StageServer on another worker; calls block until the reply arrives."""

    _ids = itertools.count()

    def __init__(self, transport: Transport, peer: str, address: str, stage_id: str, slots: int,
                 timeout_s: float = 60.0):
        self.transport, self.peer, self.address, self.stage_id = transport, peer, address, stage_id
        self.slots = slots
        self.timeout_s = timeout_s
        self._replies = _replies_of(transport)
        # Its replies come from `peer` at `address`: taken while this stage lives (or until close()).
        transport.admit_messages(peer, address)
        self._admitted = weakref.finalize(self, transport.revoke_messages, peer, address)

    def close(self) -> None:
        """Its peer's messages are no longer taken for it (also when it is garbage collected)."""
        self._admitted()

    def _submit(self, header: dict, tensor: torch.Tensor | None = None) -> concurrent.futures.Future:
        """Send a call; the future holds its result (or raises the stage's error)."""
        call_id = f"{self.transport.node_id}:{next(self._ids)}"
        reply = self._replies.expect(call_id, owner=self)
        result: concurrent.futures.Future = concurrent.futures.Future()

        def done(f: concurrent.futures.Future) -> None:
            if f.exception() is not None:
                result.set_exception(f.exception())
                return
            head, out = f.result()
            if head.get("ok"):
                result.set_result(out)
            else:
                result.set_exception(RuntimeError(f"stage {self.stage_id} on {self.peer}: {head.get('error')}"))

        reply.add_done_callback(done)
        try:
            self.transport.send_message(self.peer, self.address, CALL_CHANNEL,
                                        pack({**header, "call_id": call_id, "stage": self.stage_id}, tensor))
        except BaseException:
            self._replies.forget(call_id)
            raise
        return result

    def abort(self, reason: str) -> None:
        """Thread-safe: every call still waiting for its reply fails now. A peer that died
        mid-call may never close its connection (a killed host, a cut link): whoever learns
        it first (the planner, by heartbeats) frees the engine that waits on it."""
        self._replies.fail(self, ConnectionError(f"stage {self.stage_id} on {self.peer}: {reason}"))

    def _call(self, header: dict, tensor: torch.Tensor | None = None) -> torch.Tensor | None:
        future = self._submit(header, tensor)
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no reply from stage {self.stage_id} on {self.peer} within {self.timeout_s}s") from None

    def open(self, request_id: str) -> None:
        self._call({"op": "open", "request_id": request_id})

    def close(self, request_id: str) -> None:
        self._call({"op": "close", "request_id": request_id})

    def fork(self, src_id: str, dst_id: str, length: int) -> None:
        # Queued behind this engine's forward calls: the prefill it copies is in by then.
        self._call({"op": "fork", "src": src_id, "dst": dst_id, "length": length})

    def forward(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, logits_to_keep: int = 0
                ) -> torch.Tensor:
        return self.submit(request_ids, inputs, q_len, logits_to_keep).result(self.timeout_s)

    def call_op(self, op: str) -> torch.Tensor | None:
        """A call of the hosted stage's own (e.g. a live pair's front: "held")."""
        return self._call({"op": op})

    def front(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, blocks: int) -> torch.Tensor:
        """A live pair's front call (a PrefillFront hosted there): hidden state and KV, flattened."""
        return self._call({"op": "front", "request_ids": request_ids, "q_len": q_len, "blocks": blocks}, inputs)

    def submit_front(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, blocks: int
                     ) -> concurrent.futures.Future:
        """`front` sent without waiting (the stage server answers calls in order)."""
        return self._submit({"op": "front", "request_ids": request_ids, "q_len": q_len, "blocks": blocks}, inputs)

    def submit(self, request_ids: list[str], inputs: torch.Tensor, q_len: int, logits_to_keep: int = 0
               ) -> concurrent.futures.Future:
        """A forward pass sent without waiting: the engine keeps other micro-batches moving
        meanwhile (2D pipelining, λScale Fig. 6a)."""
        return self._submit({"op": "forward", "request_ids": request_ids, "q_len": q_len,
                             "logits_to_keep": logits_to_keep}, inputs)


class _Replies:
    """Replies of one transport's remote-stage calls, matched by call id."""

    def __init__(self, transport: Transport):
        self._lock = threading.Lock()
        self._waiting: dict[str, concurrent.futures.Future] = {}
        self._owner: dict[str, object] = {}  # call id -> the RemoteStage that sent it
        transport.on_message(REPLY_CHANNEL, self._on_reply)

    def expect(self, call_id: str, owner: object) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._waiting[call_id] = future
            self._owner[call_id] = owner
        return future

    def forget(self, call_id: str) -> None:
        with self._lock:
            self._waiting.pop(call_id, None)
            self._owner.pop(call_id, None)

    def fail(self, owner: object, error: Exception) -> None:
        """Every call of `owner` still waiting fails with `error`."""
        with self._lock:
            calls = [c for c, o in self._owner.items() if o is owner]
            futures = [self._waiting.pop(c) for c in calls]
            for c in calls:
                del self._owner[c]
        for f in futures:
            f.set_exception(error)

    def _on_reply(self, src: str, payload: bytes) -> None:
        try:
            header, tensor = unpack(payload)
        except StageMessageError as e:
            log.warning("malformed stage reply from %s dropped: %s", src, e)
            return
        with self._lock:
            call_id = str(header.get("call_id"))
            owner = self._owner.get(call_id)
            forged = owner is not None and getattr(owner, "peer", src) != src
            future = None if forged else self._waiting.pop(call_id, None)
            if not forged:
                self._owner.pop(call_id, None)
        if forged:  # a reply to a call sent to another peer: not this one's to answer
            log.warning("stage reply from %s to a call sent to %s dropped", src, owner.peer)
            return
        if future is not None:
            future.set_result((header, tensor))


_REPLIES: weakref.WeakKeyDictionary[Transport, _Replies] = weakref.WeakKeyDictionary()
_REPLIES_LOCK = threading.Lock()


def _replies_of(transport: Transport) -> _Replies:
    with _REPLIES_LOCK:
        r = _REPLIES.get(transport)
        if r is None:
            r = _REPLIES[transport] = _Replies(transport)
        return r

"""The control channel of a multi-task run: ZeroMQ between trainer rank 0 and the generator ranks.

Trainer rank 0 binds a ROUTER socket; each generator connects a DEALER whose identity is its
index. Messages are JSON objects with a "type" (below); ZeroMQ keeps each peer's messages in
order and queues them while the other side is busy, so neither side blocks the other by sending.
The weights themselves do not travel here but over the weight group (`recipe.engines.weights`):
this channel carries what comes before a push, its `WeightMeta`.

trainer rank 0 -> generator:
  {"type": "work", "items": [{group_id, prompt, num_samples, max_new_tokens, seed[, interrupt]}, ...]}
      (interrupt, under length.control=interrupt: {"close_id": c, "phrase_ids": [...], "budgets": [one
      thinking budget per sample]}, see `interrupt_to_wire`)
  {"type": "weights", "version": v, "meta": [[name, dtype, shape], ...]}  (then the broadcast)
  {"type": "stop"}
generator -> trainer rank 0:
  {"type": "hello", "index": i}
  {"type": "groups", "groups": [group, ...], "num_tokens": n, "num_positions": n, "busy_seconds": s}
      (busy_seconds: the generator's wall time with groups in flight since its last message)
  {"type": "error", "message": "..."}

JSON rather than pickle: nothing that arrives on a socket is executed, and Python floats
round-trip exactly, so the behaviour log-probs arrive bit for bit.
"""

from __future__ import annotations

import json
from typing import Any

import zmq

from recipe.engines.base import Group, Sample, WeightMeta
from recipe.model.sampler import Interrupt

Message = dict[str, Any]


class PeerLost(RuntimeError):
    """Another task of the run is gone (its process died, its node or link failed); `tasks` are
    the job's task numbers of the peers it names, whose logs say more."""

    def __init__(self, message: str, tasks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.tasks = tasks


class ControlServer:
    """Trainer rank 0's end: one ROUTER socket, peers addressed by generator index."""

    def __init__(self, num_generators: int) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a message to an unknown peer fails loudly
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.port = self.socket.bind_to_random_port("tcp://*")
        self.num_generators = num_generators
        self.names: dict[int, str] = {}
        """How errors name each generator (its task and host), once trainer rank 0 knows them."""
        self.tasks: dict[int, int] = {}
        """Each generator's task number in the job."""
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)

    def name(self, index: int) -> str:
        return self.names.get(index, f"generator {index}")

    def send(self, index: int, message: Message) -> None:
        try:
            self.socket.send_multipart([_identity(index), json.dumps(message).encode()])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # ROUTER_MANDATORY: the peer's connection is gone (its process died, or its node).
            raise PeerLost(
                f"{self.name(index)} is gone: its connection to trainer rank 0 closed ({exc})",
                tuple(self.tasks.get(i, -1) for i in [index] if i in self.tasks),
            ) from exc

    def broadcast(self, message: Message) -> None:
        for index in range(self.num_generators):
            self.send(index, message)

    def recv(self, timeout_s: float) -> tuple[int, Message] | None:
        """The next message and its sender's index, or None after `timeout_s`."""
        if not self.poller.poll(int(timeout_s * 1000)):
            return None
        identity, payload = self.socket.recv_multipart()
        return int(identity.decode().removeprefix("generator-")), json.loads(payload)

    def close(self) -> None:
        self.socket.close()
        self.context.term()


class ControlClient:
    """A generator's end: one DEALER socket connected to trainer rank 0."""

    def __init__(self, address: str, index: int) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, _identity(index))
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.connect(address)
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)

    def send(self, message: Message) -> None:
        self.socket.send(json.dumps(message).encode())

    def recv(self, timeout_s: float) -> Message | None:
        if not self.poller.poll(int(timeout_s * 1000)):
            return None
        return json.loads(self.socket.recv())

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def _identity(index: int) -> bytes:
    return f"generator-{index}".encode()


# ---------------------------------------------------------------------------------------------
# What travels


def group_to_wire(group: Group) -> Message:
    return {
        "group_id": group.group_id,
        "prompt_ids": list(group.prompt_ids),
        "samples": [
            {
                "token_ids": list(s.token_ids),
                "logprobs": list(s.logprobs),
                "finished": s.finished,
                "version_start": s.version_start,
                "version_end": s.version_end,
                **({"forced": list(s.forced)} if s.forced else {}),
            }
            for s in group.samples
        ],
    }


def group_from_wire(data: Message) -> Group:
    samples = tuple(
        Sample(
            token_ids=tuple(s["token_ids"]),
            logprobs=tuple(s["logprobs"]),
            finished=bool(s["finished"]),
            version_start=int(s["version_start"]),
            version_end=int(s["version_end"]),
            forced=tuple(int(i) for i in s.get("forced", ())),
        )
        for s in data["samples"]
    )
    return Group(str(data["group_id"]), tuple(data["prompt_ids"]), samples)


def meta_to_wire(meta: WeightMeta) -> list[list[Any]]:
    return [[name, dtype, list(shape)] for name, dtype, shape in meta]


def meta_from_wire(data: list[list[Any]]) -> WeightMeta:
    return tuple((str(name), str(dtype), tuple(int(n) for n in shape)) for name, dtype, shape in data)


def interrupt_to_wire(interrupt: Interrupt) -> Message:
    """A group's forced interruption: the phrase and one thinking budget per sample."""
    return {
        "close_id": interrupt.close_id,
        "phrase_ids": list(interrupt.phrase_ids),
        "budgets": [int(b) for b in interrupt.budget_B.tolist()],
    }


def interrupt_from_wire(data: Message | None) -> Interrupt | None:
    if data is None:
        return None
    import torch

    budgets = torch.tensor([int(b) for b in data["budgets"]], dtype=torch.long)
    return Interrupt(int(data["close_id"]), tuple(int(t) for t in data["phrase_ids"]), budgets)

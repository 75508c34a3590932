"""A stage's training state as one byte buffer, and its move from one process to another.

S3 moves a rank's parameters and optimizer state between processes while the job is paused
(GREYHOUND: pause, park, exchange peer-to-peer, resume). The state is taken as a tree of
``state_dict()`` values (module, optimizer, anything else with ``state_dict()`` /
``load_state_dict()``: an LR scheduler, a gradient scaler); its tensors are laid end to end in
one ``uint8`` buffer (each at a 16-byte boundary, so every dtype views back in place) and the
rest of the tree, with each tensor's dtype, shape and device type, is pickled beside it. One
transfer is then three messages, whatever the model: the two sizes, the description, the buffer.
The description only ever travels between processes of one job, which already trust each other
with pickles (``torch.distributed``'s own object collectives are pickles too).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from greyhound.integrations.topology import Transfer

_ALIGN = 16


@dataclass
class StageState:
    """What one rank trains: its stage's module, the optimizer over it, and other stateful objects
    (anything with ``state_dict()`` and ``load_state_dict()``) that must move with it."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "extras": {k: v.state_dict() for k, v in self.extras.items()}}

    def load_state_dict(self, tree: dict[str, Any]) -> None:
        """Strict: a missing or unexpected key, or a shape that differs, raises."""
        self.module.load_state_dict(tree["module"], strict=True)
        if (self.optimizer is None) != (tree["optimizer"] is None):
            raise ValueError("the received state and this stage disagree on having an optimizer")
        if self.optimizer is not None:
            self.optimizer.load_state_dict(tree["optimizer"])
        if set(self.extras) != set(tree["extras"]):
            raise ValueError(f"extras {sorted(tree['extras'])} received, {sorted(self.extras)} "
                             "expected")
        for k, v in self.extras.items():
            v.load_state_dict(tree["extras"][k])


class _Slot(NamedTuple):
    at: int


@dataclass(frozen=True, slots=True)
class _Spec:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    device_type: str


def pack(tree: Any, device: torch.device) -> tuple[bytes, torch.Tensor]:
    """``tree`` as (its pickled description, one uint8 buffer on ``device``)."""
    tensors: list[torch.Tensor] = []

    def strip(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            return _Slot(len(tensors) - 1)
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        if isinstance(x, list | tuple) and not isinstance(x, _Slot):
            out = [strip(v) for v in x]
            return out if isinstance(x, list) else tuple(out)
        return x

    skeleton = strip(tree)
    specs, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        specs.append(_Spec(str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes,
                           t.device.type))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    buf = torch.zeros(max(offset, 1), dtype=torch.uint8, device=device)  # never an empty message
    for t, s in zip(tensors, specs, strict=True):
        if s.nbytes:
            flat = t.to(device).contiguous().reshape(-1)
            buf[s.offset : s.offset + s.nbytes].copy_(flat.view(torch.uint8))
    return pickle.dumps((skeleton, specs), protocol=pickle.HIGHEST_PROTOCOL), buf


def unpack(meta: bytes, buf: torch.Tensor, device: torch.device) -> Any:
    """The tree :func:`pack` described; tensors own their memory, on the CPU where they were on
    the CPU (an optimizer's step counts) and on ``device`` otherwise."""
    skeleton, specs = pickle.loads(meta)  # a peer process of this job (module docstring)

    def tensor(s: _Spec) -> torch.Tensor:
        dtype = getattr(torch, s.dtype)
        raw = buf[s.offset : s.offset + s.nbytes]
        t = (raw.view(dtype) if s.nbytes else torch.empty(0, dtype=dtype, device=buf.device))
        t = t.reshape(s.shape).clone()
        return t.to("cpu" if s.device_type == "cpu" else device)

    def fill(x: Any) -> Any:
        if isinstance(x, _Slot):
            return tensor(specs[x.at])
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            out = [fill(v) for v in x]
            return out if isinstance(x, list) else tuple(out)
        return x

    return fill(skeleton)


def exchange(moves: Sequence[Transfer], me: int, state: StageState | None, *, group: Any,
             device: torch.device, timeout: timedelta) -> tuple[Any | None, int]:
    """Send this process's state to the process taking its rank, receive the state of the rank
    it takes; every process runs it with the same ``moves`` (each sends and receives at most
    once, so the messages of all pairs go at once). Returns (the received tree or None, bytes
    received). A peer that never answers raises after ``timeout``."""
    out = [m for m in moves if m.src == me]
    into = [m for m in moves if m.dst == me]
    packed = {m.dst: pack(state.state_dict(), device) for m in out} if out and state else {}
    if out and state is None:
        raise RuntimeError(f"process {me} holds no state to send")

    def run(ops: list[tuple[str, torch.Tensor, int, int]]) -> None:
        works = [(dist.isend if kind == "send" else dist.irecv)(t, peer, group=group, tag=tag)
                 for kind, t, peer, tag in ops]
        for w in works:
            if w is not None:
                w.wait(timeout)

    sizes_in = {m.src: torch.zeros(2, dtype=torch.int64, device=device) for m in into}
    run([("send", torch.tensor([len(packed[m.dst][0]), packed[m.dst][1].numel()],
                                dtype=torch.int64, device=device), m.dst, 1) for m in out]
        + [("recv", sizes_in[m.src], m.src, 1) for m in into])
    bufs_in = {src: (torch.empty(int(s[0]), dtype=torch.uint8, device=device),
                     torch.empty(int(s[1]), dtype=torch.uint8, device=device))
               for src, s in sizes_in.items()}
    ops: list[tuple[str, torch.Tensor, int, int]] = []
    for m in out:
        meta, buf = packed[m.dst]
        ops += [("send", torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device), m.dst, 2),
                ("send", buf, m.dst, 3)]
    for src, (meta_t, buf_t) in bufs_in.items():
        ops += [("recv", meta_t, src, 2), ("recv", buf_t, src, 3)]
    run(ops)
    if not into:
        return None, 0
    meta_t, buf_t = bufs_in[into[0].src]
    return unpack(bytes(meta_t.cpu().numpy().tobytes()), buf_t, device), int(buf_t.numel())

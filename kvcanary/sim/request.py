"""A request of the simulated engine: its tokens, its KV slots and where it is in its life."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvcanary.format import oracle_token


class State(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted and waiting for re-admission)
    PREFILL = "prefill"  # admitted, prompt not fully prefilled yet (chunked prefill)
    RUNNING = "running"  # decoding
    FINISHED = "finished"  # reached max_new (released, or release deferred past the in-flight forward)
    ABORTED = "aborted"  # aborted by the client, or failed by the engine (``Request.error`` says why)


@dataclass(eq=False)
class Request:
    """One request.

    Attributes:
        rid: request id (the token oracle's request id and the canary's writer id).
        prompt: prompt tokens; outputs follow in ``tokens``.
        max_new: output tokens wanted.
        arrival: step the request arrives at.
        abort_at: step the client aborts it (None: never).
        vocab: vocabulary of the token oracle.
        tokens: prompt + outputs known so far (the last output has no KV yet while decoding).
        slots: full-pool slot of each position with KV, in position order (the engine's
            copy of its ``req_to_token`` row).
        row: its ``req_to_token`` row (0 = none).
        cached_len: leading positions whose slots the prefix cache owns (locked through ``last_node``).
        last_node: deepest prefix-cache node it holds a lock reference on.
        swa_evicted: own positions below this have had their SWA slots freed (window eviction).
    """

    rid: int
    prompt: list[int]
    max_new: int
    arrival: int = 0
    abort_at: int | None = None
    vocab: int = 32000
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    row: int = 0
    cached_len: int = 0
    last_node: object | None = None
    swa_evicted: int = 0
    state: State = State.WAITING
    freed: bool = False  # its KV and row were given back (release); a request is freed once
    retractions: int = 0
    done_step: int | None = None
    error: str | None = None  # why the engine failed it (the canary's abort); its output ends there

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def kv_len(self) -> int:
        """Positions whose KV exists (the prefix length of its next forward)."""
        return len(self.slots)

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def aborted(self) -> bool:
        return self.state is State.ABORTED

    @property
    def released(self) -> bool:
        return self.state in (State.FINISHED, State.ABORTED)

    def truth(self, position: int) -> int:
        """The token that belongs at ``position``: the prompt, then the token oracle's outputs."""
        if position < len(self.prompt):
            return self.prompt[position]
        return oracle_token(self.rid, position, self.vocab)

    def token_at(self, position: int) -> int:
        """The engine's token at ``position`` (its last token past the end: planted bugs can desync)."""
        if 0 <= position < len(self.tokens):
            return self.tokens[position]
        return self.tokens[-1]

    def reset_kv(self) -> None:
        """Forget KV bookkeeping (retraction: the request is recomputed on re-admission)."""
        self.slots = []
        self.row = 0
        self.cached_len = 0
        self.last_node = None
        self.swa_evicted = 0
        self.freed = False

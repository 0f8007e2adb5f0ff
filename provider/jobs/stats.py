"""Serving counters shared by the jobs (which update them) and the heartbeat (which reports them).

Cumulative for the life of the process, never reset on reconnect: the coordinator adds the delta
between heartbeats and reads a decrease as a restart. Touched only on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import HeartbeatStats


@dataclass(slots=True)
class ServingStats:
    requests_served: int = 0
    tokens_generated: int = 0
    cancellations_received: int = 0
    cancellations_before_output: int = 0
    generation_errors_after_output: int = 0
    in_flight: dict[str, str] = field(default_factory=dict)  # accepted request id -> model id, in order

    def accepted(self, request_id: str, model_id: str) -> None:
        self.in_flight[request_id] = model_id

    def ended(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)

    def completed(self, completion_tokens: int) -> None:
        self.requests_served += 1
        self.tokens_generated += completion_tokens

    @property
    def serving(self) -> bool:
        return bool(self.in_flight)

    @property
    def active_model(self) -> str | None:
        """The model of the most recently accepted request still in flight."""
        return next(reversed(self.in_flight.values()), None)

    def wire(self) -> HeartbeatStats:
        return HeartbeatStats(
            requests_served=self.requests_served,
            tokens_generated=self.tokens_generated,
            cancellations_received=self.cancellations_received,
            cancellations_before_output=self.cancellations_before_output,
            generation_errors_after_output=self.generation_errors_after_output,
        )


__all__ = ["ServingStats"]

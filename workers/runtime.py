"""Runs the engine for the jobs RQ hands over, and publishes the engine's events on pub/sub.

Events are grouped by reply channel and sent once per decode step in one pipeline. Before each step
the cancel flags of the live requests are read in one round trip.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import redis

from schemas.job import Event, JobPayload, encode_events
from schemas.keys import cancel_key
from workers.engine import Engine

logger = logging.getLogger(__name__)


class Runtime:
    def __init__(self, engine: Engine, connection: redis.Redis) -> None:
        self.engine = engine
        self.connection = connection
        self.channels: dict[str, str] = {}

    def run(self, payload: JobPayload) -> dict[str, Any]:
        """Generate one request to its end; return the summary RQ stores as the job result."""
        request_id = payload.request_id
        self.channels[request_id] = payload.reply_channel
        logger.info("start request_id=%s prompt_tokens=%d", request_id, len(payload.prompt_token_ids))
        summary: dict[str, Any] = {"finish_reason": None}
        try:
            if self.connection.exists(cancel_key(request_id)):
                self.publish(self.engine.cancel(request_id) or [Event(request_id, 0, "cancelled")])
                return {"finish_reason": "cancelled"}
            self.engine.add_request(payload)
            while request_id in self.engine.requests:
                events = self._cancel_flagged()
                events += self.engine.step()
                self.publish(events)
                for event in events:
                    if event.request_id == request_id and event.final:
                        summary = {"finish_reason": event.finish_reason or event.kind}
                        if event.usage:
                            summary["usage"] = event.usage.to_dict()
        except Exception as exc:
            logger.exception("generation failed request_id=%s", request_id)
            self.publish(self.engine.fail_all(f"generation failed: {type(exc).__name__}"))
            raise
        finally:
            self.channels.pop(request_id, None)
        logger.info("end request_id=%s %s", request_id, summary)
        return summary

    def _cancel_flagged(self) -> list[Event]:
        """Drop the requests whose client has gone; return their final events."""
        ids = list(self.engine.requests)
        pipe = self.connection.pipeline(transaction=False)
        for request_id in ids:
            pipe.exists(cancel_key(request_id))
        events: list[Event] = []
        for request_id, flagged in zip(ids, pipe.execute(), strict=True):
            if flagged:
                logger.info("cancelled request_id=%s", request_id)
                events += self.engine.cancel(request_id)
        return events

    def publish(self, events: list[Event]) -> None:
        if not events:
            return
        by_channel: dict[str, list[Event]] = defaultdict(list)
        for event in events:
            channel = self.channels.get(event.request_id)
            if channel:
                by_channel[channel].append(event)
        pipe = self.connection.pipeline(transaction=False)
        for channel, batch in by_channel.items():
            pipe.publish(channel, encode_events(batch))
        pipe.execute()

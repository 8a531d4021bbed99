"""When a lost device link may be tried again: exponential backoff between reconnect attempts, with an optional limit.

Why one object: the serial gripper (its port) and the OpenCV camera (its device) recover the same way, and each
kept the same three fields and the same doubling; this holds them once. The settings are read from the device's
config at each use (`reconnect_backoff_s`, `reconnect_backoff_max_s`, `max_reconnect_attempts`, the same names in
both configs), so a config changed on a live device takes effect as before. Times are the caller's clock, so a
SimClock drives it as the wall clock does; the caller decides which `now` an attempt's spacing starts from (the
gripper the attempt's start, the camera its end: a USB camera's open can outlast the first steps).
"""

from __future__ import annotations

from typing import Protocol


class BackoffSettings(Protocol):
    reconnect_backoff_s: float  # first wait; doubles per failed attempt
    reconnect_backoff_max_s: float
    max_reconnect_attempts: int | None  # an outage's attempts; None: keep trying


class ReconnectBackoff:
    """The wait before the next attempt, when it is due, and the attempts of the current outage."""

    def __init__(self, settings: BackoffSettings) -> None:
        self.settings = settings
        self.delay_s = settings.reconnect_backoff_s
        self.next_t = 0.0  # clock time the next attempt is due
        self.attempts = 0  # attempts since the link was lost

    def lost(self, now: float) -> None:
        """The link just went: the first attempt is due one first wait from `now`."""
        self.attempts, self.delay_s = 0, self.settings.reconnect_backoff_s
        self.next_t = now + self.delay_s

    def gave_up(self) -> bool:
        limit = self.settings.max_reconnect_attempts
        return limit is not None and self.attempts >= limit

    def wait_s(self, now: float) -> float:
        """Seconds until the next attempt is due (0 when it is)."""
        return max(0.0, self.next_t - now)

    def attempt(self) -> int:
        """Counts an attempt about to be made; returns its number in this outage (1, 2, ...)."""
        self.attempts += 1
        return self.attempts

    def failed(self, now: float) -> None:
        """That attempt failed: the wait doubles (up to the most), counted from `now`."""
        self.delay_s = min(self.delay_s * 2, self.settings.reconnect_backoff_max_s)
        self.next_t = now + self.delay_s

    def succeeded(self) -> None:
        self.delay_s = self.settings.reconnect_backoff_s

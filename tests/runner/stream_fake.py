"""The FakeEngine with ``generate_stream`` (the real Engine's streaming API), for the tests of the
streaming runner: the threaded writer and the feeder reading ahead.

It holds at most ``batch`` requests "running", pulls more from the source without waiting while
it has some (as the real engine does) and finishes one per "step". ``kill_after``: SIGKILL this
process right after that many results (``before_kill`` runs first: the tests record the feeder's
and writer's state there).
"""
from __future__ import annotations

import os
import signal

from fake_engine import FakeEngine


class StreamingFakeEngine(FakeEngine):
    batch = 3
    kill_after = 0
    before_kill = None
    emitted = 0
    max_units_in_flight = 0  # most distinct units among the running requests at once

    def generate_stream(self, source, on_result):
        running, ended = [], False
        while True:
            if not ended and len(running) < self.batch:
                got = source.take(self.batch - len(running), wait=not running)
                if got is None:
                    ended = True
                else:
                    running += got
            if not running:
                if ended:
                    return
                continue
            units = {r.request_id[0] for r in running}
            StreamingFakeEngine.max_units_in_flight = max(StreamingFakeEngine.max_units_in_flight, len(units))
            req = running.pop(0)
            self.generate([req], on_result)
            StreamingFakeEngine.emitted += 1
            if self.kill_after and StreamingFakeEngine.emitted >= self.kill_after:
                if self.before_kill is not None:
                    self.before_kill()
                os.kill(os.getpid(), signal.SIGKILL)

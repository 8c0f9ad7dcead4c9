"""A child process that streams one completion and, once its first data line has come, sends one other request.

tests/integration/test_engine_inflight.py needs a marked request to reach the engine while a long stream runs.
Sent from the test's own process, it waited for the interpreter's lock behind the in-process gateway relaying
that stream and the thread reading it: on 2 cores it left up to 2.5 s into a 3.5 s stream (from a process of its
own, as here, in tens of milliseconds).

Usage: ``python stream_then_signal.py SPEC`` with SPEC a JSON object ``{"stream": {"url", "body"}, "signal":
{"url", "body", "headers"}}``. Prints one JSON line when the signal is answered, ``{"signal": {"status",
"headers"}}``, and one when the stream has ended, ``{"stream": {"status", "headers", "lines"}}``.
"""

from __future__ import annotations

import json
import sys

import httpx


def main(spec: dict) -> None:
    stream, signal = spec["stream"], spec["signal"]
    with httpx.Client(timeout=300) as http, http.stream("POST", stream["url"], json=stream["body"]) as r:
        lines: list[str] = []
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 1:
                answer = http.post(signal["url"], json=signal["body"], headers=signal["headers"])
                report({"signal": {"status": answer.status_code, "headers": dict(answer.headers)}})
        report({"stream": {"status": r.status_code, "headers": dict(r.headers), "lines": lines}})


def report(message: dict) -> None:
    print(json.dumps(message), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

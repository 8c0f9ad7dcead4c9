"""How ``streamrl engine`` hands the gateway a completion's tokens: the framed response, both sides of it.

The gateway needs, for every choice, the prompt's token ids, the sampled token ids and their sampling
logprobs. Asking vLLM's OpenAI server for them (``logprobs`` + ``return_token_ids``) makes it build a
JSON object per sampled token, which halved its generation speed on an H200 (docs/benchmarks.md). An
engine started by ``streamrl engine`` carries ``streamrl.engine.capture.CaptureMiddleware`` instead, which
takes the arrays from the engine's output before any per-token object is made, and sends them beside
vLLM's own response bytes:

* The gateway asks ``GET /streamrl/capture`` once per upstream: 200 (with the format version) means the
  upstream speaks this protocol, anything else means a plain vLLM (the gateway then asks for logprobs and
  token ids in the JSON, the slow path).
* A chat or completions request carrying the header ``X-Streamrl-Capture: 1`` is served by vLLM as if the
  header were absent. A 200 answer then carries ``X-Streamrl-Capture: 1`` too, and its body is a sequence
  of frames: ``kind`` (1 byte) + ``length`` (uint32 LE) + payload. ``B`` frames hold vLLM's response bytes
  exactly as it sent them (for a stream, its server-sent events); one ``C`` frame holds the capture, sent
  before the body bytes that end the response (for a stream, before ``data: [DONE]``), and only when every
  choice finished. Error answers are vLLM's, unframed.

Capture payload (little-endian)::

    u8  format version (1)
    u32 number of distinct prompts P; P times: u32 length L, L x int32 token ids
    u32 number of choices C;  C times: u32 choice index, u32 prompt slot (< P), u32 length N,
                                       N x int32 sampled token ids, N x float32 sampling logprobs

8 bytes per sampled token plus 4 per prompt token once per prompt: no JSON, no base64.

Format 2 (sent only to a request that carried ``X-Streamrl-Follow: 1``, the gateway's in-flight update mode,
``engine/inflight.py``) adds after each choice's logprobs its version spans: ``u32 S``, then ``S`` times
``u32 first token index, u32 adapter version`` (0: the base model), in token order, the first at index 0.

**Deferred capture** (non-streamed answers; the probe says ``"deferred": true``). A gateway that logs through
a record-producer process of its own need not carry the capture (and a copy of the body) through its event
loop at all: it asks with ``X-Streamrl-Capture: defer=<consumer>`` (``consumer``: its producer process's id,
``[A-Za-z0-9_-]``, at most 64 characters). The engine then answers exactly as vLLM does (same headers, same
body, unframed) plus ``X-Streamrl-Capture: deferred <token> <choices> <prompt tokens> <completion tokens>``
(``none`` instead when it has no capture to give), and queues a ``D`` frame for the consumer, which reads
them on a long-lived ``GET /streamrl/capture/stream?consumer=<consumer>`` (one reader per consumer; a new one
replaces the old). ``D`` payload: u16 token length, the token (ASCII), u32 body length, vLLM's body, the
capture payload. While nothing is queued the stream sends an empty ``H`` frame every few seconds, so that a
reader sees a dead connection. A streamed answer, or an engine with several API server processes (the
stream could reach another process than the answer), is framed as above and says ``1``.
"""

from __future__ import annotations

import itertools
import re
import struct
from dataclasses import dataclass

import numpy as np

PROBE_PATH = "/streamrl/capture"
CAPTURE_HEADER = "X-Streamrl-Capture"
FORMAT_VERSION = 1
SPANS_FORMAT_VERSION = 2
"""The capture format with per-choice version spans (in-flight updates); the probe lists both."""
FORMATS = (FORMAT_VERSION, SPANS_FORMAT_VERSION)
FOLLOW_HEADER = "X-Streamrl-Follow"
"""Request header: the request may move to its policy's newest version while it runs (``engine/inflight.py``);
its capture comes in format 2. Its value is the cache policy at a move: :data:`FOLLOW_KEEP` keeps the KV cache
of the tokens so far, :data:`FOLLOW_RECOMPUTE` computes it again under the new adapter."""
FOLLOW_KEEP, FOLLOW_RECOMPUTE = "1", "recompute"
CAPTURE_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

BODY = b"B"
CAPTURE = b"C"
DEFERRED = b"D"
HEARTBEAT = b"H"
STREAM_PATH = "/streamrl/capture/stream"
DEFER_PREFIX = "defer="
DEFERRED_ANSWER = "deferred"
NO_CAPTURE = "none"
_CONSUMER = re.compile(r"[A-Za-z0-9_-]{1,64}")
_U16 = struct.Struct("<H")
_FRAME = struct.Struct("<cI")
_U32 = struct.Struct("<I")
_CHOICE = struct.Struct("<III")
_SPAN = struct.Struct("<II")


class WireError(ValueError):
    """A framed body or capture payload that is not in this format."""


@dataclass(slots=True)
class ChoiceTokens:
    """One choice's token-level record as the engine saw it."""

    index: int
    prompt_token_ids: np.ndarray
    """int32."""
    token_ids: np.ndarray
    """int32, the sampled tokens exactly as vLLM returns them."""
    logprobs: np.ndarray
    """float32, ``logprobs[i]`` of ``token_ids[i]`` under the distribution sampled from."""
    version_spans: list[tuple[int, int]] | None = None
    """``[(first token index, adapter version), ...]`` (format 2); None: format 1, no spans sent."""


def frame(kind: bytes, payload: bytes) -> bytes:
    return _FRAME.pack(kind, len(payload)) + payload


def encode_capture(prompts: list[np.ndarray], choices: list[tuple[int, int, np.ndarray, np.ndarray]],
                   spans: list[list[tuple[int, int]]] | None = None) -> bytes:
    """``prompts``: distinct prompts' int32 ids; ``choices``: (index, prompt slot, int32 ids, float32 logprobs);
    ``spans``: each choice's version spans (format 2), or None (format 1)."""
    parts = [bytes((FORMAT_VERSION if spans is None else SPANS_FORMAT_VERSION,)), _U32.pack(len(prompts))]
    for ids in prompts:
        parts += (_U32.pack(len(ids)), np.ascontiguousarray(ids, "<i4").tobytes())
    parts.append(_U32.pack(len(choices)))
    for i, (index, slot, ids, logprobs) in enumerate(choices):
        if len(ids) != len(logprobs):
            raise WireError(f"choice {index}: {len(ids)} token ids but {len(logprobs)} logprobs")
        parts += (_CHOICE.pack(index, slot, len(ids)), np.ascontiguousarray(ids, "<i4").tobytes(),
                  np.ascontiguousarray(logprobs, "<f4").tobytes())
        if spans is not None:
            parts.append(_U32.pack(len(spans[i])))
            parts += [_SPAN.pack(first, version) for first, version in spans[i]]
    return b"".join(parts)


def decode_capture(payload: bytes) -> list[ChoiceTokens]:
    """The choices of a capture payload, in the order sent; ``WireError`` on anything malformed."""
    try:
        return _decode_capture(memoryview(payload))
    except (struct.error, ValueError) as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"malformed capture: {exc}") from None


def _decode_capture(buf: memoryview) -> list[ChoiceTokens]:
    if len(buf) < 1 or buf[0] not in FORMATS:
        raise WireError(f"unknown capture format {buf[0] if len(buf) else None}")
    with_spans = buf[0] == SPANS_FORMAT_VERSION
    pos = 1
    (n_prompts,) = _U32.unpack_from(buf, pos)
    pos += 4
    prompts = []
    for _ in range(n_prompts):
        (n,) = _U32.unpack_from(buf, pos)
        pos += 4
        prompts.append(np.frombuffer(buf, "<i4", n, pos))
        pos += 4 * n
    (n_choices,) = _U32.unpack_from(buf, pos)
    pos += 4
    out = []
    for _ in range(n_choices):
        index, slot, n = _CHOICE.unpack_from(buf, pos)
        pos += _CHOICE.size
        if slot >= len(prompts):
            raise WireError(f"choice {index}: prompt slot {slot} of {len(prompts)}")
        ids = np.frombuffer(buf, "<i4", n, pos)
        logprobs = np.frombuffer(buf, "<f4", n, pos + 4 * n)
        pos += 8 * n
        spans = None
        if with_spans:
            (count,) = _U32.unpack_from(buf, pos)
            pos += 4
            spans = [_SPAN.unpack_from(buf, pos + _SPAN.size * k) for k in range(count)]
            pos += _SPAN.size * count
            if not spans or spans[0][0] != 0 or any(b[0] < a[0] for a, b in itertools.pairwise(spans)) \
                    or spans[-1][0] > max(n - 1, 0):
                raise WireError(f"choice {index}: version spans {spans} do not cover its {n} tokens in order")
        out.append(ChoiceTokens(index, prompts[slot], ids, logprobs, spans))
    if pos != len(buf):
        raise WireError(f"{len(buf) - pos} bytes after the last choice")
    return out


def _split(buf: bytes | bytearray, kinds: tuple[bytes, ...] = (BODY, CAPTURE)) -> tuple[list[tuple[bytes, bytes]], int]:
    """The whole frames at the start of ``buf`` (each payload copied once) and where the rest begins."""
    view = memoryview(buf)
    frames = []
    pos, size = 0, len(buf)
    try:
        while size - pos >= _FRAME.size:
            kind, length = _FRAME.unpack_from(buf, pos)
            if kind not in kinds:
                raise WireError(f"unknown frame kind {kind!r}")
            end = pos + _FRAME.size + length
            if end > size:
                break
            frames.append((kind, bytes(view[pos + _FRAME.size:end])))
            pos = end
    finally:
        view.release()  # a bytearray with an exported view cannot be resized
    return frames, pos


class FrameSplitter:
    """Cuts a framed body, fed in whatever chunks the connection delivers, into (kind, payload) frames:
    an answer's ``B`` and ``C`` frames, or (``stream=True``) a capture stream's ``D`` and ``H`` frames."""

    __slots__ = ("_buffer", "_kinds")

    def __init__(self, stream: bool = False) -> None:
        self._buffer = bytearray()
        self._kinds = (DEFERRED, HEARTBEAT) if stream else (BODY, CAPTURE)

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        buf = self._buffer
        buf += data
        frames, pos = _split(buf, self._kinds)
        if pos:
            del buf[:pos]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an unfinished frame (non-zero at the end of a body: it was cut off)."""
        return len(self._buffer)


def unframe(raw: bytes) -> tuple[bytes, bytes | None]:
    """A whole framed body: (vLLM's bytes, the capture payload or ``None``); ``WireError`` if cut off or
    malformed. Read in place (a non-streamed answer: one ``B`` and one ``C`` frame, one copy of each)."""
    frames, pos = _split(raw)
    if pos != len(raw):
        raise WireError(f"framed body cut off ({len(raw) - pos} bytes of an unfinished frame)")
    body = [p for k, p in frames if k == BODY]
    capture = [p for k, p in frames if k == CAPTURE]
    if len(capture) > 1:
        raise WireError(f"{len(capture)} capture frames")
    return (body[0] if len(body) == 1 else b"".join(body)), (capture[0] if capture else None)


def capture_counts(payload: bytes) -> tuple[int, int, int]:
    """(choices, prompt tokens, completion tokens) of a capture payload, read from its lengths alone (the
    request path's metrics; the producer decodes the arrays). ``WireError`` if malformed."""
    try:
        if not payload or payload[0] not in FORMATS:
            raise WireError("unknown capture format")
        with_spans = payload[0] == SPANS_FORMAT_VERSION
        pos, prompt = 1, 0
        (n_prompts,) = _U32.unpack_from(payload, pos)
        pos += 4
        for _ in range(n_prompts):
            (n,) = _U32.unpack_from(payload, pos)
            prompt += n
            pos += 4 + 4 * n
        (n_choices,) = _U32.unpack_from(payload, pos)
        pos += 4
        completion = 0
        for _ in range(n_choices):
            _, _, n = _CHOICE.unpack_from(payload, pos)
            completion += n
            pos += _CHOICE.size + 8 * n
            if with_spans:
                (count,) = _U32.unpack_from(payload, pos)
                pos += 4 + _SPAN.size * count
    except struct.error as exc:
        raise WireError(f"malformed capture: {exc}") from None
    if pos != len(payload):
        raise WireError("capture lengths do not add up")
    return n_choices, prompt, completion


def valid_consumer(consumer: str) -> bool:
    return _CONSUMER.fullmatch(consumer) is not None


def deferred_header(token: str, counts: tuple[int, int, int]) -> str:
    """The answer's ``X-Streamrl-Capture`` value for a capture queued under ``token``."""
    return f"{DEFERRED_ANSWER} {token} {counts[0]} {counts[1]} {counts[2]}"


def parse_deferred_header(value: str) -> tuple[str, tuple[int, int, int]] | None:
    """(token, (choices, prompt tokens, completion tokens)) of a ``deferred`` answer's header; ``None`` for
    ``none`` or anything malformed (the gateway counts the call invalid)."""
    parts = value.split(" ")
    if len(parts) != 5 or parts[0] != DEFERRED_ANSWER:
        return None
    try:
        counts = (int(parts[2]), int(parts[3]), int(parts[4]))
    except ValueError:
        return None
    return parts[1], counts


def deferred_frame(token: str, body: bytes, capture: bytes) -> bytes:
    """A ``D`` frame: the token, vLLM's body and the capture payload."""
    t = token.encode("ascii")
    return frame(DEFERRED, b"".join((_U16.pack(len(t)), t, _U32.pack(len(body)), body, capture)))


def decode_deferred(payload: bytes) -> tuple[str, bytes, bytes]:
    """(token, body, capture payload) of a ``D`` frame's payload; ``WireError`` if malformed."""
    try:
        (n,) = _U16.unpack_from(payload, 0)
        token = payload[2:2 + n].decode("ascii")
        (size,) = _U32.unpack_from(payload, 2 + n)
    except (struct.error, UnicodeDecodeError) as exc:
        raise WireError(f"malformed deferred frame: {exc}") from None
    start = 6 + n
    if len(token) != n or start + size > len(payload):
        raise WireError("deferred frame cut off")
    return token, payload[start:start + size], payload[start + size:]

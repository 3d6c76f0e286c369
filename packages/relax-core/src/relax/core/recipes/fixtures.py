"""Tiny media for fixture rows, written with the standard library (no imaging or audio package): PNG images
of a few dark squares and 16 kHz mono WAV tones. Fixture rows exist to push each converter through the
dataset's real schema offline (tests, ``relax data prepare --smoke``); the pictures only need to decode."""

from __future__ import annotations

import io
import math
import struct
import wave
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def squares_png(count: int, size: int = 56) -> bytes:
    """A white ``size`` x ``size`` RGB PNG with ``count`` dark 10-pixel squares along its diagonal."""
    pixels = [[(255, 255, 255)] * size for _ in range(size)]
    for k in range(count):
        top = 4 + 12 * k
        for y in range(top, min(top + 10, size)):
            for x in range(top, min(top + 10, size)):
                pixels[y][x] = (30, 30, 30)
    raw = b"".join(b"\x00" + bytes(c for px in line for c in px) for line in pixels)  # filter 0 per scanline
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw))
        + _chunk(b"IEND", b"")
    )


def tone_wav(hz: float, seconds: float = 0.5, rate: int = 16000) -> bytes:
    """A mono 16-bit WAV of a sine at ``hz``."""
    frames = b"".join(
        struct.pack("<h", int(9000 * math.sin(2 * math.pi * hz * i / rate)))
        for i in range(int(seconds * rate))
    )
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(frames)
    return buf.getvalue()

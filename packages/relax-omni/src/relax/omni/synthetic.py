"""A small generated media task with verifiable answers (examples, tests and the bench; nothing committed).

Three kinds, each answered with a number so the built-in ``numeric`` reward checks it:
- image: circles and squares drawn on a canvas -- "how many circles?" (1..4)
- audio: two tones one after the other -- "which tone is higher, 1 or 2?"
- video: a dot moving across a few frames -- "does the dot move left (1) or right (2)?"
Prompts use only lowercase letters, digits and simple punctuation (the tiny test tokenizers' alphabet).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

QUESTIONS = {
    "image": "how many circles?",
    "audio": "which tone is higher, 1 or 2?",
    "video": "does the dot move left 1 or right 2?",
}


def circles_image(path: str | Path, circles: int, seed: int = 0, size: tuple[int, int] = (112, 84)) -> None:
    """A PNG with ``circles`` red circles and a few blue squares (distractors), none overlapping."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    cells = [(x, y) for x in range(0, size[0] - 27, 28) for y in range(0, size[1] - 27, 28)]
    rng.shuffle(cells)
    for i, (x, y) in enumerate(cells[: circles + rng.randint(0, 2)]):
        box = (x + 4, y + 4, x + 24, y + 24)
        (draw.ellipse if i < circles else draw.rectangle)(box, fill="red" if i < circles else "blue")
    img.save(path)


def two_tones(path: str | Path, first_hz: float, second_hz: float, seconds: float = 0.5, rate: int = 16000) -> None:
    """A mono WAV: ``first_hz`` then ``second_hz``, ``seconds`` each."""
    import numpy as np
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    wave = np.concatenate([np.sin(2 * np.pi * first_hz * t), np.sin(2 * np.pi * second_hz * t)])
    sf.write(str(path), (0.3 * wave).astype(np.float32), rate)


def moving_dot_video(path: str | Path, right: bool, frames: int = 8, size: int = 64, fps: int = 4,
                     tone_hz: float | None = None) -> None:
    """An MP4 (mpeg4) of a black dot crossing a white frame; with ``tone_hz`` also an AAC soundtrack."""
    import av
    import numpy as np

    with av.open(str(path), "w") as out:
        video = out.add_stream("mpeg4", rate=fps)
        video.width = video.height = size
        video.pix_fmt = "yuv420p"
        audio = None
        if tone_hz is not None:
            audio = out.add_stream("aac", rate=16000)
            audio.layout = "mono"
        step = (size - 16) // max(1, frames - 1)
        for i in range(frames):
            x = 4 + (i if right else frames - 1 - i) * step
            frame = np.full((size, size, 3), 255, np.uint8)
            frame[size // 2 - 4: size // 2 + 4, x: x + 8] = 0
            out.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(video.encode())
        if audio is not None:
            t = np.arange(16000 * frames // fps) / 16000
            samples = (0.3 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)[None]
            chunk = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            chunk.sample_rate = 16000
            out.mux(audio.encode(chunk))
            out.mux(audio.encode())


def make_row(kind: str, index: int, directory: Path, rng: random.Random) -> dict[str, Any]:
    """Write one media file under ``directory`` and return its dataset row (path relative to it)."""
    if kind == "image":
        answer = rng.randint(1, 4)
        name = f"image_{index}.png"
        circles_image(directory / name, answer, seed=rng.randrange(1 << 30))
    elif kind == "audio":
        low, high = sorted(rng.sample([220.0, 330.0, 440.0, 550.0, 660.0], 2))
        answer = rng.randint(1, 2)
        name = f"audio_{index}.wav"
        two_tones(directory / name, *((high, low) if answer == 1 else (low, high)))
    elif kind == "video":
        answer = rng.randint(1, 2)
        name = f"video_{index}.mp4"
        moving_dot_video(directory / name, right=answer == 2)
    else:
        raise ValueError(f"unknown media kind {kind!r}; choose image, audio or video")
    content = [{"type": kind, kind: name}, {"type": "text", "text": QUESTIONS[kind]}]
    return {"prompt": [{"role": "user", "content": content}], "label": str(answer)}


def make_dataset(directory: str | Path, kinds: tuple[str, ...], rows: int, seed: int = 0,
                 name: str = "train.jsonl") -> Path:
    """``rows`` rows cycling through ``kinds``, media files beside the JSONL; returns the JSONL path."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = [json.dumps(make_row(kinds[i % len(kinds)], i, out, rng)) for i in range(rows)]
    path = out / name
    path.write_text("\n".join(lines) + "\n")
    return path

"""Small generated media tasks with verifiable answers (examples, tests and the bench; nothing committed).

Each row is answered with a number so the built-in ``numeric`` reward checks it. Per media kind, a task
that exercises the loaders (the default for that kind) and one a tiny model learns to read in minutes
(the quick-starts', chosen so a policy that ignores the media stays at 1/3 or 1/2):
- image: circles and squares -- "how many circles?" (1..4); ``colour``: one big shape -- red 1, green 2, blue 3
- audio: two tones one after the other -- "which tone is higher, 1 or 2?"; ``pitch``: one tone -- low 1,
  middle 2, high 3
- video: a dot moving across a few frames -- "left 1 or right 2?"; ``fade``: the frame darkens 1 or
  lightens 2 (a temporal property: both videos have the same mean brightness)
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
    "colour": "what colour is the shape? red 1, green 2 or blue 3?",
    "pitch": "is the tone low 1, middle 2 or high 3?",
    "fade": "does it get darker 1 or lighter 2?",
}
OPTIONS = {
    "image": 4,
    "audio": 2,
    "video": 2,
    "colour": 3,
    "pitch": 3,
    "fade": 2,
}  # answers are 1..OPTIONS[task]
KIND = {"colour": "image", "pitch": "audio", "fade": "video"}  # learnable task -> its media kind
COLOURS = ((220, 40, 40), (40, 170, 40), (40, 60, 220))  # red, green, blue: answers 1, 2, 3
PITCHES_HZ = ((200.0, 260.0), (600.0, 800.0), (1800.0, 2400.0))  # low, middle, high: answers 1, 2, 3


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


def two_tones(
    path: str | Path, first_hz: float, second_hz: float, seconds: float = 0.5, rate: int = 16000
) -> None:
    """A mono WAV: ``first_hz`` then ``second_hz``, ``seconds`` each."""
    import numpy as np
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    wave = np.concatenate([np.sin(2 * np.pi * first_hz * t), np.sin(2 * np.pi * second_hz * t)])
    sf.write(str(path), (0.3 * wave).astype(np.float32), rate)


def moving_dot_video(
    path: str | Path, right: bool, frames: int = 8, size: int = 64, fps: int = 4, tone_hz: float | None = None
) -> None:
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
            frame[size // 2 - 4 : size // 2 + 4, x : x + 8] = 0
            out.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(video.encode())
        if audio is not None:
            t = np.arange(16000 * frames // fps) / 16000
            samples = (0.3 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)[None]
            chunk = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            chunk.sample_rate = 16000
            out.mux(audio.encode(chunk))
            out.mux(audio.encode())


def colour_image(
    path: str | Path, colour: tuple[int, int, int], seed: int = 0, size: tuple[int, int] = (56, 56)
) -> None:
    """A PNG of one large shape (circle or square, random place and size) in ``colour`` on a light background."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    grey = rng.randint(225, 255)
    img = Image.new("RGB", size, (grey, grey, grey))
    side = rng.randint(min(size) * 3 // 4, min(size) - 2)
    x, y = rng.randint(0, size[0] - side), rng.randint(0, size[1] - side)
    jitter = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in colour)
    draw = ImageDraw.Draw(img)
    (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x, y, x + side, y + side), fill=jitter)
    img.save(path)


def tone(path: str | Path, hz: float, seconds: float = 0.6, rate: int = 16000) -> None:
    """A mono WAV of one sine tone."""
    two_tones(path, hz, hz, seconds=seconds / 2, rate=rate)


def fading_video(path: str | Path, lighter: bool, frames: int = 8, size: int = 56, fps: int = 4) -> None:
    """An MP4 (mpeg4) whose grey frame brightens (``lighter``) or darkens step by step, from 40 to 215."""
    import av
    import numpy as np

    levels = np.linspace(40, 215, frames).round().astype(np.uint8)
    with av.open(str(path), "w") as out:
        video = out.add_stream("mpeg4", rate=fps)
        video.width = video.height = size
        video.pix_fmt = "yuv420p"
        for level in levels if lighter else levels[::-1]:
            frame = np.full((size, size, 3), level, np.uint8)
            out.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(video.encode())


def _write_media(task: str, index: int, directory: Path, rng: random.Random) -> tuple[str, int]:
    """Write one media file for ``task`` under ``directory``: (its file name, the answer)."""
    if task == "image":
        answer = rng.randint(1, 4)
        name = f"image_{index}.png"
        circles_image(directory / name, answer, seed=rng.randrange(1 << 30))
    elif task == "audio":
        low, high = sorted(rng.sample([220.0, 330.0, 440.0, 550.0, 660.0], 2))
        answer = rng.randint(1, 2)
        name = f"audio_{index}.wav"
        two_tones(directory / name, *((high, low) if answer == 1 else (low, high)))
    elif task == "video":
        answer = rng.randint(1, 2)
        name = f"video_{index}.mp4"
        moving_dot_video(directory / name, right=answer == 2)
    elif task == "colour":
        answer = rng.randint(1, 3)
        name = f"colour_{index}.png"
        colour_image(directory / name, COLOURS[answer - 1], seed=rng.randrange(1 << 30))
    elif task == "pitch":
        answer = rng.randint(1, 3)
        name = f"pitch_{index}.wav"
        tone(directory / name, rng.uniform(*PITCHES_HZ[answer - 1]), seconds=rng.uniform(0.5, 0.8))
    elif task == "fade":
        answer = rng.randint(1, 2)
        name = f"fade_{index}.mp4"
        fading_video(directory / name, lighter=answer == 2)
    else:
        raise ValueError(f"unknown media task {task!r}; choose one of {sorted(QUESTIONS)}")
    return name, answer


def make_row(
    kind: str, index: int, directory: Path, rng: random.Random, media_dir: str | Path | None = None
) -> dict[str, Any]:
    """Write one media file under ``directory`` and return its dataset row, naming the file relative to it (or
    under ``media_dir``). ``kind``: a media kind (its loader-exercising task) or a learnable task name."""
    name, answer = _write_media(kind, index, directory, rng)
    if media_dir is not None:
        name = str(Path(media_dir) / name)
    media = KIND.get(kind, kind)
    content = [{"type": media, media: name}, {"type": "text", "text": QUESTIONS[kind]}]
    return {"prompt": [{"role": "user", "content": content}], "label": str(answer)}


def make_dataset(
    directory: str | Path,
    kinds: tuple[str, ...],
    rows: int,
    seed: int = 0,
    name: str = "train.jsonl",
    media_dir: str | Path | None = None,
) -> Path:
    """``rows`` rows cycling through ``kinds`` (media kinds or task names), media files beside the JSONL; rows
    name them relative to it, or under ``media_dir`` (where the directory will be read from). Returns the JSONL."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = [json.dumps(make_row(kinds[i % len(kinds)], i, out, rng, media_dir)) for i in range(rows)]
    path = out / name
    path.write_text("\n".join(lines) + "\n")
    return path

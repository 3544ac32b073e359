"""Video inputs as a sequence of images: ``num_frames`` frames sampled evenly over the clip (PyAV decoder)."""

from __future__ import annotations

import os


def load_video_frames(path: str, num_frames: int) -> list:
    """PIL RGB frames at evenly spaced indices over the whole video (first and last frame included when
    num_frames > 1). Raises ValueError for a missing/unreadable file or a bad ``num_frames``."""
    if not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"num_frames must be a positive int, got {num_frames!r}")
    if not isinstance(path, str) or not os.path.isfile(path):
        raise ValueError(f"video file not found: {path!r}")
    try:
        import av  # optional dependency (the multimodal extra)
    except ImportError as e:  # pragma: no cover - av is a dependency of the multimodal extra
        raise ImportError("video inputs need PyAV: pip install 'sglang-backend[multimodal]'") from e
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ValueError(f"{path!r} has no video stream")
            stream = container.streams.video[0]
            count = stream.frames  # from the header: 0 when unknown, so then every frame is decoded first
            want = set(_even_indices(count, num_frames)) if count else None
            frames = {}
            for i, frame in enumerate(container.decode(stream)):
                if want is None or i in want:
                    frames[i] = frame.to_image().convert("RGB")
                if want is not None and i >= max(want):
                    break
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - PyAV raises its own error types for bad files
        raise ValueError(f"cannot decode video {path!r} ({type(e).__name__}: {e})") from None
    if not frames:
        raise ValueError(f"video {path!r} has no frames")
    if want is not None and len(frames) == len(want):
        return [frames[i] for i in _even_indices(count, num_frames)]
    decoded = sorted(frames)  # header count missing or wrong: sample evenly among what was decoded
    return [frames[decoded[j]] for j in _even_indices(len(decoded), num_frames)]


def _even_indices(n: int, k: int) -> list[int]:
    if k == 1:
        return [n // 2]
    return [round(i * (n - 1) / (k - 1)) for i in range(k)]

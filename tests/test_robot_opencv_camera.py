"""OpenCVCamera on a real capture path: a video file written with cv2.VideoWriter and read with cv2.VideoCapture."""

from pathlib import Path

import cv2
import numpy as np
import pytest

from vla_rt.errors import ConfigError
from vla_rt.robot.camera import CameraConnectionError, CameraEndOfStream, CameraReadError, CameraTimeout
from vla_rt.robot.factory import make_camera
from vla_rt.robot.opencv_camera import OpenCVCamera, OpenCVCameraConfig

N_FRAMES = 12
WIDTH, HEIGHT = 64, 48


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    """Red background (in BGR order on disk) with a green bar that moves 5 px per frame."""
    path = tmp_path_factory.mktemp("video") / "bar.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 30, (WIDTH, HEIGHT))
    assert writer.isOpened()
    for i in range(N_FRAMES):
        bgr = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
        bgr[..., 2] = 200
        bgr[:, i * 5 : i * 5 + 5] = (0, 255, 0)
        writer.write(bgr)
    writer.release()
    return path


def bar_column(rgb: np.ndarray) -> int:
    return int(np.argmax(rgb[HEIGHT // 2, :, 1]))


def test_reads_every_frame_in_rgb_then_reports_end_of_stream(video):
    camera = OpenCVCamera(OpenCVCameraConfig(str(video), realtime_playback=False))
    camera.connect()
    assert camera.device_size == (WIDTH, HEIGHT) and camera.device_fps == pytest.approx(30)
    frames = [camera.read() for _ in range(N_FRAMES)]
    assert [f.index for f in frames] == list(range(N_FRAMES))
    image = frames[0].image
    assert image.shape == (HEIGHT, WIDTH, 3) and image.dtype == np.uint8
    red, green, blue = image[HEIGHT // 2, 40]
    assert red > 150 and green < 60 and blue < 60  # BGR on disk, RGB out
    assert [bar_column(f.image) // 5 for f in frames] == list(range(N_FRAMES))
    with pytest.raises(CameraReadError, match=rf"{video.name}.*read failed after {N_FRAMES} frames: end of video"):
        camera.read()
    camera.disconnect()


def test_realtime_playback_measures_the_frame_interval_and_resizes(video):
    camera = OpenCVCamera(OpenCVCameraConfig(str(video), width=32, height=24, latency_s=0.05))
    camera.connect()
    frames = [camera.read() for _ in range(8)]
    camera.disconnect()
    assert frames[0].image.shape == (24, 32, 3)
    assert frames[3].t_capture == pytest.approx(frames[3].t_arrival - 0.05)
    spacing = np.diff([f.t_arrival for f in frames])
    assert spacing.min() > 0.025  # paced like a 30 FPS camera, not as fast as the disk
    assert camera.measured_frame_interval_s == pytest.approx(1 / 30, abs=0.015)
    assert camera.measured_fps == pytest.approx(30, abs=12)


def test_async_read_returns_each_frame_once_and_surfaces_the_end(video):
    camera = make_camera({"type": "opencv", "index_or_path": str(video), "realtime_playback": False})
    camera.connect()
    seen = []
    with pytest.raises(CameraReadError, match="end of video"):
        while True:
            seen.append(camera.read(timeout_s=5.0).index)
    camera.disconnect()
    assert seen == sorted(set(seen)) and seen[-1] == N_FRAMES - 1  # newest-first may skip, never repeats


def test_async_read_times_out_when_no_new_frame(video):
    camera = OpenCVCamera(OpenCVCameraConfig(str(video), fps=2.0))  # file replayed at 2 FPS
    camera.connect()
    camera.async_read(timeout_s=5.0)
    with pytest.raises(CameraTimeout, match="no new frame within 50 ms"):
        camera.async_read(timeout_s=0.05)
    camera.disconnect()


def test_unopenable_sources_name_the_device(tmp_path):
    missing = tmp_path / "nope.avi"
    with pytest.raises(CameraConnectionError, match=r"cannot open '.*nope.avi' with OpenCV \(no such file\)"):
        OpenCVCamera(OpenCVCameraConfig(str(missing))).connect()
    with pytest.raises(CameraConnectionError, match="cannot open 97"):
        OpenCVCamera(OpenCVCameraConfig(97)).connect()  # no /dev/video97 here
    with pytest.raises(ValueError, match="unknown keys"):
        make_camera({"type": "opencv", "resolution": 5})


def test_a_reconnected_camera_streams_again_and_reads_before_connect_say_so(video):
    """The bug: after disconnect() + connect() the camera raised the last session's 'end of video' at once (or skipped
    frames until its index passed the old one); a read(timeout_s=...) before connect() timed out as if the camera were
    silent and left a dead reader behind, so after connect() it never delivered a frame."""
    camera = OpenCVCamera(OpenCVCameraConfig(str(video), realtime_playback=False))
    with pytest.raises(CameraReadError, match=r"read before connect\(\)"):
        camera.read(timeout_s=0.1)
    camera.connect()
    with pytest.raises(CameraReadError, match="end of video"):
        while True:
            camera.read(timeout_s=5.0)
    camera.disconnect()
    camera.connect()
    assert 0 <= camera.read(timeout_s=5.0).index < N_FRAMES  # a frame of the new stream, not the old error
    camera.disconnect()


def test_the_end_of_a_video_file_is_the_end_of_the_stream_not_a_device_to_reopen(video):
    """A file that ran out must not be reopened: that would replay it as new frames. (Before camera reconnection both
    endings were one CameraReadError; the runtime could not tell them apart.)"""
    camera = OpenCVCamera(OpenCVCameraConfig(str(video), realtime_playback=False, reconnect_backoff_s=0.001))
    events = []
    camera.on_event = lambda event, **fields: events.append(event)
    camera.connect()
    for _ in range(3):  # and again: still the end, no reopen attempt however long one waits
        with pytest.raises(CameraEndOfStream, match="end of video file"):
            while True:
                camera.read(timeout_s=5.0)
    camera.disconnect()
    assert events == [] and camera.counters == {"disconnects": 0, "reconnect_attempts": 0, "reconnects": 0}


@pytest.mark.parametrize(
    ("fields", "field", "expected"),
    [
        ({"reconnect_backoff_s": 0}, "reconnect_backoff_s", "seconds > 0"),
        ({"reconnect_backoff_s": float("nan")}, "reconnect_backoff_s", "seconds > 0"),
        ({"reconnect_backoff_max_s": -1}, "reconnect_backoff_max_s", "seconds > 0"),
        ({"reconnect_backoff_s": 2.0}, "reconnect_backoff_max_s", ">= reconnect_backoff_s (2.0)"),
        ({"max_reconnect_attempts": 0}, "max_reconnect_attempts", "an integer >= 1, or None"),
    ],
)
def test_reconnect_backoff_settings_are_checked_naming_the_field(fields, field, expected):
    """A zero backoff would reopen a dead device in a tight loop and flood the log."""
    with pytest.raises(ConfigError) as info:
        make_camera({"type": "opencv", "index_or_path": 0, **fields})
    assert info.value.field == field and expected in str(info.value), str(info.value)

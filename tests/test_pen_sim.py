"""Pen-drop simulation: free-fall physics, renderer, catch judge, simulated camera timing."""

import math

import numpy as np
import pytest

from vla_rt.clock import SimClock
from vla_rt.robot.camera import CameraTimeout
from vla_rt.robot.jaw_dynamics import JawDynamics
from vla_rt.robot.pen_drop import PenDropConfig, PenDropSim
from vla_rt.robot.pen_render import PenRenderer
from vla_rt.robot.sim_camera import SimCamera, SimCameraConfig

G = 9.81


def drop(release=0.3, x=0.0, close_after_release=None, seed=0):
    jaws = JawDynamics(t0=0.0)
    sim = PenDropSim(jaws, seed=seed)
    sim.reset(0.0, t_release=release, x=x)
    if close_after_release is not None:
        jaws.command(1.0, release + close_after_release)
    return sim, jaws


def pen_mask(image: np.ndarray) -> np.ndarray:
    """Pixels of the pen's blue body."""
    img = image.astype(int)
    return (img[..., 2] > 120) & (img[..., 0] < 100)


def test_fall_time_matches_free_fall():
    sim, _ = drop(release=0.3)
    fall_time = math.sqrt(2 * 0.30 / G)
    assert fall_time == pytest.approx(0.2473, abs=1e-4)
    assert sim.state_at(0.2999).phase == "held"
    assert sim.state_at(0.3 + fall_time).tip_z == pytest.approx(0.0, abs=1e-9)
    for dt in (0.05, 0.1, 0.2, 0.26):
        state = sim.state_at(0.3 + dt)
        assert state.tip_z == pytest.approx(0.30 - 0.5 * G * dt * dt, abs=1e-9)
        assert state.velocity == pytest.approx(-G * dt, abs=1e-9)


def test_release_time_and_lateral_position_vary_within_config():
    cfg = PenDropConfig()
    sim = PenDropSim(JawDynamics(t0=0.0), seed=3)
    releases, xs = [], []
    for episode in range(40):
        sim.reset(10.0 * episode)
        releases.append(sim.t_release - 10.0 * episode)
        xs.append(sim.x)
    assert min(releases) >= cfg.release_delay_s - cfg.release_jitter_s
    assert max(releases) <= cfg.release_delay_s + cfg.release_jitter_s
    assert np.std(releases) > cfg.release_jitter_s / 4 and np.std(xs) > cfg.lateral_range_m / 4
    assert max(abs(x) for x in xs) <= cfg.lateral_range_m


@pytest.mark.parametrize(
    ("close_after", "reason"),
    [(0.190, "too_early"), (0.200, "caught"), (0.235, "caught"), (0.245, "too_late"), (None, "no_close")],
)
def test_catch_judge(close_after, reason):
    sim, jaws = drop(release=0.3, close_after_release=close_after)
    result = sim.result(1.5)
    assert result.reason == reason and result.success == (reason == "caught")
    enter, leave = result.window
    assert (enter - 0.3, leave - 0.3) == pytest.approx((0.2514, 0.2961), abs=1e-4)
    if close_after is not None:
        assert result.t_closed == pytest.approx(0.3 + close_after + 0.95 * 0.060, abs=1e-6)
        assert (enter <= result.t_closed <= leave) == (reason == "caught")


def test_caught_pen_stays_in_the_jaws_and_early_close_blocks_it():
    sim, _ = drop(close_after_release=0.2)
    held = sim.state_at(1.0)
    assert held.phase == "caught" and held.tip_z == sim.state_at(2.0).tip_z
    assert -0.13 < held.tip_z < -0.01  # spans the pads
    blocked, _ = drop(close_after_release=0.1)
    resting = blocked.state_at(1.0)
    assert resting.phase == "landed_on_jaws" and resting.tip_z == pytest.approx(0.01)


def test_renderer_shows_pen_only_after_it_enters_from_the_top():
    sim, jaws = drop(release=0.3)
    renderer = PenRenderer()
    image = renderer.render(sim.state_at(0.25), jaws.position_at(0.25))
    assert image.shape == (224, 224, 3) and image.dtype == np.uint8
    assert not pen_mask(image).any()  # hanging pen (and the upper gripper) are above the view
    enter = 0.3 + math.sqrt(2 * 0.005 / G)  # tip falls 5 mm to the top row
    # The tip is dark; the blue body follows it in 12 mm later.
    body_enter = 0.3 + math.sqrt(2 * 0.017 / G)
    assert not pen_mask(renderer.render(sim.state_at(body_enter - 0.002), 0.0)).any()
    first = pen_mask(renderer.render(sim.state_at(body_enter + 0.004), 0.0))
    rows = np.flatnonzero(first.any(axis=1))
    assert rows.size and rows.min() == 0 and rows.max() < 10  # entering at the top edge
    later = pen_mask(renderer.render(sim.state_at(0.3 + 0.2), 0.0))
    assert np.flatnonzero(later.any(axis=1)).max() > 100  # further down as it falls
    assert enter < body_enter


def test_renderer_jaws_follow_gripper_position():
    sim, _ = drop()
    renderer = PenRenderer()
    col, row = renderer.to_pixels(0.0, 0.0)

    def finger_gap(jaw_position):
        line = renderer.render(sim.state_at(0.0), jaw_position)[int(row), :, :].astype(int)
        dark = np.flatnonzero(line.sum(axis=1) < 400)  # finger / pad pixels on the jaw centre row
        inner_left = dark[dark < col].max()
        inner_right = dark[dark > col].min()
        return (inner_right - inner_left) * renderer.m_per_px

    assert finger_gap(0.0) == pytest.approx(0.050, abs=2 * PenRenderer().m_per_px)
    assert finger_gap(0.5) == pytest.approx(0.025, abs=2 * PenRenderer().m_per_px)


def test_sim_camera_delivers_with_two_frame_latency_and_capture_time_images():
    clock = SimClock()
    sim, jaws = drop(release=0.3)
    camera = SimCamera(sim, SimCameraConfig(fps=30, latency_frames=2), clock)
    camera.connect()
    frames = [camera.read() for _ in range(20)]
    assert [f.index for f in frames] == list(range(20))
    for f in frames:
        assert f.t_capture == pytest.approx(f.index / 30)
        assert f.t_arrival == pytest.approx(f.t_capture + 2 / 30)
    falling = [f for f in frames if 0.36 < f.t_capture < 0.58]  # pen in view and moving
    assert falling
    for f in falling:
        assert np.array_equal(f.image, camera.render_at(f.t_capture))
        assert not np.array_equal(f.image, camera.render_at(f.t_arrival))  # the image is 2 frames old


def test_sim_camera_late_reader_drops_and_stalls_time_out():
    clock = SimClock()
    sim, _ = drop()
    camera = SimCamera(sim, SimCameraConfig(fps=30, latency_frames=2), clock)
    camera.connect()
    clock.sleep_until(0.5)  # reader busy for 0.5 s
    frame = camera.read()
    assert frame.index == 13 and camera.dropped == 13  # newest delivered by 0.5 s: exposed at 13/30
    camera.inject_stall(16 / 30 - 0.001, 0.2)  # frames 16..21 lost
    assert camera.read().index == 14 and camera.read().index == 15
    with pytest.raises(CameraTimeout):
        camera.read(timeout_s=0.1)
    assert clock.now() == pytest.approx(17 / 30 + 0.1)
    frame = camera.read()
    assert frame.index == 22 and frame.t_arrival == pytest.approx(24 / 30)
    assert camera.dropped == 13  # stalled frames never existed; they are not counted as drops

"""Runtime fault behaviour, in simulated time (deterministic), with the real SerialGripper over a pty.

Each test states the exact behaviour: what the threads keep doing, what is logged, what reaches the gripper.
"""

import dataclasses
import math

import numpy as np
import pytest

from vla_rt.clock import SimClock
from vla_rt.robot.gripper_protocol import Cmd, encode_ack, position_to_u16
from vla_rt.robot.pen_drop import PenDropSim
from vla_rt.robot.serial_gripper import SerialGripper, SerialGripperConfig
from vla_rt.robot.sim_camera import SimCamera, SimCameraConfig
from vla_rt.robot.sim_gripper import SimGripper
from vla_rt.runtime.events import load_events, select
from vla_rt.runtime.runtime import Runtime, RuntimeConfig

FRAME = 1 / 30
LATENCY = 2 / 30
TICK = 0.005


class ScriptedPolicy:
    """Test double for the model: chunk values from `chunk_fn(call_index)`; optional simulated compute time."""

    def __init__(self, chunk_fn, clock=None, compute_s=0.0):
        self.chunk_fn = chunk_fn
        self.clock = clock
        self.compute_s = compute_s
        self.calls = []

    def infer(self, obs):
        self.calls.append(obs)
        if self.compute_s:
            self.clock.sleep(self.compute_s)  # runs in the inference thread: simulated compute time
        actions = np.asarray(self.chunk_fn(len(self.calls) - 1), dtype=float).reshape(-1, 1)
        return {"actions": actions, "timing": {"call": len(self.calls)}}


class Rig:
    """SimClock + SimGripper (pty) + SerialGripper + SimCamera over a pen scene (pen released far in the future)."""

    def __init__(self, tmp_path, policy_factory, **config):
        self.clock = SimClock()
        self.device = SimGripper(clock=self.clock).start()
        self.sim = PenDropSim(self.device, seed=0)
        self.sim.reset(0.0, t_release=100.0)
        self.camera = SimCamera(self.sim, SimCameraConfig(image_size=32), self.clock)
        self.gripper = SerialGripper(SerialGripperConfig(port=self.device.port, ack_timeout_s=2.0), self.clock)
        self.policy = policy_factory(self.clock)
        self.log_path = tmp_path / "events.jsonl"
        config = {"control_hz": 1 / TICK, "dt_action_s": 0.01, **config}
        self.runtime = Runtime(
            self.camera, self.policy, self.gripper, self.clock, RuntimeConfig(**config), self.log_path
        )

    def __enter__(self):
        self.runtime.start()
        return self

    def __exit__(self, *exc):
        if self.runtime._threads:
            self.runtime.stop()
        self.device.stop()

    def stop(self):
        counters = self.runtime.stop()
        self.events = load_events(self.log_path)
        return counters


def between(events, name, t0, t1):
    return [e for e in select(events, name) if t0 <= e["t"] < t1]


def test_camera_stall_200ms_holds_last_command_and_resumes(tmp_path):
    with Rig(tmp_path, lambda clock: ScriptedPolicy(lambda i: [0.2 + 0.001 * i] * 5)) as rig:
        rig.camera.inject_stall(1.0 - 1e-3, 0.2)  # frames exposed at 1.000 .. 1.167 (index 30..35) never come
        rig.clock.advance(1.5)
        counters = rig.stop()
    ev = rig.events
    assert not [e for e in select(ev, "frame_captured") if 30 <= e["index"] <= 35]
    last_before = [e for e in select(ev, "frame_captured") if e["index"] == 29][0]
    assert last_before["t"] == pytest.approx(29 * FRAME + LATENCY)
    (stall,) = select(ev, "camera_stall")  # logged once, one stall timeout after the last frame
    assert stall["t"] == pytest.approx(last_before["t"] + 0.1) and stall["silent_ms"] == pytest.approx(100)
    (resume,) = select(ev, "camera_resume")
    assert resume["index"] == 36 and resume["t"] == pytest.approx(36 * FRAME + LATENCY)
    assert resume["gap_ms"] == pytest.approx(7 * FRAME * 1000)
    (waiting,) = select(ev, "inference_waiting")  # the inference thread noticed too, once
    assert waiting["t"] == pytest.approx(last_before["t"] + 0.1)
    assert between(ev, "inference_start", last_before["t"] + 1e-6, resume["t"]) == []
    # The last chunk (5 steps x 10 ms from its frame's arrival) runs out; the output thread holds its last value.
    last_chunk = [e for e in select(ev, "chunk_written") if e["frame_seq"] == 29][0]
    (gap_start,) = select(ev, "gap_start")
    assert last_chunk["t_end"] <= gap_start["t"] < last_chunk["t_end"] + TICK
    held_value = 0.2 + 0.001 * 29
    assert gap_start["hold_target"] == pytest.approx(held_value)
    (gap_end,) = select(ev, "gap_end")
    assert resume["t"] <= gap_end["t"] < resume["t"] + TICK
    holds = between(ev, "command_sent", gap_start["t"], gap_end["t"])
    assert holds and all(e["source"] == "hold" and e["target"] == pytest.approx(held_value) for e in holds)
    # The control loop never skipped a beat: one acked command per 5 ms tick through the whole stall.
    sent = between(ev, "command_sent", 0.9 + TICK / 2, 1.4 + TICK / 2)
    assert len(sent) == 100 and all(e["acked"] for e in sent)
    assert np.allclose(np.diff([e["t"] for e in sent]), TICK)
    assert counters["camera_cam_stalls"] == 1 and counters["output_overruns"] == 0


def test_inference_slower_than_frame_period_uses_newest_frame_and_skips(tmp_path):
    factory = lambda clock: ScriptedPolicy(lambda i: [0.5] * 20, clock, compute_s=0.050)  # noqa: E731
    with Rig(tmp_path, factory) as rig:
        rig.clock.advance(1.0)
        counters = rig.stop()
    ev = rig.events
    newest_seen = -1
    starts = []
    for e in ev:  # log order is execution order under the SimClock
        if e["event"] == "frame_captured":
            newest_seen = e["seq"]
        elif e["event"] == "inference_start":
            assert e["frame_seq"] == newest_seen  # never a backlog
            assert e["frame_age_ms"] <= (LATENCY + FRAME) * 1000 + 1e-6
            starts.append(e)
    done = select(ev, "inference_done")
    assert all(d["duration_ms"] == pytest.approx(50.0) for d in done)
    seqs = [s["frame_seq"] for s in starts]
    assert len(seqs) >= 17 and sorted(set(seqs)) == seqs
    assert counters["frames_skipped"] == (seqs[-1] - seqs[0] + 1) - len(seqs) > 0
    assert counters["inferences"] == len(done)
    chunk_times = [c["t"] for c in select(ev, "chunk_written")]
    assert min(np.diff(chunk_times)) >= 0.050 - 1e-9
    assert counters["output_overruns"] == 0 and counters["output_gaps"] == 0


def test_serial_unplugged_mid_run_reconnects_with_backoff(tmp_path):
    with Rig(tmp_path, lambda clock: ScriptedPolicy(lambda i: [0.7] * 10)) as rig:
        rig.clock.advance(0.5)
        rig.device.unplug()
        rig.clock.advance(0.3)
        rig.device.replug()
        rig.clock.advance(0.5)
        assert rig.runtime.stop_reason is None  # kept running throughout
        counters = rig.stop()
    ev = rig.events
    (down,) = select(ev, "serial_link_down")
    assert 0.5 <= down["t"] <= 0.5 + TICK and rig.device.port in down["error"] and "serial link lost" in down["error"]
    (lost,) = select(ev, "serial_disconnected")
    failed = select(ev, "reconnect_failed")
    (reconnected,) = select(ev, "reconnected")
    (up,) = select(ev, "serial_link_up")
    attempts = [lost["t"]] + [e["t"] for e in failed] + [reconnected["t"]]
    # Backoff 50, 100, 200 ms (each attempt at the first control tick after it is due).
    assert [e["attempt"] for e in failed] == [1, 2] and reconnected["attempt"] == 3
    for gap, expected in zip(np.diff(attempts), [0.05, 0.10, 0.20]):
        assert expected - 1e-9 <= gap < expected + TICK + 1e-9
    assert 0.8 < reconnected["t"] == up["t"]
    assert up["down_ms"] == pytest.approx((up["t"] - down["t"]) * 1000)
    assert between(ev, "ack_received", down["t"], up["t"]) == []  # nothing got through while unplugged
    assert between(ev, "command_sent", down["t"], up["t"]) == []
    # Camera and inference did not care.
    assert len(between(ev, "frame_captured", down["t"], up["t"])) >= 9
    assert len(between(ev, "inference_done", down["t"], up["t"])) >= 9
    after = between(ev, "command_sent", up["t"], 1.3)
    assert len(after) >= 80 and all(e["target"] == 0.7 and e["acked"] for e in after)
    assert counters["gripper_disconnects"] == 1 and counters["output_link_losses"] == 1


def test_serial_unplugged_with_stop_policy_stops_safely(tmp_path):
    factory = lambda clock: ScriptedPolicy(lambda i: [0.7] * 10)  # noqa: E731
    with Rig(tmp_path, factory, on_gripper_disconnect="stop") as rig:
        rig.clock.advance(0.5)
        rig.device.unplug()
        rig.clock.advance(0.3)
        assert rig.runtime.stopping and rig.runtime.stop_reason == "gripper link lost"
        rig.stop()
    ev = rig.events
    (safe,) = select(ev, "safe_stop")
    assert safe["reason"].startswith("gripper link lost") and rig.device.port in safe["reason"]
    assert between(ev, "command_sent", safe["t"], 10.0) == []
    assert select(ev, "threads_not_joined") == []


def test_garbage_bytes_on_serial_are_skipped_without_losing_a_command(tmp_path):
    noise_to_host = b"\x5a\x81\x02junk\x00\xff"  # a fake sync byte, then junk
    noise_to_device = b"\xa5\x01\x00noise\xa5"
    stale_ack = encode_ack(Cmd.SET_TARGET, 201, 0x02, 1234, 0)  # CRC-valid, but for no command in flight
    with Rig(tmp_path, lambda clock: ScriptedPolicy(lambda i: [0.4] * 10)) as rig:
        for _ in range(5):
            rig.clock.advance(0.1)
            rig.device.inject_garbage(noise_to_host + stale_ack)  # device -> host
            rig.gripper._serial.write(noise_to_device)  # host -> device (no participant runs between advances)
        rig.clock.advance(0.1)
        counters = rig.stop()
    ev = rig.events
    assert counters["gripper_timeouts"] == 0 and counters["output_link_losses"] == 0
    assert counters["output_commands"] == counters["output_acked"] == counters["output_ticks"]
    assert rig.gripper.garbage_bytes_skipped == 5 * len(noise_to_host)  # the stale ack parses, then is ignored
    assert counters["gripper_stale_acks"] == 5
    assert rig.device.garbage_bytes_seen == 5 * len(noise_to_device)
    chunk_targets = {e["target"] for e in select(ev, "command_sent", source="chunk")}
    assert chunk_targets == {0.4}


def test_nan_actions_are_skipped_held_and_repeated_nan_stops_safely(tmp_path):
    def chunk(i):
        if i < 12:
            return [0.3, math.nan, 0.6, 0.6, 0.6]  # one bad step per chunk: hold, carry on
        return [math.nan] * 5  # the policy has gone bad

    factory = lambda clock: ScriptedPolicy(chunk)  # noqa: E731
    with Rig(tmp_path, factory, nan_limit=3, safe_action=0.0) as rig:
        rig.clock.advance(1.0)
        assert rig.runtime.stop_reason == "3 non-finite actions in a row"
        rig.stop()
    ev = rig.events
    sent = select(ev, "command_sent")
    assert all(math.isfinite(e["target"]) and 0.0 <= e["target"] <= 1.0 for e in sent)
    wire = {c.position_raw for _, c in rig.device.received}
    assert wire <= {position_to_u16(v) for v in (0.0, 0.3, 0.6)}  # nothing else ever reached the device
    # An isolated bad step: logged once per (chunk, step), held at the command before it.
    nan_events = select(ev, "nan_action")
    isolated = [e for e in nan_events if e["step"] == 1 and e["streak"] == 1]
    assert len(isolated) >= 10 and all(e["action"] == ["nan"] for e in isolated)
    for i, e in enumerate(sent):
        if e["source"] == "hold_nan":
            previous = next(p for p in reversed(sent[:i]) if p["source"] != "hold_nan")
            assert e["target"] == previous["target"]
    # Three bad steps in a row -> safe stop: open the gripper, then nothing more.
    (stop,) = select(ev, "safe_stop")
    bad_chunk = [c for c in select(ev, "chunk_written") if c["nonfinite_steps"] == 5][0]
    assert bad_chunk["t0"] + 0.02 <= stop["t"] < bad_chunk["t0"] + 0.02 + TICK
    assert [e["streak"] for e in nan_events if e["chunk_seq"] == bad_chunk["seq"]] == [1, 2, 3]
    assert sent[-1]["source"] == "safe" and sent[-1]["target"] == 0.0 and sent[-1]["t"] == stop["t"]
    assert rig.device.jaws.target_at(stop["t"]) == 0.0


def test_stale_chunks_are_never_executed(tmp_path):
    factory = lambda clock: ScriptedPolicy(lambda i: [1.0] * 50, clock, compute_s=0.3)  # noqa: E731
    with Rig(tmp_path, factory, max_action_age_s=0.2) as rig:
        rig.clock.advance(1.5)
        counters = rig.stop()
    ev = rig.events
    assert len(select(ev, "chunk_written")) >= 3
    assert {e["source"] for e in select(ev, "command_sent")} == {"init"}
    assert {e["target"] for e in select(ev, "command_sent")} == {0.0}
    assert counters["output_holds"] == counters["output_ticks"]
    # ... and each is said to be late (the bug: nothing did; the gripper simply never moved)
    late = select(ev, "chunk_late")
    assert len(late) == len(select(ev, "chunk_written")) == counters["chunks_late"]
    assert all(e["reason"].endswith("ms old, past max_action_age_s") for e in late)


def test_policy_exception_is_logged_and_the_loop_continues(tmp_path):
    def chunk(i):
        if i == 3:
            raise RuntimeError("CUDA error: an illegal memory access")
        return [0.5] * 10

    with Rig(tmp_path, lambda clock: ScriptedPolicy(chunk)) as rig:
        rig.clock.advance(0.5)
        counters = rig.stop()
    (error,) = select(rig.events, "inference_error")
    assert "illegal memory access" in error["error"] and error["frame_seq"] == 3
    assert counters["inference_errors"] == 1 and counters["inferences"] >= 10


def test_wait_until_live_returns_once_a_chunk_is_acked_and_names_what_is_missing(tmp_path):
    with Rig(tmp_path, lambda clock: ScriptedPolicy(lambda i: [0.3] * 5, clock, compute_s=0.05)) as rig:
        t_live = rig.runtime.wait_until_live(timeout_s=2.0)
        first_ack = rig.runtime.output.counters["acked"]
        counters = rig.stop()
    # live no earlier than the first frame's 2-frame latency plus the 50 ms inference, and within a few ticks of it
    assert LATENCY + 0.05 <= t_live <= LATENCY + 0.05 + 4 * TICK + FRAME
    assert first_ack >= 1 and counters["inferences"] >= 1

    def failing(clock):
        return ScriptedPolicy(lambda i: 1 / 0)

    with Rig(tmp_path, failing) as rig:
        with pytest.raises(TimeoutError, match=r"not live after 0.5 s: no inference has finished"):
            rig.runtime.wait_until_live(timeout_s=0.5)
        assert rig.clock.now() == pytest.approx(0.5, abs=0.01)  # simulated seconds, driven by the wait itself


def test_a_gripper_that_fails_to_connect_leaves_no_camera_open(tmp_path):
    """The bug: `start()` connected the cameras, then the gripper's connect failed and the cameras stayed open (a
    real camera held busy until the process exited)."""
    clock = SimClock()
    sim = PenDropSim(SimGripper(clock=clock), seed=0)  # the jaws the scene draws; never started, so no port
    sim.reset(0.0, t_release=100.0)
    camera = SimCamera(sim, SimCameraConfig(image_size=32), clock)
    gripper = SerialGripper(SerialGripperConfig(port=str(tmp_path / "no-such-port"), ack_timeout_s=0.1), clock)
    runtime = Runtime(camera, ScriptedPolicy(lambda i: [0.0]), gripper, clock, RuntimeConfig(), tmp_path / "e.jsonl")
    with pytest.raises(Exception, match="no-such-port"):
        runtime.start()
    assert not camera.is_connected and not gripper.is_connected and not runtime._threads


def test_start_after_stop_is_refused_before_any_device_connects(tmp_path):
    """The bug: start() after stop() connected the camera and the gripper, then every thread exited at once (the stop
    flag stayed set, the rings and the log closed): no command, no error, the devices held open."""
    with Rig(tmp_path, lambda clock: ScriptedPolicy(lambda i: [0.5] * 5)) as rig:
        rig.clock.advance(0.2)
        rig.stop()
        with pytest.raises(RuntimeError, match=r"already stopped \(stop\(\) called\); a Runtime runs once"):
            rig.runtime.start()
        assert not rig.camera.is_connected and not rig.gripper.is_connected and not rig.runtime._threads


def test_action_index_past_the_policys_action_dim_is_one_clear_error_and_the_gripper_holds(tmp_path):
    """The bug: RuntimeConfig(action_index=2) with a 1-dim policy crashed the output thread mid-run with 'IndexError:
    index 2 is out of bounds for axis 0 with size 1' (under a SimClock: a SimThreadError out of advance())."""
    with Rig(tmp_path, lambda clock: ScriptedPolicy(lambda i: [0.9] * 5), action_index=2) as rig:
        rig.clock.advance(0.3)
        assert rig.runtime.stop_reason is None
        counters = rig.stop()
    errors = select(rig.events, "inference_error")
    assert errors and all("expected action_dim > 2 (RuntimeConfig.action_index)" in e["error"] for e in errors)
    assert counters["inferences"] == 0 and select(rig.events, "thread_crashed") == []
    assert {e["source"] for e in select(rig.events, "command_sent")} == {"init"}  # the initial command, held


class NanCaptureCamera:
    """The sim camera with a driver bug: from frame 3 on, capture times are NaN."""

    def __init__(self, camera):
        self.camera, self.name = camera, camera.name

    is_connected = property(lambda self: self.camera.is_connected)

    def connect(self):
        self.camera.connect()

    def disconnect(self):
        self.camera.disconnect()

    def read(self, timeout_s=None):
        frame = self.camera.read(timeout_s)
        return frame if frame.index < 3 else dataclasses.replace(frame, t_capture=math.nan)

    async_read = read


def test_frames_without_a_finite_capture_time_never_reach_the_policy(tmp_path):
    """The bug: such frames went through; their chunks carried t_frame NaN, so `now - t_frame > max_action_age_s` was
    never true and the gripper executed them whatever their age."""
    with Rig(tmp_path, lambda clock: ScriptedPolicy(lambda i: [0.9] * 5), max_action_age_s=0.2) as rig:
        rig.runtime.camera_loops["cam"].camera = NanCaptureCamera(rig.camera)  # before the first tick runs
        rig.clock.advance(0.6)
        counters = rig.stop()
    errors = select(rig.events, "camera_error")
    assert errors and all("frames/cam: timestamp nan is not a finite clock time" in e["error"] for e in errors)
    assert [e["index"] for e in select(rig.events, "frame_captured")] == [0, 1, 2]
    assert counters["inferences"] == 3 and counters["camera_cam_frames"] == 3


def test_a_chunk_ready_after_its_last_step_was_due_is_logged_as_late(tmp_path):
    """Latency-compensated chunks (frame_capture origin) of 5 x 10 ms from a frame 67 ms old and a 30 ms inference: due
    before they exist. The bug: the runtime held the initial command with no word of why."""
    factory = lambda clock: ScriptedPolicy(lambda i: [1.0] * 5, clock, compute_s=0.03)  # noqa: E731
    with Rig(tmp_path, factory, action_time_origin="frame_capture") as rig:
        rig.clock.advance(0.5)
        counters = rig.stop()
    late = select(rig.events, "chunk_late")
    assert late and len(late) == counters["chunks_late"] == counters["inferences"]
    assert all(e["reason"].startswith("ready ") and "after its last step was due" in e["reason"] for e in late)
    assert {e["source"] for e in select(rig.events, "command_sent")} == {"init"}

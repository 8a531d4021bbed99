"""SerialGripper (pyserial) against SimGripper over a real pseudo-terminal."""

import math
import time

import pytest

from vla_rt.clock import SimClock
from vla_rt.robot.gripper_protocol import Cmd, encode_ack
from vla_rt.robot.serial_gripper import (
    GripperDisconnected,
    GripperTimeout,
    SerialGripper,
    SerialGripperConfig,
)
from vla_rt.robot.sim_gripper import SimGripper


@pytest.fixture
def sim_time_rig():
    """Device and host on one SimClock driven by the test: jaw dynamics and backoff are exact."""
    clock = SimClock()
    device = SimGripper(clock=clock).start()
    events = []
    host = SerialGripper(
        SerialGripperConfig(port=device.port, ack_timeout_s=1.0),
        clock,
        on_event=lambda name, **fields: events.append((clock.now(), name, fields)),
    )
    host.connect()
    yield clock, device, host, events
    host.disconnect()
    device.stop()


def test_command_ack_round_trip(sim_time_rig):
    clock, device, host, _ = sim_time_rig
    state = host.send_target(0.5)
    assert state.seq == 1 and state.moving and not state.at_target and state.position == 0.0
    ((t_recv, command),) = device.received
    assert command.cmd == Cmd.SET_TARGET and command.seq == 1 and command.position_raw == 32768
    assert host.read_state().seq == 2
    assert host.counters["sent"] == host.counters["acks"] == 2


def test_closing_takes_60_ms(sim_time_rig):
    clock, device, host, _ = sim_time_rig
    host.send_target(1.0)
    clock.advance(0.030)
    assert host.read_state().position == pytest.approx(0.5, abs=2e-5)
    clock.advance(0.029)
    state = host.read_state()
    assert state.moving and state.position == pytest.approx(59 / 60, abs=2e-5)
    clock.advance(0.001)
    state = host.read_state()
    assert state.at_target and state.position == 1.0
    assert device.jaws.settle_time(0.0) == pytest.approx(0.060)


def test_closing_dynamics_in_real_time():
    with SimGripper() as device:
        host = SerialGripper(SerialGripperConfig(port=device.port, ack_timeout_s=2.0))
        host.connect()
        first = host.send_target(1.0)
        readings = [first]
        while not readings[-1].at_target:
            readings.append(host.read_state())
            assert readings[-1].t_ack - first.t_sent < 5.0
        host.disconnect()
    closed_after = readings[-1].t_ack - first.t_sent
    assert closed_after >= 0.060
    # Each reading lies on the 60 ms ramp (the device measures between our send and its ack).
    for reading in readings[1:-1]:
        assert reading.position <= (reading.t_ack - first.t_sent) / 0.060 + 1e-4
        assert reading.position >= (reading.t_sent - first.t_ack) / 0.060 - 1e-4


def test_timeout_when_device_stops_answering(sim_time_rig):
    clock, device, host, events = sim_time_rig
    host.config.ack_timeout_s = 0.05
    device.muted = True
    with pytest.raises(GripperTimeout, match=rf"gripper on {device.port}: no ack for SET_TARGET seq=1 within 50 ms"):
        host.send_target(1.0)
    assert host.counters["timeouts"] == 1 and [e[1] for e in events] == ["ack_timeout"]
    assert len(device.received) == 1  # the command did arrive; the device just never answered
    device.muted = False
    assert host.send_target(1.0).seq == 2  # the link itself is fine


def test_unplug_gives_clear_error_then_reconnects_with_backoff(sim_time_rig):
    clock, device, host, events = sim_time_rig
    host.send_target(1.0)
    device.unplug()
    with pytest.raises(
        GripperDisconnected, match=rf"gripper on {device.port}: serial link lost .*reconnecting in 50 ms"
    ):
        host.send_target(0.0)
    assert not host.is_connected
    with pytest.raises(GripperDisconnected, match="next reconnect attempt in 50 ms"):
        host.send_target(0.0)  # within the backoff: no attempt
    assert host.counters["reconnect_attempts"] == 0
    clock.advance(0.05)
    with pytest.raises(GripperDisconnected, match=r"reconnect attempt 1 failed .*No such file.*next in 100 ms"):
        host.send_target(0.0)
    clock.advance(0.05)
    with pytest.raises(GripperDisconnected, match="next reconnect attempt in 50 ms"):
        host.send_target(0.0)
    device.replug()
    clock.advance(0.05)
    state = host.send_target(0.0)
    assert state.position == 1.0 and host.is_connected
    assert host.counters["disconnects"] == 1
    assert host.counters["reconnect_attempts"] == 2 and host.counters["reconnects"] == 1
    assert [(round(t, 3), name) for t, name, _ in events] == [
        (0.0, "serial_disconnected"),
        (0.05, "reconnect_failed"),
        (0.15, "reconnected"),
    ]


def test_gives_up_after_max_reconnect_attempts(sim_time_rig):
    clock, device, host, _ = sim_time_rig
    host.config.max_reconnect_attempts = 2
    device.unplug()
    with pytest.raises(GripperDisconnected):
        host.send_target(0.0)
    for _ in range(2):
        clock.advance(1.0)
        with pytest.raises(GripperDisconnected, match="reconnect attempt"):
            host.send_target(0.0)
    clock.advance(1.0)
    with pytest.raises(GripperDisconnected, match="gave up after 2 reconnect attempts") as info:
        host.send_target(0.0)
    assert info.value.permanent


def test_garbage_on_the_line_both_ways(sim_time_rig):
    clock, device, host, _ = sim_time_rig
    host.send_target(0.25)
    stale = encode_ack(Cmd.SET_TARGET, 99, 0x02, 123, 0)  # a valid ack for a command we never sent
    device.inject_garbage(b"\x5a\x81\x02junk\x00\xff" + stale + b"\x5a\x5a")
    state = host.send_target(0.75)
    assert state.seq == 2
    assert host.garbage_bytes_skipped >= 10 and host.crc_errors >= 1
    assert host.counters["stale_acks"] == 1
    host._serial.write(b"\xa5\x01\x00noise\xa5")  # noise toward the device
    assert host.send_target(1.0).seq == 3
    assert device.garbage_bytes_seen >= 7
    assert [c.position_raw for _, c in device.received] == [16384, 49151, 65535]


def test_connect_to_missing_port_names_it():
    host = SerialGripper(SerialGripperConfig(port="/dev/does-not-exist-vla"))
    with pytest.raises(GripperDisconnected, match="gripper on /dev/does-not-exist-vla: cannot open serial port"):
        host.connect()


def test_non_finite_target_is_refused_before_the_wire(sim_time_rig):
    _, device, host, _ = sim_time_rig
    with pytest.raises(ValueError, match="finite"):
        host.send_target(math.nan)
    time.sleep(0.05)
    assert device.received == [] and host.counters["sent"] == 0


def test_a_port_another_host_holds_is_refused_as_busy(sim_time_rig):
    """The bug: a second SerialGripper on the same port opened silently, and both drove one gripper (each could read
    the other's acks, since both counted seq from 1)."""
    _, device, host, _ = sim_time_rig
    second = SerialGripper(SerialGripperConfig(port=device.port, ack_timeout_s=0.1))
    with pytest.raises(GripperDisconnected, match=rf"gripper on {device.port}: cannot open serial port \(busy"):
        second.connect()
    assert not second.is_connected and host.send_target(0.5).seq == 1
    host.disconnect()
    second.connect()  # free once the first host lets go
    second.disconnect()

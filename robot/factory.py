"""Devices from plain config dicts (hydra `configs/robot/*.yaml`): `{"type": ..., **fields of the config dataclass}`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vla_rt.clock import Clock
from vla_rt.robot.camera import Camera
from vla_rt.robot.opencv_camera import OpenCVCamera, OpenCVCameraConfig
from vla_rt.robot.pen_drop import PenDropConfig, PenDropSim
from vla_rt.robot.serial_gripper import SerialGripper, SerialGripperConfig
from vla_rt.robot.sim_camera import SimCamera, SimCameraConfig
from vla_rt.robot.sim_gripper import SimGripper, SimGripperConfig


def build_config(cls: type, fields: Mapping[str, Any]) -> Any:
    """`cls(**fields)` that names the device type and the unknown keys instead of a bare TypeError."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known - {"type"})
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; known: {sorted(known)}")
    return cls(**{k: v for k, v in fields.items() if k != "type"})


def make_camera(config: Mapping[str, Any], clock: Clock | None = None, sim: PenDropSim | None = None) -> Camera:
    """type "opencv" -> OpenCVCamera; type "sim" -> SimCamera over `sim` (required)."""
    kind = config.get("type")
    if kind == "opencv":
        return OpenCVCamera(build_config(OpenCVCameraConfig, config), clock)
    if kind == "sim":
        if sim is None:
            raise ValueError("a 'sim' camera needs the PenDropSim it films (make_camera(..., sim=...))")
        return SimCamera(sim, build_config(SimCameraConfig, config), clock)
    raise ValueError(f"unknown camera type {kind!r}; expected 'opencv' or 'sim'")


def make_gripper(config: Mapping[str, Any], clock: Clock | None = None) -> SerialGripper:
    """type "serial" -> SerialGripper on `port`. (A simulated gripper is a SimGripper device + a SerialGripper.)"""
    kind = config.get("type")
    if kind == "serial":
        return SerialGripper(build_config(SerialGripperConfig, config), clock)
    raise ValueError(f"unknown gripper type {kind!r}; expected 'serial'")


def make_sim_gripper(config: Mapping[str, Any], clock: Clock | None = None) -> SimGripper:
    """The simulated controller device (type "sim_serial"); start() it, then connect a SerialGripper to its port."""
    if config.get("type") != "sim_serial":
        raise ValueError(f"unknown simulated gripper type {config.get('type')!r}; expected 'sim_serial'")
    return SimGripper(build_config(SimGripperConfig, config), clock)


def make_pen_drop(config: Mapping[str, Any], jaws: Any, seed: int | None = None) -> PenDropSim:
    return PenDropSim(jaws, build_config(PenDropConfig, config), seed)


@dataclass
class SimPenRig:
    """Everything the runtime needs for a simulated pen catch; `close()` stops the device thread."""

    device: SimGripper
    gripper: SerialGripper
    sim: PenDropSim
    camera: SimCamera

    def close(self) -> None:
        self.gripper.disconnect()
        self.device.stop()


def build_sim_pen_rig(robot: Mapping[str, Any], clock: Clock, seed: int | None = None) -> SimPenRig:
    """From `configs/robot/sim.yaml`: SimGripper on a pty, the SerialGripper that drives it, the pen scene, the
    camera filming it. Call `rig.sim.reset(t)` to start an episode."""
    device = make_sim_gripper(robot["gripper"], clock).start()
    link = {**robot.get("link", {"type": "serial"}), "port": device.port}
    gripper = make_gripper(link, clock)
    sim = make_pen_drop(robot["pen"], device, seed)
    camera = make_camera(robot["camera"], clock, sim)
    return SimPenRig(device, gripper, sim, camera)

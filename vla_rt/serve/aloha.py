"""openpi's `adapt_to_pi` conversions between the standard Aloha joint space and the space π0 was trained in.

Facts from openpi `policies/aloha_policy.py` (re-derived here, not copied): state and actions are
[left arm 6 joints, left gripper, right arm 6 joints, right gripper]. Joints 1, 2, 8, 9 change sign. The gripper
(dims 6 and 13) travels as a linear position on the robot and as an angle, normalized over the encoder range, in
π0's space: robot -> π0 un-normalizes over the puppet gripper's open/closed positions (0.01844 .. 0.05800 m), turns
the linear position into the horn angle of Interbotix's linkage (arm 0.036 m, horn 0.022 m) and normalizes that
angle over (0.5476 .. 1.6296) rad; π0 -> robot adds 0.5476 rad and normalizes over the puppet gripper joint's
range (-0.6213 .. 1.4910) rad.
"""

from __future__ import annotations

import numpy as np

JOINT_FLIP = np.array([1, -1, -1, 1, 1, 1, 1, 1, -1, -1, 1, 1, 1, 1], dtype=np.float64)
GRIPPER_DIMS = [6, 13]
# Joint dims that π0 predicts as deltas from the current state (openpi's make_bool_mask(6, -1, 6, -1)).
DELTA_MASK = (True,) * 6 + (False,) + (True,) * 6 + (False,)

_GRIPPER_LINEAR_RANGE = (0.01844, 0.05800)  # puppet gripper position open / closed (m)
_GRIPPER_ANGLE_RANGE = (0.5476, 1.6296)  # π0's normalized gripper angle range (rad)
_GRIPPER_JOINT_RANGE = (-0.6213, 1.4910)  # puppet gripper joint open / closed (rad)
_ARM_LENGTH, _HORN_RADIUS = 0.036, 0.022


def _to_unit(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return (x - lo) / (hi - lo)


def _from_unit(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return x * (hi - lo) + lo


def gripper_to_pi(position: np.ndarray) -> np.ndarray:
    """Robot gripper reading (normalized linear position) -> π0's normalized gripper angle."""
    linear = _from_unit(position, *_GRIPPER_LINEAR_RANGE)
    cos_rule = (_HORN_RADIUS**2 + linear**2 - _ARM_LENGTH**2) / (2 * _HORN_RADIUS * linear)
    angle = np.arcsin(np.clip(cos_rule, -1.0, 1.0))
    return _to_unit(angle, *_GRIPPER_ANGLE_RANGE)


def gripper_from_pi(value: np.ndarray) -> np.ndarray:
    """π0's gripper action -> the robot's normalized gripper joint command."""
    return _to_unit(value + _GRIPPER_ANGLE_RANGE[0], *_GRIPPER_JOINT_RANGE)


def state_to_pi(state: np.ndarray) -> np.ndarray:
    """(14,) robot state -> (14,) float64 state in π0's space."""
    out = JOINT_FLIP * np.asarray(state, dtype=np.float64)
    out[GRIPPER_DIMS] = gripper_to_pi(out[GRIPPER_DIMS])
    return out


def actions_from_pi(actions: np.ndarray) -> np.ndarray:
    """(H, 14) actions in π0's space -> (H, 14) float64 robot commands."""
    out = JOINT_FLIP * np.asarray(actions, dtype=np.float64)
    out[:, GRIPPER_DIMS] = gripper_from_pi(out[:, GRIPPER_DIMS])
    return out

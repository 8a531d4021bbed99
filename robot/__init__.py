"""Robot devices (installed as `vla_rt.robot`): cameras, the serial gripper, and the pen-drop simulator.

Modules: camera (interface), opencv_camera, sim_camera, gripper_protocol, serial_gripper, sim_gripper,
jaw_dynamics, pen_drop, pen_render, pen_dataset, factory. Import the module you need; nothing heavy loads here.
"""

"""`vla-rt serve`: openpi's websocket policy protocol for many robots on one GPU (docs/serving.md).

Layers, top to bottom: `server` (websockets front end: handshake, auth, admission, per-connection reader/writer)
and `ray_app` (the same as a Ray Serve deployment) -> `service` (a request's path: profile, policy, queue, answer,
timing fields) -> `admission` (SLO admission from stage costs) and `scheduler` (which stage runs next, the stage
queue; neither imports torch) and `worker` (the one thread that runs the stages) -> `engines` (the stage engine
over one copy of the weights, `vla_rt.engine.stages`). `app` checks the settings and builds it all; `wire` is the
msgpack codec, `profiles` / `aloha` the robot formats, `metrics` the Prometheus registry, `loadtest` /
`loadtest_run` / `loadtest_report` the load generator, `soak` the long-running check.
"""

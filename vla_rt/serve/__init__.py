"""`vla-rt serve`: openpi's websocket policy protocol for many robots on one GPU (docs/serving.md).

Layers, top to bottom: `server` (websockets front end: handshake, auth, admission, per-connection reader/writer)
and `ray_app` (the same as a Ray Serve deployment) -> `service` (a request's path: profile, policy, queue, answer)
-> `scheduler` (batch buckets, SLO admission, the batch queue; no torch) and `worker` (the one thread that runs
the model) -> `engines` (one model per batch bucket over one copy of the weights). `wire` is the msgpack codec,
`profiles` / `aloha` the robot formats, `metrics` the Prometheus registry, `loadtest` the load generator.
"""

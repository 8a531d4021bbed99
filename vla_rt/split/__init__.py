"""The split π0 (PDD: prefill, relay decode, main decode): the VLM prefix on a server, the action expert beside the
robot, the KV cache between them over a real network protocol. docs/split.md has the design and the numbers.

- `expert_file`: the expert half of a checkpoint (what a robot stores);
- `kv_codec`: a KV version as chunks on the wire (native or fp8), assembled whole or not at all;
- `messages`: the KV link's hello / observation / relay messages; `shaper`: the slow-link test hook;
- prefix side: `prefix_service` (prefix engine + relay, one GPU thread), `kv_server` (experts subscribe);
- robot side: `kv_client` (the link, kept up), `expert_worker` (installs, chunks, staleness), `expert_service`
  (openpi's protocol through `vla_rt.serve.server.PolicyServer`);
- `roles`: `vla-rt serve --role prefix|expert|export-expert`.
"""

"""The launch-config tuner (`vla-rt tune`): `candidates` (which shapes, which configs to try), `measure` (inputs as
the engine lays them out, the correctness check, the CUDA Graph timing), `precompile` (the worker pool that
compiles every candidate before the timing), `run` (the order, the budget, the table it writes)."""

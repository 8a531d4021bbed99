"""How much colder a lone robot's host work runs when requests come 100 ms apart, and what warms it (no GPU).

Why: one robot at 10 Hz sees 2-4 ms more round trip than the engine's GPU time (issue 26 asks for <= 3 ms), and each
host step of its request (decode, prepare, the prefix stage's host part, finish) measures several times slower in the
server than back to back (docs/serving.md, "Why `prepare` takes 0.4-0.5 ms for one robot"). This times the first of
those steps exactly as the server runs them for the load test's observation (msgpack decode, the generic profile's
parse, `Pi0Policy.prepare` with uint8 views), for the `tiny` model on the CPU:

- `back-to-back`: calls one after another (warm);
- `idle`: one call every `--period-ms` (a 10 Hz robot);
- `spin`: the same, with a busy loop of `--spin-ms` just before each call (keeps the core awake, touches nothing);
- `dry-<lead>`: the same, with a dry run of the same work `lead` ms before each call (what a server could do for a
  robot whose next frame it expects), for each of `--leads`.

    python tools/host_warmth_probe.py                 # ~25 s
    python tools/host_warmth_probe.py --iters 60 --leads 1,3,10,30

Measured on this repository's 2-core CPU (2026-12-06): back-to-back 0.09 ms, idle 0.65-0.78, spin 0.79, dry run 1 /
3 / 10 / 30 ms before 0.31 / 0.34 / 0.73 / 0.75 ms (medians). So it is the caches, not the clock: a spin that touches
nothing does not help, a dry run of the same work does while it is within a few ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np


def host_work() -> Callable[[], float]:
    """The server's first host steps of one request, as a callable returning its ms."""
    from openpi_client import msgpack_numpy

    from vla_rt.policy import Pi0Policy
    from vla_rt.serve.profiles import MODEL_VIEWS, get_profile

    policy = Pi0Policy.from_pretrained("random:tiny", device="cpu", num_views=2, chunk=50, prompt_len=20,
                                       camera_names=MODEL_VIEWS[:2])  # fmt: skip
    profile = get_profile("generic", 2)
    size = policy.model.config.vision.image_size
    frame = msgpack_numpy.packb(profile.example(np.random.default_rng(0), size=size, prompt=np.arange(1, 21)))

    def work() -> float:
        t0 = time.perf_counter()
        inputs = profile.parse(msgpack_numpy.unpackb(frame))
        policy.prepare(inputs.policy_obs, uint8_images=True)
        return (time.perf_counter() - t0) * 1e3

    return work


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def measure(work: Callable[[], float], *, iters: int, period_ms: float, spin_ms: float,
            leads: list[float]) -> dict[str, tuple[float, float]]:  # fmt: skip
    """{mode: (median ms, p90 ms)} over `iters` calls of each mode."""
    period = period_ms / 1e3
    modes: dict[str, Callable[[], None]] = {
        "back-to-back": lambda: None,
        "idle": lambda: time.sleep(period),
        "spin": lambda: (time.sleep(max(0.0, period - spin_ms / 1e3)), _spin(spin_ms)),
    }
    for lead in leads:
        modes[f"dry-{lead:g}"] = lambda lead=lead: (
            time.sleep(max(0.0, period - lead / 1e3)),
            work(),
            time.sleep(lead / 1e3),
        )
    for _ in range(10):
        work()
    out = {}
    for name, before in modes.items():
        times = []
        for _ in range(iters):
            before()
            times.append(work())
        times.sort()
        out[name] = (statistics.median(times), times[int(0.9 * (len(times) - 1))])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40, help="calls a mode")
    ap.add_argument("--period-ms", type=float, default=100.0, help="time between calls (10 Hz: 100)")
    ap.add_argument("--spin-ms", type=float, default=3.0, help="the busy loop before each call of `spin`")
    ap.add_argument("--leads", default="1,3,10,30", help="ms between the dry run and the call, comma-separated")
    args = ap.parse_args()
    if args.iters < 1 or args.period_ms <= 0:
        ap.error(f"expected --iters >= 1 and --period-ms > 0, found {args.iters} and {args.period_ms}")
    leads = [float(x) for x in args.leads.split(",") if x]
    rows = measure(host_work(), iters=args.iters, period_ms=args.period_ms, spin_ms=args.spin_ms, leads=leads)
    print(f"| mode ({args.iters} calls, {args.period_ms:g} ms apart) | median ms | p90 ms |\n|---|---|---|")
    for name, (median, p90) in rows.items():
        print(f"| {name} | {median:.3f} | {p90:.3f} |")


if __name__ == "__main__":
    main()

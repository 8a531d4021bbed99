"""The split benchmark's numbers people read: per-round summaries, the Markdown table and the timeline plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TIMELINE_KINDS = ("uplink", "relay", "kv_first", "kv_complete", "install", "answer")
TIMELINE_KEEP = 3000  # events of each kind kept in the JSON


def stats(xs) -> dict:
    a = np.asarray([x for x in xs if x is not None and np.isfinite(x)], dtype=float)
    if a.size == 0:
        return {"n": 0}
    return {"median": float(np.median(a)), "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max()), "n": int(a.size)}  # fmt: skip


def round_trip_ms(answer: dict) -> float:
    """Request → actions of one answer on the robot's clock."""
    return (answer["t_recv"] - answer["t_send"]) * 1e3


def round_summary(kv_format: str, link, answers: list[dict], events: list[dict], dtype: str) -> dict:
    """One round (a KV format and a link): what the robot saw and what the link did, from answers and events."""
    ok = [a for a in answers if "error" not in a]
    local = [a for a in ok if a["source"] == "local"]
    by = {k: [e for e in events if e["kind"] == k] for k in TIMELINE_KINDS}
    first = {e["version"]: e["t"] for e in by["kv_first"]}
    uplink = {e["version"]: e["t"] for e in by["uplink"]}
    relay = {e["version"]: e["t"] for e in by["relay"]}
    # when the server finished the relay chunk, on its clock (= ours on one machine): the KV hand-over starts there
    relay_done = {e["version"]: e["server_start"] + (e["prefix_ms"] + e["relay_ms"]) / 1e3 for e in by["relay"]
                  if e.get("server_start") is not None}  # fmt: skip
    installs = by["install"]
    ends = sorted(e["end"] for e in installs)
    seconds = (answers[-1]["t_recv"] - answers[0]["t_send"]) if answers else 0.0
    return {
        "kv_format": kv_format if kv_format == "fp8" else f"native ({dtype})",
        "link": "loopback" if link is None else f"{link.latency_ms:g} ms, {link.mbps:g} Mb/s each way",
        "answers": len(ok),
        "answers_per_s": len(ok) / seconds if seconds else 0.0,
        "relay_answers": sum(a["source"] == "relay" for a in ok),
        "refused": [a["error"] for a in answers if "error" in a][:5],
        "refused_count": sum("error" in a for a in answers),
        "request_to_actions_ms": stats(map(round_trip_ms, ok)),
        "request_to_actions_local_ms": stats(map(round_trip_ms, local)),
        "request_to_actions_relay_ms": stats(round_trip_ms(a) for a in ok if a["source"] == "relay"),
        "chunk_compute_ms": stats(a["server_timing"]["infer_ms"] for a in local),
        # where a local answer's time goes: waiting for the answering thread, the whole server side (websocket
        # frame in → answer out), the rest being the client, the protocol and the loopback
        "queue_local_ms": stats(a["server_timing"]["queue_ms"] for a in local),
        "server_total_local_ms": stats(a["server_timing"]["total_ms"] for a in local),
        "kv_age_ms": stats(a["kv_age_ms"] for a in ok),
        "kv_payload_bytes": stats(e["bytes"] for e in by["kv_complete"]),
        "kv_wire_bytes": stats(e["wire_bytes"] for e in by["kv_complete"]),
        "kv_transfer_ms": stats(
            (e["t"] - first[e["version"]]) * 1e3 for e in by["kv_complete"] if e["version"] in first
        ),
        "relay_done_to_kv_ms": stats(
            (e["t"] - relay_done[e["version"]]) * 1e3 for e in by["kv_complete"] if e["version"] in relay_done
        ),  # fmt: skip
        "uplink_to_relay_ms": stats((t - uplink[v]) * 1e3 for v, t in relay.items() if v in uplink),
        "uplink_to_installed_ms": stats(
            (e["end"] - uplink[e["version"]]) * 1e3 for e in installs if e["version"] in uplink
        ),  # fmt: skip
        "install_ms": stats((e["end"] - e["start"]) * 1e3 for e in installs),
        "installs": len(installs),
        "installs_mid_chunk": sum(e["mid_chunk"] for e in installs),
        "refresh_period_ms": stats(np.diff(ends) * 1e3),
        "prefix_ms": stats(e.get("prefix_ms") for e in by["relay"]),
        "relay_ms": stats(e.get("relay_ms") for e in by["relay"]),
        "answer_timeline": [
            {k: a.get(k) for k in ("t_send", "t_recv", "kv_age_ms", "source", "kv_version")} for a in ok
        ][:TIMELINE_KEEP],  # fmt: skip
        "timeline": [e for k in TIMELINE_KINDS for e in by[k][:TIMELINE_KEEP]],
    }


def _ms(s: dict, key: str = "median") -> str:
    return f"{s[key]:.2f}" if s.get("n") else "–"


def markdown(r: dict) -> str:
    lines = [f"# Split π0 on {r['device']}: prefix server and robot-side expert, two processes", "",
             f"`random:{r['preset']}`, {r['views']} views, prompt {r['prompt_len']}, chunk {r['chunk']}, "
             f"{r['num_steps']} steps; robot at {r['rate_hz']:g} Hz for {r['seconds']:g} s a round; "
             f"`--max-kv-age-ms {r['max_kv_age_ms']:g}`. Command: `{r['command']}`", ""]  # fmt: skip
    e, m = r.get("expert_engine", {}), r.get("expert_memory") or {}
    mono = r.get("monolithic", {})
    lines += ["## Robot side", "", "| | |", "|---|---|"]
    if e:
        lines.append(f"| expert chunk ({r['num_steps']} steps, the engine alone) | {_ms(_t(e['chunk']))} ms "
                     f"(p99 {_ms(_t(e['chunk']), 'p99')}) |")  # fmt: skip
        lines.append(f"| expert step (the streaming unit) | {_ms(_t(e['step']))} ms |")
        lines.append(f"| expert weights / KV slots on the device | {e['bytes']['weights'] / 2**20:.1f} MB / "
                     f"{e['bytes']['kv_slots'] / 2**20:.1f} MB |")  # fmt: skip
    if mono.get("monolithic_call"):
        lines.append(f"| monolithic engine call (prefix + chunk) | {_ms(_t(mono['monolithic_call']))} ms |")
    if m:
        lines.append(
            f"| expert process GPU memory, as the driver counts it (nvidia-smi; None: the container hides "
            f"PIDs) | {m.get('process_mb')} MB (the most at a round's end: {m.get('process_mb_after_rounds')} MB) |"
        )
        lines.append(f"| expert process: CUDA context + torch reserved (target ≤ 1536 MB) | "
                     f"{m.get('cuda_context_mb')} + {m['torch_reserved_mb']:.0f} = {m.get('context_plus_reserved_mb')} "
                     f"MB (torch peak allocated {m['torch_allocated_mb']:.0f} MB; reserved at a round's end at most "
                     f"{m.get('torch_reserved_mb_after_rounds', float('nan')):.0f} MB) |")  # fmt: skip
    if r.get("prefix_server_memory_mb") is not None:
        lines.append(f"| prefix server process GPU memory | {r['prefix_server_memory_mb']} MB |")
    lines += ["", "## Rounds (times on the robot side's clock; one machine, so the server's too)", "",
              "| KV format | link | KV MB a refresh (payload / wire) | KV transfer ms: first → last chunk / relay "
              "done → KV whole | uplink → relay ms | uplink → installed ms | refresh period ms | request → actions "
              "ms p50 / p99 | chunk compute ms | KV age ms p50 / p99 / max | answers (relay) | refused |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for x in r["rounds"]:
        lines.append(
            f"| {x['kv_format']} | {x['link']} | {_mb(x['kv_payload_bytes'])} / {_mb(x['kv_wire_bytes'])} | "
            f"{_ms(x['kv_transfer_ms'])} / {_ms(x['relay_done_to_kv_ms'])} | {_ms(x['uplink_to_relay_ms'])} | {_ms(x['uplink_to_installed_ms'])} | "
            f"{_ms(x['refresh_period_ms'])} | {_ms(x['request_to_actions_ms'])} / "
            f"{_ms(x['request_to_actions_ms'], 'p99')} | {_ms(x['chunk_compute_ms'])} | {_ms(x['kv_age_ms'])} / "
            f"{_ms(x['kv_age_ms'], 'p99')} / {_ms(x['kv_age_ms'], 'max')} | {x['answers']} ({x['relay_answers']}) | "
            f"{x['refused_count']} |"
        )  # fmt: skip
    lines += _latency_table(r)
    if mono.get("draws"):
        n = len(mono["draws"])
        lines += ["", f"## Accuracy against the float32 reference (rel_err of the actions, max over {n} draws)", "",
                  "| path | max rel_err vs fp32 | max rel_err vs monolithic |", "|---|---|---|",
                  f"| monolithic engine | {mono['max_monolithic_vs_fp32']:.2e} | – |",
                  f"| split, native KV (through the wire) | {mono['max_native_kv_vs_fp32']:.2e} | "
                  f"{mono['max_native_kv_vs_monolithic']:.2e} |",
                  f"| split, fp8 KV (through the wire) | {mono['max_fp8_kv_vs_fp32']:.2e} | "
                  f"{mono['max_fp8_kv_vs_monolithic']:.2e} |", "",
                  f"Split actions on a fresh KV bit-identical to the monolithic engine's: **{mono['all_identical']}**.",
                  "", "Refresh path, part by part (first draw): prefix engine "
                  f"{_ms(_t(mono['prefix_run']))} ms; copy out {mono['copy_out_native_ms']:.2f} ms (native) / "
                  f"{mono['copy_out_fp8_ms']:.2f} ms (fp8); chunking {mono['encode_native_ms']:.2f} / "
                  f"{mono['encode_fp8_ms']:.2f} ms; encode + assemble + import "
                  f"{mono['wire_to_slot_native_ms']:.2f} / {mono['wire_to_slot_fp8_ms']:.2f} ms."]  # fmt: skip
    if r.get("kv_bytes_computed"):
        lines += ["", "KV bytes a refresh by view count (computed from the dims, all prefix keys valid; not measured): "
                  + "; ".join(f"{v} view{'s' * (int(v) > 1)}: {b['bf16'] / 1e6:.2f} MB bf16, {b['fp8'] / 1e6:.2f} MB fp8"
                              for v, b in r["kv_bytes_computed"].items()) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _latency_table(r: dict) -> list[str]:
    """Request → actions on the robot's clock by answer source, beside the monolithic server's over the same client."""
    lines = ["", "## Request → actions on the robot's clock, the same client and frames", "",
             "| path | answers | p50 ms | p99 ms | server side p50 ms (frame in → answer out) | of which queued | "
             "of which compute |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for x in r["rounds"]:
        for source in ("local", "relay"):
            s = x.get(f"request_to_actions_{source}_ms")
            if s and s.get("n"):
                local = source == "local"
                server = [_ms(x.get(k, {})) if local else "–" for k in ("server_total_local_ms", "queue_local_ms",
                                                                        "chunk_compute_ms")]  # fmt: skip
                lines.append(f"| split, {x['kv_format']} KV, {x['link']}, {source} answers | {s['n']} | {_ms(s)} | "
                             f"{_ms(s, 'p99')} | {' | '.join(server)} |")  # fmt: skip
    m = r.get("monolithic_server")
    if m:
        s = m["request_to_actions_ms"]
        lines.append(f"| monolithic server (`vla-rt serve`, the whole model; started in {m['startup_s']:.0f} s) | "
                     f"{s.get('n', 0)} | {_ms(s)} | {_ms(s, 'p99')} | {_ms(m['server_total_ms'])} | "
                     f"{_ms(m.get('queue_ms', {}))} | {_ms(m['infer_ms'])} |")  # fmt: skip
    return lines


def _t(timing: dict) -> dict:
    """A `Timing.to_dict()` in `stats` keys."""
    return {"median": timing["median_ms"], "p99": timing["p99_ms"], "n": timing["n"]}


def _mb(s: dict) -> str:
    return f"{s['median'] / 1e6:.2f}" if s.get("n") else "–"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [x for x in r["rounds"] if x["kv_format"] != "fp8"][:2] or r["rounds"][:1]
    fig, axes = plt.subplots(len(shown) + 1, 1, figsize=(11, 2.6 * len(shown) + 2.6))
    axes = np.atleast_1d(axes)
    for ax, x in zip(axes, shown):
        _timeline(ax, x)
    ax = axes[-1]
    for x in r["rounds"]:
        a = x["answer_timeline"]
        if a:
            t0 = a[0]["t_send"]
            ax.plot([(e["t_send"] - t0) for e in a], [e["kv_age_ms"] for e in a], ".", ms=3,
                    label=f"{x['kv_format']}, {x['link']}")  # fmt: skip
    ax.axhline(r["max_kv_age_ms"], color="red", lw=0.8, ls="--", label="--max-kv-age-ms")
    ax.set_xlabel("s into the round")
    ax.set_ylabel("KV age of each answer (ms)")
    ax.legend(fontsize=7)
    fig.suptitle(f"split π0 on {r['device']}: prefix refreshes, KV transfers, robot-side answers", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _timeline(ax, x: dict) -> None:
    events = x["timeline"]
    installs = sorted(e["end"] for e in events if e["kind"] == "install")
    if not installs:
        ax.set_title(f"{x['kv_format']}, {x['link']}: no KV installed", fontsize=9)
        return
    start = installs[min(4, len(installs) - 1)]
    period = x["refresh_period_ms"].get("median", 50.0) / 1e3
    end = start + min(2.0, max(0.3, 4 * period))
    lanes = {"prefix + relay (server)": 3, "KV transfer": 2, "install": 1, "answers": 0}
    for e in events:
        if e["kind"] == "relay" and e.get("server_start") is not None:
            s, p, rl = e["server_start"], e["prefix_ms"] / 1e3, e["relay_ms"] / 1e3
            _bar(ax, s, p, 3, "tab:orange", start, end)
            _bar(ax, s + p, rl, 3, "tab:green", start, end)
        elif e["kind"] == "install":
            _bar(ax, e["start"], e["end"] - e["start"], 1, "tab:purple", start, end)
        elif e["kind"] == "answer":
            _bar(ax, e["start"], e["end"] - e["start"], 0, "tab:green" if e["source"] == "relay" else "tab:blue",
                 start, end)  # fmt: skip
    firsts = {e["version"]: e["t"] for e in events if e["kind"] == "kv_first"}
    for e in events:
        if e["kind"] == "kv_complete" and e["version"] in firsts:
            _bar(ax, firsts[e["version"]], e["t"] - firsts[e["version"]], 2, "tab:gray", start, end)
    ax.set_yticks(list(lanes.values()), list(lanes))
    ax.set_xlim(0, (end - start) * 1e3)
    ax.set_xlabel("ms (orange: prefix, green: relay chunk / relay answer, blue: local chunk, gray: KV chunks "
                  "arriving, purple: install)", fontsize=7)  # fmt: skip
    ax.set_title(f"{x['kv_format']}, {x['link']}", fontsize=9)


def _bar(ax, t: float, width: float, lane: int, color: str, start: float, end: float) -> None:
    if t + width < start or t > end:
        return
    ax.broken_barh([((t - start) * 1e3, max(width * 1e3, 0.2))], (lane - 0.35, 0.7), facecolors=color)


def write_report(result: dict, out: Path) -> dict[str, Path]:
    name = f"split_{result['device']}"
    paths = {"json": out / f"{name}.json", "markdown": out / f"{name}.md", "plot": out / f"{name}.png"}
    paths["markdown"].write_text(markdown(result))
    plot(result, paths["plot"])
    return paths

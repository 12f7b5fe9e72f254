"""Start the server from parsed flags: check them and bind the port before the model loads, build
the engine, report flags that do not apply, serve until a signal drains the server, shut the
engine down. Every start-up mistake is one line (status 2); see utils/preflight.py."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import socket
from typing import TYPE_CHECKING

from glmflash.utils import env
from glmflash.utils.cli_args import MAX_PORT
from glmflash.utils.logging import setup_logging
from glmflash.utils.preflight import (
    UsageError,
    check_device,
    check_model_path,
    clamp_cpu_threads,
    run_reporting_errors,
)

if TYPE_CHECKING:
    from glmflash.engine.engine import Engine
    from glmflash.server.state import ServerConfig

logger = logging.getLogger(__name__)
TINY_MODEL_NAME = "glmflash-tiny"


def server_config(args: argparse.Namespace) -> ServerConfig:
    from glmflash.server.state import ServerConfig

    names = args.served_model_name or [args.model_path or TINY_MODEL_NAME]
    return ServerConfig(served_model_names=tuple(names), api_key=args.api_key,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout,
                        max_request_bytes=args.max_request_bytes)


def check_server_args(args: argparse.Namespace) -> None:
    """Everything that can be checked before the model loads (the port is bound separately)."""
    env.check()
    check_device(args.device)
    check_model_path(args.model_path)
    args.kt_cpuinfer = clamp_cpu_threads(args.kt_cpuinfer, "--kt-cpuinfer")


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, taken before the model loads so a busy port fails at once."""
    if not 0 <= port <= MAX_PORT:  # 0: a free port (tests, embedding programs)
        # getaddrinfo would wrap it (70000 binds 4464) and clients would call another port.
        raise UsageError(f"--port {port}: must be in 1..{MAX_PORT}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"--port {port}: {host}:{port} is already in use (another server?); "
                             "choose a free port with --port") from None
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def build_engine(args: argparse.Namespace) -> Engine:
    import torch

    from glmflash.engine.engine import Engine
    from glmflash.engine.errors import STARTUP_ERRORS
    from glmflash.server.args import engine_options, inapplicable_flags

    try:
        engine = Engine(args.model_path, device=args.device, dtype=args.dtype,
                        log_level=args.log_level.upper(), **engine_options(args))
    except STARTUP_ERRORS as exc:
        raise UsageError(f"cannot start the engine: {exc}") from exc
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for line in inapplicable_flags(args, engine.device.type, num_gpus, engine.supports_media):
        logger.warning("%s", line)
    return engine


def run_server(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the process exit status."""
    setup_logging(args.log_level.upper())
    from glmflash.engine.errors import STARTUP_ERRORS

    return run_reporting_errors(lambda: _serve(args), debug=args.debug,
                                usage_errors=STARTUP_ERRORS)


def _serve(args: argparse.Namespace) -> int:
    from glmflash.utils.memory import configure_allocator

    check_server_args(args)
    configure_allocator()
    sock = bind_socket(args.host, args.port)
    with contextlib.closing(sock):
        return serve(build_engine(args), server_config(args), sock, log_level=args.log_level)


def serve(engine: Engine, config: ServerConfig, sock: socket.socket, *,
          log_level: str = "info") -> int:
    """Run the app on a bound socket until it drains; the engine is shut down on the way out."""
    from glmflash.server.app import create_app
    from glmflash.server.lifecycle import GracefulServer

    app = create_app(engine, config)
    state = app.state.server
    server = GracefulServer(GracefulServer.config(app, state.lifecycle, log_level),
                            state.lifecycle)
    host, port = sock.getsockname()[:2]
    logger.info("serving %s on http://%s:%d (tool parser %s, reasoning parser %s, API key %s)",
                ", ".join(config.served_model_names), host, port, config.tool_call_parser,
                config.reasoning_parser, "required" if config.api_key else "off")
    try:
        server.run(sockets=[sock])
    finally:
        state.bridge.shutdown()
        _report_cache(engine)
    logger.info("server stopped (exit status %d)", state.lifecycle.exit_code)
    return state.lifecycle.exit_code


def _report_cache(engine: Engine) -> None:
    """After shutdown (the engine thread has stopped, so the check reads a still engine)."""
    try:
        engine.check_integrity()
    except AssertionError as exc:
        logger.error("cache integrity check failed after shutdown: %s", exc)
        return
    stats = engine.stats()
    logger.info("cache integrity after shutdown: ok (%d of %d pages free)",
                stats.num_free_pages, stats.num_pages)

"""Start the server from parsed flags: build the engine, report flags that do not apply, run
uvicorn, shut the engine down on exit."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from glmflash.utils.logging import setup_logging

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
                        reasoning_parser=args.reasoning_parser)


def build_engine(args: argparse.Namespace) -> Engine:
    import torch

    from glmflash.engine.engine import Engine
    from glmflash.server.args import engine_options, inapplicable_flags

    engine = Engine(args.model_path, device=args.device, dtype=args.dtype,
                    log_level=args.log_level.upper(), **engine_options(args))
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    supports_media = hasattr(engine, "prepare_multimodal")
    for line in inapplicable_flags(args, engine.device.type, num_gpus, supports_media):
        logger.warning("%s", line)
    return engine


def run_server(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the process exit status."""
    setup_logging(args.log_level.upper())
    import uvicorn

    from glmflash.model.weights import CheckpointError
    from glmflash.server.app import create_app

    try:
        engine = build_engine(args)
    except (ValueError, TypeError, CheckpointError, OSError) as exc:
        logger.error("cannot start the engine: %s", exc)
        return 2
    config = server_config(args)
    app = create_app(engine, config)
    logger.info("serving %s on http://%s:%d (tool parser %s, reasoning parser %s, API key %s)",
                ", ".join(config.served_model_names), args.host, args.port,
                config.tool_call_parser, config.reasoning_parser,
                "required" if config.api_key else "off")
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        app.state.server.bridge.shutdown()
    return 0
